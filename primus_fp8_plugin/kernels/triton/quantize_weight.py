"""128x128 weight quantization: one HBM read of W [N, K] writes W (fprop) and W^T (dgrad) with scales.

Hopper FP8 tensor cores need the contraction dim contiguous, so dgrad needs W^T physically; both
copies hold the same FP8 values and scales (transposed), produced by the same program. A program
walks its 128x128 block in chunks of SUB_M rows (by default the whole block at once): one pass for
the block's amax, then (from L2) one to quantize and store W and one for W^T. The transposed copy
is made in a second pass over the block, from fp32 values: computing both copies from one loaded
chunk gives wrong W^T bytes with Triton 3.6 on sm_90 (see the kernel's comment).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, scale_inv_shape
from .heuristics import QuantizeConfig, weight_quant_config
from .launch import FastLauncher
from .quantize_act import MAX_GRID_Y  # K blocks run on grid axis 1, as in the act kernel
from .scales import max_nan, scale_and_inverse

MAX_DIM = 2**31 // BLOCK  # in-block offsets (row * K, col * N within a 128-block) are int32


@triton.jit
def quantize_128x128_kernel(
    w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_wn, stride_s, stride_st, fp8_max, amax_eps, in_max,
    POW2: tl.constexpr, BLOCK: tl.constexpr, SUB_M: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK
    k0 = pid_k * BLOCK
    sub = tl.arange(0, SUB_M)
    blk = tl.arange(0, BLOCK)
    full = (n0 + BLOCK <= N) & (k0 + BLOCK <= K)  # interior blocks need no masks
    # 64-bit block bases; in-block offsets fit in 32 bits
    w_blk = w_ptr + n0.to(tl.int64) * stride_wn + k0
    q_blk = q_ptr + n0.to(tl.int64) * K + k0
    qt_blk = qt_ptr + k0.to(tl.int64) * N + n0

    amax2d = tl.zeros([SUB_M, BLOCK], dtype=tl.float32)  # NaN-propagating: see scales.py
    for c in tl.static_range(BLOCK // SUB_M):
        r = c * SUB_M + sub
        mask = (n0 + r < N)[:, None] & (k0 + blk < K)[None, :]
        if full:
            x = tl.load(w_blk + r[:, None] * stride_wn + blk[None, :])
        else:
            x = tl.load(w_blk + r[:, None] * stride_wn + blk[None, :], mask=mask, other=0.0)
        amax2d = max_nan(amax2d, tl.abs(x.to(tl.float32)))
    amax = tl.reduce(tl.reduce(amax2d, 1, max_nan), 0, max_nan)
    scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)

    # W, then W^T in a separate pass over the block (from L2). Computing both from one loaded chunk
    # gave wrong W^T bytes (about 1 in 4) for fp32 inputs on sm_90 with triton 3.6, apparently as the
    # compiler moved the transpose after the FP8 cast; tests/gpu guard this.
    for c in tl.static_range(BLOCK // SUB_M):
        r = c * SUB_M + sub
        mask = (n0 + r < N)[:, None] & (k0 + blk < K)[None, :]
        if full:
            x = tl.load(w_blk + r[:, None] * stride_wn + blk[None, :])
            tl.store(q_blk + r[:, None] * K + blk[None, :], (scale * x.to(tl.float32)).to(q_ptr.dtype.element_ty))
        else:
            x = tl.load(w_blk + r[:, None] * stride_wn + blk[None, :], mask=mask, other=0.0)
            q = (scale * x.to(tl.float32)).to(q_ptr.dtype.element_ty)
            tl.store(q_blk + r[:, None] * K + blk[None, :], q, mask=mask)
    for c in tl.static_range(BLOCK // SUB_M):
        r = c * SUB_M + sub
        mask = (n0 + r < N)[:, None] & (k0 + blk < K)[None, :]
        if full:
            x = tl.load(w_blk + r[:, None] * stride_wn + blk[None, :])
            qt = (scale * tl.trans(x.to(tl.float32))).to(qt_ptr.dtype.element_ty)  # [BLOCK (k), SUB_M (n)]
            tl.store(qt_blk + blk[:, None] * N + r[None, :], qt)
        else:
            x = tl.load(w_blk + r[:, None] * stride_wn + blk[None, :], mask=mask, other=0.0)
            qt = (scale * tl.trans(x.to(tl.float32))).to(qt_ptr.dtype.element_ty)
            tl.store(qt_blk + blk[:, None] * N + r[None, :], qt, mask=tl.trans(mask))
    tl.store(s_ptr + pid_n * stride_s + pid_k, s_inv)
    tl.store(st_ptr + pid_k * stride_st + pid_n, s_inv)


_launch = FastLauncher(quantize_128x128_kernel)


def quantize_128x128(w: torch.Tensor, params: QuantParams, *, config: QuantizeConfig | None = None) -> BlockwiseFp8Tensor:
    """Both copies of a contiguous ``w [N, K]`` quantized with 128x128 blocks, in one pass. ``config``: the
    launch (default: ``heuristics.weight_quant_config``)."""
    assert w.dim() == 2 and w.is_contiguous() and params.block_dim == 2
    cfg = config or weight_quant_config()
    n, k = w.shape
    if max(n, k) >= MAX_DIM:
        raise ValueError(f"weight is [{n}, {k}]: this kernel's in-block offsets are 32-bit, so N and K must stay "
                         f"below {MAX_DIM}")  # fmt: skip
    if k > MAX_GRID_Y:
        raise ValueError(f"weight is [{n}, {k}]: K's {ceil_div(k, BLOCK)} blocks exceed the 65535 programs of a "
                         f"CUDA grid's second axis (K <= {MAX_GRID_Y})")  # fmt: skip
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
        params.pow2_scales, BLOCK, cfg.sub_m,  # POW2, BLOCK, SUB_M
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return BlockwiseFp8Tensor(
        (n, k), 2, f8, w.dtype, rowwise_data=q, rowwise_scale_inv=s, columnwise_data=qt, columnwise_scale_inv=st
    )
