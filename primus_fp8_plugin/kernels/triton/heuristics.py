"""The launch configs of the portable Triton kernels (this folder): the one place that picks them.

Every kernel wrapper here takes a ``config``; left out, the wrapper launches what this module returns
for its shapes. The portable kernels take every input, so nothing here depends on the kernels, and
the kernels import their configs from here. ``tools/aot_triton.py`` compiles exactly these configs for
sm_90 and gfx950 ahead of time and checks them spill-free. Which *kernel* runs a call (a Hopper Gluon
kernel or the portable one) is ``kernels/sm90/heuristics.py``'s decision; the FlyDSL kernels' is
``kernels/gfx950/heuristics.py``'s.

Launch variants of the fused ops' norm kernels (``NORM_STATS``, ``NORM_BWD``): every variant of a kernel
computes the same bits; they differ only in how the work is laid out over programs, warps and registers
(rows per program, columns loaded per loop step), never in the order of any floating-point operation.
The tests run every variant against the spec (``backends/reference_fused.py``);
``benchmarks/bench_fused.py --variants`` times them all, so that the defaults are the measured best. A
backend picks others by name (``backends/triton.py``, ``FusedVariants``).

Resources on sm_90 (``python -m tools.aot_triton``), bf16: norm statistics, LayerNorm 64 registers
(``base``), 96 (``u4``); norm backward 96 (``base``, a barrier per column sum in its loop), 243 LayerNorm /
150 RMSNorm (``wide``, no exchange between warps in the loop).
"""

from __future__ import annotations

from dataclasses import dataclass

from .fused_math import OP_LAYERNORM, OP_RMSNORM, OP_SWIGLU

# --------------------------------------------------------------------------------------------------
# Quantizers (quantize_act.py, quantize_weight.py, quantize_weight_preshuffle.py, quantize_grouped.py) and the
# W^T transpose (transpose_weight.py)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizeConfig:
    """A quantizer's launch: ``sub_m`` rows of its 128x128 tile per pass (128: the whole tile at once),
    ``num_warps``, and Triton's ``num_stages`` (passed explicitly, so that the AOT check compiles the
    binary that runs)."""

    sub_m: int
    num_warps: int
    num_stages: int = 3


# The whole tile loaded at once with 4 warps: the fastest on the H200 (229 registers, two programs per SM;
# 8 warps: 126 registers but slower, 56% against 65% of copy; docs/PERFORMANCE.md).
ACT_QUANT = QuantizeConfig(sub_m=128, num_warps=4)
# Where M or K is not a multiple of 16, Triton cannot vectorise the stores and the one-pass kernel spills
# (616-3648 bytes, ahead of time for sm_90): 16-row chunks with 4 warps compile spill-free.
ACT_QUANT_RAGGED = QuantizeConfig(sub_m=16, num_warps=4)
# The whole block per pass with 8 warps: the fastest of a sweep on the H200 (docs/PERFORMANCE.md)
WEIGHT_QUANT = QuantizeConfig(sub_m=128, num_warps=8)


def act_quant_config(m: int, k: int) -> QuantizeConfig:
    """The act quantizer's launch for ``x [m, k]``: one pass over each tile where M and K are multiples of
    16 (Triton then specialises the int arguments as such), 16-row chunks otherwise. The grouped
    quantizer passes ``m = 16``: its token rows start anywhere, so only K decides the alignment."""
    return ACT_QUANT if m % 16 == 0 and k % 16 == 0 else ACT_QUANT_RAGGED


def weight_quant_config() -> QuantizeConfig:
    """The 128x128 weight quantizers' launch (K-major, preshuffled, batched over experts)."""
    return WEIGHT_QUANT


@dataclass(frozen=True)
class TransposeConfig:
    """W^T on demand (transpose_weight.py): ``sub_m`` rows of a 128x128 block per pass, ``num_warps``, ``num_stages``."""

    sub_m: int
    num_warps: int
    num_stages: int = 3


# A byte copy: half a block per pass keeps the [64, 128] chunk and its transpose in registers with 4 warps. Not
# yet measured against other launches on a GPU (benchmarks/bench_quant.py times it: "W^T from W").
WEIGHT_TRANSPOSE = TransposeConfig(sub_m=64, num_warps=4)


def weight_transpose_config() -> TransposeConfig:
    """The W^T transpose's launch (dense and stacked experts): one config for every shape."""
    return WEIGHT_TRANSPOSE


# --------------------------------------------------------------------------------------------------
# GEMMs (gemm.py, gemm_grouped.py)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """A blockwise GEMM's launch (BLOCK_K is always 128: one scale per step); the grouped kernels need
    ``block_m == 128`` (one row tile per 128 padded tokens)."""

    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int


# The one config of the portable GEMMs (dense and grouped): compiled ahead of time for sm_90 and gfx950
GEMM = GemmConfig(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3)


def gemm_config() -> GemmConfig:
    """The portable dense GEMM's and grouped fprop/dgrad's launch: one config for every shape."""
    return GEMM


# The grouped wgrad over few tokens per expert (an expert's dW tile over a few K blocks, then its fp32 main_grad
# read and written): bound by each tile's latency, not by its math. The 128x128 tile with 8 warps takes ~240
# registers, one program per SM, and nothing hides the main_grad round trip; 64x64 with 4 warps takes 127 and
# three programs share an SM. H100, Qwen3 shapes, 128 experts, 128-256 tokens each (benchmarks/
# bench_grouped_gemm.py --wgrad-configs): 1.15-1.19x faster, the same bits. Above ``GROUPED_WGRAD_SHORT_MAX_TOKENS``
# (not timed there) the dense tile stays. gfx950: both compiled spill-free ahead of time, not timed.
GROUPED_WGRAD_SHORT = GemmConfig(block_m=64, block_n=64, group_m=8, num_warps=4, num_stages=4)
GROUPED_WGRAD_SHORT_MAX_TOKENS = 512


def grouped_wgrad_config(tokens_per_expert: float) -> GemmConfig:
    """The portable grouped wgrad's launch for ``tokens_per_expert`` (the layout's capacity over its experts:
    the mean count's upper bound, known on the host when the counts are on the device)."""
    return GROUPED_WGRAD_SHORT if tokens_per_expert <= GROUPED_WGRAD_SHORT_MAX_TOKENS else GEMM


