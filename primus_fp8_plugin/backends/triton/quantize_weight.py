"""128x128 weight quantization: one HBM read of W [N, K] writes W (fprop) and W^T (dgrad) with scales.

Hopper FP8 tensor cores need the contraction dim contiguous, so dgrad needs W^T physically; both
copies hold the same FP8 values and scales (transposed), produced by the same program. As in
``quantize_act.py`` a program walks its 128x128 block in chunks of SUB_M rows: one pass for the
block's amax, then (from L2) one to quantize and store W and one for W^T. The transposed copy is
made by transposing fp32 values, never FP8 ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape
from .launch import FastLauncher
from .scales import abs_or_inf, is_bad, quantize_with_scale, scale_from_amax

SUB_M = 64  # measured on H200: docs/PERFORMANCE.md
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
    SUB_M: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < K
    sub = tl.arange(0, SUB_M)
    w_tile = w_ptr + n0.to(tl.int64) * stride_wn

    amax2d = tl.zeros([SUB_M, BLOCK], dtype=tl.float32)  # NaN counts as inf: see scales.abs_or_inf
    for c in tl.static_range(BLOCK // SUB_M):
        rows = n0 + c * SUB_M + sub
        mask = (rows < N)[:, None] & col_ok[None, :]
        x = tl.load(w_tile + (c * SUB_M + sub)[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        amax2d = tl.maximum(amax2d, abs_or_inf(x))
    amax = tl.max(tl.max(amax2d, axis=1), axis=0)
    bad = is_bad(amax)
    scale = scale_from_amax(amax, fp8_max, amax_eps, in_max, POW2)

    # W, then W^T in a separate pass over the block (from L2). Computing both from one loaded chunk
    # gave wrong W^T bytes (about 1 in 4) for fp32 inputs on sm_90 with triton 3.6, apparently as the
    # compiler moved the transpose after the FP8 cast; tests/gpu guard this.
    for c in tl.static_range(BLOCK // SUB_M):
        rows = n0 + c * SUB_M + sub
        mask = (rows < N)[:, None] & col_ok[None, :]
        x = tl.load(w_tile + (c * SUB_M + sub)[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
        q = quantize_with_scale(x.to(tl.float32), scale, bad, fp8_max, q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)
    scale_v = tl.zeros([BLOCK], dtype=tl.float32) + scale  # per-row scale vector, as in quantize_act
    bad_v = (tl.zeros([BLOCK], dtype=tl.float32) + bad.to(tl.float32)) != 0.0
    for c in tl.static_range(BLOCK // SUB_M):
        rows = n0 + c * SUB_M + sub
        row_ok = rows < N
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(w_tile + (c * SUB_M + sub)[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
        xt = tl.trans(x.to(tl.float32))  # [BLOCK (k), SUB_M (n)]
        qt = quantize_with_scale(xt, scale_v[:, None], bad_v[:, None], fp8_max, qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + cols.to(tl.int64)[:, None] * N + rows[None, :], qt, mask=col_ok[:, None] & row_ok[None, :])
    s_inv = tl.where(bad, float("nan"), tl.div_rn(tl.zeros_like(scale) + 1.0, scale))
    tl.store(s_ptr + pid_n * stride_s + pid_k, s_inv)
    tl.store(st_ptr + pid_k * stride_st + pid_n, s_inv)


_launch = FastLauncher(_quantize_128x128_kernel)


def quantize_128x128(
    w: torch.Tensor, params: QuantParams, *, sub_m: int = SUB_M, num_warps: int = NUM_WARPS
) -> BlockwiseFp8Tensor:
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
    _launch(
        grid, w, q, qt, s, st, n, k, w.stride(0), s.stride(0), st.stride(0),
        params.fp8_max, params.amax_epsilon, torch.finfo(w.dtype).max,
        params.pow2_scales, BLOCK, sub_m,  # POW2, BLOCK, SUB_M
        num_warps=num_warps,
    )  # fmt: skip
    return BlockwiseFp8Tensor(
        (n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st
    )
