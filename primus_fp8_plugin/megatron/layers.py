"""Megatron-core linear layers computing with FP8 blockwise GEMMs.

They subclass Megatron's own ``ColumnParallelLinear`` / ``RowParallelLinear``, so tensor-parallel
attributes, weight initialisation, ``sharded_state_dict`` and ``main_grad`` handling stay Megatron's;
only ``_forward_impl`` (the matrix multiply with its tensor-parallel communication) is replaced:

* column-parallel: with sequence parallelism the local sequence shard is quantized and its FP8
  rowwise copy all-gathered (``fp8_blockwise_linear(..., sequence_parallel_group=)``: only the shard's
  columnwise copy is saved for backward and re-gathered there in FP8; the input gradient is
  reduce-scattered; a bf16 gather where a shard's rows are not a multiple of 128); otherwise the
  input gradient is all-reduced across TP ranks (``allreduce_dgrad``) and the FP8 blockwise linear
  runs on the local weight shard.
* row-parallel: the FP8 blockwise linear on the local shard; Megatron's forward then reduces (or
  reduce-scatters) the output as usual.

Each layer's ``input_stage`` (``ops/stages.py``) says what its input is: ``"plain"``; ``"norm"`` (column-parallel:
the layer owns ``layer_norm_weight`` / ``layer_norm_bias``, TE's ``LayerNormColumnParallelLinear`` names, and the
norm is computed and quantized in one kernel, the bf16 norm output never written; ``Fp8LayerNormColumnParallelLinear``
is this stage's name in specs); ``"swiglu"`` (row-parallel: the input is fc1's ``[gate | up]`` output, SwiGLU is
computed and quantized in one kernel; ``mlp.Fp8SwigluMLP`` builds its fc2 so). The stages give the bits of the
unfused composition (``normalization.norm`` / ``swiglu.swiglu``, then the plain layer), outputs and gradients.

Tensor parallelism with the norm stage: each rank's gradient of the normed input is a partial sum over the ranks'
output columns and the norm's backward runs inside the op, so without sequence parallelism the input's gradient is
all-reduced after the norm's backward (it is linear in its incoming gradient) and so are the gamma/beta gradients;
with sequence parallelism the norm runs on the local shard, fused with its quantization, its FP8 rowwise copy is
all-gathered, and the gamma/beta gradients (this rank's tokens) are summed by Megatron's all-reduce of
``sequence_parallel`` parameters.

Every layer owns a weight cache (``weight_cache.py``) refreshed once per weight version and
whenever ``is_first_microbatch`` is set. Megatron's optimizers write the new bf16 params through
``.data`` (the mixed-precision optimizer's copy of main params) or into the parameter buffer and
all-gather it (the distributed optimizer), which no version counter sees; both do it after the
inner ``torch.optim`` step, whose global post-hook advances the cache's optimizer-step epoch, so the
next forward re-quantizes (tests/megatron/test_weight_cache_megatron.py). Note: Megatron's
``MegatronModule.set_is_first_microbatch`` only sets it when ``config.fp8`` is set (TE's switch),
which plugin users leave unset; ``set_is_first_microbatch(model)`` here sets it on the plugin's
layers.

Weight gradients go into ``weight.main_grad`` (fp32) inside the wgrad GEMM wherever Megatron's DDP gives the weight
one, whether or not ``config.gradient_accumulation_fusion`` is set (Megatron needs that flag, and apex, for its own
layers; the plugin's kernels need neither): the layer sets ``grad_added_to_main_grad`` and hands autograd one
shared placeholder gradient, so Megatron's backward hook adds nothing (``ops/core.py``). The opt-out is the layer's
``fuse_wgrad_accumulation=False`` keyword (or ``set_wgrad_accumulation_fusion(model, False)``): ``dW`` then goes to
``weight.grad`` in the weight's dtype and Megatron's hook adds it to ``main_grad``, as for its unfused layers.
"""

from __future__ import annotations

import copy
import inspect

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from .. import env
from ..modules import HoldsWeightCache, take_first_microbatch
from ..ops import fp8_blockwise_linear, fp8_norm_linear, fp8_swiglu_linear
from ..recipe import BlockwiseRecipe
from ..weight_cache import WeightCache
from .fp8_params import install_hooks
from .norm import make_norm_params


