"""Layer specs that put the FP8 blockwise layers into Megatron-core models: the one builder of the local, fast and
TE-hybrid specs. Each starts from Megatron's own spec (the local one, or TE's) and writes the plugin's module specs
into it with one tree walker (``_swap``: the linears by class name) and direct replacements of named submodules.

* ``get_gpt_layer_spec(...)``: a GPT layer (dense or MoE), TE-style with the norm fused into
  ``linear_qkv`` / ``linear_fc1`` (``fused_norm=True``), or local-style with separate norms.
* ``apply_fp8_blockwise(spec, ...)``: swaps every linear of an existing spec (local or TE) for its
  FP8 counterpart (and Megatron's ``TEGroupedMLP`` for ``Fp8GroupedMLP``, which fuses SwiGLU into fc2, and its
  ``MoELayer`` for ``Fp8MoELayer``, which routes tokens straight into the grouped FP8 layout where it can);
  ``fp8_block_spec`` keeps chosen layers (e.g. first and last) in BF16.
* ``get_gpt_block_spec(num_layers, ...)``: a whole decoder block (with a sequence-parallel capable
  final norm), optionally with BF16 layers (e.g. first and last).
* ``get_gpt_fast_layer_spec(...)``: the TE-free fast layer: the fused-norm layer with SDPA attention, the plugin's
  RoPE (``Fp8FastSelfAttention``) and, dense layers, the SwiGLU-fusing MLP (``Fp8SwigluMLP``).
* ``get_te_gpt_layer_spec(...)``: TE's layer spec with the plugin's linears and SwiGLU-fusing MLP (needs TE).
* ``Fp8SpecProvider``: a Megatron ``BackendSpecProvider`` (``grouped_mlp_modules(True)``: the plugin's grouped
  experts, ``grouped.py``).
* Module-level specs for Megatron-LM's ``--spec primus_fp8_plugin.megatron <name>``:
  ``fp8_gpt_layer_spec`` (LayerNorm), ``fp8_gpt_layer_spec_rmsnorm``, ``fp8_gpt_moe_layer_spec`` (grouped
  experts under ``--moe-grouped-gemm``, SequentialMLP otherwise).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterable
from functools import partial

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..recipe import BlockwiseRecipe
from .compat import grouped_linear, moe_experts, provider_experts
from .fast_attention import Fp8FastSelfAttention
from .grouped import (
    Fp8ColumnParallelGroupedLinear,
    Fp8Experts,
    Fp8GroupedMLP,
    Fp8RowParallelGroupedLinear,
    grouped_mlp,
    sequential_mlp,
)
from .layers import Fp8ColumnParallelLinear, Fp8LayerNormColumnParallelLinear, Fp8RowParallelLinear
from .mlp import Fp8SwigluMLP
from .moe import Fp8MoELayer
from .norm import TorchNorm

TE_MISSING = (
    "{name} needs NVIDIA Transformer Engine (transformer_engine.pytorch), which does not import here ({err}). "
    "Install it (e.g. `pip install --no-build-isolation transformer_engine[pytorch]`) and run with "
    "--transformer-impl transformer_engine, or use the TE-free spec: "
    "--spec primus_fp8_plugin.megatron fp8_gpt_fast_layer_spec with --transformer-impl local "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-rope-fusion"
)

# Linear classes replaced by apply_fp8_blockwise, matched by name so TE's need not be importable.
_SWAP = {
    "ColumnParallelLinear": Fp8ColumnParallelLinear,
    "TEColumnParallelLinear": Fp8ColumnParallelLinear,
    "RowParallelLinear": Fp8RowParallelLinear,
    "TERowParallelLinear": Fp8RowParallelLinear,
    "TELayerNormColumnParallelLinear": Fp8LayerNormColumnParallelLinear,
}
# TE's grouped expert linears (replaced by builders or ModuleSpecs, as the installed TEGroupedMLP takes them: compat.py)
_SWAP_GROUPED = {
    "TEColumnParallelGroupedLinear": Fp8ColumnParallelGroupedLinear,
    "TERowParallelGroupedLinear": Fp8RowParallelGroupedLinear,
}
# Megatron's modules replaced by their subclasses: the grouped experts that fuse SwiGLU into fc2 (grouped.py), the
# MoE layer that routes tokens straight into the grouped FP8 layout where it can (moe.py)
_SWAP_MODULES = {"TEGroupedMLP": Fp8GroupedMLP, "MoELayer": Fp8MoELayer}
_FP8_CLASSES = (Fp8ColumnParallelLinear, Fp8RowParallelLinear, Fp8LayerNormColumnParallelLinear,
                Fp8ColumnParallelGroupedLinear, Fp8RowParallelGroupedLinear)  # fmt: skip


def _fp8_module(cls: type, recipe: BlockwiseRecipe | None, backend: str) -> ModuleSpec:
    return ModuleSpec(module=cls, params={"fp8_recipe": recipe, "fp8_backend": backend})


def _swap(node, recipe, backend):
    """Recursively replace linear classes in a spec tree (ModuleSpec, submodule dataclasses, partials)."""
    if isinstance(node, type):
        if node.__name__ in _SWAP_MODULES:
            return _SWAP_MODULES[node.__name__]
        if node.__name__ in _SWAP_GROUPED:
            return grouped_linear(_SWAP_GROUPED[node.__name__], fp8_recipe=recipe, fp8_backend=backend)
        new = _SWAP.get(node.__name__)
        return _fp8_module(new, recipe, backend) if new is not None else node
    if isinstance(node, ModuleSpec):
        node = copy.copy(node)
        if isinstance(node.module, type) and node.module.__name__ in _SWAP:
            params = dict(node.params or {})
            params.update(fp8_recipe=recipe, fp8_backend=backend)
            node.module, node.params = _SWAP[node.module.__name__], params
        elif isinstance(node.module, type) and node.module.__name__ in _SWAP_MODULES:
            node.module = _SWAP_MODULES[node.module.__name__]
        if node.submodules is not None:
            node.submodules = _swap(node.submodules, recipe, backend)
        return node
    if isinstance(node, partial):
        return partial(_swap(node.func, recipe, backend), *node.args,
                       **{k: _swap(v, recipe, backend) for k, v in node.keywords.items()})  # fmt: skip
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        changes = {f.name: _swap(getattr(node, f.name), recipe, backend) for f in dataclasses.fields(node)}
        return dataclasses.replace(node, **changes)
    if isinstance(node, list):
        return [_swap(v, recipe, backend) for v in node]
    return node


def apply_fp8_blockwise(spec, *, recipe: BlockwiseRecipe | None = None, backend: str = "auto", norm=None):
    """A copy of ``spec`` whose column/row-parallel linears (local or TE classes, TE's grouped expert linears
    included) are the FP8 blockwise ones. Attention and everything else stay.

    TE's fused norm+linear (``TELayerNormColumnParallelLinear``) becomes, by default, the plugin's fused
    ``Fp8LayerNormColumnParallelLinear`` (the norm is then the plugin's). With ``norm`` (a norm class,
    e.g. TE's ``TENorm``) and a transformer-layer ``spec``, it is split instead: ``norm`` goes into
    ``input_layernorm`` / ``pre_mlp_layernorm`` and the linear becomes ``Fp8ColumnParallelLinear``, so
    that only the linears change."""
    if norm is not None:
        spec = _unfuse_norm_linears(spec, norm, recipe, backend)
    return _swap(spec, recipe, backend)


def _is_fused_norm_linear(node) -> bool:
    cls = node.module if isinstance(node, ModuleSpec) else node
    return isinstance(cls, type) and cls.__name__ in ("TELayerNormColumnParallelLinear", "Fp8LayerNormColumnParallelLinear")


def _unfuse_norm_linears(spec, norm, recipe, backend):
    """A transformer-layer spec with its fused norm+linear layers (linear_qkv, linear_fc1) split into
    ``norm`` followed by the plugin's column-parallel linear."""
    sub = getattr(spec, "submodules", None)
    if not isinstance(spec, ModuleSpec) or not hasattr(sub, "self_attention"):
        raise ValueError("apply_fp8_blockwise(norm=...) needs a transformer-layer ModuleSpec")
    linear = _fp8_module(Fp8ColumnParallelLinear, recipe, backend)
    changes = {}
    attn = sub.self_attention
    if _is_fused_norm_linear(getattr(attn.submodules, "linear_qkv", None)):
        changes.update(input_layernorm=norm, self_attention=_with_attention_submodules(attn, linear_qkv=linear))
    mlp_sub = sub.mlp.keywords["submodules"] if isinstance(sub.mlp, partial) else getattr(sub.mlp, "submodules", None)
    if _is_fused_norm_linear(getattr(mlp_sub, "linear_fc1", None)):
        changes.update(pre_mlp_layernorm=norm, mlp=_with_fc1(sub.mlp, linear))
    if changes:  # fused-name aliases of the norms' checkpoint keys no longer apply
        changes["sharded_state_dict_keys_map"] = {}
    return ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(sub, **changes))


