"""Megatron-core integration: FP8 blockwise layer classes and layer specs (needs ``megatron-core``)."""

from .fast_attention import Fp8FastSelfAttention
from .fast_specs import (
    fp8_gpt_fast_dense_spec,
    fp8_gpt_fast_layer_spec,
    fp8_gpt_fast_moe_spec,
    fp8_te_gpt_layer_spec,
    get_gpt_fast_layer_spec,
    get_te_gpt_layer_spec,
)
from .fused_layers import Fp8FusedNormColumnParallelLinear, Fp8FusedSwigluMLP, Fp8SwigluRowParallelLinear
from .grouped import Fp8ColumnParallelGroupedLinear, Fp8Experts, Fp8RowParallelGroupedLinear
from .layers import (
    Fp8ColumnParallelLinear,
    Fp8LayerNormColumnParallelLinear,
    Fp8RowParallelLinear,
    set_is_first_microbatch,
)
from .norm import TorchNorm
from .specs import (
    Fp8SpecProvider,
    apply_fp8_blockwise,
    fp8_block_spec,
    fp8_gpt_layer_spec,
    fp8_gpt_layer_spec_rmsnorm,
    fp8_gpt_moe_layer_spec,
    get_gpt_block_spec,
    get_gpt_layer_spec,
    is_fp8_linear,
)

__all__ = [
    "Fp8FastSelfAttention",
    "Fp8FusedNormColumnParallelLinear",
    "Fp8FusedSwigluMLP",
    "Fp8SwigluRowParallelLinear",
    "fp8_gpt_fast_dense_spec",
    "fp8_gpt_fast_layer_spec",
    "fp8_gpt_fast_moe_spec",
    "fp8_te_gpt_layer_spec",
    "get_gpt_fast_layer_spec",
    "get_te_gpt_layer_spec",
    "Fp8ColumnParallelGroupedLinear",
    "Fp8ColumnParallelLinear",
    "Fp8Experts",
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
]
