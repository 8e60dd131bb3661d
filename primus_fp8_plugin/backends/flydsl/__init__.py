"""The FlyDSL backend for AMD MI355X (gfx950): FlyDSL blockwise GEMMs on the FP8 MFMA, with the
Triton quantization kernels (also compiled for gfx950). Verified by compilation only (docs/AMD.md).
"""

from __future__ import annotations

import torch

from ..base import Availability
from ..triton import TritonBackend, device_availability
from .gemm import blockwise_gemm


class FlydslBackend(TritonBackend):
    """FlyDSL GEMMs (tile-aligned E4M3 shapes; the rest go to the Triton GEMM) + Triton quantizers."""

    name = "flydsl"
    _blockwise_gemm = staticmethod(blockwise_gemm)

    def availability(self, device):
        if device.type != "cuda" or not torch.version.hip:
            return Availability(False, "FlyDSL kernels run on AMD GPUs (ROCm) only; this device is not one")
        base = device_availability(device)  # gfx950 check and the Triton quantizers
        if not base:
            return base
        try:
            import flydsl  # noqa: F401
        except ImportError as err:
            return Availability(False, f"flydsl is not importable ({err}); pip install 'flydsl>=0.5'")
        return Availability(True)
