"""The FP8 modules: ``Fp8BlockwiseLinear`` (a drop-in for ``torch.nn.Linear``) and ``Fp8GroupedLinear`` (TE's
``GroupedLinear`` for mixture-of-experts layers), and what every FP8 layer of the package (these and the Megatron
layers) holds beside its weights: a weight cache, dropped when the module is moved or converted, and Megatron's
``is_first_microbatch`` flag, which re-quantizes the weights on the next forward."""

from __future__ import annotations

import math

import torch
from torch import nn

from .backends import get_backend
from .ops import fp8_blockwise_linear, fp8_grouped_linear
from .recipe import BlockwiseRecipe, TensorRole
from .tensor import HIGH_PRECISION_DTYPES
from .weight_cache import GroupedWeightCache, WeightCache


def take_first_microbatch(layer: nn.Module) -> bool:
    """Whether this forward starts a step (Megatron sets ``is_first_microbatch = True``): the layer's weight cache
    then re-quantizes, and the flag is cleared for the step's later microbatches."""
    first = bool(getattr(layer, "is_first_microbatch", False))
    if first:
        layer.is_first_microbatch = False
    return first


class HoldsWeightCache:
    """Mixin of the FP8 layers: ``weight_cache`` (a ``WeightCache``, a ``GroupedWeightCache`` or None) reported, and
    dropped when the module's tensors are moved or converted (``.to()``, ``.cuda()``, ``.half()``); and the layer's
    part of FP8 primary weights (``fp8_params.py``): ``hold_weights`` makes the cache's FP8 W the weights' primary
    form. Each layer says what its cache quantizes (``fp8_weight_source``)."""

    weight_cache: WeightCache | None = None

    def fp8_weight_source(self) -> tuple[torch.Tensor | list[torch.Tensor], BlockwiseRecipe, str]:
        """``(weights, recipe, backend name)`` as the layer passes them to its op: one weight for a ``WeightCache``,
        the experts' list for a ``GroupedWeightCache``."""
        raise NotImplementedError(f"{type(self).__name__} does not say which weights its cache quantizes")

    def hold_weights(self) -> None:
        """Quantize the weights now and hold their FP8 W in the cache as their primary form (``WeightCache.own``)."""
        weights, recipe, backend = self.fp8_weight_source()
        first = weights[0] if isinstance(weights, list) else weights
        self.weight_cache.own(weights, recipe.params(TensorRole.WEIGHT), get_backend(backend, first.device))

    def invalidate_weight_cache(self) -> None:
        """Forget the quantized weights. Needed only after a write the cache cannot see: through ``.data``, through
        another tensor sharing the weight's storage, or by a collective, outside an optimizer step
        (``weight_cache.py``)."""
        if self.weight_cache is not None:
            self.weight_cache.invalidate()

    @property
    def weight_cache_nbytes(self) -> int:
        """Device memory held by the cached quantized weights."""
        return 0 if self.weight_cache is None else self.weight_cache.nbytes

    def _apply(self, fn, *args, **kwargs):
        self.invalidate_weight_cache()
        return super()._apply(fn, *args, **kwargs)


def check_weight_dtype(dtype: torch.dtype | None, layer: str) -> None:
    """An FP8 layer keeps bf16, fp16 or fp32 weights (``dtype`` None: torch's default dtype)."""
    resolved = dtype if dtype is not None else torch.get_default_dtype()
    if resolved not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"dtype={resolved}: {layer} keeps bfloat16, float16 or float32 weights "
                        "(pass dtype=torch.bfloat16, or use torch.nn.Linear for other dtypes)")  # fmt: skip


def check_backend(backend: str, weight: torch.Tensor) -> None:
    """An explicit backend name must run where the weight lives (``"auto"`` is resolved per call)."""
    if backend != "auto":
        get_backend(backend, weight.device if weight.device.type != "meta" else None)


