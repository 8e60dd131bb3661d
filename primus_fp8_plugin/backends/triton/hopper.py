"""What the Gluon kernels for NVIDIA Hopper (sm_90) share: the target's limits, the dtype map and the
device queries their wrappers make on every call (cached)."""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl

SMEM_LIMIT = 232448  # bytes of dynamic shared memory per CTA on H100/H200 (227 KiB)

TORCH_TO_GL = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.float8_e5m2: gl.float8e5,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float32: gl.float32,
}


@functools.cache  # built once: the wrappers' host time counts
def transpose_tile_layouts():
    """Layouts of the Gluon quantizers (quantize_weight_gluon.py, quantize_act_gluon.py) for a 128x128
    tile [r, c] and 8 warps: ``L`` (registers of the loaded tile), ``LN`` (the same threads and
    values, r-first register order, for FP8 pairs along r), ``LT`` (the transposed [c, r] FP8 tile, 16
    bytes of a row per thread) and ``T_SMEM`` (the swizzled [c, r] buffer between LN and LT)."""
    # [r, c]: 4 rows x (2 x 8) columns per thread; 8 lanes along c (128 contiguous bytes of bf16 per
    # warp and row), 4 along r; warps along r, so the block amax crosses warps once
    reg_c_first = [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [0, 64]]
    reg_r_first = [[1, 0], [2, 0], [0, 1], [0, 2], [0, 4], [0, 64]]
    lanes = [[0, 8], [0, 16], [0, 32], [4, 0], [8, 0]]
    warps = [[16, 0], [32, 0], [64, 0]]
    block = gl.DistributedLinearLayout(reg_c_first, lanes, warps, [], [128, 128])
    block_r_first = gl.DistributedLinearLayout(reg_r_first, lanes, warps, [], [128, 128])
    transposed = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])  # [c, r]: 16 bytes of a row per thread
    # [c, r] FP8 buffer: 16-byte units XOR (c // 8) % 8, so the rows 8 apart that one store
    # instruction writes (4 lanes along r x 8 along c) fall in 32 distinct banks
    t_smem = gl.SwizzledSharedLayout(vec=16, per_phase=8, max_phase=8, order=[1, 0])
    return block, block_r_first, transposed, t_smem


@functools.lru_cache(maxsize=8)
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (the persistent kernels' grid size)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def runs_on(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA Hopper (sm_90) GPU (not ROCm, not the CPU)."""
    if device.type != "cuda" or torch.version.hip:
        return False
    return _is_sm90(device.index if device.index is not None else torch.cuda.current_device())
