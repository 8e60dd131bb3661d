"""The FlyDSL backend for AMD MI355X (gfx950): FlyDSL blockwise GEMMs on the FP8 MFMA (``kernels/gfx950/``),
with the Triton quantization kernels (also compiled for gfx950). Verified by compilation only (docs/AMD.md).

A composition: ``kernels/gfx950/heuristics.py`` names the kernel of each call. An E4M3 weight [N, K] with
N, K multiples of 128 is quantized straight into FlyDSL's (16, 16) preshuffled layout (W and W^T, one
pass: ``kernels/triton/quantize_weight_preshuffle.py``); fprop and dgrad read it with the LDS-staged
kernels (``gemm_lds.py``). Other weights stay K-major and use the direct-load kernel (``gemm.py``) or the
portable Triton GEMM. A preshuffled weight meeting an E5M2 gradient (HYBRID dgrad) is unshuffled for the
portable GEMM (correct, not fast), as is a preshuffled weight held without W^T, whose W^T is made K-major on demand.
"""

from __future__ import annotations

import torch

from ..kernels.gfx950 import gemm_lds
from ..kernels.gfx950 import heuristics as gfx950
from ..kernels.gfx950.gemm import blockwise_gemm as direct_gemm
from ..kernels.triton.gemm import blockwise_gemm as portable_gemm
from ..kernels.triton.quantize_weight_preshuffle import quantize_128x128_preshuffled
from ..preshuffle import PRESHUFFLE16
from .base import Availability, Backend, fused_ops_from_triton
from .triton import TritonBackend, device_availability


def direct_or_portable_gemm(a, a_scale_inv, b, b_scale_inv, **kwargs) -> torch.Tensor:
    """The portable ``blockwise_gemm``'s contract on K-major operands: the FlyDSL direct-load kernel where the
    gfx950 heuristics pick it, else the portable Triton GEMM."""
    gemm = direct_gemm if gfx950.direct_gemm(a, b) else portable_gemm
    return gemm(a, a_scale_inv, b, b_scale_inv, **kwargs)


@fused_ops_from_triton
class FlydslBackend(Backend):
    """FlyDSL GEMMs (where the gfx950 heuristics pick them; the rest go to the Triton GEMM) + Triton quantizers.

    Holds a ``triton`` backend built with ``direct_or_portable_gemm`` (the Triton GEMM's contract): its
    quantizers run as they are, its GEMM methods call the FlyDSL direct-load kernel where it applies.
    """

    name = "flydsl"

    def __init__(self) -> None:
        self.triton = TritonBackend(blockwise_gemm=direct_or_portable_gemm)

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
        if gfx950.preshuffled_weight(w, params):
            return quantize_128x128_preshuffled(w, params)
        return self.triton.quantize_weight(w, params)

    def transpose_weight(self, w):
        # a preshuffled W: its W^T made K-major (dgrad then runs the portable GEMM: correct, not fast)
        return self.triton.transpose_weight(w.k_major().rowwise_only())

    def gemm_fwd(self, x, w, bias, out_dtype):
        if w.layout != PRESHUFFLE16:
            return self.triton.gemm_fwd(x, w, bias, out_dtype)
        cfg = gfx950.lds_fwd(x, w)
        if cfg is None:
            return self.triton.gemm_fwd(x, w.k_major(), bias, out_dtype)
        return gemm_lds.blockwise_gemm_lds(x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv,
                                           cfg=cfg, out_dtype=out_dtype, bias=bias)  # fmt: skip

    def gemm_dgrad(self, dy, w, out_dtype):
        if w.layout != PRESHUFFLE16:
            return self.triton.gemm_dgrad(dy, w, out_dtype)
        wt, wt_scale, n_valid, padded = gemm_lds.dgrad_operands(w)  # W^T, padded to 256-multiple rows if stored so
        cfg = gfx950.lds_dgrad(dy, w.shape[1], padded)
        if cfg is None:
            return self.triton.gemm_dgrad(dy, w.k_major(), out_dtype)
        return gemm_lds.blockwise_gemm_lds(dy.rowwise_data, dy.rowwise_scale_inv, wt, wt_scale, cfg=cfg,
                                           out_dtype=out_dtype, n_valid=n_valid)  # fmt: skip

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        cfg = gfx950.lds_wgrad(dy, x)
        if cfg is None:
            return self.triton.gemm_wgrad(dy, x, out_dtype, accumulate_into)
        return gemm_lds.blockwise_gemm_lds(dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data,
                                           x.columnwise_scale_inv, cfg=cfg, out_dtype=out_dtype,
                                           accumulate_into=accumulate_into)  # fmt: skip
