"""Dual 1x128 quantization of activations for Hopper (sm_90), written in Gluon.

Same contract, numerics and outputs as :func:`.quantize_act.quantize_1x128_dual` (bit for bit): X
[M, K] (bf16/fp16/fp32) -> the rowwise copy [M, K] (1x128 tiles along K, scale_inv ``[ceil(K/128),
pad4(M)]``, entry ``[kb, m]``) and/or the columnwise copy X^T [K, M] (128x1 tiles along M,
scale_inv ``[ceil(M/128), pad4(K)]``, entry ``[mb, k]``).

Design (persistent, one partition of NUM_WARPS warps per CTA, CTAS_PER_SM CTAs per SM):

* each CTA walks the 128x128 tiles ``pid, pid + grid, ...`` (row-major over the tile grid);
* a NUM_STAGES-deep ring of TMA loads (one mbarrier per stage) keeps the next tiles' loads in flight
  while the current tile is processed; TMA zero-fills the part of a ragged tile outside X (harmless
  for the amax: |0| never raises it);
* *row pass*: the tile is read from shared memory in a blocked layout ``LR`` (16-byte ``ld.shared``
  along K, one row per 8 or 4 lanes' chunk: conflict-free), row amax (shuffles), row scales, FP8
  rowwise tile -> shared memory (8/4-byte stores along K, conflict-free) -> TMA store; the column
  amax of the same registers is reduced across warps (``gl.reduce``, through shared memory);
* *column pass*: the tile is read again from shared memory in a linear layout ``LC``, quantized with
  the column scales and written *transposed* ([128 k, 128 m], FP8) to shared memory, 8 contiguous
  bytes along m per thread, then TMA-stored into X^T. ``LC`` is chosen so that both the 16-byte
  reads of the (128-byte swizzled) input and the 8-byte writes of the (128-byte swizzled) transposed
  output are free of bank conflicts: lanes 0-2 step along m *and* k at once (``_col_layouts``); a
  blocked layout cannot have both (the swizzle XORs with the row index mod 8, which the thread's
  8 contiguous rows / columns share across lanes);
* the FP8 output tiles are OUT_BUFS-buffered: the TMA stores of one tile drain while the next tile
  is computed (``store_wait`` with the stores of the other buffer still pending);
* the scale_inv entries are plain global stores, including the TE layout's padding entries (1.0) for
  rows in [M, pad4(M)) and columns in [K, pad4(K)) on the last tile row / column.

Per element: one smem read per pass, one convert to fp32 per pass, one ``max.NaN`` per copy, one
multiply and half a ``cvt.rn.satfinite.e4m3x2`` per copy; no address arithmetic or masks (TMA). The
scale rule is ``scales.py``'s, replicated as Gluon functions (same operations in the same order).

Limits (``NotImplementedError`` from the wrapper before anything is launched, so that the caller
falls back to the Triton kernel): NVIDIA sm_90; X contiguous, 16-byte aligned, rows of a multiple of
16 bytes (K * elem % 16); rowwise: K % 16 == 0 (FP8 rows); columnwise: M % 16 == 0 (FP8 X^T rows).
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4, scale_inv_shape

SMEM_LIMIT = 232448  # bytes of dynamic shared memory per CTA on H100/H200 (227 KiB)
FP32_MAX = gl.constexpr(3.4028234663852886e38)

_TORCH_TO_GL = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.float8_e5m2: gl.float8e5,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float32: gl.float32,
}


@dataclass(frozen=True)
class GluonQuantConfig:
    """Launch configuration. ``num_stages=0``: the default for the input dtype (``_default_stages``)."""

    num_warps: int = 8
    num_stages: int = 0  # TMA load ring depth (input tiles in flight per CTA)
    out_bufs: int = 2  # FP8 output tiles per copy (1: the next tile waits for this tile's TMA stores)
    ctas_per_sm: int = 1  # persistent grid = min(tiles, ctas_per_sm * SMs)


DEFAULT_CONFIG = GluonQuantConfig()


# --------------------------------------------------------------------------------------------------
# Scale rule (scales.py, as Gluon functions: the same operations in the same order)
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _max_nan(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _scale_from_amax(amax, fp8_max, amax_eps, in_max, POW2: gl.constexpr):
    amax = gl.maximum(amax, amax_eps)
    scale = gl.div_rn(gl.zeros_like(amax) + fp8_max, amax)
    scale = gl.where(scale > FP32_MAX, in_max, scale)
    if POW2:
        scale = (scale.to(gl.int32, bitcast=True) & 0x7F800000).to(gl.float32, bitcast=True)
    return gl.where(amax == 0.0, 1.0, scale)


@gluon.jit
def _scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2: gl.constexpr):
    ok = amax <= FP32_MAX
    scale = _scale_from_amax(gl.where(ok, amax, 0.0), fp8_max, amax_eps, in_max, POW2)
    if POW2:
        bits = scale.to(gl.int32, bitcast=True)
        inv = (0x7F000000 - bits).to(gl.float32, bitcast=True)
        inv = gl.where(bits < 0x7F000000, inv, (gl.zeros_like(bits) + 0x00400000).to(gl.float32, bitcast=True))
    else:
        inv = gl.div_rn(gl.zeros_like(scale) + 1.0, scale)
    return gl.where(ok, scale, float("nan")), gl.where(ok, inv, float("nan"))


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _issue_load(x_desc, x_bufs, ready, tile, s, nk):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [(tile // nk) * BM, (tile % nk) * BK], ready.index(s), x_bufs.index(s))


@gluon.jit
def _quantize_1x128_dual_gluon_kernel(
    x_desc, rq_desc, cq_desc, row_s_ptr, col_s_ptr, M, K, M_PAD, K_PAD, fp8_max, amax_eps, in_max,
    ROWWISE: gl.constexpr, COLWISE: gl.constexpr, POW2: gl.constexpr, NUM_STAGES: gl.constexpr,
    OUT_BUFS: gl.constexpr, LR: gl.constexpr, LC_LOAD: gl.constexpr, LC_STORE: gl.constexpr,
):  # fmt: skip
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    NSTORES: gl.constexpr = ROWWISE + COLWISE  # TMA stores per tile
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES, BM, BK], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
    if ROWWISE:
        rq_bufs = gl.allocate_shared_memory(rq_desc.dtype, [OUT_BUFS, BM, BK], rq_desc.layout)
    if COLWISE:
        cq_bufs = gl.allocate_shared_memory(cq_desc.dtype, [OUT_BUFS, BK, BM], cq_desc.layout)
    fence_async_shared()

    nm = gl.cdiv(M, BM)
    nk = gl.cdiv(K, BK)
    num_tiles = nm * nk
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_my = gl.cdiv(num_tiles - pid, nprog)  # tiles of this CTA (the grid never exceeds num_tiles)

    for i in gl.static_range(NUM_STAGES):
        if i < n_my:
            _issue_load(x_desc, x_bufs, ready, pid + i * nprog, i, nk)

    rows_r = gl.arange(0, BM, layout=gl.SliceLayout(1, LR))
    cols_r = gl.arange(0, BK, layout=gl.SliceLayout(0, LR))
    for j in range(n_my):
        tile = pid + j * nprog
        pm = tile // nk
        pk = tile % nk
        m0 = pm * BM
        k0 = pk * BK
        s = j % NUM_STAGES
        ob = j % OUT_BUFS
        mbarrier.wait(ready.index(s), (j // NUM_STAGES) & 1)
        x_s = x_bufs.index(s)

        # ---- row pass (and the column amax)
        x = x_s.load(LR).to(gl.float32)
        if COLWISE:
            col_amax = gl.reduce(gl.abs(x), 0, _max_nan)
        if ROWWISE:
            scale, s_inv = _scale_and_inverse(gl.reduce(gl.abs(x), 1, _max_nan), fp8_max, amax_eps, in_max, POW2)
            q = (gl.expand_dims(scale, 1) * x).to(rq_desc.dtype)
            # the TMA store that last read this buffer (OUT_BUFS tiles ago) is done
            tma.store_wait(pendings=NSTORES * (OUT_BUFS - 1))
            gl.thread_barrier()
            rq_s = rq_bufs.index(ob)
            rq_s.store(q)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(rq_desc, [m0, k0], rq_s)
            rows = m0 + rows_r
            s_inv = gl.where(rows < M, s_inv, 1.0)  # padding entries of the TE layout
            gl.store(row_s_ptr + pk * M_PAD + rows, s_inv, mask=rows < M_PAD)

        # ---- column pass
        if COLWISE:
            cscale, cs_inv = _scale_and_inverse(col_amax, fp8_max, amax_eps, in_max, POW2)
            cols = k0 + cols_r
            cs_inv = gl.where(cols < K, cs_inv, 1.0)
            gl.store(col_s_ptr + pm * K_PAD + cols, cs_inv, mask=cols < K_PAD)
            cscale_c = gl.convert_layout(cscale, gl.SliceLayout(0, LC_LOAD))
            xc = x_s.load(LC_LOAD).to(gl.float32)
            qc = (gl.expand_dims(cscale_c, 0) * xc).to(cq_desc.dtype)
            qc = gl.convert_layout(qc, LC_STORE)
            if not ROWWISE:
                tma.store_wait(pendings=NSTORES * (OUT_BUFS - 1))
                gl.thread_barrier()
            cq_s = cq_bufs.index(ob)
            cq_s.permute((1, 0)).store(qc)
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(cq_desc, [k0, m0], cq_s)

        # every warp has read x_s: refill it with the tile NUM_STAGES ahead
        gl.thread_barrier()
        if j + NUM_STAGES < n_my:
            _issue_load(x_desc, x_bufs, ready, tile + NUM_STAGES * nprog, s, nk)
    tma.store_wait(pendings=0)


# --------------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------------


def _log2(n: int) -> int:
    assert n > 0 and n & (n - 1) == 0, n
    return n.bit_length() - 1


def _row_layout(elem_bytes: int, num_warps: int) -> gl.BlockedLayout:
    """[128, 128] tile, 16 bytes of a row per thread (``ld.shared.v4``), a row over 128/vec lanes."""
    vec = 16 // elem_bytes
    tpw_k = min(32, BLOCK // vec)
    return gl.BlockedLayout([1, vec], [32 // tpw_k, tpw_k], [num_warps, 1], [1, 0])


def _col_layouts(elem_bytes: int, num_warps: int) -> tuple[gl.DistributedLinearLayout, gl.DistributedLinearLayout]:
    """Linear layouts of the [128 m, 128 k] tile for the column pass: (load order, store order).

    Registers: ``vec`` contiguous k (one 16-byte ``ld.shared`` of a row) x 8 contiguous m (one 8-byte
    ``st.shared`` of a row of the transposed FP8 tile). Lanes 0-2 step by (8, 8 vec)-style pairs
    ``(m + 8*2^i, k + vec*2^i)``: within an 8-lane phase of a 16-byte load the swizzled 16-byte
    column (k bits above the vector, XOR the row mod 8 = the register's row) differs, and within a
    16-lane phase of an 8-byte store the m bits 3-6 differ, so neither access has bank conflicts
    (128-byte swizzle: the 16-byte unit is XORed with address bits 7-9, i.e. the row mod 8).
    Lane 3 takes m + 64, lane 4 and the warps the k bits left; leftover k bits go to registers.
    """
    vb = _log2(16 // elem_bytes)  # k bits inside one 16-byte load
    wb = _log2(num_warps)

    def m(i):
        return [1 << i, 0]

    def k(i):
        return [0, 1 << i]

    lanes = [[1 << (3 + i), 1 << (vb + i)] for i in range(3)] + [m(6), k(vb + 3)]
    warps = [k(vb + i) for i in range(wb)]
    used_k = {vb + i for i in range(wb)} | {vb + 3}
    assert wb <= 3, "at most 8 warps"
    # k bits vb..vb+2 are also spanned by the lanes' mixed vectors (with the warps' pure k vectors);
    # any k bit in vb..vb+2 not taken by a warp must come from registers
    left_k = [i for i in range(vb, 7) if i not in used_k]
    load_regs = [k(i) for i in range(vb)] + [m(i) for i in range(3)] + [k(i) for i in left_k]
    store_regs = [m(i) for i in range(3)] + [k(i) for i in range(vb)] + [k(i) for i in left_k]
    shape = [BLOCK, BLOCK]
    return (
        gl.DistributedLinearLayout(load_regs, lanes, warps, [], shape),
        gl.DistributedLinearLayout(store_regs, lanes, warps, [], shape),
    )


def _default_stages(elem_bytes: int, cfg: GluonQuantConfig) -> int:
    if cfg.num_stages > 0:
        return cfg.num_stages
    return 3 if elem_bytes <= 2 else 2


def smem_bytes(elem_bytes: int, stages: int, out_bufs: int, rowwise: bool, columnwise: bool) -> int:
    return stages * BLOCK * BLOCK * elem_bytes + out_bufs * BLOCK * BLOCK * (int(rowwise) + int(columnwise))


def _fp8_layout(dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], dtype)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile check (no GPU needed)
# --------------------------------------------------------------------------------------------------

_GL_NAME = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.bfloat16: "bf16",
            torch.float16: "fp16", torch.float32: "fp32"}  # fmt: skip


def _descs(x, rq, cq, fp8_dtype):
    in_layout = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], _TORCH_TO_GL[x.dtype])
    f8 = _fp8_layout(_TORCH_TO_GL[fp8_dtype])
    x_desc = TensorDescriptor.from_tensor(x, [BLOCK, BLOCK], in_layout)
    rq_desc = TensorDescriptor.from_tensor(rq, [BLOCK, BLOCK], f8) if rq is not None else None
    cq_desc = TensorDescriptor.from_tensor(cq, [BLOCK, BLOCK], f8) if cq is not None else None
    return x_desc, rq_desc, cq_desc


def compile_variant(in_dtype, fp8_dtype, pow2, rowwise, columnwise, cfg: GluonQuantConfig = DEFAULT_CONFIG):
    """Compile one variant for sm_90 without a GPU; returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    m = k = 1024
    x = torch.empty(m, k, dtype=in_dtype)
    rq = torch.empty(m, k, dtype=fp8_dtype)
    cq = torch.empty(k, m, dtype=fp8_dtype)
    x_desc, rq_desc, cq_desc = _descs(x, rq, cq, fp8_dtype)
    eb = x.element_size()
    lc_load, lc_store = _col_layouts(eb, cfg.num_warps)
    sig = {
        "x_desc": mangle_type(x_desc), "rq_desc": mangle_type(rq_desc), "cq_desc": mangle_type(cq_desc),
        "row_s_ptr": "*fp32", "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32",
        "fp8_max": "fp32", "amax_eps": "fp32", "in_max": "fp32",
        "ROWWISE": "constexpr", "COLWISE": "constexpr", "POW2": "constexpr", "NUM_STAGES": "constexpr",
        "OUT_BUFS": "constexpr", "LR": "constexpr", "LC_LOAD": "constexpr", "LC_STORE": "constexpr",
    }  # fmt: skip
    cons = {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": pow2, "NUM_STAGES": _default_stages(eb, cfg),
            "OUT_BUFS": cfg.out_bufs, "LR": _row_layout(eb, cfg.num_warps), "LC_LOAD": lc_load,
            "LC_STORE": lc_store}  # fmt: skip
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("row_s_ptr", "col_s_ptr", "M", "K", "M_PAD", "K_PAD")}
    src = GluonASTSource(fn=_quantize_1x128_dual_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})
