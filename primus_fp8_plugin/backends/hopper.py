"""The ``hopper`` backend: on NVIDIA Hopper, each GEMM by the kernel that is faster for it, as measured
sustained on the H200 (each kernel run back to back at the card's power limit, as in training;
docs/PERFORMANCE.md): fwd and dgrad by the Gluon kernel (``triton`` backend); wgrad by the kernel
``kernels/sm90/heuristics.wgrad_by_cublas`` names: cuBLAS blockwise (``cublas`` backend) into a bf16/fp16
``weight.grad``, the Gluon kernel into an fp32 ``main_grad`` (Megatron's gradient-accumulation fusion).

Quantization: the Triton/Gluon kernels, as in the ``triton`` and ``cublas`` backends. Inputs cuBLAS
cannot take (E5M2 operands, unaligned dims) go to the Triton GEMM, as in the ``cublas`` backend.
Numerics: fwd and dgrad are bit-identical to cuBLAS's, plain wgrad is cuBLAS's; the accumulating
wgrad is the Gluon kernel's, whose 1x128 x 1x128 product differs from cuBLAS's in summation order
(~1e-7 relative in fp32, within the recipe's tolerance; not bit-identical).
"""

from __future__ import annotations

from ..kernels.sm90.heuristics import wgrad_by_cublas
from .base import Backend, fused_ops_from_triton
from .cublas import CublasBackend
from .triton import TritonBackend


@fused_ops_from_triton
class HopperBackend(Backend):
    """Gluon GEMMs for fwd, dgrad and accumulating wgrad; cuBLAS for plain wgrad (Hopper only).

    Holds the two backends it delegates to (``triton``, ``cublas``); available where ``cublas`` is.
    """

    name = "hopper"

    def __init__(self, triton: TritonBackend | None = None, cublas: CublasBackend | None = None) -> None:
        self.triton = triton or TritonBackend()
        self.cublas = cublas or CublasBackend(self.triton)

    def availability(self, device):
        return self.cublas.availability(device)

    def quantize_act(self, x, params, *, rowwise, columnwise):
        return self.triton.quantize_act(x, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_weight(self, w, params):
        return self.triton.quantize_weight(w, params)

    def gemm_fwd(self, x, w, bias, out_dtype):
        return self.triton.gemm_fwd(x, w, bias, out_dtype)

    def gemm_dgrad(self, dy, w, out_dtype):
        return self.triton.gemm_dgrad(dy, w, out_dtype)

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        backend = self.cublas if wgrad_by_cublas(accumulate_into is not None) else self.triton
        return backend.gemm_wgrad(dy, x, out_dtype, accumulate_into)
