"""Grouped weight quantization on Hopper: each expert's ``[N, K]`` through the dense Gluon 128x128 kernel
(``quantize_weight.py``: one read of each block) into its slice of the stacked ``GroupedFp8Weight``
buffers, one launch per expert. Every expert's slice of those buffers has the dense layout (W ``[N, K]``,
scales ``[ceil(N/128), pad4(ceil(K/128))]``, and the transposed pair), so the bits are the dense kernel's,
which are the portable batched kernel's (kernels/triton/quantize_grouped.py). Which of the two runs:
``heuristics.weight_quant_per_expert``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...grouped_tensor import GroupedFp8Weight
from ...recipe import QuantParams
from ..triton.quantize_grouped import grouped_weight_out
from .quantize_weight import quantize_128x128_gluon
from .quantize_weight import unsupported_reason as weight_unsupported_reason
from .target import GluonUnsupported


def _experts(weights: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    return list(weights.unbind(0)) if isinstance(weights, torch.Tensor) else list(weights)


def unsupported_reason(weights: Sequence[torch.Tensor] | torch.Tensor, params: QuantParams) -> str | None:
    """Why the dense Gluon kernel does not take one of the experts' weights (naming the expert), or None."""
    for i, w in enumerate(_experts(weights)):
        why = weight_unsupported_reason(w, params)
        if why is not None:
            return f"expert {i}: {why}"
    return None


def quantize_128x128_per_expert_gluon(
    weights: Sequence[torch.Tensor] | torch.Tensor, params: QuantParams, out: GroupedFp8Weight | None = None
) -> GroupedFp8Weight:
    """Both copies of ``E`` weights (contiguous ``[N, K]`` tensors of one shape, or one contiguous
    ``[E, N, K]``) quantized with 128x128 blocks, one dense Gluon launch per expert, into ``out``
    (allocated when None). Raises ``GluonUnsupported`` before launching where ``unsupported_reason`` says so."""
    experts = _experts(weights)
    if any(w.shape != experts[0].shape for w in experts):
        raise ValueError(f"the experts' weights differ in shape: {sorted({tuple(w.shape) for w in experts})}")
    why = unsupported_reason(experts, params)
    if why is not None:
        raise GluonUnsupported(why)
    out = grouped_weight_out(len(experts), experts[0], params, out)
    for e, w in enumerate(experts):
        quantize_128x128_gluon(w, params, out=out.expert(e))
    out.orig_dtype = experts[0].dtype
    return out
