"""W^T on demand: the columnwise copy of 128x128-quantized weights, made from their rowwise copy by an exact
transpose of the FP8 blocks and their scales (``tensor.transpose_blocks`` is the reference form; the bits are the
quantizer's own W^T, ``docs/NUMERICS.md``).

One program per 128x128 block (of one expert: the grid's third axis runs over ``E`` stacked weights): it copies
the block's bytes transposed in chunks of ``SUB_M`` rows (FP8 moved as raw bytes, nothing converted) and writes the
block's inverse scale at its transposed place. A bandwidth-bound pass: one read and one write of the FP8 data.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK
from ...tensor import ceil_div, pad4
from .heuristics import TransposeConfig, weight_transpose_config
from .launch import FastLauncher
from .quantize_act import MAX_GRID_Y
from .quantize_weight import MAX_DIM


@triton.jit
def transpose_128x128_kernel(
    q_ptr, s_ptr, qt_ptr, st_ptr, N, K, stride_s, stride_st, stride_se, stride_ste,
    BLOCK: tl.constexpr, SUB_M: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    n0 = pid_n * BLOCK
    k0 = pid_k * BLOCK
    sub = tl.arange(0, SUB_M)
    blk = tl.arange(0, BLOCK)
    full = (n0 + BLOCK <= N) & (k0 + BLOCK <= K)
    # 64-bit expert and block bases; in-block offsets fit in 32 bits
    q_blk = q_ptr + e * N * K + n0.to(tl.int64) * K + k0
    qt_blk = qt_ptr + e * N * K + k0.to(tl.int64) * N + n0
    for c in tl.static_range(BLOCK // SUB_M):
        r = c * SUB_M + sub
        if full:
            x = tl.load(q_blk + r[:, None] * K + blk[None, :])
            tl.store(qt_blk + blk[:, None] * N + r[None, :], tl.trans(x))
        else:
            mask = (n0 + r < N)[:, None] & (k0 + blk < K)[None, :]
            x = tl.load(q_blk + r[:, None] * K + blk[None, :], mask=mask, other=0)
            tl.store(qt_blk + blk[:, None] * N + r[None, :], tl.trans(x), mask=tl.trans(mask))
    s_inv = tl.load(s_ptr + e * stride_se + pid_n * stride_s + pid_k)
    tl.store(st_ptr + e * stride_ste + pid_k * stride_st + pid_n, s_inv)


_launch = FastLauncher(transpose_128x128_kernel)


def transpose_128x128(
    data: torch.Tensor, scale_inv: torch.Tensor, *, config: TransposeConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """W^T of ``data [N, K]`` or ``[E, N, K]`` (FP8, contiguous) with its 128x128 scales ``scale_inv [(E,)
    ceil(N/128), pad4(ceil(K/128))]`` (TE's layout, contiguous): ``(data^T [(E,) K, N], scale_inv^T [(E,)
    ceil(K/128), pad4(ceil(N/128))])``, padding entries 1.0. ``config``: the launch (default:
    ``heuristics.weight_transpose_config``)."""
    cfg = config or weight_transpose_config()
    assert data.dim() in (2, 3) and data.is_contiguous() and scale_inv.is_contiguous()
    assert scale_inv.dim() == data.dim() and scale_inv.dtype == torch.float32
    *lead, n, k = data.shape
    e = lead[0] if lead else 1
    if max(n, k) >= MAX_DIM:
        raise ValueError(f"weight is [{n}, {k}]: this kernel's in-block offsets are 32-bit, so N and K must stay "
                         f"below {MAX_DIM}")  # fmt: skip
    if k > MAX_GRID_Y or e > 65535:
        raise ValueError(f"{e} weight(s) [{n}, {k}]: K's blocks and the experts run on CUDA grid axes of at most "
                         f"65535 programs (K <= {MAX_GRID_Y}, E <= 65535)")  # fmt: skip
    rb, kb = ceil_div(n, BLOCK), ceil_div(k, BLOCK)
    qt = torch.empty(*lead, k, n, dtype=data.dtype, device=data.device)
    st = torch.ones(*lead, kb, pad4(rb), dtype=torch.float32, device=data.device)  # the kernel writes the real entries
    if data.numel() == 0:
        return qt, st
    stride_se = scale_inv.stride(0) if lead else 0
    stride_ste = st.stride(0) if lead else 0
    _launch(
        (rb, kb, e), data.view(torch.uint8), scale_inv, qt.view(torch.uint8), st, n, k,
        scale_inv.stride(-2), st.stride(-2), stride_se, stride_ste,
        BLOCK, cfg.sub_m,  # BLOCK, SUB_M
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return qt, st