def fp8_block_spec(layer_spec, num_layers: int, *, bf16_layers: Iterable[int] = (), recipe=None, backend="auto"):
    """A ``TransformerBlockSubmodules`` with ``num_layers`` layers, FP8 except ``bf16_layers``
    (indices; negative ones count from the end, e.g. ``(0, -1)`` keeps the first and last in BF16).
    ``layer_spec`` is the BF16 (local or TE) layer spec."""
    keep = {i % num_layers for i in bf16_layers}
    fp8 = apply_fp8_blockwise(layer_spec, recipe=recipe, backend=backend)
    layers = [layer_spec if i in keep else fp8 for i in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TorchNorm)


def get_gpt_block_spec(num_layers: int, *, bf16_layers: Iterable[int] = (), **layer_kwargs) -> TransformerBlockSubmodules:
    """A whole decoder block of ``get_gpt_layer_spec(**layer_kwargs)`` layers with a final norm that
    works with sequence parallelism (``TorchNorm``); ``bf16_layers`` get Megatron's local BF16 layer
    (its norms also ``TorchNorm``), so ``bf16_layers=range(num_layers)`` is the BF16 baseline."""
    keep = {i % num_layers for i in bf16_layers}
    fp8 = get_gpt_layer_spec(**layer_kwargs) if len(keep) < num_layers else None
    bf16 = None
    if keep:
        local = {k: layer_kwargs[k] for k in ("num_experts", "qk_layernorm", "normalization") if k in layer_kwargs}
        bf16 = with_core_attention(_norms_to_torch_norm(_local_spec(**local)), layer_kwargs.get("core_attention", "local"))
    layers = [bf16 if i in keep else fp8 for i in range(num_layers)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TorchNorm)


