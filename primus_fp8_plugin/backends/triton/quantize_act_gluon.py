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
* *column pass*: the tile is read again from shared memory in a blocked layout ``LC`` (16
  contiguous m x 4-8 contiguous k per thread: 8/16-byte ``ld.shared``), quantized with the column
  scales and written *transposed* ([128 k, 128 m], FP8) to shared memory with one 16-byte
  ``st.shared`` per k (16 contiguous bytes along m), then TMA-stored into X^T. Bank conflicts,
  counted ahead of time per tile (``_col_layout``): reads ideal; transposed stores ideal for fp32,
  2x for bf16/fp16 (a search over blocked layouts found none with both ideal under the 128-byte swizzle, whose
  16-byte unit is XORed with the row mod 8 that a thread's contiguous rows/columns share; Gluon
  rejects lane bases moving along both dims);
* the FP8 output tiles are OUT_BUFS-buffered: the TMA stores of one tile drain while the next tile
  is computed (``store_wait`` with the stores of the other buffer still pending);
* the scale_inv entries are plain global stores, including the TE layout's padding entries (1.0) for
  rows in [M, pad4(M)) and columns in [K, pad4(K)) on the last tile row / column.

Per element: one smem read per pass, one convert to fp32 per pass, one ``max.NaN`` per copy, one
multiply and half a ``cvt.rn.satfinite.e4m3x2`` per copy; no address arithmetic or masks (TMA). The
scale rule is ``scales.py``'s (the same device functions as the Triton kernels).

