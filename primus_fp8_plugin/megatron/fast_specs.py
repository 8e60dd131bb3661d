"""Layer specs that read Megatron's config: the TE-free fast stack and TE's spec with the plugin's linears.

For Megatron-LM's ``--spec primus_fp8_plugin.megatron NAME``; Megatron >= 0.19 calls a spec that is not a
``ModuleSpec`` as ``NAME(config, vp_stage=vp_stage)`` (``config``: its ``TransformerConfig`` or the
``GPTModelConfig`` around one; only attributes are read):

* ``fp8_gpt_fast_layer_spec``: no TE, no apex (``--transformer-impl local``); returns this pipeline stage's
  decoder block (``TransformerBlockSubmodules``) with the plugin's sequence-parallel capable final norm.
  Core attention through PyTorch's SDPA (``attention.SdpaAttention``), the norm fused with the FP8
  quantization of ``linear_qkv`` / ``linear_fc1``'s input (``Fp8FusedNormColumnParallelLinear``), SwiGLU
  fused with the quantization of fc2's input (``Fp8FusedSwigluMLP``, dense layers with ``--swiglu``), the
  plugin's RoPE (``Fp8FastSelfAttention``). Numerics: the unfused plugin spec with SDPA attention
  (``get_gpt_layer_spec(core_attention="sdpa")``) bit for bit.
* ``fp8_te_gpt_layer_spec``: Transformer Engine's own layer spec (its fused attention, RoPE and, for MoE,
  pre-MLP norm) with the plugin's FP8 linears, the norm+quantization and SwiGLU+quantization fusions as above
  (``--transformer-impl transformer_engine``). Needs TE when called; this module imports without it.

Both honour ``normalization`` (LayerNorm / RMSNorm), ``qk_layernorm``, ``num_moe_experts`` and
``moe_grouped_gemm`` (grouped FP8 experts, else ``SequentialMLP``); MoE layers keep a separate pre-MLP norm
(the router reads the normalized input) and unfused expert activations. Refused with a clear error: an
MoE config whose ``moe_layer_freq`` mixes dense and MoE layers, multi-latent attention, experimental
attention variants, and ``config.fp8`` (TE's FP8 switch: leave ``--fp8-format`` unset, the plugin's linears
are the FP8).

Object exports for Megatron versions that take a ``ModuleSpec`` only (Primus passes the object, never calls
it): ``fp8_gpt_fast_dense_spec`` and ``fp8_gpt_fast_moe_spec`` (the norm kind is read from the config when
the layer is built; the MoE one builds grouped experts under ``--moe-grouped-gemm``).
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from ..recipe import BlockwiseRecipe
from .fast_attention import Fp8FastSelfAttention
from .fused_layers import Fp8FusedNormColumnParallelLinear, Fp8FusedSwigluMLP, Fp8SwigluRowParallelLinear
from .layers import Fp8LayerNormColumnParallelLinear
from .norm import TorchNorm
from .specs import _fp8_module, _with_attention_submodules, apply_fp8_blockwise, get_gpt_layer_spec

NORMALIZATIONS = ("LayerNorm", "RMSNorm")

TE_MISSING = (
    "{name} needs NVIDIA Transformer Engine (transformer_engine.pytorch), which does not import here ({err}). "
    "Install it (e.g. `pip install --no-build-isolation transformer_engine[pytorch]`) and run with "
    "--transformer-impl transformer_engine, or use the TE-free spec: "
    "--spec primus_fp8_plugin.megatron fp8_gpt_fast_layer_spec with --transformer-impl local "
    "--no-persist-layer-norm --no-masked-softmax-fusion --no-gradient-accumulation-fusion --no-rope-fusion"
)


def _retarget(node, mapping: dict):
    """A copy of a spec tree with the module classes in ``mapping`` (old class -> new class) replaced."""
    if isinstance(node, type):
        return mapping.get(node, node)
    if isinstance(node, ModuleSpec):
        node = copy.copy(node)
        node.module = mapping.get(node.module, node.module) if isinstance(node.module, type) else node.module
        if node.submodules is not None:
            node.submodules = _retarget(node.submodules, mapping)
        return node
    if isinstance(node, partial):
        return partial(_retarget(node.func, mapping), *node.args, **{k: _retarget(v, mapping) for k, v in node.keywords.items()})
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: _retarget(getattr(node, f.name), mapping) for f in dataclasses.fields(node)})
    if isinstance(node, list):
        return [_retarget(v, mapping) for v in node]
    return node


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


def _fuse(spec: ModuleSpec, *, dense: bool, recipe, backend, attention_cls=None, qk_norm=None) -> ModuleSpec:
    """A plugin-linear layer spec with the fused norm+quantization linears, the fused SwiGLU MLP (dense) and,
    given, the attention class and the q/k norm class."""
    spec = _retarget(spec, {Fp8LayerNormColumnParallelLinear: Fp8FusedNormColumnParallelLinear})
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
        mlp_sub = _mlp_submodules(sub.mlp)
        fc2 = _fp8_module(Fp8SwigluRowParallelLinear, recipe, backend)
        mlp_sub = dataclasses.replace(mlp_sub, linear_fc2=fc2)
        changes["mlp"] = _with_mlp_class(sub.mlp, Fp8FusedSwigluMLP, mlp_sub)
    return ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(sub, **changes))


def get_gpt_fast_layer_spec(
    num_experts: int | None = None,
    *,
    qk_layernorm: bool = False,
    normalization: str = "LayerNorm",
    moe_grouped_gemm: bool | None = False,
    recipe: BlockwiseRecipe | None = None,
    backend: str = "auto",
) -> ModuleSpec:
    """The TE-free fast GPT layer (see the module docstring); arguments as ``get_gpt_layer_spec``'s
    (``moe_grouped_gemm=None``: grouped experts when ``config.moe_grouped_gemm`` is set at build time)."""
    spec = get_gpt_layer_spec(num_experts, qk_layernorm=qk_layernorm, normalization=normalization, fused_norm=True,
                              core_attention="sdpa", moe_grouped_gemm=moe_grouped_gemm, recipe=recipe,
                              backend=backend)  # fmt: skip
    return _fuse(spec, dense=num_experts is None, recipe=recipe, backend=backend, attention_cls=Fp8FastSelfAttention,
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
    return _fuse(spec, dense=num_experts is None, recipe=recipe, backend=backend)


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


def spec_options(config) -> dict:
    """What the config-reading specs take from ``config``: ``num_experts``, ``qk_layernorm``,
    ``normalization``, ``moe_grouped_gemm``; raises for what they do not build (see the module docstring)."""
    normalization = getattr(config, "normalization", "LayerNorm")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"the plugin's specs take normalization {NORMALIZATIONS}, got {normalization!r}")
    if getattr(config, "fp8", None):
        raise ValueError(f"config.fp8={config.fp8!r} switches on Transformer Engine's FP8 around the plugin's: "
                         "leave --fp8-format/--fp8-recipe unset with the plugin's specs (its linears are the FP8)")  # fmt: skip
    if getattr(config, "multi_latent_attention", False):
        raise NotImplementedError("the plugin's specs do not build multi-latent attention (MLA)")
    if getattr(config, "experimental_attention_variant", None) is not None:
        raise NotImplementedError(f"the plugin's specs do not build experimental_attention_variant="
                                  f"{config.experimental_attention_variant!r}")  # fmt: skip
    num_experts = getattr(config, "num_moe_experts", None) or None
    freq = getattr(config, "moe_layer_freq", 1)
    if num_experts is not None and freq != 1:
        raise NotImplementedError(f"moe_layer_freq={freq!r} mixes dense and MoE layers; the plugin's specs build "
                                  "every layer alike (use moe_layer_freq=1, or build a block spec in Python)")  # fmt: skip
    return dict(num_experts=num_experts, qk_layernorm=bool(getattr(config, "qk_layernorm", False)),
                normalization=normalization, moe_grouped_gemm=bool(getattr(config, "moe_grouped_gemm", False)))  # fmt: skip


def fp8_gpt_fast_layer_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """``--spec primus_fp8_plugin.megatron fp8_gpt_fast_layer_spec``: the TE-free fast layers for ``config``,
    as the decoder block of this pipeline stage (``vp_stage``: its virtual stage) with the plugin's final norm
    (``TorchNorm``: sequence parallelism works without apex, where Megatron's fallback norm refuses it)."""
    layer = get_gpt_fast_layer_spec(**spec_options(config))
    return TransformerBlockSubmodules(layer_specs=[layer] * _num_layers_to_build(config, vp_stage), layer_norm=TorchNorm)


def _num_layers_to_build(config, vp_stage):
    """This pipeline stage's layer count (Megatron's ``get_num_layers_to_build``; all layers before Megatron's
    parallel state exists, as in ``check_spec``)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    if not parallel_state.model_parallel_is_initialized():
        return config.num_layers
    return get_num_layers_to_build(config, vp_stage=vp_stage)


def fp8_te_gpt_layer_spec(config, vp_stage: int | None = None) -> ModuleSpec:
    """``--spec primus_fp8_plugin.megatron fp8_te_gpt_layer_spec``: TE's layer for ``config`` with the plugin's
    linears (``--transformer-impl transformer_engine``; ImportError naming TE when it is missing)."""
    require_transformer_engine("fp8_te_gpt_layer_spec")
    opts = spec_options(config)
    opts.pop("normalization")  # TE's norms and the plugin's fused ones read config.normalization when built
    return get_te_gpt_layer_spec(**opts)


# For Megatron versions (and Primus) that take a ModuleSpec object, not a callable
fp8_gpt_fast_dense_spec = get_gpt_fast_layer_spec()
fp8_gpt_fast_moe_spec = get_gpt_fast_layer_spec(num_experts=8, moe_grouped_gemm=None)
