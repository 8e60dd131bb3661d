"""Which Hopper (sm_90) kernel runs a call, and with which config: the one place that decides.

Each Gluon kernel states once what it takes (its module's ``unsupported_reason``, or ``supports`` for the
dense GEMM's tiles); the functions here consult it and answer None (or False) for every call it does not
take, which then runs the portable Triton kernel (kernels/triton/): the same bits either way. Nothing
here raises, and nothing else chooses: the backends (``backends/triton.py``, ``backends/hopper.py``) call
these functions, then the kernel they name. A Gluon wrapper called with input it does not take raises
``GluonUnsupported`` (a caller that skipped these functions).

Measurements behind the choices: docs/PERFORMANCE.md (H200).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...recipe import QuantParams
from . import fused_act, gemm, gemm_grouped, quantize_act, quantize_grouped, quantize_weight
from .fused_act import FusedQuantConfig
from .gemm import GluonGemmConfig
from .gemm_grouped import GroupedConfig

# --------------------------------------------------------------------------------------------------
# Quantizers: the Gluon kernels wherever they take the input (both dims multiples of 16, ...), else the
# portable ones
# --------------------------------------------------------------------------------------------------


def act_quant(x: torch.Tensor, params: QuantParams) -> bool:
    """Whether ``quantize_act.quantize_1x128_dual_gluon`` quantizes ``x``."""
    return quantize_act.unsupported_reason(x, params) is None


def weight_quant(w: torch.Tensor, params: QuantParams) -> bool:
    """Whether ``quantize_weight.quantize_128x128_gluon`` quantizes ``w``."""
    return quantize_weight.unsupported_reason(w, params) is None


# Launch variants of the fused quantizer (``fused_act.FusedQuantConfig``): the tile in two column halves with
# SwiGLU's register cap at 128 (two programs per SM) is the measured best (benchmarks/bench_fused.py --variants)
FUSED_QUANT = {
    "base": FusedQuantConfig(parts=1),
    "halves": FusedQuantConfig(parts=2, swiglu_maxnreg=128),
}
FUSED_QUANT_DEFAULT = "halves"


def fused_quant_config(variant: str = FUSED_QUANT_DEFAULT) -> FusedQuantConfig:
    """The fused quantizer's launch variant ``variant`` (a name in ``FUSED_QUANT``)."""
    return FUSED_QUANT[variant]


def fused_quant(src: torch.Tensor, k: int, params: QuantParams, variant: str = FUSED_QUANT_DEFAULT) -> FusedQuantConfig | None:
    """The config ``fused_act.quantize_fused_gluon`` quantizes the fused op's output ``[M, k]`` of ``src``
    with, or None where the portable kernel does (M, K or the row stride not multiples of 16, ...)."""
    return FUSED_QUANT[variant] if fused_act.unsupported_reason(src, k, params) is None else None


# --------------------------------------------------------------------------------------------------
# Dense GEMM (gemm.py): the tile per call (gemm.py's docstring has the table)
# --------------------------------------------------------------------------------------------------

CONFIG_128x128 = GluonGemmConfig(block_m=128, block_n=128, consumer_regs=232, producer_regs=40)
CONFIG_128x256 = GluonGemmConfig(block_n=256, consumer_regs=240, producer_regs=24)
CONFIG_256x128 = GluonGemmConfig(block_m=256, block_n=128, consumer_regs=240, producer_regs=24)


def gemm_config(b_block_dim: int, out_dtype: torch.dtype, accumulate: bool, has_bias: bool = False) -> GluonGemmConfig:
    """The tile of a call: 256x128 for 1x128-scaled B without a bias, else 128x256 where it takes the
    output (bf16/fp16, or ``accumulate_into`` except with 1x128 B and a bias), else 128x128."""
    for cfg in (CONFIG_256x128, CONFIG_128x256):
        if gemm.supports(cfg, b_block_dim, out_dtype, accumulate, has_bias) is None:
            return cfg
    return CONFIG_128x128


def dense_gemm(
    a: torch.Tensor, b: torch.Tensor, *, b_block_dim: int, out_dtype: torch.dtype, bias: torch.Tensor | None,
    accumulate_into: torch.Tensor | None,
) -> GluonGemmConfig | None:  # fmt: skip
    """The config ``gemm.blockwise_gemm_gluon`` runs ``a [M, K] @ b [N, K]^T`` with, or None where the
    portable GEMM does (off Hopper, K % 16 or N % 8 not 0, unaligned operands: ``gemm.unsupported_reason``)."""
    if gemm.unsupported_reason(a, b, accumulate_into) is not None:
        return None
    out = accumulate_into.dtype if accumulate_into is not None else out_dtype
    return gemm_config(b_block_dim, out, accumulate_into is not None, bias is not None)


def wgrad_by_cublas(accumulate: bool) -> bool:
    """Whether the ``hopper`` backend gives a wgrad to cuBLAS rather than the Gluon kernel: into a bf16/fp16
    ``weight.grad`` cuBLAS's blockwise GEMM is the faster one sustained on the H200; into an fp32
    ``main_grad`` (Megatron's gradient-accumulation fusion) the Gluon kernel, which adds in its epilogue
    where cuBLAS writes an fp32 product that a second pass adds (docs/PERFORMANCE.md)."""
    return not accumulate


# --------------------------------------------------------------------------------------------------
# Grouped (MoE) GEMMs (gemm_grouped.py) and the grouped weight quantization
# --------------------------------------------------------------------------------------------------

