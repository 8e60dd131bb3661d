"""The FlyDSL backend for AMD MI355X (gfx950): FlyDSL blockwise GEMMs on the FP8 MFMA, with the
Triton quantization kernels (also compiled for gfx950). Verified by compilation only (docs/AMD.md).
"""

from __future__ import annotations

import torch

from ..base import Availability, Backend, fused_ops_from_triton
from ..triton import TritonBackend, device_availability
from .gemm import blockwise_gemm


@fused_ops_from_triton
class FlydslBackend(Backend):
    """FlyDSL GEMMs (tile-aligned E4M3 shapes; the rest go to the Triton GEMM) + Triton quantizers.

    Holds a ``triton`` backend built with the FlyDSL GEMM (``flydsl/gemm.py``, the Triton GEMM's
    contract): its quantizers run as they are, its GEMM methods call the FlyDSL kernel.
    """

    name = "flydsl"

    def __init__(self) -> None:
        self.triton = TritonBackend(blockwise_gemm=blockwise_gemm)

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

    def quantize_act(self, x, params, *, rowwise, columnwise):
        return self.triton.quantize_act(x, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_weight(self, w, params):
        return self.triton.quantize_weight(w, params)

    def gemm_fwd(self, x, w, bias, out_dtype):
        return self.triton.gemm_fwd(x, w, bias, out_dtype)

    def gemm_dgrad(self, dy, w, out_dtype):
        return self.triton.gemm_dgrad(dy, w, out_dtype)

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        return self.triton.gemm_wgrad(dy, x, out_dtype, accumulate_into)
