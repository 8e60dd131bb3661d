"""The fused quantization of ``fused_act.py`` for Hopper (sm_90), in Gluon: the act quantizer of
``quantize_act.py`` (one program per 128x128 tile, 8 warps, one block barrier, the columnwise
copy transposed through shared memory in the input dtype) with the fused op's producer in front of it.

The producer computes the norm's or SwiGLU's output in the loaded tile's registers (layout ``L``),
rounds it to the input dtype exactly as ``fused_act._produce`` does (the same fp32 operations, the
same ``swiglu_value``, compiled without FMA contraction), and the quantizer then treats that tile as
the act quantizer treats its input: the same bits as ``fused_act.quantize_fused`` and as
``quantize_1x128_dual_gluon`` of the unfused output.

The kernel takes M, K and the source row stride multiples of 16 and a 16-byte aligned source (the
Gluon act quantizer's rules: ``unsupported_reason``); the heuristics send other calls to the portable
kernel (kernels/triton/fused_act.py), and the wrapper raises ``GluonUnsupported`` for them before
launching anything.

Launch variants (``FusedQuantConfig``; the heuristics name them): the whole 128x128 tile produced at once,
or in two 128x64 column halves. Resources on sm_90 (``python -m tools.aot_triton --gluon fused_act``), bf16:
the fused SwiGLU quantizer issues about 4,500 instructions per thread per 128x128 tile (about 70 per
element: the spec's exp polynomial and IEEE divisions, no FMA), so at 8192x14336 it is bound by instruction
issue near 280 us rather than by its 712 MB of traffic (about 180 us at copy bandwidth); with ``parts=1``
it needs 187 registers (one 8-warp program per SM), with ``parts=2`` 128 (two)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4
from ..triton.fused_math import FP_OPTIONS, OP_SWIGLU, swiglu_value
from ..triton.launch import FastLauncher, aligned
from ..triton.quantize_act import MAX_DIM, MAX_GRID_Y, dual_outputs
from ..triton.scales import amax_nan, max_nan, scale_and_inverse
from .quantize_act import NUM_WARPS, layouts
from .quantize_tiles import store_tile
from .target import GluonUnsupported, runs_on


@dataclass(frozen=True)
class FusedQuantConfig:
    """``parts`` = 1 produces the 128x128 tile at once, 2 in two 128x64 column halves (fewer live registers
    while the producer runs: SwiGLU's needs ~190 at once, one program per SM). ``swiglu_maxnreg`` /
    ``norm_maxnreg``: the register cap passed to the compiler for 2-byte inputs writing both FP8 copies
    (the training case; checked spill-free ahead of time by ``tools.aot_triton --gluon fused_act``); None,
    and every other case: the compiler's choice. Every config computes the same bits."""

    parts: int
    swiglu_maxnreg: int | None = None
    norm_maxnreg: int | None = None

    def maxnreg(self, swiglu: bool, element_size: int, rowwise: bool, columnwise: bool) -> int | None:
        if element_size != 2 or not (rowwise and columnwise):
            return None
        return self.swiglu_maxnreg if swiglu else self.norm_maxnreg


@gluon.jit
def _load(ptr, r0, c0, R, C, stride, NC: gl.constexpr, L: gl.constexpr):
    """Tile ``[r0:r0+128, c0:c0+NC]`` of a row-major ``[R, C]`` tensor (row stride ``stride``) in
    layout ``L``, zeros outside (``quantize_tiles.load_tile`` for NC = 128)."""
    rr = gl.arange(0, 128, layout=gl.SliceLayout(1, L))
    rc = gl.arange(0, NC, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(r0 + rr < R, 1) & gl.expand_dims(c0 + rc < C, 0)
    tile = ptr + r0.to(gl.int64) * stride + c0
    return gl.load(tile + gl.expand_dims(rr * stride, 1) + gl.expand_dims(rc, 0), mask=mask, other=0.0)


@gluon.jit
def _store(vals, ptr, r0, c0, R, C, NC: gl.constexpr, L: gl.constexpr):
    """Store ``vals`` ([128, NC], layout ``L``) as ``[r0:r0+128, c0:c0+NC]`` of the contiguous ``[R, C]``
    tensor at ``ptr``, masked at the edges (``quantize_tiles.store_tile`` for NC = 128)."""
    rr = gl.arange(0, 128, layout=gl.SliceLayout(1, L))
    rc = gl.arange(0, NC, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(r0 + rr < R, 1) & gl.expand_dims(c0 + rc < C, 0)
    tile = ptr + r0.to(gl.int64) * C + c0
    gl.store(tile + gl.expand_dims(rr * C, 1) + gl.expand_dims(rc, 0), vals, mask=mask)


@gluon.jit
def _produce_tile(src_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, m0, k0, M, K, stride, up_offset,
                  OP: gl.constexpr, HAS_BETA: gl.constexpr, NC: gl.constexpr, L: gl.constexpr):  # fmt: skip
    """The fused op's output on tile [m0:m0+128, k0:k0+NC], rounded to the input dtype, 0 outside."""
    B: gl.constexpr = 128
    ty = src_ptr.dtype.element_ty
    rows = m0 + gl.arange(0, B, layout=gl.SliceLayout(1, L))
    cols = k0 + gl.arange(0, NC, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < K, 0)
    if OP == 2:
        a = _load(src_ptr, m0, k0, M, K, stride, NC, L).to(gl.float32)
        b = _load(src_ptr + up_offset, m0, k0, M, K, stride, NC, L).to(gl.float32)
        y = swiglu_value(a, b, ty)
    else:
        x = _load(src_ptr, m0, k0, M, K, stride, NC, L).to(gl.float32)
        rstd = gl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        gamma = gl.load(gamma_ptr + cols, mask=cols < K, other=0.0).to(gl.float32)
        if OP == 0:
            mean = gl.load(mean_ptr + rows, mask=rows < M, other=0.0)
            xhat = (x - gl.expand_dims(mean, 1)) * gl.expand_dims(rstd, 1)
        else:
            xhat = x * gl.expand_dims(rstd, 1)
        y = xhat * gl.expand_dims(gamma, 0)
        if HAS_BETA:
            beta = gl.load(beta_ptr + cols, mask=cols < K, other=0.0).to(gl.float32)
            y = y + gl.expand_dims(beta, 0)
    return gl.where(mask, y.to(ty).to(gl.float32), 0.0).to(ty)


@gluon.jit
def quantize_fused_gluon_kernel(
    src_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr,
    M, K, M_PAD, K_PAD, stride_sm, up_offset, fp8_max, amax_eps, in_max,
    OP: gl.constexpr, HAS_BETA: gl.constexpr, ROWWISE: gl.constexpr, COLWISE: gl.constexpr, POW2: gl.constexpr,
    L: gl.constexpr, LN: gl.constexpr, LT_RAW: gl.constexpr, T_RAW: gl.constexpr,
    PARTS: gl.constexpr, L2: gl.constexpr, LN2: gl.constexpr,
):  # fmt: skip
    B: gl.constexpr = 128
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = pid_m * B
    k0 = pid_k * B

    if PARTS == 1:
        yr = _produce_tile(src_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, m0, k0, M, K, stride_sm, up_offset, OP,
                           HAS_BETA, B, L)  # fmt: skip
        if COLWISE:
            t_raw = gl.allocate_shared_memory(src_ptr.dtype.element_ty, [B, B], T_RAW)
            t_raw.permute((1, 0)).store(gl.convert_layout(yr, LN, assert_trivial=True))
        if ROWWISE:
            y = yr.to(gl.float32)
            scale, s_inv = scale_and_inverse(amax_nan(y, 1), fp8_max, amax_eps, in_max, POW2)
            store_tile((gl.expand_dims(scale, 1) * y).to(row_q_ptr.dtype.element_ty), row_q_ptr, m0, k0, M, K, L)
            rows = m0 + gl.arange(0, B, layout=gl.SliceLayout(1, L))
            gl.store(row_s_ptr + pid_k * M_PAD + rows, gl.where(rows < M, s_inv, 1.0), mask=rows < M_PAD)
    else:
        # two 128x64 column halves (layouts L2 / LN2: L and LN without their [0, 64] register basis), each
        # produced, then written transposed into its half of the shared buffer; the row amax is the
        # NaN-propagating max of the halves' (the same value as the whole tile's)
        HB: gl.constexpr = B // 2
        y0 = _produce_tile(src_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, m0, k0, M, K, stride_sm, up_offset, OP,
                           HAS_BETA, HB, L2)  # fmt: skip
        if COLWISE:
            t_raw = gl.allocate_shared_memory(src_ptr.dtype.element_ty, [B, B], T_RAW)
            t_raw.slice(0, HB, dim=0).permute((1, 0)).store(gl.convert_layout(y0, LN2, assert_trivial=True))
        y1 = _produce_tile(src_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, m0, k0 + HB, M, K, stride_sm, up_offset,
                           OP, HAS_BETA, HB, L2)  # fmt: skip
        if COLWISE:
            t_raw.slice(HB, HB, dim=0).permute((1, 0)).store(gl.convert_layout(y1, LN2, assert_trivial=True))
        if ROWWISE:
            f0 = y0.to(gl.float32)
            f1 = y1.to(gl.float32)
            amax = max_nan(amax_nan(f0, 1), amax_nan(f1, 1))
            scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)
            q_ty = row_q_ptr.dtype.element_ty
            _store((gl.expand_dims(scale, 1) * f0).to(q_ty), row_q_ptr, m0, k0, M, K, HB, L2)
            _store((gl.expand_dims(scale, 1) * f1).to(q_ty), row_q_ptr, m0, k0 + HB, M, K, HB, L2)
            rows = m0 + gl.arange(0, B, layout=gl.SliceLayout(1, L2))
            gl.store(row_s_ptr + pid_k * M_PAD + rows, gl.where(rows < M, s_inv, 1.0), mask=rows < M_PAD)

    if COLWISE:
        gl.thread_barrier()  # the only one: the transposed tile is complete
        yt = t_raw.load(LT_RAW).to(gl.float32)  # [B (k), B (m)]: each column of the output inside one warp
        cscale, cs_inv = scale_and_inverse(amax_nan(yt, 1), fp8_max, amax_eps, in_max, POW2)
        store_tile((gl.expand_dims(cscale, 1) * yt).to(col_q_ptr.dtype.element_ty), col_q_ptr, k0, m0, K, M, LT_RAW)
        cols = k0 + gl.arange(0, B, layout=gl.SliceLayout(1, LT_RAW))
        gl.store(col_s_ptr + pid_m * K_PAD + cols, gl.where(cols < K, cs_inv, 1.0), mask=cols < K_PAD)


_launch = FastLauncher(quantize_fused_gluon_kernel)


@functools.cache
def half_layouts():
    """(L2, LN2): ``transpose_tile_layouts``' L and LN for a 128x64 column half of the tile (their
    [0, 64] register basis dropped: the same threads hold the same rows and columns of each half)."""
    reg_c_first = [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0]]
    reg_r_first = [[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]]
    lanes = [[0, 8], [0, 16], [0, 32], [4, 0], [8, 0]]
    warps = [[16, 0], [32, 0], [64, 0]]
    return (gl.DistributedLinearLayout(reg_c_first, lanes, warps, [], [128, 64]),
            gl.DistributedLinearLayout(reg_r_first, lanes, warps, [], [128, 64]))  # fmt: skip


def unsupported_reason(src: torch.Tensor, k: int, params: QuantParams) -> str | None:
    """Why this kernel does not take the fused op's source ``src`` (output ``[M, k]``), or None."""
    if not runs_on(src.device):
        return "the Gluon fused quantizer runs on NVIDIA Hopper (sm_90) only"
    if params.block_dim != 1:
        return "1x128 tiles (block_dim=1) only"
    if src.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input dtype {src.dtype} not supported (bf16, fp16, fp32)"
    m, stride = src.shape[0], src.stride(0)
    if m % 16 or k % 16 or stride % 16:
        return f"M = {m}, K = {k} and the row stride {stride} must be multiples of 16 (16-byte vectors)"
    if max(m, k) >= MAX_DIM or k > MAX_GRID_Y:
        return f"[{m}, {k}] is too large for this kernel's 32-bit in-tile offsets or grid"
    if src.data_ptr() % 16 or src.stride(1) != 1:
        return "the source must be 16-byte aligned with a contiguous last dim"
    return None


def quantize_fused_gluon(src, op, params, *, k, config: FusedQuantConfig, up_offset=0, mean=None, rstd=None, gamma=None,
                         beta=None, rowwise, columnwise) -> BlockwiseFp8Tensor:  # fmt: skip
    """The portable ``quantize_fused`` (kernels/triton/fused_act.py; same contract and bits) on Hopper, in the
    launch variant ``config`` (``heuristics.fused_quant_config``); raises ``GluonUnsupported`` before
    launching anything where ``unsupported_reason`` says so."""
    why = unsupported_reason(src, k, params)
    if why is not None:
        raise GluonUnsupported(why)
    m = src.shape[0]
    rowwise, columnwise = bool(rowwise), bool(columnwise)
    row_q, row_s, col_q, col_s, parts = dual_outputs(src.new_empty(()).expand(m, k), params, rowwise, columnwise)
    if m > 0 and k > 0 and (rowwise or columnwise):
        lay, lay_n, lt_raw, t_raw = layouts(src.element_size())
        q_any = row_q if row_q is not None else col_q
        s_any = row_s if row_s is not None else col_s
        stats = rstd if rstd is not None else s_any  # pointers the kernel does not read for this OP
        pow2 = bool(params.pow2_scales)
        # what can vary between calls; unsupported_reason fixes the rest (M, K, the stride and so F
        # multiples of 16 below MAX_DIM, pad4(M) == M, a 16-byte aligned source; float scalars)
        cfg = config
        lay2, lay_n2 = half_layouts()
        cap = cfg.maxnreg(op == OP_SWIGLU, src.element_size(), rowwise, columnwise)
        options = {} if cap is None else {"maxnreg": cap}
        hint = (src.dtype, params.fp8_dtype, op, beta is not None, rowwise, columnwise, pow2, cfg,
                aligned(row_q, row_s, col_q, col_s, mean, rstd, gamma, beta))  # fmt: skip
        _launch.hinted(
            hint, (ceil_div(m, BLOCK), ceil_div(k, BLOCK)), src, row_q if rowwise else q_any, row_s if rowwise else s_any,
            col_q if columnwise else q_any, col_s if columnwise else s_any, mean if mean is not None else stats, stats,
            gamma if gamma is not None else src, beta if beta is not None else src, m, k, pad4(m), pad4(k),
            src.stride(0), up_offset, params.fp8_max, float(params.amax_epsilon), torch.finfo(src.dtype).max,
            op, beta is not None, rowwise, columnwise, pow2, lay, lay_n, lt_raw, t_raw, cfg.parts, lay2, lay_n2,
            num_warps=NUM_WARPS, **options, **FP_OPTIONS,
        )  # fmt: skip
    elif m == 0 and columnwise:
        col_s.fill_(1.0)
    return BlockwiseFp8Tensor((m, k), 1, params.fp8_dtype, src.dtype, **parts)
