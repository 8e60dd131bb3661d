"""Rotary position embedding without apex or TE: Megatron's unfused ``apply_rotary_pos_emb`` for the
sbhd layout, bit for bit in forward and backward (``docs/NUMERICS.md``, "Fused ops"), in one kernel
each way on the triton backend.

``cos(freqs)`` and ``sin(freqs)`` are computed by the same torch ops as Megatron's, so they are the
same bits on each device; the rotation is then exact elementwise arithmetic, rounded as torch rounds it.
"""

from __future__ import annotations

import torch

from .backends import Backend, get_backend
from .backends.reference_fused import rope_cos_sin
from .tensor import HIGH_PRECISION_DTYPES


class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin, interleaved, backend):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.backend = interleaved, backend
        return backend.rope(t, cos, sin, interleaved=interleaved, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return ctx.backend.rope(dy, cos, sin, interleaved=ctx.interleaved, backward=True), None, None, None, None


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    *,
    rotary_interleaved: bool = False,
    mscale: float = 1.0,
    backend: str | Backend = "auto",
) -> torch.Tensor:
    """``(t * cos) + (rotate_half(t) * sin)`` on the first ``rot`` features of each head, the rest
    passed through: Megatron's ``_apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved, mscale=mscale)``.

    Args:
        t: ``[s, b, h, d]`` bf16/fp16/fp32 (any strides, last dim contiguous or not).
        freqs: ``[s, 1, 1, rot]`` or ``[s, b, 1, rot]`` angles (fp32, no gradient), ``rot`` even, ``<= d``.
        rotary_interleaved: pair features (2i, 2i+1) instead of (i, i + rot/2).
        mscale: factor applied to cos and sin.

    Megatron's MLA interleaving (``mla_rotary_interleaved``) and the packed thd layout are not handled.
    """
    if t.dim() != 4 or t.dtype not in HIGH_PRECISION_DTYPES:
        raise ValueError(f"t must be [s, b, h, d] bf16/fp16/fp32 (sbhd), got {tuple(t.shape)} {t.dtype}")
    s, b = t.shape[:2]
    if freqs.dim() != 4 or freqs.shape[0] != s or freqs.shape[1] not in (1, b) or freqs.shape[2] != 1:
        raise ValueError(f"freqs must be [s, 1 or b, 1, rot] with s = {s}, b = {b}, got {tuple(freqs.shape)}")
    rot = freqs.shape[-1]
    if rot % 2 or rot == 0 or rot > t.shape[-1]:
        raise ValueError(f"the rotary dim {rot} must be even, > 0 and <= the head dim {t.shape[-1]}")
    if freqs.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("gradients with respect to freqs are not computed: pass freqs.detach()")
    if freqs.device != t.device:
        raise ValueError(f"t is on {t.device} but freqs on {freqs.device}")
    impl = backend if isinstance(backend, Backend) else get_backend(backend, t.device)
    cos, sin = rope_cos_sin(freqs, t.dtype, mscale)
    return _RopeFn.apply(t, cos, sin, bool(rotary_interleaved), impl)
