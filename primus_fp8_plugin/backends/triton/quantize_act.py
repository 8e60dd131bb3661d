"""Dual 1x128 quantization of activations and gradients: one read of X, both copies written.

Each program loads one 128x128 tile of X [M, K] once and writes
* the rowwise copy [M, K] (1x128 tiles: an amax per row of the tile) and its scale_inv column
  ``[kb, m0:m0+128]`` of the TE layout ``[ceil(K/128), pad4(M)]``;
* the columnwise copy X^T [K, M] (128x1 tiles: an amax per column) and its scale_inv row
  ``[mb, k0:k0+128]`` of ``[ceil(M/128), pad4(K)]``.
Programs on the last row/column of tiles also write the layout's padding entries (1.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4, scale_inv_shape
from .scales import quantize_with_scale, scale_from_amax

NUM_WARPS = 8  # 128x128 tile in flight per program; checked for spills by aot.py


@triton.jit
def _quantize_1x128_dual_kernel(
    x_ptr,
    row_q_ptr,
    row_s_ptr,
    col_q_ptr,
    col_s_ptr,
    M,
    K,
    M_PAD,
    K_PAD,
    stride_xm,
    fp8_max,
    amax_eps,
    in_max,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    ax = tl.abs(x)
    # x * 0 is 0 for finite x and NaN for NaN/Inf: a sum of it flags tiles holding non-finite values
    # without keeping a mask tile live (an Inf amax or NaN scale is overridden for those tiles).
    zero_or_nan = x * 0.0

    if ROWWISE:
        amax = tl.max(ax, axis=1)
        bad = tl.sum(zero_or_nan, axis=1) != 0.0
        scale = scale_from_amax(amax, fp8_max, amax_eps, in_max, POW2)
        q = quantize_with_scale(x, scale[:, None], bad[:, None], fp8_max, row_q_ptr.dtype.element_ty)
        tl.store(row_q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)
        s_inv = tl.where(bad, float("nan"), tl.div_rn(tl.zeros_like(scale) + 1.0, scale))
        s_inv = tl.where(rows < M, s_inv, 1.0)  # padding entries of the TE layout
        tl.store(row_s_ptr + pid_k * M_PAD + rows, s_inv, mask=rows < M_PAD)

    if COLWISE:
        amax = tl.max(ax, axis=0)
        bad = tl.sum(zero_or_nan, axis=0) != 0.0
        scale = scale_from_amax(amax, fp8_max, amax_eps, in_max, POW2)
        q = quantize_with_scale(x, scale[None, :], bad[None, :], fp8_max, col_q_ptr.dtype.element_ty)
        # X^T [K, M]: write the transposed tile so that M is the contiguous dim.
        tl.store(
            col_q_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :],
            tl.trans(q),
            mask=(cols < K)[:, None] & (rows < M)[None, :],
        )
        s_inv = tl.where(bad, float("nan"), tl.div_rn(tl.zeros_like(scale) + 1.0, scale))
        s_inv = tl.where(cols < K, s_inv, 1.0)
        tl.store(col_s_ptr + pid_m * K_PAD + cols, s_inv, mask=cols < K_PAD)


def quantize_1x128_dual(
    x: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool, num_warps: int = NUM_WARPS
) -> BlockwiseFp8Tensor:
    """Rowwise and/or columnwise 1x128 quantization of a contiguous 2-D ``x [M, K]`` in one pass."""
    assert x.dim() == 2 and x.is_contiguous() and params.block_dim == 1
    m, k = x.shape
    dev, f8 = x.device, params.fp8_dtype
    parts = {}
    row_q = row_s = col_q = col_s = None
    if rowwise:
        row_q = torch.empty(m, k, dtype=f8, device=dev)
        row_s = torch.empty(scale_inv_shape(m, k, 1), dtype=torch.float32, device=dev)
        parts.update(rowwise_data=row_q, rowwise_scale_inv=row_s)
    if columnwise:
        col_q = torch.empty(k, m, dtype=f8, device=dev)
        col_s = torch.empty(scale_inv_shape(k, m, 1), dtype=torch.float32, device=dev)
        parts.update(columnwise_data=col_q, columnwise_scale_inv=col_s)
    if m > 0:
        # pad4(n) never crosses a 128 boundary, so the last tile also writes the padding entries.
        grid = (ceil_div(m, BLOCK), ceil_div(k, BLOCK))
        dummy = row_q if row_q is not None else col_q
        dummy_s = row_s if row_s is not None else col_s
        _quantize_1x128_dual_kernel[grid](
            x,
            row_q if rowwise else dummy,
            row_s if rowwise else dummy_s,
            col_q if columnwise else dummy,
            col_s if columnwise else dummy_s,
            m,
            k,
            pad4(m),
            pad4(k),
            x.stride(0),
            params.fp8_max,
            params.amax_epsilon,
            torch.finfo(x.dtype).max,
            ROWWISE=rowwise,
            COLWISE=columnwise,
            POW2=params.pow2_scales,
            BLOCK=BLOCK,
            num_warps=num_warps,
        )
    elif columnwise:
        col_s.fill_(1.0)
    return BlockwiseFp8Tensor((m, k), 1, f8, x.dtype, **parts)
