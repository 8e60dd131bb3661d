"""The plugin's LayerNorm and RMSNorm (differentiable), with the numerics of ``docs/NUMERICS.md``
("Fused ops"): fp32 math in a fixed order, so every backend gives the same bits, and the same bits as
the fused norm + FP8 linear (``ops.fp8_norm_linear``) feeds its GEMM.

``norm(x, normalization, weight, bias, eps, zero_centered_gamma)`` takes ``megatron/norm.py``'s
``apply_norm`` arguments. Against torch's ``F.layer_norm`` / ``F.rms_norm`` it differs only in the
order of its sums and in using IEEE square roots (torch's reductions run in an order that depends on
the device and the launch): in bf16 the outputs are equal but for a few last-bit differences.
"""

from __future__ import annotations

import torch

from .backends import Backend, get_backend
from .backends.reference_fused import NORMALIZATIONS
from .tensor import HIGH_PRECISION_DTYPES


def check_norm_inputs(x: torch.Tensor, normalization: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise for what the norm kernels do not take (clear messages; shapes, dtypes, devices)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"the norm's input has dtype {x.dtype}; it takes bfloat16, float16 or float32")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"the norm's input needs a non-empty last dim, got shape {tuple(x.shape)}")
    h = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != (h,) or p.device != x.device or p.dtype not in HIGH_PRECISION_DTYPES:
            raise ValueError(
                f"norm {name} must be a [{h}] bf16/fp16/fp32 tensor on {x.device}, got {tuple(p.shape)} {p.dtype} on {p.device}"
            )
    if bias is not None:
        if normalization == "RMSNorm":
            raise ValueError("RMSNorm has no bias: pass bias=None")
        if bias.dtype != weight.dtype:
            raise ValueError(f"norm weight and bias must share a dtype, got {weight.dtype} and {bias.dtype}")


def norm_gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    """The scale the norm applies: ``weight + 1`` (in the weight's dtype) for zero-centred gamma."""
    return weight + 1 if zero_centered_gamma else weight


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, normalization, eps, backend):
        x2d = x.reshape(-1, x.shape[-1])
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        y, mean, rstd = backend.norm_fwd(x2d, gamma, beta, eps, normalization)
        ctx.save_for_backward(x2d, gamma, mean, rstd)
        ctx.backend, ctx.shape = backend, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, gamma, mean, rstd = ctx.saved_tensors
        dy2d = dy.reshape(x2d.shape)
        if not dy2d.is_contiguous():
            dy2d = dy2d.contiguous()
        need_dx, need_dgamma, need_dbeta = ctx.needs_input_grad[:3]
        dx, dgamma, dbeta = ctx.backend.norm_bwd(dy2d, x2d, gamma, mean, rstd, need_dgamma=need_dgamma, need_dbeta=need_dbeta)
        return (dx.view(ctx.shape) if need_dx else None), dgamma, dbeta, None, None, None


def norm(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    *,
    backend: str | Backend = "auto",
) -> torch.Tensor:
    """LayerNorm or RMSNorm of ``x [..., H]`` over its last dim, in x's dtype (differentiable).

    Args:
        x: bfloat16, float16 or float32, any leading dims.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        weight: ``[H]`` (gamma); with ``zero_centered_gamma`` the scale is ``weight + 1``.
        bias: ``[H]`` (beta, LayerNorm only, weight's dtype) or None.
        eps: added to the variance (mean square for RMSNorm) before the square root.
        backend: a backend name, ``"auto"`` or a ``Backend`` (``reference`` or ``triton``).
    """
    check_norm_inputs(x, normalization, weight, bias)
    impl = backend if isinstance(backend, Backend) else get_backend(backend, x.device)
    return _NormFn.apply(x, norm_gamma(weight, zero_centered_gamma), bias, normalization, float(eps), impl)