@contextlib.contextmanager
def _keep_megatron_norm_choice():
    """Megatron's local spec for RMSNorm rebinds ``megatron.core.models.backends.LNImpl`` globally
    (so later LayerNorm specs of the user's would get the fallback norm); undo that."""
    from megatron.core.models import backends

    saved = getattr(backends, "LNImpl", None)
    try:
        yield
    finally:
        if saved is not None:
            backends.LNImpl = saved


def _local_spec(**kwargs):
    with _keep_megatron_norm_choice():
        return get_gpt_layer_local_spec(**kwargs)


def _norms_to_torch_norm(spec):
    """Separate norms of a layer spec -> TorchNorm (sequence-parallel capable without apex/TE)."""
    sub = spec.submodules
    changes = {}
    for field in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, field) is not IdentityOp:
            changes[field] = TorchNorm
    return ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(sub, **changes))


CORE_ATTENTIONS = ("local", "sdpa")


def with_core_attention(spec: ModuleSpec, core_attention: str) -> ModuleSpec:
    """``spec`` (a transformer-layer ModuleSpec) with its ``core_attention`` chosen by name:
    ``"local"`` keeps Megatron's unfused ``DotProductAttention``; ``"sdpa"`` puts the plugin's
    ``SdpaAttention`` (PyTorch's fused flash / memory-efficient kernels) there."""
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention must be one of {CORE_ATTENTIONS}, got {core_attention!r}")
    if core_attention == "local":
        return spec
    from .attention import SdpaAttention

    attn = _with_attention_submodules(spec.submodules.self_attention, core_attention=SdpaAttention)
    return ModuleSpec(module=spec.module, params=spec.params,
                      submodules=dataclasses.replace(spec.submodules, self_attention=attn))  # fmt: skip


