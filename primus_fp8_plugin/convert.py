"""Swap a plain PyTorch model's ``nn.Linear`` layers for ``Fp8BlockwiseLinear`` in place.

    model = convert_to_fp8_blockwise(model)                       # every linear the plugin takes
    model = convert_to_fp8_blockwise(model, lambda mod, fqn: fqn != "lm_head", recipe=BlockwiseRecipe("HYBRID"))
    model, report = convert_to_fp8_blockwise(model, report=True)  # + which linears were converted, which not and why
    print(report)

Which layers are converted: modules whose type is exactly ``torch.nn.Linear`` (subclasses may
override ``forward`` or be read by their parent without calling it, e.g. ``nn.MultiheadAttention``'s
``out_proj``), whose ``in_features`` and ``out_features`` are both multiples of 16 and whose weight
is bfloat16, float16 or float32, and for which ``module_filter_fn(module, fqn)`` (if given) returns
True. Dims that are not multiples of 16 cannot use the Hopper kernels or cuBLAS (16-byte aligned FP8
rows) and would run the portable kernels, slower than the BF16 layer; such layers stay
``nn.Linear``. ``skip_reason(module)`` says, for one module, why the rule refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, overload

import torch
from torch import nn

from .modules import Fp8BlockwiseLinear
from .recipe import BlockwiseRecipe

__all__ = ["ConversionReport", "convert_to_fp8_blockwise", "convertible", "skip_reason"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FILTERED_OUT = "module_filter_fn returned False"


def skip_reason(module: nn.Module) -> str | None:
    """Why ``convert_to_fp8_blockwise`` leaves ``module`` as it is by the module docstring's rule (the
    user's filter aside), or None when it converts it."""
    if not isinstance(module, nn.Linear):
        return f"{type(module).__name__} is not an nn.Linear"
    if type(module) is not nn.Linear:
        return (f"{type(module).__qualname__} subclasses nn.Linear: it may override forward, or its parent may "
                "read its weight without calling it (nn.MultiheadAttention's out_proj); only nn.Linear is converted")  # fmt: skip
    for dim in ("in_features", "out_features"):
        if getattr(module, dim) % 16:
            return (f"{dim}={getattr(module, dim)} is not a multiple of 16 (the FP8 GEMMs need 16-byte aligned rows; "
                    "the portable kernels would run slower than this layer)")  # fmt: skip
    if module.weight.dtype not in _DTYPES:
        return f"weight dtype {module.weight.dtype} (bfloat16, float16 and float32 are converted)"
    return None


def convertible(module: nn.Module) -> bool:
    """Whether ``convert_to_fp8_blockwise`` converts ``module`` by the module docstring's rule (the
    user's filter aside): exactly ``nn.Linear``, both dims multiples of 16, a float weight."""
    return skip_reason(module) is None


@dataclass
class ConversionReport:
    """What ``convert_to_fp8_blockwise(..., report=True)`` did with each ``nn.Linear`` (subclasses included)
    of the model, by its first name in ``model.named_modules()`` (``""``: the model itself); a module
    reachable under several names appears once. ``str(report)`` is a table for people."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was left as it is

    def __str__(self) -> str:
        width = max((len(n or "(model)") for n in [*self.converted, *self.skipped]), default=0)
        lines = [f"converted {len(self.converted)} linear layer(s) to Fp8BlockwiseLinear, skipped {len(self.skipped)}"]
        lines += [f"  converted  {n or '(model)'}" for n in self.converted]
        lines += [f"  skipped    {n or '(model)':<{width}}  {why}" for n, why in self.skipped.items()]
        return "\n".join(lines)


@overload
def convert_to_fp8_blockwise(
    model: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = ...,
    recipe: BlockwiseRecipe | None = ...,
    backend: str = ...,
    *,
    report: Literal[False] = ...,
) -> nn.Module: ...


@overload
def convert_to_fp8_blockwise(
    model: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = ...,
    recipe: BlockwiseRecipe | None = ...,
    backend: str = ...,
    *,
    report: Literal[True],
) -> tuple[nn.Module, ConversionReport]: ...


def convert_to_fp8_blockwise(
    model: nn.Module,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    recipe: BlockwiseRecipe | None = None,
    backend: str = "auto",
    *,
    report: bool = False,
) -> nn.Module | tuple[nn.Module, ConversionReport]:
    """Replace the ``nn.Linear`` modules of ``model`` that ``convertible`` accepts (and
    ``module_filter_fn(module, fqn)``, if given, where ``fqn`` is the module's name in
    ``model.named_modules()``) with ``Fp8BlockwiseLinear.from_linear(module, recipe=recipe,
    backend=backend)``, in place.

    The new layers hold the old layers' weight and bias Parameters (no copy: same device, dtype,
    ``requires_grad``, values and state-dict keys, and an optimizer built before the conversion keeps
    updating them). A Linear reachable under several names is converted once and stays shared.
    Hooks registered on a replaced module are not carried over.

    Returns ``model``, or the new layer when ``model`` itself is a convertible ``nn.Linear``; with
    ``report=True`` the pair ``(that, ConversionReport)``: each ``nn.Linear`` converted or skipped, and why.
    """
    recipe = recipe or BlockwiseRecipe()
    done = ConversionReport()

    def wanted(module: nn.Module, fqn: str) -> bool:
        why = skip_reason(module)
        if why is None and module_filter_fn is not None and not module_filter_fn(module, fqn):
            why = FILTERED_OUT
        if why is None:
            done.converted.append(fqn)
        elif isinstance(module, nn.Linear):
            done.skipped[fqn] = why
        return why is None

    result = _convert(model, wanted, recipe, backend)
    return (result, done) if report else result


def _convert(model: nn.Module, wanted: Callable[[nn.Module, str], bool], recipe: BlockwiseRecipe, backend: str) -> nn.Module:
    """``convert_to_fp8_blockwise``'s walk: ``wanted(module, fqn)`` is asked once per module, at its first name."""
    if wanted(model, ""):
        return Fp8BlockwiseLinear.from_linear(model, recipe=recipe, backend=backend)
    # one decision per module, at its first name (the one named_modules() reports), in that order
    replacement = {
        id(module): Fp8BlockwiseLinear.from_linear(module, recipe=recipe, backend=backend) if wanted(module, fqn) else None
        for fqn, module in model.named_modules()
        if fqn
    }
    # then every (parent, attribute) edge that holds a replaced module (named_children() skips repeated names)
    edges = [(parent, name, child) for parent in model.modules() for name, child in parent._modules.items() if child is not None]
    for parent, name, child in edges:
        if replacement.get(id(child)) is not None:
            setattr(parent, name, replacement[id(child)])
    return model
