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

from .sm90 import runs_on


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
WGRAD_128x256 = GroupedConfig(block_m=128, block_n=256)


def fwd_config(n: int, k: int, num_groups: int, capacity: int) -> GroupedConfig:
    """The fwd/dgrad config for ``N`` output columns, ``K`` (the contraction), ``E`` experts and ``capacity``
    padded token rows."""
    del k, num_groups, capacity  # one tile config fits every MoE shape measured (docs/PERFORMANCE.md)
    n_tiles = -(-n // FWD_128x256.block_n)
    return FWD_128x256 if n_tiles > 4 else GroupedConfig(block_m=128, block_n=256, group_m=4, consumer_regs=224, producer_regs=56)


def wgrad_config(m: int, n: int, num_groups: int, capacity: int) -> GroupedConfig:
    """The wgrad config for ``[M, N]`` outputs per expert."""
    del m, n, num_groups, capacity
    return WGRAD_256x128


# wgrad accumulated into main_grad through the Gluon kernel: off in the backend for now. The kernel equals the
# dense Gluon loop and the portable grouped kernel bit for bit in tests/gpu/test_gpu_grouped_gluon.py (both
# epilogues) and in isolation on the routings of tests/gpu/test_gpu_grouped.py, but that file's loop test saw
# main_grad differ from the portable dense kernel in a few experts (skewed-64, qwen-like-128; H200, 2026-12-02),
# not yet explained. The plain (bf16) wgrad, fwd and dgrad run the Gluon kernels.
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