def _with_attention_submodules(attn: ModuleSpec, **changes) -> ModuleSpec:
    """A copy of a self-attention spec with some of its submodules replaced (the input stays as it was)."""
    attn = copy.copy(attn)
    attn.submodules = dataclasses.replace(attn.submodules, **changes)
    return attn


def get_gpt_layer_spec(
    num_experts: int | None = None,
    *,
    qk_layernorm: bool = False,
    normalization: str = "LayerNorm",
    fused_norm: bool = True,
    core_attention: str = "local",
    moe_grouped_gemm: bool | None = False,
    single_grouped_weight: bool = False,
    recipe: BlockwiseRecipe | None = None,
    backend: str = "auto",
) -> ModuleSpec:
    """A GPT transformer layer with FP8 blockwise linears.

    ``fused_norm=True`` (TE-style): ``input_layernorm`` is folded into ``linear_qkv`` and, for dense
    layers, ``pre_mlp_layernorm`` into ``linear_fc1`` (MoE layers keep a separate pre-MLP norm:
    the router needs the normalized input). ``fused_norm=False``: Megatron's local layout.
    ``num_experts``: None for dense, else an MoE layer whose experts are, with ``moe_grouped_gemm=True``,
    Megatron's ``TEGroupedMLP`` with the plugin's grouped FP8 linears (one grouped GEMM for all local experts),
    with ``False`` ``SequentialMLP`` with the dense FP8 linears, and with ``None`` the one that
    ``config.moe_grouped_gemm`` (``--moe-grouped-gemm``) names when the layer is built.
    ``core_attention``: ``"local"`` (Megatron's unfused attention) or ``"sdpa"`` (fused, TE-free;
    see ``with_core_attention``). ``single_grouped_weight``: each grouped linear's experts in one ``[E, out, in]``
    parameter (``grouped.py``).
    """
    spec = apply_fp8_blockwise(
        _local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm, normalization=normalization),
        recipe=recipe,
        backend=backend,
    )
    spec = with_core_attention(_norms_to_torch_norm(spec), core_attention)
    if num_experts is not None and moe_grouped_gemm is not False:
        experts = (grouped_mlp(recipe, backend, single_grouped_weight) if moe_grouped_gemm
                   else Fp8Experts(recipe, backend, grouped=None, single_grouped_weight=single_grouped_weight))  # fmt: skip
        mlp = _with_experts(spec.submodules.mlp, moe_experts(experts))
        spec = ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(spec.submodules, mlp=mlp))
    if not fused_norm:
        return spec
    sub = spec.submodules
    fused = _fp8_module(Fp8LayerNormColumnParallelLinear, recipe, backend)
    attn = _with_attention_submodules(sub.self_attention, linear_qkv=fused)
    changes = {"input_layernorm": IdentityOp, "self_attention": attn, "sharded_state_dict_keys_map": {}}
    if num_experts is None:
        changes.update(pre_mlp_layernorm=IdentityOp, mlp=_with_fc1(sub.mlp, fused))
    return ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(sub, **changes))


def _with_experts(mlp, experts):
    """The MoE layer spec (a partial of MoELayer, or a ModuleSpec) with its ``experts`` replaced."""
    if isinstance(mlp, partial):
        kw = dict(mlp.keywords)
        kw["submodules"] = dataclasses.replace(kw["submodules"], experts=experts)
        return partial(mlp.func, *mlp.args, **kw)
    mlp = copy.copy(mlp)
    mlp.submodules = dataclasses.replace(mlp.submodules, experts=experts)
    return mlp


