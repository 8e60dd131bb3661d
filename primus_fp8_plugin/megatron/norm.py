"""LayerNorm / RMSNorm for the plugin's specs, usable with sequence parallelism.

Megatron's fallback norm (``WrappedTorchNorm``, used when neither apex nor TE is installed, as on
our GPU machine) refuses sequence parallelism only because it does not mark its parameters; this
one marks them (``param.sequence_parallel``) so that Megatron all-reduces their gradients across
the tensor-parallel group, which is all sequence parallelism asks of a norm.
"""

from __future__ import annotations

import torch

from ..normalization import norm


def apply_norm(x, normalization: str, weight, bias, eps: float, zero_centered_gamma: bool = False):
    """``LayerNorm`` or ``RMSNorm`` over the last dim (``zero_centered_gamma``: scale by 1 + weight): the
    plugin's ``normalization.norm``, whose bits the fused norm + FP8 linear kernels reproduce, so unfused
    and fused layers agree bit for bit."""
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return norm(x, normalization, weight, bias, eps, zero_centered_gamma)


def make_norm_params(module: torch.nn.Module, config, size: int, prefix: str = "") -> None:
    """Create ``{prefix}weight`` (and ``{prefix}bias`` for LayerNorm) on ``module``, marked for
    sequence parallelism when the config uses it."""
    device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
    zero_centered = getattr(config, "layernorm_zero_centered_gamma", False)
    init = torch.zeros if zero_centered else torch.ones
    weight = torch.nn.Parameter(init(size, device=device, dtype=config.params_dtype))
    bias = None
    if getattr(config, "normalization", "LayerNorm") == "LayerNorm":
        bias = torch.nn.Parameter(torch.zeros(size, device=device, dtype=config.params_dtype))
    for p in (weight, bias):
        if p is not None:
            p.sequence_parallel = bool(config.sequence_parallel)
    setattr(module, f"{prefix}weight", weight)
    setattr(module, f"{prefix}bias", bias)


class TorchNorm(torch.nn.Module):
    """Megatron-constructible norm: ``TorchNorm(config, hidden_size, eps)``, kind from ``config.normalization``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__()
        self.normalization = getattr(config, "normalization", "LayerNorm")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.normalization!r}")
        self.eps = eps
        self.zero_centered_gamma = getattr(config, "layernorm_zero_centered_gamma", False)
        make_norm_params(self, config, hidden_size)

    def forward(self, x):
        return apply_norm(x, self.normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma)