def expert_parameter_names(num_experts: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of a grouped layer's parameters, TE's: ``weight0..``, ``bias0..``."""
    return tuple(f"weight{i}" for i in range(num_experts)), tuple(f"bias{i}" for i in range(num_experts))


def split_stacked_weight(tensor: torch.Tensor, num_gemms: int, key: str) -> list[torch.Tensor]:
    """A single grouped weight ``[E, out, in]`` as its ``E`` experts' ``[out, in]`` weights (views)."""
    if tensor.dim() != 3 or tensor.shape[0] != num_gemms:
        raise RuntimeError(f"cannot split {key} of shape {tuple(tensor.shape)} into {num_gemms} experts' weights: a "
                           "single grouped weight is [experts, out_features, in_features]")  # fmt: skip
    return list(tensor.unbind(0))


def match_expert_weight_layout(state_dict: dict, prefix: str, num_gemms: int, single: bool) -> None:
    """A grouped layer's state dict in the other weight layout, made this layer's in place (TE's rule): ``weight0..``
    stacked into a single ``weight [E, out, in]``, or a single ``weight`` split into ``weight0..``. Per-expert
    weights win over a single one beside them (Megatron's upcycling adds them to the model's own state dict)."""
    grouped, indexed = f"{prefix}weight", [f"{prefix}weight{i}" for i in range(num_gemms)]
    if single and all(k in state_dict for k in indexed):
        state_dict[grouped] = torch.stack([state_dict.pop(k) for k in indexed])
    elif not single and grouped in state_dict and not any(k in state_dict for k in indexed):
        for k, w in zip(indexed, split_stacked_weight(state_dict.pop(grouped), num_gemms, grouped)):
            state_dict[k] = w


def expert_parameters(module: nn.Module, names: tuple[str, ...]) -> list:
    """The module's parameters of these names, as they are now (a replaced parameter is the new one), in one
    C-level pass (``getattr`` would run ``nn.Module.__getattr__``, a Python call per expert)."""
    return list(map(module._parameters.__getitem__, names))


class Fp8BlockwiseLinear(HoldsWeightCache, nn.Module):
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
        check_weight_dtype(dtype, "Fp8BlockwiseLinear")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.recipe = recipe or BlockwiseRecipe()
        self.backend = backend
        check_backend(backend, self.weight)
        self.weight_cache = WeightCache() if cache_weight else None
        self.is_first_microbatch: bool | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (Kaiming-uniform weight, uniform bias)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def fp8_weight_source(self):
        return self.weight, self.recipe, self.backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_blockwise_linear(x, self.weight, self.bias, recipe=self.recipe, backend=self.backend,
                                    weight_cache=self.weight_cache, refresh_weight_cache=take_first_microbatch(self))  # fmt: skip

    def extra_repr(self) -> str:
        fmt = self.recipe.fp8_format.value
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8={fmt}, backend={self.backend}, weight_cache={'on' if self.weight_cache is not None else 'off'}"
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
        check_backend(backend, weight)  # as the constructor checks it, for the weight's real device
        return new.train(linear.training)


class Fp8GroupedLinear(HoldsWeightCache, nn.Module):
    """``num_gemms`` experts' linears (``y_e = x_e W_e^T + b_e``) on permuted tokens, with TE ``Float8BlockScaling``
    numerics; parameters ``weight0..``, ``bias0..`` as in TE's ``GroupedLinear``.

    Args:
        num_gemms: number of experts ``E``.
        in_features, out_features, bias, device, dtype: per expert, as for ``torch.nn.Linear``.
        recipe, backend, cache_weight: as for ``Fp8BlockwiseLinear`` (the cache holds all experts' W and W^T).
        single_grouped_weight: the experts' weights as one parameter ``weight [E, out_features, in_features]``
            (TE's option of that name): autograd, an optimizer and a gradient norm then work on one tensor, not
            ``E``; the same bits, the same initial weights for a seed; state dicts of either layout load into both.

    ``forward(x, m_splits)``: ``x [T, in_features]`` (or ``[..., in_features]``), ``m_splits`` the tokens per
    expert (a list, an integer device tensor, or a ``GroupLayout``). ``is_first_microbatch`` as for
    ``Fp8BlockwiseLinear``.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        recipe: BlockwiseRecipe | None = None,
        backend: str = "auto",
        cache_weight: bool = True,
        single_grouped_weight: bool = False,
    ) -> None:
        super().__init__()
        if num_gemms < 1:
            raise ValueError(f"num_gemms must be >= 1, got {num_gemms}")
        check_weight_dtype(dtype, "Fp8GroupedLinear")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        self.single_grouped_weight = bool(single_grouped_weight)
        make = lambda *shape: nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))  # noqa: E731
        if self.single_grouped_weight:
            self.register_parameter("weight", make(num_gemms, out_features, in_features))
        for i in range(num_gemms):
            if not self.single_grouped_weight:
                self.register_parameter(f"weight{i}", make(out_features, in_features))
            self.register_parameter(f"bias{i}", make(out_features) if bias else None)
        self.weight_names, self.bias_names = expert_parameter_names(num_gemms)
        if self.single_grouped_weight:
            self.weight_names = ("weight",)
        self.recipe = recipe or BlockwiseRecipe()
        self.backend = backend
        check_backend(backend, self.weights[0])
        self.weight_cache = GroupedWeightCache() if cache_weight else None
        self.is_first_microbatch: bool | None = None
        self.reset_parameters()
        self._register_load_state_dict_pre_hook(self._match_weight_layout)

    def _match_weight_layout(self, state_dict, prefix, *args, **kwargs):
        match_expert_weight_layout(state_dict, prefix, self.num_gemms, self.single_grouped_weight)

    @property
    def weights(self) -> list[nn.Parameter]:
        """The weight parameters: ``weight0..``, or the one ``[E, out, in]`` ``weight``."""
        return expert_parameters(self, self.weight_names)

    @property
    def biases(self) -> list[nn.Parameter] | None:
        return expert_parameters(self, self.bias_names) if self.use_bias else None

    def expert_weight(self, i: int) -> torch.Tensor:
        """Expert ``i``'s ``[out, in]`` weight (a view of the single grouped weight where there is one)."""
        return self.weight[i] if self.single_grouped_weight else getattr(self, f"weight{i}")

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation for every expert (in the same order in either layout)."""
        bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
        for i in range(self.num_gemms):
            nn.init.kaiming_uniform_(self.expert_weight(i), a=math.sqrt(5))
            if self.use_bias:
                nn.init.uniform_(getattr(self, f"bias{i}"), -bound, bound)

    def fp8_weight_source(self):
        """``E`` weight tensors, or the single ``[E, out, in]`` one, as the op takes them."""
        weights = self.weight if self.single_grouped_weight else self.weights
        return weights, self.recipe, self.backend

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        weights = self.fp8_weight_source()[0]
        return fp8_grouped_linear(x, m_splits, weights, self.biases, recipe=self.recipe, backend=self.backend,
                                  weight_cache=self.weight_cache, refresh_weight_cache=take_first_microbatch(self))  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, fp8={self.recipe.fp8_format.value}, backend={self.backend}, "
            f"single_grouped_weight={self.single_grouped_weight}"
        )