Limits (``NotImplementedError`` from the wrapper before anything is launched, so that the caller
falls back to the Triton kernel): NVIDIA sm_90; X contiguous, 16-byte aligned, rows of a multiple of
16 bytes (K * elem % 16); rowwise: K % 16 == 0 (FP8 rows); columnwise: M % 16 == 0 (FP8 X^T rows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4
from .hopper import SMEM_LIMIT, TORCH_TO_GL, num_sms
from .quantize_act import dual_outputs
from .scales import max_nan, scale_and_inverse


@dataclass(frozen=True)
class GluonQuantConfig:
    """Launch configuration. ``num_stages=0``: the default for the input dtype (``_default_stages``)."""

    num_warps: int = 8
    num_stages: int = 0  # TMA load ring depth (input tiles in flight per CTA)
    out_bufs: int = 2  # FP8 output tiles per copy (1: the next tile waits for this tile's TMA stores)
    ctas_per_sm: int = 1  # persistent grid = min(tiles, ctas_per_sm * SMs)
    # register cap per thread (ptxas otherwise caps the 8-warp dual variants at 128 and spills a
    # few bytes); 0: none. Two 256-thread CTAs per SM need <= 128.
    maxnreg: int = 168


DEFAULT_CONFIG = GluonQuantConfig()


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
    OUT_BUFS: gl.constexpr, LR: gl.constexpr, LC: gl.constexpr,
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
            col_amax = gl.reduce(gl.abs(x), 0, max_nan)
        if ROWWISE:
            scale, s_inv = scale_and_inverse(gl.reduce(gl.abs(x), 1, max_nan), fp8_max, amax_eps, in_max, POW2)
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
            cscale, cs_inv = scale_and_inverse(col_amax, fp8_max, amax_eps, in_max, POW2)
            cols = k0 + cols_r
            cs_inv = gl.where(cols < K, cs_inv, 1.0)
            gl.store(col_s_ptr + pm * K_PAD + cols, cs_inv, mask=cols < K_PAD)
            cscale_c = gl.convert_layout(cscale, gl.SliceLayout(0, LC))
            xc = x_s.load(LC).to(gl.float32)
            qc = (gl.expand_dims(cscale_c, 0) * xc).to(cq_desc.dtype)
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


def _col_layout(elem_bytes: int, num_warps: int) -> gl.BlockedLayout:
    """[128 m, 128 k] tile for the column pass: 16 contiguous m per thread (one 16-byte ``st.shared``
    of a row of the transposed FP8 tile) x 4 or 8 contiguous k (8- or 16-byte ``ld.shared`` of the
    input). Lanes step along k by the vector, so one load instruction covers distinct swizzled
    16-byte columns (128-byte swizzle: the unit is XORed with the row mod 8, the same for all lanes)
    and the stores' k (the transposed rows) differ in bits 2 (fp32) or 2-4 within a wavefront.
    Bank conflicts per tile, counted ahead of time (wavefronts, ideal in brackets): bf16 8 warps:
    loads 256 (256), stores 256 (128); fp32 8 warps: loads 512 (512), stores 128 (128)."""
    if elem_bytes == 4:
        wm = 2
        return gl.BlockedLayout([16, 4], [4, 8], [wm, num_warps // wm], [1, 0])
    if num_warps >= 8:
        return gl.BlockedLayout([16, 4], [2, 16], [4, num_warps // 4], [1, 0])
    return gl.BlockedLayout([16, 8], [4, 8], [2, num_warps // 2], [1, 0])


def _default_stages(elem_bytes: int, cfg: GluonQuantConfig) -> int:
    if cfg.num_stages > 0:
        return cfg.num_stages
    return 3 if elem_bytes <= 2 else 2


def smem_bytes(elem_bytes: int, stages: int, out_bufs: int, rowwise: bool, columnwise: bool) -> int:
    return stages * BLOCK * BLOCK * elem_bytes + out_bufs * BLOCK * BLOCK * (int(rowwise) + int(columnwise))


def _fp8_layout(dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], dtype)


# --------------------------------------------------------------------------------------------------
# Wrapper
# --------------------------------------------------------------------------------------------------


def _config(launch_opts: dict) -> GluonQuantConfig:
    cfg = launch_opts.pop("config", None) or DEFAULT_CONFIG
    unknown = set(launch_opts) - set(GluonQuantConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown launch options {sorted(unknown)} (config, num_warps, num_stages, out_bufs, ctas_per_sm)")
    cfg = GluonQuantConfig(**{**cfg.__dict__, **launch_opts})
    if cfg.num_warps not in (4, 8):
        raise ValueError(f"num_warps={cfg.num_warps}: 4 or 8")
    if cfg.out_bufs not in (1, 2) or cfg.ctas_per_sm < 1 or cfg.num_stages < 0:
        raise ValueError(f"bad launch config {cfg}")
    return cfg


def unsupported_reason(x: torch.Tensor, params: QuantParams, rowwise: bool, columnwise: bool) -> str | None:
    """Why the Gluon kernel cannot take this call (the caller then uses the Triton kernel), or None."""
    if x.device.type != "cuda" or torch.version.hip:
        return "the Gluon quantization kernel runs on NVIDIA GPUs only"
    if torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the Gluon quantization kernel is written for Hopper (sm_90)"
    if params.block_dim != 1:
        return "1x128 tiles (block_dim=1) only"
    if x.dim() != 2 or not x.is_contiguous():
        return "x must be a contiguous 2-D tensor"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input dtype {x.dtype} not supported (bf16, fp16, fp32)"
    m, k = x.shape
    if x.data_ptr() % 16:
        return "x must be 16-byte aligned (TMA)"
    if (k * x.element_size()) % 16:
        return f"K={k}: rows of x must be a multiple of 16 bytes (TMA)"
    if rowwise and k % 16:
        return f"K={k} must be a multiple of 16 for the rowwise FP8 copy (TMA)"
    if columnwise and m % 16:
        return f"M={m} must be a multiple of 16 for the columnwise FP8 copy X^T (TMA)"
    return None


def quantize_1x128_dual_gluon(
    x: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool, **launch_opts
) -> BlockwiseFp8Tensor:
    """Same contract as :func:`.quantize_act.quantize_1x128_dual` (bit-exact outputs).

    ``launch_opts``: ``config=GluonQuantConfig(...)`` and/or its fields (``num_warps``, ``num_stages``,
    ``out_bufs``, ``ctas_per_sm``). Raises ``NotImplementedError`` before launching anything when the
    device or the shapes do not suit this kernel (``unsupported_reason``)."""
    why = unsupported_reason(x, params, rowwise, columnwise)
    if why is not None:
        raise NotImplementedError(why)
    cfg = _config(dict(launch_opts))
    eb = x.element_size()
    stages = _default_stages(eb, cfg)
    need = smem_bytes(eb, stages, cfg.out_bufs, rowwise, columnwise) + 8192  # + reduction scratch, barriers
    if need > SMEM_LIMIT:
        raise ValueError(f"{cfg} needs about {need} bytes of shared memory (limit {SMEM_LIMIT})")
    m, k = x.shape
    dev, f8 = x.device, params.fp8_dtype
    row_q, row_s, col_q, col_s, parts = dual_outputs(x, params, rowwise, columnwise)
    if m > 0 and k > 0 and (rowwise or columnwise):
        x_desc, rq_desc, cq_desc = _descs(x, row_q, col_q, f8)
        num_tiles = ceil_div(m, BLOCK) * ceil_div(k, BLOCK)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        grid = (min(num_tiles, cfg.ctas_per_sm * num_sms(index)),)
        s_any = row_s if row_s is not None else col_s
        _quantize_1x128_dual_gluon_kernel[grid](
            x_desc, rq_desc, cq_desc, row_s if rowwise else s_any, col_s if columnwise else s_any,
            m, k, pad4(m), pad4(k), params.fp8_max, params.amax_epsilon, torch.finfo(x.dtype).max,
            ROWWISE=rowwise, COLWISE=columnwise, POW2=params.pow2_scales, NUM_STAGES=stages,
            OUT_BUFS=cfg.out_bufs, LR=_row_layout(eb, cfg.num_warps), LC=_col_layout(eb, cfg.num_warps),
            num_warps=cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        )  # fmt: skip
    elif m == 0 and columnwise:
        col_s.fill_(1.0)
    return BlockwiseFp8Tensor((m, k), 1, f8, x.dtype, **parts)


# --------------------------------------------------------------------------------------------------
# Ahead-of-time compile check (no GPU needed)
# --------------------------------------------------------------------------------------------------

_GL_NAME = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.bfloat16: "bf16",
            torch.float16: "fp16", torch.float32: "fp32"}  # fmt: skip


def _descs(x, rq, cq, fp8_dtype):
    in_layout = gl.NVMMASharedLayout.get_default_for([BLOCK, BLOCK], TORCH_TO_GL[x.dtype])
    f8 = _fp8_layout(TORCH_TO_GL[fp8_dtype])
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
    rq = torch.empty(m, k, dtype=fp8_dtype) if rowwise else None
    cq = torch.empty(k, m, dtype=fp8_dtype) if columnwise else None
    x_desc, rq_desc, cq_desc = _descs(x, rq, cq, fp8_dtype)
    eb = x.element_size()
    sig = {
        "x_desc": mangle_type(x_desc),
        "rq_desc": mangle_type(rq_desc) if rowwise else "constexpr",
        "cq_desc": mangle_type(cq_desc) if columnwise else "constexpr",
        "row_s_ptr": "*fp32", "col_s_ptr": "*fp32", "M": "i32", "K": "i32", "M_PAD": "i32", "K_PAD": "i32",
        "fp8_max": "fp32", "amax_eps": "fp32", "in_max": "fp32",
        "ROWWISE": "constexpr", "COLWISE": "constexpr", "POW2": "constexpr", "NUM_STAGES": "constexpr",
        "OUT_BUFS": "constexpr", "LR": "constexpr", "LC": "constexpr",
    }  # fmt: skip
    cons = {"ROWWISE": rowwise, "COLWISE": columnwise, "POW2": pow2, "NUM_STAGES": _default_stages(eb, cfg),
            "OUT_BUFS": cfg.out_bufs, "LR": _row_layout(eb, cfg.num_warps), "LC": _col_layout(eb, cfg.num_warps)}  # fmt: skip
    if not rowwise:
        cons["rq_desc"] = None
    if not columnwise:
        cons["cq_desc"] = None
    names = list(sig)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in ("row_s_ptr", "col_s_ptr", "M", "K", "M_PAD", "K_PAD")}
    src = GluonASTSource(fn=_quantize_1x128_dual_gluon_kernel, signature=sig, constexprs=cons, attrs=attrs)
    opts = {"num_warps": cfg.num_warps}
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


EXPECT_SM90 = {
    "tma_load": r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global",
    "tma_store": r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta",
    "mbarrier_wait": r"mbarrier\.try_wait",
    "ld_shared_vec": r"ld\.shared\.v[24]\.b(16|32)",
    "st_shared_vec": r"st\.shared(\.v[24])?\.b(16|32)|stmatrix\.sync",
}


def aot_variants(cfg: GluonQuantConfig = DEFAULT_CONFIG) -> list[tuple]:
    """Every (in dtype, fp8 dtype, pow2, rowwise, columnwise) the wrapper can launch."""
    out = []
    for in_dt in (torch.bfloat16, torch.float16, torch.float32):
        for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for pow2 in (True, False):
                for row, col in ((True, True), (True, False), (False, True)):
                    out.append((in_dt, f8, pow2, row, col))
    return out


def inspect_compiled(kernel, fp8_dtype) -> dict:
    from .aot import sm90_resources

    ptx = kernel.asm["ptx"]
    res, sass = sm90_resources(kernel.asm["cubin"])
    cvt = "e4m3x2" if fp8_dtype == torch.float8_e4m3fn else "e5m2x2"
    expect = {**EXPECT_SM90, "cvt": rf"cvt\.rn\.satfinite\.{cvt}\.f32"}
    text = ptx + "\n" + sass
    found = {key: len(re.findall(pat, text)) for key, pat in expect.items()}
    byte_st = len(re.findall(r"st\.shared(\.v[248])?\.[bu]8", ptx))  # the transpose must not go byte by byte
    return {
        "regs": int(res.get("REG", -1)), "stack": int(res.get("STACK", -1)), "local": int(res.get("LOCAL", -1)),
        "smem": int(getattr(kernel.metadata, "shared", 0)), "found": found, "ptx": ptx, "sass": sass,
        "byte_st": byte_st,
        "sass_lines": sum(1 for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)),
    }  # fmt: skip


def aot_check(dump_dir: Path | None = None, verbose: bool = True, cfg: GluonQuantConfig = DEFAULT_CONFIG) -> bool:
    """Compile every variant the wrapper launches (for ``cfg``) for sm_90 and check it: TMA loads and
    stores, the saturating FP8 conversion, vectorised shared-memory accesses, no spills, smem fits."""
    ok_all = True
    for in_dt, f8, pow2, row, col in aot_variants(cfg):
        name = f"{_GL_NAME[in_dt]}->{_GL_NAME[f8]}:pow2={int(pow2)}:row={int(row)}:col={int(col)}"
        try:
            info = inspect_compiled(compile_variant(in_dt, f8, pow2, row, col, cfg), f8)
        except Exception as e:  # noqa: BLE001
            ok_all = False
            print(f"{name:40} COMPILE FAILED: {type(e).__name__}: {str(e)[:2000]}")
            continue
        f = info["found"]
        need = ["tma_load", "mbarrier_wait", "cvt", "ld_shared_vec"] + (["tma_store", "st_shared_vec"] if row or col else [])
        ok = (all(f[key] for key in need) and info["stack"] == 0 and info["local"] == 0
              and info["smem"] <= SMEM_LIMIT and info["byte_st"] == 0)  # fmt: skip
        ok_all &= ok
        if verbose:
            print(f"{name:40} {'OK ' if ok else 'BAD'} regs={info['regs']:3} stack={info['stack']} "
                  f"local={info['local']} smem={info['smem']} byte_st={info['byte_st']} sass={info['sass_lines']} "
                  f"found={f}")  # fmt: skip
        if dump_dir is not None:
            from .aot import dump_asm

            dump_asm(dump_dir, name, {"ptx": info["ptx"], "sass": info["sass"]})
    return ok_all


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="AOT-compile the Gluon 1x128 dual quantization kernel for sm_90 and check it")
    ap.add_argument("--dump", type=Path, help="write PTX and SASS of each variant into this folder")
    ap.add_argument("--num-warps", type=int, default=DEFAULT_CONFIG.num_warps)
    ap.add_argument("--num-stages", type=int, default=DEFAULT_CONFIG.num_stages)
    ap.add_argument("--out-bufs", type=int, default=DEFAULT_CONFIG.out_bufs)
    ap.add_argument("--maxnreg", type=int, default=DEFAULT_CONFIG.maxnreg)
    args = ap.parse_args()
    c = GluonQuantConfig(num_warps=args.num_warps, num_stages=args.num_stages, out_bufs=args.out_bufs, maxnreg=args.maxnreg)
    sys.exit(0 if aot_check(args.dump, cfg=c) else 1)
