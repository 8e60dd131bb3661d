"""Megatron-core integration: FP8 blockwise layer classes and layer specs (needs ``megatron-core``; the supported
versions: ``compat.SUPPORTED``).

Where megatron-core is absent or lacks what the plugin needs, this package still imports, so that
``python -m primus_fp8_plugin.megatron.check_spec`` can say so in one line: ``import_error`` holds the
``ImportError`` (None when all is well) and every name of ``__all__`` raises it.
"""

try:
    from .fast_attention import Fp8FastSelfAttention
    from .fast_specs import (
        fp8_gpt_fast_dense_spec,
        fp8_gpt_fast_layer_spec,
        fp8_gpt_fast_moe_spec,
        fp8_te_gpt_layer_spec,
    )
    from .grouped import Fp8ColumnParallelGroupedLinear, Fp8Experts, Fp8GroupedMLP, Fp8RowParallelGroupedLinear
    from .layers import (
        Fp8ColumnParallelLinear,
        Fp8LayerNormColumnParallelLinear,
        Fp8RowParallelLinear,
        set_is_first_microbatch,
        set_wgrad_accumulation_fusion,
    )
    from .mlp import Fp8SwigluMLP
    from .norm import TorchNorm
    from .specs import (
        Fp8SpecProvider,
        apply_fp8_blockwise,
        fp8_block_spec,
        fp8_gpt_layer_spec,
        fp8_gpt_layer_spec_rmsnorm,
        fp8_gpt_moe_layer_spec,
        get_gpt_block_spec,
        get_gpt_fast_layer_spec,
        get_gpt_layer_spec,
        get_te_gpt_layer_spec,
        is_fp8_linear,
    )
except ImportError as err:
    import_error: ImportError | None = err
else:
    import_error = None


def __getattr__(name: str):
    if import_error is not None and name in __all__:
        raise explained(import_error) from import_error
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def explained(err: ImportError) -> ImportError:
    """``err`` with the installed megatron-core version and the supported range in its message."""
    try:
        from .compat import explain_import_error
    except ImportError as compat_err:  # megatron-core absent or too old: compat's own message says so
        return compat_err
    return explain_import_error(err)


__all__ = [
    "Fp8FastSelfAttention",
    "Fp8SwigluMLP",
    "fp8_gpt_fast_dense_spec",
    "fp8_gpt_fast_layer_spec",
    "fp8_gpt_fast_moe_spec",
    "fp8_te_gpt_layer_spec",
    "get_gpt_fast_layer_spec",
    "get_te_gpt_layer_spec",
    "Fp8ColumnParallelGroupedLinear",
    "Fp8ColumnParallelLinear",
    "Fp8Experts",
    "Fp8GroupedMLP",
    "Fp8LayerNormColumnParallelLinear",
    "Fp8RowParallelGroupedLinear",
    "Fp8RowParallelLinear",
    "Fp8SpecProvider",
    "TorchNorm",
    "apply_fp8_blockwise",
    "fp8_block_spec",
    "fp8_gpt_layer_spec",
    "fp8_gpt_layer_spec_rmsnorm",
    "fp8_gpt_moe_layer_spec",
    "get_gpt_block_spec",
    "get_gpt_layer_spec",
    "is_fp8_linear",
    "set_is_first_microbatch",
    "set_wgrad_accumulation_fusion",
]
