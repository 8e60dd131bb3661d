"""Grouped blockwise FP8 GEMMs for mixture-of-experts layers: one launch for all experts, no host sync.

``grouped_gemm`` (fprop, dgrad): ``C [T, N]``, expert ``e``'s token rows ``= A_e [c_e, K] @ B_e [N, K]^T``,
with A 1x128-scaled (the permuted tokens' rowwise copy, scales ``[kb, t]``) and B the expert's 128x128-scaled
weight from stacked ``[E, N, K]`` buffers. The tile schedule comes from the ``GroupLayout`` on the device:
``padded_offsets[E] / 128`` row tiles in all (each expert's count rounded up to whole 128-row tiles), times
the N tiles; a program finds its expert from the prefix sums and masks the rows past the expert's end. The
grid is sized for ``GroupLayout.capacity`` (an upper bound when the counts are only on the device); the
programs past the last tile return at once.

``grouped_wgrad``: ``dW_e [N, K] = dY_e^T X_e`` for each expert, from the padded columnwise copies
(``[N, C]`` and ``[K, C]``, expert ``e``'s tokens at columns ``padded_offsets[e]..``), contracting over the
expert's ``c_e`` tokens (``ceil(c_e/128)`` K blocks, 0 for an empty expert; the zero padding of the last
block stands for the dense kernel's masked loads). The outputs are ``E`` tensors
``[N, K]`` reached through a device table of addresses (Megatron's ``main_grad`` buffers, added into in
fp32) or one ``[E, N, K]`` buffer.

Both do per K block exactly what the dense kernel does (``gemm.py``: the same tile shape and masks, the
product of one K block into a fresh accumulator, then ``acc += part * a_scale * b_scale``; bias added in
fp32; ``acc += C`` when accumulating), so each expert's result equals a dense call on its own tokens bit for
bit. The row tiles are 128 tokens (``BLOCK_M == 128``: one tile per 128 padded rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ...grouped_tensor import GroupLayout
from ...recipe import BLOCK
from ...tensor import ceil_div
from .heuristics import GemmConfig, gemm_config, grouped_wgrad_config
from .launch import FastLauncher
from .pointer_table import pointer_table
from .quantize_grouped import block_e, find_group


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_s_ptr, b_s_ptr, bias_ptr, offsets_ptr, padded_ptr, E, N, K, stride_am, stride_be,
    stride_bn, stride_cm, stride_as, stride_bse, stride_bs, stride_biase,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_pid_m = tl.load(padded_ptr + E) // BLOCK_M  # row tiles of all experts (device-side schedule)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if pid < num_pid_m * num_pid_n:
        # L2-friendly order, as in the dense kernel: GROUP_M row tiles sweep the N tiles together
        group = pid // (GROUP_M * num_pid_n)
        first_m = group * GROUP_M
        group_size = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
        pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
        e = find_group(padded_ptr, pid_m * BLOCK_M, E, BLOCK_E)
        row0 = tl.load(offsets_ptr + e) + (pid_m * BLOCK_M - tl.load(padded_ptr + e))  # the tile's first token
        end = tl.load(offsets_ptr + e + 1)

        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < end
        n_mask = offs_n < N
        b_e = b_ptr + e.to(tl.int64) * stride_be
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_e + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
        b_s_ptrs = b_s_ptr + e * stride_bse + (offs_n // BLOCK_K) * stride_bs

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            a_s = tl.load(a_s_ptr + kb * stride_as + offs_m, mask=m_mask, other=0.0)
            b_s = tl.load(b_s_ptrs + kb, mask=n_mask, other=0.0)
            partial = tl.dot(a, tl.trans(b))
            acc += partial * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * stride_biase + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, b_ptr, c_table_ptr, c0_ptr, a_s_ptr, b_s_ptr, offsets_ptr, padded_ptr, M, N, CAP, stride_as, stride_bs,
    stride_ce, C_TABLE: tl.constexpr, TABLE_ALIGN: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    e = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    tokens = tl.load(offsets_ptr + e + 1) - tl.load(offsets_ptr + e)  # this expert's contraction length
    col0 = tl.multiple_of(tl.load(padded_ptr + e), BLOCK_K)  # its first token column in the padded copies

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * CAP + col0 + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * CAP + col0 + offs_k[None, :]
    s_row0 = col0 // BLOCK_K  # its first scale row (tile) in both copies

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(tokens, BLOCK_K)):
        # no mask along the tokens: the copies hold FP8 zeros past the expert's last token up to its padded
        # end, the values a masked load (the dense kernel's) gives there
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None], other=0.0)
        a_s = tl.load(a_s_ptr + (s_row0 + kb) * stride_as + offs_m, mask=m_mask, other=0.0)
        b_s = tl.load(b_s_ptr + (s_row0 + kb) * stride_bs + offs_n, mask=n_mask, other=0.0)
        partial = tl.dot(a, tl.trans(b))
        acc += partial * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if C_TABLE:  # (TABLE_ALIGN: the table's alignment, so that the fp32 main_grad moves in 16-byte accesses)
        c_e = tl.multiple_of(tl.load(c_table_ptr + e).to(tl.pointer_type(c0_ptr.dtype.element_ty)), TABLE_ALIGN)
    else:
        c_e = c0_ptr + e.to(tl.int64) * stride_ce
    c_ptrs = c_e + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
    tl.store(c_ptrs, acc.to(c0_ptr.dtype.element_ty), mask=c_mask)


_launch_gemm = FastLauncher(grouped_gemm_kernel)
_launch_wgrad = FastLauncher(grouped_wgrad_kernel)


def _check_fp8(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not t.is_contiguous():
            raise TypeError(f"FP8 (e4m3fn/e5m2) contiguous operands required, got {t.dtype}")


def grouped_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    layout: GroupLayout,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``C [T, N]``: expert ``e``'s rows of ``a [T, K]`` (1x128 scales ``[ceil(K/128), >=T]``) times ``b[e]^T``
    (``b [E, N, K]``, 128x128 scales ``[E, ceil(N/128), >=ceil(K/128)]``), plus ``bias[e]`` (``[E, N]``)."""
    _check_fp8(a, b)
    t, k = a.shape
    e, n, kb_ = b.shape
    if kb_ != k or e != layout.num_groups or t != layout.num_tokens:
        raise ValueError(f"a is {tuple(a.shape)} and b {tuple(b.shape)} for a layout of {layout.num_groups} experts, "
                         f"{layout.num_tokens} tokens")  # fmt: skip
    cfg = config or gemm_config()
    if cfg.block_m != BLOCK:
        raise ValueError(f"the grouped GEMM's row tiles are {BLOCK} tokens (block_m={cfg.block_m} given)")
    c = torch.empty(t, n, dtype=out_dtype, device=a.device)
    if k == 0:
        return c.zero_()
    if t == 0 or n == 0:
        return c
    grid = (layout.capacity // BLOCK * ceil_div(n, cfg.block_n),)
    _launch_gemm(
        grid, a, b, c, a_scale_inv, b_scale_inv, bias if bias is not None else c, layout.offsets, layout.padded_offsets,
        e, n, k, a.stride(0), b.stride(0), b.stride(1), c.stride(0), a_scale_inv.stride(0), b_scale_inv.stride(0),
        b_scale_inv.stride(1), bias.stride(0) if bias is not None else 0,
        bias is not None, cfg.block_m, cfg.block_n, BLOCK, cfg.group_m, block_e(e),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c


def grouped_wgrad(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    layout: GroupLayout,
    *,
    out_dtype: torch.dtype,
    accumulate_into: Sequence[torch.Tensor] | None = None,
    config: GemmConfig | None = None,
) -> list[torch.Tensor]:
    """``C_e [M, N] = a_e @ b_e^T`` over each expert's token columns of ``a [M, C]`` and ``b [N, C]`` (padded
    columnwise copies, 1x128 scales ``[C/128, >=M]`` and ``[C/128, >=N]``). Into ``accumulate_into`` (``E``
    contiguous fp32 ``[M, N]``, added to in place) or new tensors (views of one ``[E, M, N]``)."""
    _check_fp8(a, b)
    m, cap = a.shape
    n = b.shape[0]
    e = layout.num_groups
    if b.shape[1] != cap or cap != layout.capacity:
        raise ValueError(f"a is {tuple(a.shape)}, b {tuple(b.shape)}; both need the layout's {layout.capacity} token columns")
    if e > 65535:
        raise ValueError(f"{e} experts: the grouped wgrad runs them on a CUDA grid axis of at most 65535 programs")
    cfg = config or grouped_wgrad_config(cap / max(e, 1))
    if accumulate_into is not None:
        outs = list(accumulate_into)
        c0, (table, align), stride_ce = outs[0], pointer_table(outs), 0
    else:
        stacked = torch.empty(e, m, n, dtype=out_dtype, device=a.device)
        outs = list(stacked.unbind(0))
        c0, table, align, stride_ce = stacked, stacked, 1, m * n
    if m == 0 or n == 0:
        return outs
    grid = (ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n), e)
    _launch_wgrad(
        grid, a, b, table, c0, a_scale_inv, b_scale_inv, layout.offsets, layout.padded_offsets, m, n, cap,
        a_scale_inv.stride(0), b_scale_inv.stride(0), stride_ce,
        accumulate_into is not None, align, accumulate_into is not None, cfg.block_m, cfg.block_n, BLOCK, cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return outs
