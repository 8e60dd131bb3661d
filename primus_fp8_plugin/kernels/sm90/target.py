"""The NVIDIA Hopper (sm_90) target, as its Gluon kernels see it: the shared-memory limit, the one
torch -> Gluon dtype map, the error for input a kernel does not take, and the device queries the
wrappers make on every call (cached)."""

from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl

SMEM_LIMIT = 232448  # bytes of dynamic shared memory per CTA on H100/H200 (227 KiB)

# torch dtype -> Gluon dtype; str() of the Gluon dtype is the name kernel signatures use ("bf16", "fp8e4nv")
TORCH_TO_GL = {
    torch.float8_e4m3fn: gl.float8e4nv,
    torch.float8_e5m2: gl.float8e5,
    torch.bfloat16: gl.bfloat16,
    torch.float16: gl.float16,
    torch.float32: gl.float32,
}


class GluonUnsupported(NotImplementedError):
    """A Gluon wrapper called with valid input its kernel does not take (not an sm_90 GPU, a shape or
    layout outside its TMA or tile rules: its module's ``unsupported_reason``), before anything is
    allocated or launched. The heuristics (``heuristics.py``) never send such input, so this is a
    caller's mistake, not a choice. Wrong inputs raise ValueError / TypeError instead."""


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
