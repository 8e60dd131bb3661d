"""primus-fp8-plugin: FP8 blockwise-scaled training (TE ``Float8BlockScaling`` numerics) for Megatron-core."""

from .backends import (
    BackendUnavailableError,
    available_backends,
    backend_availability,
    get_backend,
)
from .convert import convert_to_fp8_blockwise
from .gemm import gemm_dgrad, gemm_fwd, gemm_wgrad
from .modules import Fp8BlockwiseLinear, Fp8GroupedLinear
from .ops import fp8_blockwise_linear, fp8_grouped_linear, fp8_grouped_swiglu_linear, fp8_norm_linear, fp8_swiglu_linear
from .quantize import quantize_activation, quantize_weight
from .recipe import BlockwiseRecipe, Fp8Format, QuantParams, TensorRole
from .tensor import BlockwiseFp8Tensor
from .weight_cache import GroupedWeightCache, WeightCache

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "BlockwiseFp8Tensor",
    "BlockwiseRecipe",
    "Fp8BlockwiseLinear",
    "Fp8Format",
    "Fp8GroupedLinear",
    "GroupedWeightCache",
    "QuantParams",
    "TensorRole",
    "WeightCache",
    "available_backends",
    "backend_availability",
    "convert_to_fp8_blockwise",
    "fp8_blockwise_linear",
    "fp8_grouped_linear",
    "fp8_grouped_swiglu_linear",
    "fp8_norm_linear",
    "fp8_swiglu_linear",
    "gemm_dgrad",
    "gemm_fwd",
    "gemm_wgrad",
    "get_backend",
    "quantize_activation",
    "quantize_weight",
]
