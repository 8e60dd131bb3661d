"""SwiGLU of fc1's output ``h [M, 2F] = [a | b]`` (Megatron's gated layout: the gate ``a`` first):
``silu(a) * b`` written in h's dtype or quantized to FP8 directly (``fused_act.py``), and its
backward, recomputed from ``h``; bit for bit ``reference_fused.swiglu_fwd`` / ``swiglu_bwd``.

The backward kernel reads ``a``, ``b`` and the output gradient once and writes ``[da | db]``:
``db = dy * silu(a)``, ``gs = dy * b`` (each rounded to h's dtype), ``da = (gs * sig) * (1 + a * (1 - sig))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_act import OP_SWIGLU, apply_fused, quantize_fused
from .fused_math import FP_OPTIONS, exp_fp32
from .launch import FastLauncher

BWD_BLOCK_M = 32
BWD_BLOCK_F = 128
BWD_WARPS = 4


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, h_ptr, dh_ptr, M, F, stride_dy, stride_h, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
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


_launch_bwd = FastLauncher(_swiglu_bwd_kernel)


def _half(h: torch.Tensor) -> int:
    if h.shape[1] % 2:
        raise ValueError(f"SwiGLU needs an even last dim [M, 2F], got {tuple(h.shape)}")
    return h.shape[1] // 2


def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    f = _half(h)
    return apply_fused(h, OP_SWIGLU, k=f, up_offset=f)


def quantize_swiglu_act(h, params, *, rowwise, columnwise):
    f = _half(h)
    return quantize_fused(h, OP_SWIGLU, params, k=f, up_offset=f, rowwise=rowwise, columnwise=columnwise)


def swiglu_bwd(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    m = h.shape[0]
    f = _half(h)
    dh = torch.empty(m, 2 * f, dtype=h.dtype, device=h.device)
    if m > 0 and f > 0:
        grid = (triton.cdiv(m, BWD_BLOCK_M), triton.cdiv(f, BWD_BLOCK_F))
        _launch_bwd(grid, dy, h, dh, m, f, dy.stride(0), h.stride(0), BWD_BLOCK_M, BWD_BLOCK_F,
                    num_warps=BWD_WARPS, **FP_OPTIONS)  # fmt: skip
    return dh