def _with_fc1(mlp, fc1):
    """The MLP spec (a ModuleSpec or, in Megatron >= 0.17, a partial) with ``linear_fc1`` replaced."""
    if isinstance(mlp, partial):
        kw = dict(mlp.keywords)
        kw["submodules"] = dataclasses.replace(kw["submodules"], linear_fc1=fc1)
        return partial(mlp.func, *mlp.args, **kw)
    mlp = copy.copy(mlp)
    mlp.submodules = dataclasses.replace(mlp.submodules, linear_fc1=fc1)
    return mlp


def _with_mlp_class(mlp, cls, submodules):
    """The dense MLP spec (``partial(MLP.as_mlp_submodule, ...)`` in Megatron >= 0.17, else a ModuleSpec of MLP)
    building ``cls`` with ``submodules`` instead."""
    if isinstance(mlp, partial) and getattr(mlp.func, "__self__", None) is MLP:
        return partial(cls.as_mlp_submodule, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    if isinstance(mlp, ModuleSpec) and mlp.module is MLP:
        return ModuleSpec(module=cls, params=dict(mlp.params or {}), submodules=submodules)
    raise TypeError(f"expected the dense layer's MLP spec (Megatron's MLP), got {mlp!r}")


def _mlp_submodules(mlp):
    return mlp.keywords["submodules"] if isinstance(mlp, partial) else mlp.submodules


def _fast_layer(spec: ModuleSpec, *, dense: bool, backend: str, attention_cls=None, qk_norm=None) -> ModuleSpec:
    """A plugin-linear layer spec with, given, the attention class and the q/k norm class and (dense layers) the
    SwiGLU-fusing MLP (``mlp.Fp8SwigluMLP``: it builds fc2 with the swiglu input stage where the config allows)."""
    sub = spec.submodules
    attn = copy.copy(sub.self_attention)
    attn_changes = {}
    if qk_norm is not None:
        for field in ("q_layernorm", "k_layernorm"):
            if getattr(attn.submodules, field, IdentityOp) is not IdentityOp:
                attn_changes[field] = qk_norm
    if attention_cls is not None:
        attn.module = attention_cls
        attn.params = {**(attn.params or {}), "rope_backend": backend}
    attn.submodules = dataclasses.replace(attn.submodules, **attn_changes)
    changes = {"self_attention": attn}
    if dense:
        changes["mlp"] = _with_mlp_class(sub.mlp, Fp8SwigluMLP, _mlp_submodules(sub.mlp))
    return ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(sub, **changes))


def get_gpt_fast_layer_spec(
    num_experts: int | None = None,
    *,
    qk_layernorm: bool = False,
    normalization: str = "LayerNorm",
    moe_grouped_gemm: bool | None = False,
    single_grouped_weight: bool = False,
    recipe: BlockwiseRecipe | None = None,
    backend: str = "auto",
) -> ModuleSpec:
    """The TE-free fast GPT layer (see the module docstring); arguments as ``get_gpt_layer_spec``'s
    (``moe_grouped_gemm=None``: grouped experts when ``config.moe_grouped_gemm`` is set at build time)."""
    spec = get_gpt_layer_spec(num_experts, qk_layernorm=qk_layernorm, normalization=normalization, fused_norm=True,
                              core_attention="sdpa", moe_grouped_gemm=moe_grouped_gemm,
                              single_grouped_weight=single_grouped_weight, recipe=recipe, backend=backend)  # fmt: skip
    return _fast_layer(spec, dense=num_experts is None, backend=backend, attention_cls=Fp8FastSelfAttention,
                       qk_norm=TorchNorm)  # fmt: skip


