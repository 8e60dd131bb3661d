"""Swap a plain PyTorch model's ``nn.Linear`` layers for ``Fp8BlockwiseLinear`` in place.

    model = convert_to_fp8_blockwise(model)                       # every linear the plugin takes
    model = convert_to_fp8_blockwise(model, lambda mod, fqn: fqn != "lm_head", recipe=BlockwiseRecipe("HYBRID"))

Which layers are converted: modules whose type is exactly ``torch.nn.Linear`` (subclasses may
override ``forward`` or be read by their parent without calling it, e.g. ``nn.MultiheadAttention``'s
``out_proj``), whose ``in_features`` and ``out_features`` are both multiples of 16 and whose weight
is bfloat16, float16 or float32, and for which ``module_filter_fn(module, fqn)`` (if given) returns
True. Dims that are not multiples of 16 cannot use the Hopper kernels or cuBLAS (16-byte aligned FP8
rows) and would run the portable kernels, slower than the BF16 layer; such layers stay
``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .modules import Fp8BlockwiseLinear
from .recipe import BlockwiseRecipe

__all__ = ["convert_to_fp8_blockwise", "convertible"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def convertible(module: nn.Module) -> bool:
    """Whether ``convert_to_fp8_blockwise`` converts ``module`` by the module docstring's rule (the
    user's filter aside): exactly ``nn.Linear``, both dims multiples of 16, a float weight."""
    return (
        type(module) is nn.Linear
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
        and module.weight.dtype in _DTYPES
    )


def convert_to_fp8_blockwise(
    model: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    recipe: BlockwiseRecipe | None = None,
    backend: str = "auto",
) -> nn.Module:
    """Replace the ``nn.Linear`` modules of ``model`` that ``convertible`` accepts (and
    ``module_filter_fn(module, fqn)``, if given, where ``fqn`` is the module's name in
    ``model.named_modules()``) with ``Fp8BlockwiseLinear.from_linear(module, recipe=recipe,
    backend=backend)``, in place.

    The new layers hold the old layers' weight and bias Parameters (no copy: same device, dtype,
    ``requires_grad``, values and state-dict keys, and an optimizer built before the conversion keeps
    updating them). A Linear reachable under several names is converted once and stays shared.
    Hooks registered on a replaced module are not carried over.

    Returns ``model``, or the new layer when ``model`` itself is a convertible ``nn.Linear``.
    """
    recipe = recipe or BlockwiseRecipe()

    def wanted(module: nn.Module, fqn: str) -> bool:
        return convertible(module) and (module_filter_fn is None or bool(module_filter_fn(module, fqn)))

    if wanted(model, ""):
        return Fp8BlockwiseLinear.from_linear(model, recipe=recipe, backend=backend)
    # the (parent, attribute, child) edges first: the tree must not change while it is walked
    edges = [
        (parent, name, child, f"{prefix}.{name}" if prefix else name)
        for prefix, parent in model.named_modules(remove_duplicate=False)
        for name, child in parent._modules.items()  # every name (named_children() skips repeats)
        if child is not None
    ]
    # one decision per module, at its first name (the one named_modules() reports)
    replacement: dict[int, Fp8BlockwiseLinear | None] = {}
    for parent, name, child, fqn in edges:
        if id(child) not in replacement:
            replacement[id(child)] = (
                Fp8BlockwiseLinear.from_linear(child, recipe=recipe, backend=backend) if wanted(child, fqn) else None
            )
        if replacement[id(child)] is not None:
            setattr(parent, name, replacement[id(child)])
    return model