def _accepted(cls: type, kwargs: dict) -> dict:
    """The keyword arguments ``cls.__init__`` accepts: Megatron adds and drops some across versions."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _without_apex_fusion_check(config):
    """``config`` as Megatron's ``ColumnParallelLinear.__init__`` should see it.

    That constructor refuses ``gradient_accumulation_fusion=True`` unless apex's
    ``fused_weight_gradient_mlp_cuda`` imports, because its own backward needs it. These layers
    fuse the accumulation in their own wgrad GEMM (``main_grad += dY^T X`` in fp32) and never call
    apex, so the parent is built from a shallow copy with the flag off and the flag is restored
    afterwards (``_init_fp8``).
    """
    if not getattr(config, "gradient_accumulation_fusion", False):
        return config
    quiet = copy.copy(config)  # shallow: no __post_init__ re-validation, shares everything else
    quiet.gradient_accumulation_fusion = False
    return quiet


INPUT_STAGES = {"column": ("plain", "norm"), "row": ("plain", "swiglu")}


class Fp8MegatronLinear(HoldsWeightCache):
    """What the FP8 layers add to Megatron's: recipe, backend, input stage, weight cache and the FP8 matmul."""

    def _init_fp8(self, config, fp8_recipe: BlockwiseRecipe | None, fp8_backend: str, input_stage: str, kind: str,
                  input_size: int, fuse_wgrad_accumulation: bool) -> None:  # fmt: skip
        if input_stage not in INPUT_STAGES[kind]:
            raise ValueError(f"a {kind}-parallel FP8 linear takes input_stage {INPUT_STAGES[kind]}, got {input_stage!r}")
        self.config = config  # the caller's object, not the copy the parent was built from
        self.gradient_accumulation_fusion = bool(getattr(config, "gradient_accumulation_fusion", False))
        fuse_into_main_grad([self.weight], fuse_wgrad_accumulation)
        self.fp8_recipe = fp8_recipe or BlockwiseRecipe()
        self.fp8_backend = fp8_backend
        self.input_stage = input_stage
        self.weight_cache = WeightCache()
        self.is_first_microbatch: bool | None = None
        if env.fp8_params():  # FP8 primary weights in a loop the plugin does not own (Megatron-LM)
            install_hooks()
        if input_stage == "norm":
            self.normalization = getattr(config, "normalization", "LayerNorm")
            if self.normalization not in ("LayerNorm", "RMSNorm"):
                raise ValueError(f"the norm input stage takes LayerNorm and RMSNorm, got {self.normalization!r}")
            self.eps = config.layernorm_epsilon
            self.zero_centered_gamma = getattr(config, "layernorm_zero_centered_gamma", False)
            # sequence-parallel norm weights see only local tokens: Megatron all-reduces their gradients
            make_norm_params(self, config, input_size, prefix="layer_norm_")

    def fp8_weight_source(self):
        return self.weight, self.fp8_recipe, self.fp8_backend

    def fp8_options(self) -> dict:
        """The FP8 keywords of this layer's ops (the weight cache refreshed on the first microbatch)."""
        return dict(recipe=self.fp8_recipe, backend=self.fp8_backend, weight_cache=self.weight_cache,
                    refresh_weight_cache=take_first_microbatch(self))  # fmt: skip

    def _fp8_linear(self, input, weight, bias, *, allreduce_dgrad: bool = False, tp_group=None,
                    sequence_parallel_group=None):  # fmt: skip
        """The layer's FP8 op on ``input`` through its input stage; ``allreduce_dgrad``: the input's (and the norm
        parameters') gradients are all-reduced over ``tp_group``. ``dW`` goes into ``weight.main_grad`` where the
        weight has one (module docstring), whatever Megatron's ``gradient_accumulation_fusion`` argument says."""
        if self.input_stage == "swiglu":
            return fp8_swiglu_linear(input, weight, bias, **self.fp8_options())
        sp = {} if sequence_parallel_group is None else {"sequence_parallel_group": sequence_parallel_group}
        if self.input_stage == "plain":
            if allreduce_dgrad:
                input = copy_to_tensor_model_parallel_region(input, group=tp_group)
            return fp8_blockwise_linear(input, weight, bias, **sp, **self.fp8_options())
        gamma, beta = self.layer_norm_weight, self.layer_norm_bias
        if allreduce_dgrad:
            input, gamma = (copy_to_tensor_model_parallel_region(t, group=tp_group) for t in (input, gamma))
            beta = None if beta is None else copy_to_tensor_model_parallel_region(beta, group=tp_group)
        return fp8_norm_linear(input, gamma, beta, weight, bias, normalization=self.normalization, eps=self.eps,
                               zero_centered_gamma=self.zero_centered_gamma, **sp, **self.fp8_options())  # fmt: skip


def tp_group_of(tp_group):
    """The tensor-parallel group Megatron passed (newer versions), else its global one."""
    return tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()


