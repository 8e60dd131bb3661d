"""SwiGLU of fc1's output ``h [M, 2F] = [a | b]`` (Megatron's gated layout: the gate ``a`` first):
``silu(a) * b`` written in h's dtype or quantized to FP8 directly (``fused_act.py``; the backend's
``quantize_swiglu_act``), and its
backward, recomputed from ``h``; bit for bit ``reference_fused.swiglu_fwd`` / ``swiglu_bwd``.

The backward kernel reads ``a``, ``b`` and the output gradient once and writes ``[da | db]``:
``db = dy * silu(a)``, ``gs = dy * b`` (each rounded to h's dtype), ``da = (gs * sig) * (1 + a * (1 - sig))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_act import apply_fused
from .fused_math import FP_OPTIONS, OP_SWIGLU, exp_fp32
from .heuristics import SWIGLU_BWD, TileConfig
from .launch import FastLauncher


@triton.jit
def swiglu_bwd_kernel(dy_ptr, h_ptr, dh_ptr, M, F, stride_dy, stride_h, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    f0 = tl.program_id(1) * BLOCK_F
    r = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = f0 + tl.arange(0, BLOCK_F)
    ok = (r < M)[:, None] & (c < F)[None, :]
    ty = h_ptr.dtype.element_ty
    h_rows = h_ptr + r[:, None] * stride_h + c[None, :]
    a = tl.load(h_rows, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(h_rows + F, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + r[:, None] * stride_dy + c[None, :], mask=ok, other=0.0).to(tl.float32)
    e = exp_fp32(-a)
    s = tl.div_rn(a, 1.0 + e).to(ty).to(tl.float32)
    sig = tl.div_rn(1.0, 1.0 + e)
    gs = (g * b).to(ty).to(tl.float32)
    da = (gs * sig) * (1.0 + a * (1.0 - sig))
    db = g * s
    dh_rows = dh_ptr + r[:, None] * (2 * F) + c[None, :]
    tl.store(dh_rows, da.to(ty), mask=ok)
    tl.store(dh_rows + F, db.to(ty), mask=ok)


_launch_bwd = FastLauncher(swiglu_bwd_kernel)


def swiglu_width(h: torch.Tensor) -> int:
    """F of ``h [M, 2F]`` (raises for an odd last dim)."""
    if h.shape[1] % 2:
        raise ValueError(f"SwiGLU needs an even last dim [M, 2F], got {tuple(h.shape)}")
    return h.shape[1] // 2


def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    f = swiglu_width(h)
    return apply_fused(h, OP_SWIGLU, k=f, up_offset=f)


def swiglu_bwd(dy: torch.Tensor, h: torch.Tensor, config: TileConfig = SWIGLU_BWD) -> torch.Tensor:
    m = h.shape[0]
    f = swiglu_width(h)
    dh = torch.empty(m, 2 * f, dtype=h.dtype, device=h.device)
    if m > 0 and f > 0:
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(f, config.block_n))
        _launch_bwd(grid, dy, h, dh, m, f, dy.stride(0), h.stride(0), config.block_m, config.block_n,
                    num_warps=config.num_warps, **FP_OPTIONS)  # fmt: skip
    return dh
