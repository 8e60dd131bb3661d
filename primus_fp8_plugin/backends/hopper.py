"""The ``hopper`` backend: on NVIDIA Hopper, each GEMM by the kernel that measured faster for it.

Measured on one H200 under sustained load (each kernel run back to back at the card's 700 W power
limit, as in training; docs/PERFORMANCE.md, 2026-12-01, sixth session):

* fwd and dgrad: the Gluon kernel (``triton`` backend), 1.01-1.07x cuBLAS blockwise;
* wgrad into a bf16/fp16 ``weight.grad``: cuBLAS blockwise (``cublas`` backend), which the Gluon
  kernel reaches only to 0.94-0.97x;
* wgrad accumulated into an fp32 ``main_grad`` (Megatron's gradient-accumulation fusion): the Gluon
  kernel, which adds into ``main_grad`` in its epilogue, where cuBLAS writes an fp32 product that a
  second pass adds (``CublasBackend.gemm_wgrad``).

Quantization: the Triton/Gluon kernels, as in the ``triton`` and ``cublas`` backends. Inputs cuBLAS
cannot take (E5M2 operands, unaligned dims) go to the Triton GEMM, as in the ``cublas`` backend.
Numerics: fwd and dgrad are bit-identical to cuBLAS's (docs/PERFORMANCE.md), plain wgrad is cuBLAS's;
the accumulating wgrad is the Gluon kernel's, whose 1x128 x 1x128 product differs from cuBLAS's in
summation order (~1e-7 relative in fp32, within the recipe's tolerance; not bit-identical).
"""

from __future__ import annotations

from .cublas import CublasBackend
from .triton import TritonBackend


class HopperBackend(CublasBackend):
    """Gluon GEMMs for fwd, dgrad and accumulating wgrad; cuBLAS for plain wgrad (Hopper only)."""

    name = "hopper"

    def gemm_fwd(self, x, w, bias, out_dtype):
        return TritonBackend.gemm_fwd(self, x, w, bias, out_dtype)

    def gemm_dgrad(self, dy, w, out_dtype):
        return TritonBackend.gemm_dgrad(self, dy, w, out_dtype)

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        if accumulate_into is not None:
            return TritonBackend.gemm_wgrad(self, dy, x, out_dtype, accumulate_into)
        return CublasBackend.gemm_wgrad(self, dy, x, out_dtype, accumulate_into)