def require_transformer_engine(name: str = "this spec") -> None:
    """Raise ``ImportError`` saying what to do when ``transformer_engine.pytorch`` does not import."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # noqa: BLE001 - TE fails in many ways (missing, CUDA mismatch): all mean "no TE"
        raise ImportError(TE_MISSING.format(name=name, err=f"{type(err).__name__}: {err}")) from err


def get_te_gpt_layer_spec(
    num_experts: int | None = None,
    *,
    qk_layernorm: bool = False,
    moe_grouped_gemm: bool = False,
    recipe: BlockwiseRecipe | None = None,
    backend: str = "auto",
) -> ModuleSpec:
    """TE's GPT layer spec (``get_gpt_layer_with_transformer_engine_spec``) with the plugin's FP8 linears, the
    norm fused into ``linear_qkv`` / ``linear_fc1`` with the quantization, and (dense layers) the fused SwiGLU
    MLP; TE's attention (its output shared with the FP8 output projection: ``te_attention``), RoPE, q/k norms and
    MoE pre-MLP norm stay. Needs TE (``ImportError`` saying so)."""
    require_transformer_engine("fp8_te_gpt_layer_spec")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    te = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=bool(moe_grouped_gemm),
                                                    qk_layernorm=qk_layernorm)  # fmt: skip
    spec = apply_fp8_blockwise(_with_marking_te_attention(te), recipe=recipe, backend=backend)
    return _fast_layer(spec, dense=num_experts is None, backend=backend)


def _with_marking_te_attention(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with TE's core attention swapped for ``Fp8TEDotProductAttention`` (the same module, its output
    marked for the FP8 output projection where TE saves it anyway: te_attention.py)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    from .te_attention import Fp8TEDotProductAttention

    attn = spec.submodules.self_attention
    if getattr(attn.submodules, "core_attention", None) is not TEDotProductAttention:
        return spec
    attn = _with_attention_submodules(attn, core_attention=Fp8TEDotProductAttention)
    return ModuleSpec(module=spec.module, params=spec.params,
                      submodules=dataclasses.replace(spec.submodules, self_attention=attn))  # fmt: skip


class Fp8SpecProvider(LocalSpecProvider):
    """Megatron ``BackendSpecProvider``: local modules, with FP8 blockwise linears and (by default)
    the norm fused into the column-parallel linear that follows it."""

    def __init__(self, recipe: BlockwiseRecipe | None = None, backend: str = "auto", fuse_norm: bool = True):
        self.recipe, self.backend, self.fuse_norm = recipe, backend, fuse_norm

    def column_parallel_linear(self):
        return _fp8_module(Fp8ColumnParallelLinear, self.recipe, self.backend)

    def row_parallel_linear(self):
        return _fp8_module(Fp8RowParallelLinear, self.recipe, self.backend)

    def fuse_layernorm_and_linear(self) -> bool:
        return self.fuse_norm

    def column_parallel_layer_norm_linear(self):
        return _fp8_module(Fp8LayerNormColumnParallelLinear, self.recipe, self.backend) if self.fuse_norm else None

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool = False):
        """``TEGroupedMLP`` with the plugin's grouped FP8 linears (``moe_use_grouped_gemm``), else
        ``SequentialMLP`` with the dense FP8 linears: a builder, or ``(class, submodules)`` for Megatron-core
        0.16 (compat.py). megatron-core 0.16's legacy ``GroupedMLP`` has no FP8 counterpart."""
        if moe_use_legacy_grouped_gemm:
            raise NotImplementedError("--moe-use-legacy-grouped-gemm (Megatron's legacy GroupedMLP) has no FP8 blockwise "
                                      "counterpart: drop the flag (the plugin's grouped experts replace TEGroupedMLP's)")
        return provider_experts((grouped_mlp if moe_use_grouped_gemm else sequential_mlp)(self.recipe, self.backend))


def is_fp8_linear(module) -> bool:
    return isinstance(module, _FP8_CLASSES)


assert {c.__name__ for c in (ColumnParallelLinear, RowParallelLinear)} <= _SWAP.keys()

# For Megatron-LM: --spec primus_fp8_plugin.megatron fp8_gpt_layer_spec
fp8_gpt_layer_spec = get_gpt_layer_spec()
fp8_gpt_layer_spec_rmsnorm = get_gpt_layer_spec(normalization="RMSNorm")
# MoE: grouped experts where Megatron-LM's --moe-grouped-gemm is given, SequentialMLP otherwise
fp8_gpt_moe_layer_spec = get_gpt_layer_spec(num_experts=8, moe_grouped_gemm=None)
