"""The entry points Megatron-LM's ``--spec`` calls: layer specs built (by ``specs.py``) for Megatron's config, the
TE-free fast stack and TE's spec with the plugin's linears.

For Megatron-LM's ``--spec primus_fp8_plugin.megatron NAME``; Megatron >= 0.19 calls a spec that is not a
``ModuleSpec`` as ``NAME(config, vp_stage=vp_stage)`` (``config``: its ``TransformerConfig`` or the
``GPTModelConfig`` around one; only attributes are read):

* ``fp8_gpt_fast_layer_spec``: no TE, no apex (``--transformer-impl local``); returns this pipeline stage's
  decoder block (``TransformerBlockSubmodules``) with the plugin's sequence-parallel capable final norm.
  Core attention through PyTorch's SDPA (``attention.SdpaAttention``), the norm fused with the FP8
  quantization of ``linear_qkv`` / ``linear_fc1``'s input (``Fp8LayerNormColumnParallelLinear``), SwiGLU
  fused with the quantization of fc2's input (``Fp8SwigluMLP``, dense layers with ``--swiglu``), the
  plugin's RoPE (``Fp8FastSelfAttention``); ``PRIMUS_FP8_MOE_SINGLE_GROUPED_WEIGHT=1``: grouped experts with one
  ``[E, out, in]`` weight per linear (``grouped.py``, ``single_grouped_weight``, and its checkpoint limits). Numerics:
  the unfused plugin spec with SDPA attention (``get_gpt_layer_spec(core_attention="sdpa")``) bit for bit.
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

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .. import env
from .norm import TorchNorm
from .specs import get_gpt_fast_layer_spec, get_te_gpt_layer_spec, require_transformer_engine

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


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
    layer = get_gpt_fast_layer_spec(**spec_options(config), single_grouped_weight=env.moe_single_grouped_weight())
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
