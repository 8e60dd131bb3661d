"""Rotary position embedding of ``t [s, b, h, d]`` (Megatron's sbhd layout), forward and backward,
bit for bit Megatron's unfused ``apply_rotary_pos_emb`` and torch's autograd of it
(``reference_fused.rope``): one read and one write of ``t``, where the unfused composition runs
about ten elementwise kernels.

A program owns one (sequence position, batch) pair and walks its heads in blocks of ``BLOCK_H``;
``cos``/``sin`` (in t's dtype, computed by torch as Megatron computes them) are loaded once per
program. Each feature ``d < rot`` reads its partner (``d ^ 1`` interleaved, ``d +- rot/2``
otherwise) a second time from L1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_math import FP_OPTIONS
from .heuristics import ROPE, RopeConfig
from .launch import FastLauncher


@triton.jit
def rope_kernel(t_ptr, cos_ptr, sin_ptr, out_ptr, B, NH, D, ROT, stride_ts, stride_tb, stride_th, stride_cs,
                 stride_cb, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    si = pid // B
    bi = pid % B
    ty = t_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    in_rot = d < ROT
    if INTERLEAVED:
        partner = d ^ 1
        negative = (d % 2) == 0
    else:
        half = ROT // 2
        partner = tl.where(d < half, d + half, d - half)
        negative = d < half
    partner = tl.where(in_rot, partner, d)
    cs = cos_ptr + si.to(tl.int64) * stride_cs + bi * stride_cb
    ss = sin_ptr + si.to(tl.int64) * stride_cs + bi * stride_cb
    cos = tl.load(cs + d, mask=in_rot, other=0.0).to(tl.float32)
    if BACKWARD:
        sin = tl.load(ss + partner, mask=in_rot, other=0.0).to(tl.float32)
    else:
        sin = tl.load(ss + d, mask=in_rot, other=0.0).to(tl.float32)
    t_base = t_ptr + si.to(tl.int64) * stride_ts + bi.to(tl.int64) * stride_tb
    o_base = out_ptr + pid.to(tl.int64) * NH * D
    for h0 in tl.range(0, NH, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)
        ok = (hh < NH)[:, None] & (d < D)[None, :]
        rows = t_base + hh.to(tl.int64)[:, None] * stride_th
        x = tl.load(rows + d[None, :], mask=ok, other=0.0)
        xf = x.to(tl.float32)
        xp = tl.load(rows + partner[None, :], mask=ok & in_rot[None, :], other=0.0).to(tl.float32)
        p1 = (xf * cos[None, :]).to(ty).to(tl.float32)
        if BACKWARD:
            rot = (xp * sin[None, :]).to(ty).to(tl.float32)
            rot = tl.where(negative[None, :], rot, -rot)
        else:
            rot = (tl.where(negative[None, :], -xp, xp) * sin[None, :]).to(ty).to(tl.float32)
        y = tl.where(in_rot[None, :], (p1 + rot).to(ty), x)
        if BACKWARD:  # torch's autograd sums the two slices' gradients: -0 comes out +0
            y = tl.where(y == 0.0, 0.0, y.to(tl.float32)).to(ty)
        tl.store(o_base + hh[:, None] * D + d[None, :], y, mask=ok)


_launch = FastLauncher(rope_kernel)


def rope(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, backward: bool, config: RopeConfig = ROPE
) -> torch.Tensor:
    """``reference_fused.rope`` (same contract): ``t [s, b, h, d]`` with a contiguous last dim,
    ``cos``/``sin`` ``[s, 1 or b, 1, rot]`` in t's dtype -> a new contiguous tensor. ``config``: heads are
    taken in blocks of about ``config.tile_elements`` elements."""
    s, b, nh, d = t.shape
    rot = cos.shape[-1]
    fb = cos.shape[1]
    if t.stride(-1) != 1:
        t = t.contiguous()
    cos = cos.reshape(s, fb, rot).contiguous()
    sin = sin.reshape(s, fb, rot).contiguous()
    out = torch.empty(s, b, nh, d, dtype=t.dtype, device=t.device)
    if out.numel() == 0:
        return out
    block_d = triton.next_power_of_2(d)
    block_h = max(1, min(triton.next_power_of_2(nh), config.tile_elements // block_d))
    _launch((s * b,), t, cos, sin, out, b, nh, d, rot, t.stride(0), t.stride(1), t.stride(2), fb * rot,
            rot if fb == b and b > 1 else 0, bool(interleaved), bool(backward), block_h, block_d,
            num_warps=config.num_warps, **FP_OPTIONS)  # fmt: skip
    return out
