"""``Fp8BlockwiseLinear``: a drop-in for ``torch.nn.Linear`` computing with FP8 blockwise GEMMs."""

from __future__ import annotations

import math

import torch
from torch import nn

from .backends import get_backend
from .linear import fp8_blockwise_linear
from .recipe import BlockwiseRecipe
from .tensor import HIGH_PRECISION_DTYPES
from .weight_cache import WeightCache


class Fp8BlockwiseLinear(nn.Module):
    """``y = x W^T + b`` like ``nn.Linear``, with TE ``Float8BlockScaling`` numerics.

    Args:
        in_features, out_features, bias, device, dtype: as for ``torch.nn.Linear``.
        recipe: a ``BlockwiseRecipe`` (default: TE's defaults).
        backend: backend name or ``"auto"`` (resolved per call for the input's device).
        cache_weight: keep the quantized weight (W and W^T) between calls while the weight is
            provably unchanged (default True; what that covers and what it cannot see:
            ``weight_cache.py``); it is never part of ``state_dict``.

    Raises:
        TypeError: for a weight dtype other than bfloat16, float16 or float32.

    Attributes:
        is_first_microbatch: Megatron sets it to True on the first microbatch of each step; the
            next forward then re-quantizes the weight and sets it back to False.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: BlockwiseRecipe | None = None,
        backend: str = "auto",
        cache_weight: bool = True,
    ) -> None:
        super().__init__()
        resolved = dtype if dtype is not None else torch.get_default_dtype()
        if resolved not in HIGH_PRECISION_DTYPES:
            raise TypeError(
                f"dtype={resolved}: Fp8BlockwiseLinear keeps bfloat16, float16 or float32 weights "
                "(pass dtype=torch.bfloat16, or use torch.nn.Linear for other dtypes)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.recipe = recipe or BlockwiseRecipe()
        self.backend = backend
        if backend != "auto":
            get_backend(backend, self.weight.device if self.weight.device.type != "meta" else None)
        self._weight_cache = WeightCache() if cache_weight else None
        self.is_first_microbatch: bool | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (Kaiming-uniform weight, uniform bias)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refresh = bool(self.is_first_microbatch)
        y = fp8_blockwise_linear(
            x, self.weight, self.bias, recipe=self.recipe, backend=self.backend,
            weight_cache=self._weight_cache, refresh_weight_cache=refresh,
        )  # fmt: skip
        if refresh:
            self.is_first_microbatch = False
        return y

    def invalidate_weight_cache(self) -> None:
        """Forget the quantized weight. Needed only after a write the cache cannot see: through
        ``.data``, through another tensor sharing the weight's storage, or by a collective, outside an
        optimizer step (``weight_cache.py``)."""
        if self._weight_cache is not None:
            self._weight_cache.invalidate()

    @property
    def weight_cache_nbytes(self) -> int:
        """Device memory held by the cached quantized weight."""
        return 0 if self._weight_cache is None else self._weight_cache.nbytes

    def _apply(self, fn, *args, **kwargs):
        self.invalidate_weight_cache()  # .to() / .cuda() / .half() move or convert the weight
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        fmt = self.recipe.fp8_format.value
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8={fmt}, backend={self.backend}, weight_cache={'on' if self._weight_cache is not None else 'off'}"
        )

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        recipe: BlockwiseRecipe | None = None,
        backend: str = "auto",
        cache_weight: bool = True,
    ) -> Fp8BlockwiseLinear:
        """An ``Fp8BlockwiseLinear`` computing ``linear``'s function with FP8 blockwise GEMMs.

        The new layer holds ``linear``'s own ``weight`` and ``bias`` Parameters (no copy: the same
        device, dtype, ``requires_grad``, values and state-dict keys; an optimizer built on ``linear``
        keeps updating them) and its train/eval mode. ``recipe``, ``backend`` and ``cache_weight`` as
        for the constructor. Raises TypeError if ``linear`` is not an ``nn.Linear``.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes a torch.nn.Linear, got {type(linear).__name__}")
        weight = linear.weight
        new = cls(
            linear.in_features, linear.out_features, bias=False, device="meta", dtype=weight.dtype,
            recipe=recipe, backend="auto", cache_weight=cache_weight,
        )  # fmt: skip
        new.weight = weight
        new.bias = linear.bias
        new.backend = backend
        if backend != "auto":  # as the constructor checks it, for the weight's real device
            get_backend(backend, weight.device if weight.device.type != "meta" else None)
        return new.train(linear.training)