# fwd/dgrad: 128 token rows x 256 output columns, BLOCK_K 128, as many pipeline stages as fit (4), two consumer
# warpgroups at 224 registers and a 1-warp producer at 56, not the dense tile's 240 / 24: the producer's
# device-side tile schedule (the expert search) spills below 56 (AOT check: tools/aot_triton.py --gluon grouped).
# group_m (the L2 grouping within an expert): 8 row tiles sweep the N tiles together, 4 where the expert's N
# tiles already fit in L2 with all its row tiles (small N: B is re-read from L2 anyway). One tile config fits
# every MoE shape measured (docs/PERFORMANCE.md).
GROUPED_FWD_128x256 = GroupedConfig(block_m=128, block_n=256, consumer_regs=224, producer_regs=56)
GROUPED_FWD_128x256_G4 = GroupedConfig(block_m=128, block_n=256, group_m=4, consumer_regs=224, producer_regs=56)
# wgrad: the dense CONFIG_256x128's mainloop, 4 stages (no output buffers), group_m 8
GROUPED_WGRAD_256x128 = GroupedConfig(block_m=256, block_n=128)
# wgrad accumulated into main_grad: 232 / 40 registers (the config timed; 240 / 24 is as correct since the stage
# release is fenced, gemm_library.release_stage). Against the portable kernel (H100, benchmarks/
# bench_grouped_gemm.py --ops wgrad, balanced routing): 0.89-0.91x at 256 tokens per expert (Qwen3 shapes), 1.21-1.22x
# at 1024, 1.23-1.64x at DeepSeek-V3 and Mixtral shapes (1024-16384): the Gluon kernel from
# ``GROUPED_WGRAD_MAIN_GRAD_MIN_TOKENS`` tokens per expert on average (the layout's capacity over its experts).
GROUPED_WGRAD_MAIN_GRAD_256x128 = GroupedConfig(block_m=256, block_n=128, consumer_regs=232, producer_regs=40)
GROUPED_WGRAD_MAIN_GRAD_MIN_TOKENS = 512


def grouped_fwd_config(n: int) -> GroupedConfig:
    """The fwd/dgrad config for ``N`` output columns."""
    return GROUPED_FWD_128x256 if -(-n // GROUPED_FWD_128x256.block_n) > 4 else GROUPED_FWD_128x256_G4


def grouped_wgrad_config(accumulate: bool = False) -> GroupedConfig:
    """The wgrad config (``accumulate``: into main_grad)."""
    return GROUPED_WGRAD_MAIN_GRAD_256x128 if accumulate else GROUPED_WGRAD_256x128


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> GroupedConfig | None:
    """The config ``gemm_grouped.grouped_gemm_gluon`` runs fwd/dgrad with (``a [T, K]``, ``b [E, N, K]``), or
    None where the portable grouped GEMM does (``gemm_grouped.fwd_unsupported_reason``)."""
    if gemm_grouped.fwd_unsupported_reason(a, b, out_dtype, bias) is not None:
        return None
    return grouped_fwd_config(b.shape[1])


def grouped_wgrad(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, accumulate_into: Sequence[torch.Tensor] | None
) -> GroupedConfig | None:
    """The config ``gemm_grouped.grouped_wgrad_gluon`` runs wgrad with (``a [M, C]``, ``b [N, C]``), or None
    where the portable grouped wgrad does: what ``gemm_grouped.wgrad_unsupported_reason`` refuses, and an
    accumulation into main_grad over fewer than ``GROUPED_WGRAD_MAIN_GRAD_MIN_TOKENS`` token columns per expert."""
    if gemm_grouped.wgrad_unsupported_reason(a, b, out_dtype, accumulate_into) is not None:
        return None
    if accumulate_into is None:
        return GROUPED_WGRAD_256x128
    if a.shape[1] < GROUPED_WGRAD_MAIN_GRAD_MIN_TOKENS * len(accumulate_into):
        return None
    return GROUPED_WGRAD_MAIN_GRAD_256x128


# Weight quantization (W and W^T of E experts): per expert through the dense Gluon kernel (one read of each
# 128x128 block, one launch per expert) where the experts are few, else the batched portable kernel in one
# launch (it reads each block three times). H200, benchmarks/bench_grouped.py, the quantization's share of a
# fresh step (fresh minus cached): 8 x [28672, 4096] 2.43 ms batched against 0.86 ms per expert (the
# SequentialMLP contender, the same 3.8 GB moved: ~4.4 TB/s) and 0.92 ms for TE; 128 x [1536, 2048] 0.73 ms
# batched against 1.87 ms per expert (host-bound: 128 launches).
WEIGHT_PER_EXPERT_MAX_GROUPS = 32


def weight_quant_per_expert(weights: Sequence[torch.Tensor] | torch.Tensor, params: QuantParams) -> bool:
    """Whether ``E`` expert weights are quantized one dense Gluon launch per expert
    (``quantize_grouped.quantize_128x128_per_expert_gluon``): at most ``WEIGHT_PER_EXPERT_MAX_GROUPS``
    experts that the dense Gluon kernel all takes; else the batched portable kernel."""
    num_groups = weights.shape[0] if isinstance(weights, torch.Tensor) else len(weights)
    return 0 < num_groups <= WEIGHT_PER_EXPERT_MAX_GROUPS and quantize_grouped.unsupported_reason(weights, params) is None
