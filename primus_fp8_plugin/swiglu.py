"""SwiGLU of fc1's output in Megatron's gated layout (differentiable): ``h [..., 2F] = [a | b]`` ->
``silu(a) * b`` ``[..., F]``, each step rounded to h's dtype as ``F.silu(a) * b`` rounds it; the
numerics of ``docs/NUMERICS.md`` ("Fused ops"), the same on every backend and the same bits as
``ops.fp8_swiglu_linear`` feeds fc2's GEMM. In bf16 and fp16 the forward equals torch's
``F.silu(a) * b`` bit for bit (all 65536 inputs checked on the CPU; ``tests/gpu`` checks CUDA)."""

from __future__ import annotations

import torch

from .backends import Backend, get_backend
from .tensor import HIGH_PRECISION_DTYPES


def check_swiglu_input(h: torch.Tensor) -> None:
    if h.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"SwiGLU's input has dtype {h.dtype}; it takes bfloat16, float16 or float32")
    if h.dim() < 1 or h.shape[-1] % 2 or h.shape[-1] == 0:
        raise ValueError(f"SwiGLU needs a last dim 2F > 0 (gate then up), got shape {tuple(h.shape)}")


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, backend):
        h2d = h.reshape(-1, h.shape[-1])
        if not h2d.is_contiguous():
            h2d = h2d.contiguous()
        ctx.save_for_backward(h2d)
        ctx.backend, ctx.shape = backend, h.shape
        return backend.swiglu_fwd(h2d).view(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        (h2d,) = ctx.saved_tensors
        dy2d = dy.reshape(h2d.shape[0], -1)
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        return ctx.backend.swiglu_bwd(dy2d, h2d).view(ctx.shape), None


def swiglu(h: torch.Tensor, *, backend: str | Backend = "auto") -> torch.Tensor:
    """``silu(a) * b`` of ``h [..., 2F] = [a | b]`` (bf16/fp16/fp32) -> ``[..., F]`` in h's dtype."""
    check_swiglu_input(h)
    impl = backend if isinstance(backend, Backend) else get_backend(backend, h.device)
    return _SwigluFn.apply(h, impl)