# --------------------------------------------------------------------------------------------------
# Fused ops (fused_act.py, norm.py, swiglu.py, rope.py)
# --------------------------------------------------------------------------------------------------

# The fused quantizer (SUB_M rows per pass, warps), checked spill-free ahead of time (tools/aot_specs_fused.py):
# the whole tile where M, K and the row stride are multiples of 16 (SwiGLU: 64-row halves, two producers'
# tiles live), 16-row chunks otherwise.
FUSED_QUANT = {
    OP_LAYERNORM: QuantizeConfig(sub_m=128, num_warps=8),
    OP_RMSNORM: QuantizeConfig(sub_m=128, num_warps=8),
    OP_SWIGLU: QuantizeConfig(sub_m=64, num_warps=8),
}
FUSED_QUANT_RAGGED = {op: QuantizeConfig(sub_m=16, num_warps=4) for op in (OP_LAYERNORM, OP_RMSNORM, OP_SWIGLU)}


def fused_quant_config(op: int, m: int, k: int, stride: int) -> QuantizeConfig:
    """The fused quantizer's launch for op ``op`` (``fused_math.OP_*``), an output ``[m, k]`` and a source
    row stride ``stride``: the whole tile at once where all three are multiples of 16 (Triton then
    specialises them as such), 16-row chunks otherwise."""
    return FUSED_QUANT[op] if m % 16 == 0 and k % 16 == 0 and stride % 16 == 0 else FUSED_QUANT_RAGGED[op]


@dataclass(frozen=True)
class TileConfig:
    """An elementwise kernel's launch: ``block_m`` x ``block_n`` elements per program, ``num_warps``."""

    block_m: int
    block_n: int
    num_warps: int


FUSED_APPLY = TileConfig(block_m=32, block_n=128, num_warps=4)  # the fused op's output written in the input dtype
SWIGLU_BWD = TileConfig(block_m=32, block_n=128, num_warps=4)  # block_n columns of a and of b per program


@dataclass(frozen=True)
class RopeConfig:
    """``rope.py``'s launch: about ``tile_elements`` elements (heads x features) per loop step."""

    tile_elements: int
    num_warps: int


ROPE = RopeConfig(tile_elements=4096, num_warps=4)


@dataclass(frozen=True)
class StatsConfig:
    """``norm``'s statistics kernel: ``rows`` per program, ``unroll`` 128-column chunks loaded per loop step
    (all issued before the row sums take them in column order), ``warps``."""

    rows: int
    unroll: int
    warps: int


@dataclass(frozen=True)
class BwdConfig:
    """``norm``'s backward kernel (a program per 16-row group, fixed by the spec's column sums):
    ``unroll`` 128-column chunks per step of the first pass (the row sums); ``width`` columns per step
    of the second pass (dx and the group's column sums), taken ``sub`` rows at a time (4, 8 or 16);
    a width of 256 * warps puts all ``sub`` rows of 8 columns in one thread, so the column sums need
    no exchange between threads (at most ``width`` = the row length rounded up to a power of 2 is
    used); ``reverse``: the second pass walks the row backwards, starting with the columns the first
    pass read last (still in L2); ``warps``; ``colsum_cols`` / ``colsum_warps``: columns per program and
    warps of the kernel that sums the groups; ``stages``: Triton's ``num_stages`` (software pipelining
    of the loops' loads, which costs registers)."""

    unroll: int
    width: int
    sub: int
    reverse: bool
    warps: int
    colsum_cols: int
    stages: int = 3
    colsum_warps: int = 4


NORM_STATS = {
    "base": StatsConfig(rows=16, unroll=1, warps=4),
    "u4": StatsConfig(rows=16, unroll=4, warps=4),
    "r8u4": StatsConfig(rows=8, unroll=4, warps=4),
}
NORM_BWD = {
    "base": BwdConfig(unroll=1, width=128, sub=16, reverse=False, warps=4, colsum_cols=32),
    "base_u4": BwdConfig(unroll=4, width=128, sub=16, reverse=True, warps=4, colsum_cols=16),
    "wide": BwdConfig(unroll=1, width=1024, sub=4, reverse=False, warps=4, colsum_cols=16, stages=1),
}
NORM_STATS_DEFAULT = "u4"
NORM_BWD_DEFAULT = "wide"


def norm_stats_config(variant: str = NORM_STATS_DEFAULT) -> StatsConfig:
    """The norm statistics kernel's launch variant ``variant`` (a name in ``NORM_STATS``)."""
    return NORM_STATS[variant]


def norm_bwd_config(variant: str = NORM_BWD_DEFAULT) -> BwdConfig:
    """The norm backward kernel's launch variant ``variant`` (a name in ``NORM_BWD``)."""
    return NORM_BWD[variant]
