"""The activations that fused ops make, written in the input dtype or quantized to FP8 directly.

Two producers, chosen by the constexpr ``OP``:

* ``OP_LAYERNORM`` / ``OP_RMSNORM``: the norm's output ``xhat * gamma (+ beta)`` from the residual
  stream ``x [M, H]`` and its row statistics (``norm.py`` computes them first);
* ``OP_SWIGLU``: ``silu(a) * b`` from fc1's output ``h [M, 2F] = [a | b]``.

Each value is rounded to the input dtype exactly as the unfused op rounds its output
(``reference_fused.py``), and then, in ``quantize_fused_kernel``, quantized exactly as the activation
quantizer quantizes a tensor: the kernel is ``quantize_act.quantize_1x128_dual_kernel`` with this
producer in place of its load, and calls the same device functions for the rowwise copy (1x128
tiles), the columnwise copy (128x1 tiles, over the 128 rows of the program's tile) and the scales in
TE's layouts. So a program owns one 128x128 tile of the output; the norm's statistics for its 128
rows come from memory. The high-precision output is never written in the fused path.

``apply_kernel`` writes the output in the input dtype instead (the unfused path of the triton
backend: the same producer, so the same bits before quantization). On Hopper the triton backend runs
``kernels/sm90/fused_act.py``'s kernel instead where M, K and the row stride are multiples of 16
(``kernels/sm90/heuristics.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4
from .fused_math import FP_OPTIONS, swiglu_value
from .heuristics import FUSED_APPLY, QuantizeConfig, TileConfig, fused_quant_config
from .launch import FastLauncher
from .quantize_act import MAX_DIM, MAX_GRID_Y, column_scales, columnwise_copy, dual_outputs, rowwise_copy
from .scales import amax_nan, max_nan, scale_and_inverse


@triton.jit
def _produce(src_tile, r, c, stride, rows_ok, cols_ok, full, mean_p, rstd_p, gamma_p, beta_p, up_offset,
             OP: tl.constexpr, HAS_BETA: tl.constexpr):  # fmt: skip
    """The fused op's output at rows ``r`` x columns ``c`` of the tile, rounded to the input dtype and
    returned in fp32, 0 outside the tensor (``rows_ok``/``cols_ok``; ``full``: the whole tile is inside,
    nothing is masked). ``mean_p``/``rstd_p`` point at the tile's first row, ``gamma_p``/``beta_p`` at
    its first column, ``up_offset`` is the distance in elements from ``a`` to ``b`` (SwiGLU)."""
    ty = src_tile.dtype.element_ty
    offs = r[:, None] * stride + c[None, :]
    mask = rows_ok[:, None] & cols_ok[None, :]
    if OP == 2:
        if full:
            a = tl.load(src_tile + offs).to(tl.float32)
            b = tl.load(src_tile + up_offset + offs).to(tl.float32)
        else:
            a = tl.load(src_tile + offs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(src_tile + up_offset + offs, mask=mask, other=0.0).to(tl.float32)
        y = swiglu_value(a, b, ty)
    else:
        if full:
            x = tl.load(src_tile + offs).to(tl.float32)
            rstd = tl.load(rstd_p + r)
            gamma = tl.load(gamma_p + c).to(tl.float32)
        else:
            x = tl.load(src_tile + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_p + r, mask=rows_ok, other=0.0)
            gamma = tl.load(gamma_p + c, mask=cols_ok, other=0.0).to(tl.float32)
        if OP == 0:
            if full:
                mean = tl.load(mean_p + r)
            else:
                mean = tl.load(mean_p + r, mask=rows_ok, other=0.0)
            xhat = (x - mean[:, None]) * rstd[:, None]
        else:
            xhat = x * rstd[:, None]
        y = xhat * gamma[None, :]
        if HAS_BETA:
            if full:
                beta = tl.load(beta_p + c).to(tl.float32)
            else:
                beta = tl.load(beta_p + c, mask=cols_ok, other=0.0).to(tl.float32)
            y = y + beta[None, :]
        y = y.to(ty).to(tl.float32)
    if not full:
        y = tl.where(mask, y, 0.0)
    return y


@triton.jit
def quantize_fused_kernel(
    src_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr,
    M, K, M_PAD, K_PAD, stride_sm, up_offset, fp8_max, amax_eps, in_max,
    OP: tl.constexpr, HAS_BETA: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, POW2: tl.constexpr,
    BLOCK: tl.constexpr, SUB_M: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = pid_m * BLOCK
    k0 = pid_k * BLOCK
    sub = tl.arange(0, SUB_M)
    blk = tl.arange(0, BLOCK)
    full = (m0 + BLOCK <= M) & (k0 + BLOCK <= K)  # interior tiles need no masks
    src_tile = src_ptr + m0.to(tl.int64) * stride_sm + k0
    rq_tile = row_q_ptr + m0.to(tl.int64) * K + k0
    cq_tile = col_q_ptr + k0.to(tl.int64) * M + m0
    mean_p, rstd_p = mean_ptr + m0, rstd_ptr + m0
    gamma_p, beta_p = gamma_ptr + k0, beta_ptr + k0
    cols_ok = k0 + blk < K
    if SUB_M == BLOCK:
        rows_ok = m0 + blk < M
        mask = rows_ok[:, None] & cols_ok[None, :]
        y = _produce(src_tile, blk, blk, stride_sm, rows_ok, cols_ok, full, mean_p, rstd_p, gamma_p, beta_p,
                     up_offset, OP, HAS_BETA)  # fmt: skip
        if ROWWISE:
            rowwise_copy(y, blk, blk, rq_tile, row_s_ptr, pid_k, m0, M, K, M_PAD, mask, full, fp8_max, amax_eps,
                          in_max, POW2)  # fmt: skip
        if COLWISE:
            scale, s_inv = scale_and_inverse(amax_nan(y, 0), fp8_max, amax_eps, in_max, POW2)
            columnwise_copy(y, scale, blk, blk, cq_tile, M, mask, full)
            column_scales(s_inv, blk, col_s_ptr, pid_m, k0, K, K_PAD)
    else:
        # chunks of SUB_M rows: rowwise copy and a running column amax, then the columnwise copy in a
        # second pass that produces each chunk again
        col_amax2d = tl.zeros([SUB_M, BLOCK], dtype=tl.float32)
        for ch in tl.range(0, BLOCK // SUB_M):
            r = ch * SUB_M + sub
            rows_ok = m0 + r < M
            y = _produce(src_tile, r, blk, stride_sm, rows_ok, cols_ok, full, mean_p, rstd_p, gamma_p, beta_p,
                         up_offset, OP, HAS_BETA)  # fmt: skip
            if ROWWISE:
                mask = rows_ok[:, None] & cols_ok[None, :]
                rowwise_copy(y, r, blk, rq_tile, row_s_ptr, pid_k, m0, M, K, M_PAD, mask, full, fp8_max, amax_eps,
                              in_max, POW2)  # fmt: skip
            if COLWISE:
                col_amax2d = max_nan(col_amax2d, tl.abs(y))
        if COLWISE:
            scale, s_inv = scale_and_inverse(tl.reduce(col_amax2d, 0, max_nan), fp8_max, amax_eps, in_max, POW2)
            for ch in tl.range(0, BLOCK // SUB_M):
                r = ch * SUB_M + sub
                rows_ok = m0 + r < M
                y = _produce(src_tile, r, blk, stride_sm, rows_ok, cols_ok, full, mean_p, rstd_p, gamma_p, beta_p,
                             up_offset, OP, HAS_BETA)  # fmt: skip
                columnwise_copy(y, scale, r, blk, cq_tile, M, rows_ok[:, None] & cols_ok[None, :], full)
            column_scales(s_inv, blk, col_s_ptr, pid_m, k0, K, K_PAD)


@triton.jit
def apply_kernel(src_ptr, y_ptr, mean_ptr, rstd_ptr, gamma_ptr, beta_ptr, M, K, stride_sm, up_offset,
                  OP: tl.constexpr, HAS_BETA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    m0 = tl.program_id(0) * BLOCK_M
    k0 = tl.program_id(1) * BLOCK_K
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_K)
    rows_ok = m0 + r < M
    cols_ok = k0 + c < K
    full = (m0 + BLOCK_M <= M) & (k0 + BLOCK_K <= K)
    src_tile = src_ptr + m0.to(tl.int64) * stride_sm + k0
    y = _produce(src_tile, r, c, stride_sm, rows_ok, cols_ok, full, mean_ptr + m0, rstd_ptr + m0, gamma_ptr + k0,
                 beta_ptr + k0, up_offset, OP, HAS_BETA)  # fmt: skip
    y_tile = y_ptr + m0.to(tl.int64) * K + k0
    tl.store(y_tile + r[:, None] * K + c[None, :], y.to(y_ptr.dtype.element_ty), mask=rows_ok[:, None] & cols_ok[None, :])


_launch_quantize = FastLauncher(quantize_fused_kernel)
_launch_apply = FastLauncher(apply_kernel)


def _check_dims(m: int, k: int) -> None:
    if max(m, k) >= MAX_DIM:
        raise ValueError(f"the output is [{m}, {k}]: the fused kernels' in-tile offsets are 32-bit, so M and K must "
                         f"stay below {MAX_DIM}; split the tensor into row blocks")  # fmt: skip
    if k > MAX_GRID_Y:
        raise ValueError(f"the output is [{m}, {k}]: K's {ceil_div(k, BLOCK)} blocks exceed the 65535 programs of a "
                         f"CUDA grid's second axis (K <= {MAX_GRID_Y})")  # fmt: skip


def quantize_fused(src: torch.Tensor, op: int, params: QuantParams, *, k: int, up_offset: int = 0, mean=None, rstd=None,
                   gamma=None, beta=None, rowwise: bool, columnwise: bool,
                   config: QuantizeConfig | None = None) -> BlockwiseFp8Tensor:  # fmt: skip
    """Rowwise and/or columnwise 1x128 quantization of the fused op's output ``[M, k]`` made from
    ``src`` (rows of ``src.stride(0)`` elements, last dim contiguous); the same bits as
    ``quantize_1x128_dual`` of that output. Norms: ``mean`` (LayerNorm), ``rstd`` fp32 [M], ``gamma``
    [k], ``beta`` [k] or None. SwiGLU: ``up_offset`` = F, the offset of ``b`` in each row. ``config``: the
    launch (default: ``heuristics.fused_quant_config``)."""
    m = src.shape[0]
    _check_dims(m, k)
    stride = src.stride(0)
    # dual_outputs reads only the shape and device of its first argument: an [m, k] view of no memory
    row_q, row_s, col_q, col_s, parts = dual_outputs(src.new_empty(()).expand(m, k), params, rowwise, columnwise)
    if m > 0:
        cfg = config or fused_quant_config(op, m, k, stride)
        q_any = row_q if row_q is not None else col_q
        s_any = row_s if row_s is not None else col_s
        stats = rstd if rstd is not None else s_any  # pointers the kernel does not read for this OP
        _launch_quantize(
            (ceil_div(m, BLOCK), ceil_div(k, BLOCK)), src, row_q if rowwise else q_any, row_s if rowwise else s_any,
            col_q if columnwise else q_any, col_s if columnwise else s_any,
            mean if mean is not None else stats, stats, gamma if gamma is not None else src,
            beta if beta is not None else src, m, k, pad4(m), pad4(k), stride, up_offset,
            params.fp8_max, float(params.amax_epsilon), torch.finfo(src.dtype).max,
            op, beta is not None, bool(rowwise), bool(columnwise), bool(params.pow2_scales), BLOCK, cfg.sub_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **FP_OPTIONS,
        )  # fmt: skip
    elif columnwise:
        col_s.fill_(1.0)
    return BlockwiseFp8Tensor((m, k), 1, params.fp8_dtype, src.dtype, **parts)


def apply_fused(src: torch.Tensor, op: int, *, k: int, up_offset: int = 0, mean=None, rstd=None, gamma=None,
                beta=None, config: TileConfig = FUSED_APPLY) -> torch.Tensor:  # fmt: skip
    """The fused op's output ``[M, k]`` in ``src``'s dtype (arguments as for ``quantize_fused``)."""
    m = src.shape[0]
    _check_dims(m, k)
    y = torch.empty(m, k, dtype=src.dtype, device=src.device)
    if m > 0:
        stats = rstd if rstd is not None else y
        _launch_apply(
            (ceil_div(m, config.block_m), ceil_div(k, config.block_n)), src, y, mean if mean is not None else stats, stats,
            gamma if gamma is not None else src, beta if beta is not None else src, m, k, src.stride(0), up_offset,
            op, beta is not None, config.block_m, config.block_n, num_warps=config.num_warps, **FP_OPTIONS,
        )  # fmt: skip
    return y
