"""The FlyDSL backend for AMD MI355X (gfx950): FlyDSL blockwise GEMMs on the FP8 MFMA, with the
Triton quantization kernels (also compiled for gfx950). Verified by compilation only (docs/AMD.md).
"""

from __future__ import annotations

import torch

from ..base import Availability
from ..triton import TritonBackend, device_availability
from .gemm import blockwise_gemm


class FlydslBackend(TritonBackend):
    name = "flydsl"

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

    def gemm_fwd(self, x, w, bias, out_dtype):
        return blockwise_gemm(x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv,
                              b_block_dim=2, out_dtype=out_dtype, bias=bias)  # fmt: skip

    def gemm_dgrad(self, dy, w, out_dtype):
        return blockwise_gemm(dy.rowwise_data, dy.rowwise_scale_inv, w.columnwise_data, w.columnwise_scale_inv,
                              b_block_dim=2, out_dtype=out_dtype)  # fmt: skip

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        return blockwise_gemm(dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data, x.columnwise_scale_inv,
                              b_block_dim=1, out_dtype=out_dtype, accumulate_into=accumulate_into)  # fmt: skip