class Fp8ColumnParallelLinear(Fp8MegatronLinear, ColumnParallelLinear):
    """``ColumnParallelLinear`` with FP8 blockwise GEMMs. Extra keyword arguments: ``fp8_recipe`` (a
    ``BlockwiseRecipe``), ``fp8_backend`` (a backend name or ``"auto"``), ``input_stage`` (``"plain"`` or
    ``"norm"``: the module docstring) and ``fuse_wgrad_accumulation`` (default True: ``dW`` into ``main_grad`` in the
    GEMM whatever ``config.gradient_accumulation_fusion`` says; False: into ``weight.grad``)."""

    def __init__(self, input_size, output_size, *, config, init_method, fp8_recipe=None, fp8_backend="auto",
                 input_stage="plain", fuse_wgrad_accumulation=True, **kwargs):  # fmt: skip
        super().__init__(
            input_size, output_size, config=_without_apex_fusion_check(config), init_method=init_method,
            **_accepted(ColumnParallelLinear, kwargs),
        )  # fmt: skip
        self._init_fp8(config, fp8_recipe, fp8_backend, input_stage, "column", input_size, fuse_wgrad_accumulation)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **_unused):  # fmt: skip
        if sequence_parallel:  # the FP8 all-gather of the quantized shard (the bf16 one where it must)
            return self._fp8_linear(input, weight, bias, sequence_parallel_group=tp_group_of(tp_group))
        return self._fp8_linear(input, weight, bias, allreduce_dgrad=allreduce_dgrad, tp_group=tp_group)


class Fp8LayerNormColumnParallelLinear(Fp8ColumnParallelLinear):
    """``Fp8ColumnParallelLinear`` with the ``"norm"`` input stage (LayerNorm or RMSNorm, from
    ``config.normalization``): where TE's ``TELayerNormColumnParallelLinear`` stands (``linear_qkv``,
    ``linear_fc1``), with its parameter names (``layer_norm_weight``, ``layer_norm_bias``), so that checkpoints map
    onto TE-spec and local-spec ones. Returns ``(Y, bias | None)`` with ``Y = norm(X) W^T``."""

    def __init__(self, input_size, output_size, *, config, init_method, **kwargs):
        kwargs.pop("input_stage", None)
        super().__init__(input_size, output_size, config=config, init_method=init_method, input_stage="norm", **kwargs)


class Fp8RowParallelLinear(Fp8MegatronLinear, RowParallelLinear):
    """``RowParallelLinear`` with FP8 blockwise GEMMs (extra keywords as ``Fp8ColumnParallelLinear``; ``input_stage``
    ``"plain"`` or ``"swiglu"``: the input is then fc1's ``[gate | up]`` output ``[s, b, 2F/tp]``)."""

    def __init__(self, input_size, output_size, *, config, init_method, fp8_recipe=None, fp8_backend="auto",
                 input_stage="plain", fuse_wgrad_accumulation=True, **kwargs):  # fmt: skip
        super().__init__(input_size, output_size, config=config, init_method=init_method, **_accepted(RowParallelLinear, kwargs))
        self._init_fp8(config, fp8_recipe, fp8_backend, input_stage, "row", input_size, fuse_wgrad_accumulation)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, **_unused):
        return self._fp8_linear(input, weight, bias)


def fuse_into_main_grad(weights, enabled: bool) -> None:
    """Whether the FP8 ops accumulate these weights' gradients into their ``main_grad`` (``enabled``, the default of
    every layer) or hand them to autograd (the opt-out): the weights' ``fuse_wgrad_accumulation`` attribute, which
    the op reads (``ops/core.main_grads_to_fill``)."""
    for w in weights:
        w.fuse_wgrad_accumulation = bool(enabled)


def set_wgrad_accumulation_fusion(model: torch.nn.Module, enabled: bool) -> int:
    """Turn the accumulation of the FP8 layers' weight gradients into ``main_grad`` on or off for every FP8 layer
    of ``model`` (the layers' ``fuse_wgrad_accumulation`` keyword, for a model already built). Returns how many
    weights were set."""
    weights = [p for m in model.modules() if isinstance(m, HoldsWeightCache)
               for n, p in m.named_parameters(recurse=False) if n.startswith("weight")]  # fmt: skip
    fuse_into_main_grad(weights, enabled)
    return len(weights)


def set_is_first_microbatch(model: torch.nn.Module) -> int:
    """Mark every FP8 layer of ``model`` so its next forward re-quantizes its weight (call it at
    the start of a training step; Megatron's own method skips it unless ``config.fp8`` is set).
    Returns how many layers were marked."""
    layers = [m for m in model.modules() if isinstance(m, HoldsWeightCache)]
    for m in layers:
        m.is_first_microbatch = True
    return len(layers)
