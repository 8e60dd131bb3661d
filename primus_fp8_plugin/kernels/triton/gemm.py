"""Blockwise FP8 GEMM ``C [M, N] = A [M, K] @ B [N, K]^T`` with per-128-K-block scale promotion.

A is 1x128-scaled (its scale_inv in TE's 1D layout: entry [kb, m]); B is 128x128-scaled (entry
[n // 128, kb], fprop and dgrad) or 1x128-scaled (entry [kb, n], wgrad). Both operands are
K-contiguous, as Hopper's FP8 wgmma requires. Each K block's tensor-core product is multiplied by
the two scales and added to an fp32 accumulator (DeepSeek-V3's promotion).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK
from ...tensor import ceil_div
from .heuristics import GemmConfig, gemm_config
from .launch import FastLauncher


@triton.jit
def blockwise_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_s_ptr,
    b_s_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as,
    stride_bs,
    B_2D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # L2-friendly order: GROUP_M rows of tiles sweep the N tiles together.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    if B_2D:
        b_s_ptrs = b_s_ptr + (offs_n // BLOCK_K) * stride_bs
    else:
        b_s_ptrs = b_s_ptr + offs_n

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        a_s = tl.load(a_s_ptr + kb * stride_as + offs_m, mask=m_mask, other=0.0)
        if B_2D:
            b_s = tl.load(b_s_ptrs + kb, mask=n_mask, other=0.0)
        else:
            b_s = tl.load(b_s_ptrs + kb * stride_bs, mask=n_mask, other=0.0)
        partial = tl.dot(a, tl.trans(b))
        acc += partial * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


_launch = FastLauncher(blockwise_gemm_kernel)


def check_operands(a, a_scale_inv, b, b_scale_inv, b_block_dim, out_dtype, bias, accumulate_into) -> None:
    """The GEMM wrappers' contract (this kernel's and the Hopper Gluon one's): wrong inputs raise
    ``TypeError`` / ``ValueError`` before anything is allocated or launched."""
    if a.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or b.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"FP8 operands (e4m3fn/e5m2) required, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected a [M, K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    m, k = a.shape
    n = b.shape[0]
    kb = ceil_div(k, BLOCK)
    if a_scale_inv.dtype != torch.float32 or a_scale_inv.dim() != 2 or a_scale_inv.stride(1) != 1:
        raise ValueError("a_scale_inv must be a float32 [ceil(K/128), >=M] tensor with unit column stride")
    if a_scale_inv.shape[0] != kb or a_scale_inv.shape[1] < m:
        raise ValueError(f"a_scale_inv has shape {tuple(a_scale_inv.shape)}, expected [{kb}, >={m}]")
    if b_scale_inv.dtype != torch.float32 or b_scale_inv.dim() != 2 or b_scale_inv.stride(1) != 1:
        raise ValueError("b_scale_inv must be a float32 2-D tensor with unit column stride")
    if b_block_dim == 2:
        if b_scale_inv.shape[0] != ceil_div(n, BLOCK) or b_scale_inv.shape[1] < kb:
            raise ValueError(f"b_scale_inv has shape {tuple(b_scale_inv.shape)}, expected [{ceil_div(n, 128)}, >={kb}]")
    elif b_block_dim == 1:
        if b_scale_inv.shape[0] != kb or b_scale_inv.shape[1] < n:
            raise ValueError(f"b_scale_inv has shape {tuple(b_scale_inv.shape)}, expected [{kb}, >={n}]")
    else:
        raise ValueError(f"b_block_dim must be 1 or 2, got {b_block_dim}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [N={n}] tensor")
    if accumulate_into is not None:
        c = accumulate_into
        if c.dtype != torch.float32 or tuple(c.shape) != (m, n) or c.stride(1) != 1:
            raise ValueError(f"accumulate_into must be a float32 [{m}, {n}] tensor with unit column stride, got "
                             f"{c.dtype} {tuple(c.shape)} strides {c.stride()}")  # fmt: skip
    elif out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype {out_dtype} not supported (bf16, fp16, fp32)")
    for t in (a_scale_inv, b_scale_inv) + ((bias,) if bias is not None else ()):
        if t.device != a.device or b.device != a.device:
            raise ValueError("all tensors must be on the same device")


def blockwise_gemm(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    *,
    b_block_dim: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    accumulate_into: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T``; scale tensors in TE's layouts (see module docstring). ``config``: the launch
    (default: ``heuristics.gemm_config``)."""
    check_operands(a, a_scale_inv, b, b_scale_inv, b_block_dim, out_dtype, bias, accumulate_into)
    assert a.is_contiguous() and b.is_contiguous()
    m, k = a.shape
    n = b.shape[0]
    if accumulate_into is not None:
        c = accumulate_into
    else:
        c = torch.empty(m, n, dtype=out_dtype, device=a.device)
        if k == 0:
            return c.zero_()
    if m == 0 or n == 0:
        return c
    cfg = config or gemm_config()
    grid = (ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n),)
    _launch(
        grid, a, b, c, a_scale_inv, b_scale_inv, bias if bias is not None else c,
        m, n, k, a.stride(0), b.stride(0), c.stride(0), a_scale_inv.stride(0), b_scale_inv.stride(0),
        b_block_dim == 2, bias is not None, accumulate_into is not None,  # B_2D, HAS_BIAS, ACCUMULATE
        cfg.block_m, cfg.block_n, BLOCK, cfg.group_m,  # BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return c
