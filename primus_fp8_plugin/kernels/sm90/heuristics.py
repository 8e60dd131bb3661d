"""Which kernel and tile config runs a grouped (MoE) GEMM: decided here from the shapes, so that the kernels
(``gemm_grouped_gluon.py``, ``gemm_grouped.py``) take no decisions of their own.

Kernels: ``gluon`` (Hopper, persistent, warp specialised: 128x256 fwd/dgrad tiles, 256x128 wgrad tiles) where
it applies (an sm_90 GPU, TMA-compatible dims, a bf16/fp16 fwd/dgrad output), else ``triton`` (the portable
kernels, 128x128 tiles, every device). Both give the same bits (per-128-K promotion as the dense kernels).

Gluon config, per GEMM:

* fwd/dgrad: 128 token rows x 256 output columns, BLOCK_K 128, as many pipeline stages as fit (4), two
  consumer warpgroups at 240 registers and a 1-warp producer at 24 (``gemm_gluon.CONFIG_128x256``'s split).
  ``group_m`` (the L2 grouping within an expert): 8 row tiles sweep the N tiles together, fewer where the
  expert's N tiles already fit in L2 with all its row tiles (small N: B is re-read from L2 anyway).
* wgrad: 256 x 128 output tiles (``CONFIG_256x128``'s mainloop), 4 stages (no output buffers), group_m 8.
* ``ctas``: the persistent grid, one CTA per SM (None: the device's SM count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .target import runs_on


@dataclass(frozen=True)
class GroupedConfig:
    """Launch configuration of a Gluon grouped GEMM."""

    block_m: int
    block_n: int
    num_stages: int = 0  # 0: as many as fit (at most 6)
    group_m: int = 8
    consumer_regs: int = 240
    producer_regs: int = 24
    ctas: int | None = None  # persistent CTAs (None: one per SM)


# fwd/dgrad: 224 / 56 registers, not the dense tile's 240 / 24: the producer's device-side tile schedule
# (the expert search) spills below 56 (AOT check: tools/aot_triton.py --gluon grouped)
FWD_128x256 = GroupedConfig(block_m=128, block_n=256, consumer_regs=224, producer_regs=56)
WGRAD_256x128 = GroupedConfig(block_m=256, block_n=128)
# wgrad accumulated into main_grad: 232 / 40 registers. At 240 / 24 the kernel's results were wrong now and then
# on the H200 (a few experts per call came out with whole-tile errors, differing from run to run; never with one
# CTA); at 232 / 40 and 224 / 56 none in 20 calls on the qwen-like-128 routing (tools/grouped_wgrad_repeat.py).
# Root cause not found (see GLUON_MAIN_GRAD).
WGRAD_MAIN_GRAD_256x128 = GroupedConfig(block_m=256, block_n=128, consumer_regs=232, producer_regs=40)
WGRAD_128x256 = GroupedConfig(block_m=128, block_n=256)


def fwd_config(n: int, k: int, num_groups: int, capacity: int) -> GroupedConfig:
    """The fwd/dgrad config for ``N`` output columns, ``K`` (the contraction), ``E`` experts and ``capacity``
    padded token rows."""
    del k, num_groups, capacity  # one tile config fits every MoE shape measured (docs/PERFORMANCE.md)
    n_tiles = -(-n // FWD_128x256.block_n)
    return FWD_128x256 if n_tiles > 4 else GroupedConfig(block_m=128, block_n=256, group_m=4, consumer_regs=224, producer_regs=56)


def wgrad_config(m: int, n: int, num_groups: int, capacity: int, accumulate: bool = False) -> GroupedConfig:
    """The wgrad config for ``[M, N]`` outputs per expert (``accumulate``: into main_grad)."""
    del m, n, num_groups, capacity
    return WGRAD_MAIN_GRAD_256x128 if accumulate else WGRAD_256x128


# wgrad accumulated into main_grad through the Gluon kernel: off in the backend (the portable kernel accumulates).
# At 240 / 24 registers the Gluon kernel gave wrong tiles in 0-3 of 128 experts per call (TMA-stored epilogue) and
# 9-19 (stores from registers), changing from run to run, never with one CTA (H200, 2026-12-02). At 232 / 40
# (WGRAD_MAIN_GRAD_256x128) the TMA-stored epilogue was clean in every call tried (10 diagnosis calls, 8 per case
# of tests/gpu/test_gpu_grouped_gluon.py); stores from registers still failed, so the wrapper refuses them. The
# cause is not understood, so it stays off until it is.
GLUON_MAIN_GRAD = False


def use_gluon(device: torch.device, op: str, out_dtype: torch.dtype, dims: tuple[int, ...], accumulate: bool = False) -> bool:
    """Whether the Gluon kernel runs ``op`` ('fwd', 'dgrad', 'wgrad') on ``device``: an sm_90 GPU, and dims
    TMA takes (fwd/dgrad ``(N, K)``: K % 16 == 0, N % 8 == 0, output bf16/fp16; wgrad ``(M, N)``: both % 16,
    into ``accumulate_into`` or a bf16/fp16 output).
    The wrappers check the same and raise ``GluonUnsupported`` otherwise."""
    if not runs_on(device):
        return False
    if op in ("fwd", "dgrad"):
        n, k = dims
        return k % 16 == 0 and n % 8 == 0 and out_dtype in (torch.bfloat16, torch.float16)
    m, n = dims
    if accumulate:
        return GLUON_MAIN_GRAD and m % 16 == 0 and n % 16 == 0
    return m % 16 == 0 and n % 16 == 0 and out_dtype in (torch.bfloat16, torch.float16)


# Weight quantization (W and W^T of E experts): per expert through the dense Gluon kernel (one read of each
# 128x128 block, one launch per expert) where the experts are few, else the batched portable kernel in one
# launch (it reads each block three times). H200, benchmarks/bench_grouped.py, 2026-12-03, the quantization's
# share of a fresh step (fresh minus cached): 8 x [28672, 4096] 2.43 ms batched against 0.86 ms per expert
# (the SequentialMLP contender, the same 3.8 GB moved: ~4.4 TB/s) and 0.92 ms for TE; 128 x [1536, 2048]
# 0.73 ms batched against 1.87 ms per expert (host-bound: 128 launches).
WEIGHT_PER_EXPERT_MAX_GROUPS = 32


def weight_quant_per_expert(device: torch.device, num_groups: int) -> bool:
    """Whether ``num_groups`` expert weights on ``device`` are quantized one dense Gluon launch per expert
    (an sm_90 GPU, at most ``WEIGHT_PER_EXPERT_MAX_GROUPS`` experts); where the Gluon kernel refuses a
    weight, ``quantize_grouped_gluon`` raises ``GluonUnsupported`` before launching and the batched one runs."""
    return runs_on(device) and 0 < num_groups <= WEIGHT_PER_EXPERT_MAX_GROUPS
