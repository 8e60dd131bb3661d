"""128x128 weight quantization: one read of W [N, K] writes W (fprop) and W^T (dgrad) with scales.

Hopper FP8 tensor cores need the contraction dim contiguous, so dgrad needs W^T physically; the
two copies hold the same FP8 values and scales (transposed), produced by the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape
from .scales import quantize_with_scale, scale_from_amax

NUM_WARPS = 8


@triton.jit
def _quantize_128x128_kernel(
    w_ptr,
    q_ptr,
    qt_ptr,
    s_ptr,
    st_ptr,
    N,
    K,
    stride_wn,
    stride_s,
    stride_st,
    fp8_max,
    amax_eps,
    in_max,
    POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK + tl.arange(0, BLOCK)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    x = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    # x * 0 is NaN exactly for NaN/Inf x (see quantize_act.py)
    bad = tl.sum(tl.sum(x * 0.0, axis=1), axis=0) != 0.0
    scale = scale_from_amax(amax, fp8_max, amax_eps, in_max, POW2)
    q = quantize_with_scale(x, scale, bad, fp8_max, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)
    tl.store(
        qt_ptr + cols.to(tl.int64)[:, None] * N + rows[None, :],
        tl.trans(q),
        mask=(cols < K)[:, None] & (rows < N)[None, :],
    )
    s_inv = tl.where(bad, float("nan"), tl.div_rn(tl.zeros_like(scale) + 1.0, scale))
    tl.store(s_ptr + pid_n * stride_s + pid_k, s_inv)
    tl.store(st_ptr + pid_k * stride_st + pid_n, s_inv)


def quantize_128x128(w: torch.Tensor, params: QuantParams, *, num_warps: int = NUM_WARPS) -> BlockwiseFp8Tensor:
    """Both copies of a contiguous ``w [N, K]`` quantized with 128x128 blocks, in one pass."""
    assert w.dim() == 2 and w.is_contiguous() and params.block_dim == 2
    n, k = w.shape
    dev, f8 = w.device, params.fp8_dtype
    q = torch.empty(n, k, dtype=f8, device=dev)
    qt = torch.empty(k, n, dtype=f8, device=dev)
    # Padding entries of TE's layout hold 1.0; the kernel writes every real entry.
    s = torch.ones(scale_inv_shape(n, k, 2), dtype=torch.float32, device=dev)
    st = torch.ones(scale_inv_shape(k, n, 2), dtype=torch.float32, device=dev)
    grid = (ceil_div(n, BLOCK), ceil_div(k, BLOCK))
    _quantize_128x128_kernel[grid](
        w, q, qt, s, st, n, k, w.stride(0), s.stride(0), st.stride(0),
        params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max,
        POW2=params.pow2_scales, BLOCK=BLOCK, num_warps=num_warps,
    )  # fmt: skip
    return BlockwiseFp8Tensor(
        (n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st
    )
