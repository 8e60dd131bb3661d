"""The cuBLAS backend: blockwise FP8 GEMMs through ``torch.nn.functional.scaled_mm`` (cuBLASLt >= 12.9,
NVIDIA Hopper only), with the Triton quantization kernels.

cuBLAS layout rules (docs/NUMERICS.md, "Scale layouts"), satisfied without copies by TE's layouts where possible:
* A [M, K] row-major with 1x128 scales as an ``[M, K/128]`` view of strides ``(1, M)``;
* B [K, N] column-major (our K-major copy, transposed view);
* 128x128 scales of B as ``[pad4(K/128), N/128]`` with strides ``(1, pad4(K/128))``: the K-block
  dim **padded to a multiple of 4** (torch 2.11 checks the padded shape when K/128 is odd; an
  unpadded contiguous tensor is silently wrong: relative errors up to 1e17 with K/128 odd). TE's 2D layout is exactly that;
* both operands E4M3 (cuBLAS blockwise has no E5M2: HYBRID gradients go to the Triton GEMM);
* 1x128 scales of B (wgrad) as ``[N, K/128]`` with strides ``(1, N)``.

cuBLAS FP8 also needs 16-byte aligned leading dimensions: where a GEMM's contraction or row
length is not a multiple of 16 (e.g. wgrad with M % 16 != 0, which TE refuses), this backend uses
the Triton GEMM for that call instead.
"""

from __future__ import annotations

import torch

from .base import Availability, Backend, fused_ops_from_triton
from .triton import TritonBackend, device_availability


def _scale_1x128(te_scale: torch.Tensor, rows: int) -> torch.Tensor:
    """TE 1D layout [KB, pad4(rows)] -> cuBLAS [rows, KB] with strides (1, rows): a view (rows % 16 == 0)."""
    assert te_scale.shape[1] == rows
    return te_scale.t()


def _scale_128x128(te_scale: torch.Tensor) -> torch.Tensor:
    """TE 2D layout [NB, pad4(KB)] -> cuBLAS [pad4(KB), NB] with strides (1, pad4(KB)): a view."""
    return te_scale.t()


def add_bias_rounding_once(y: torch.Tensor, bias: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(y + bias)`` for an fp32 ``y`` [M, N], rounded once to ``out_dtype``: one kernel that adds in
    fp32 and writes ``out_dtype`` (the same bits as ``y.add_(bias).to(out_dtype)``, without the
    second pass over the fp32 tensor)."""
    if out_dtype == torch.float32:
        return y.add_(bias)
    return torch.add(y, bias, out=torch.empty(y.shape, dtype=out_dtype, device=y.device))


def _cublas_can(a, b, *dims: int) -> bool:
    """cuBLAS blockwise needs E4M3 operands and 16-byte aligned leading dims."""
    e4m3 = a.fp8_dtype == torch.float8_e4m3fn and b.fp8_dtype == torch.float8_e4m3fn
    return e4m3 and all(d % 16 == 0 for d in dims) and min(dims) > 0


@fused_ops_from_triton
class CublasBackend(Backend):
    """cuBLAS blockwise GEMMs (Hopper) + Triton quantization.

    Holds the ``triton`` backend it delegates to: its quantizers, and its GEMMs for the calls cuBLAS
    cannot take (E5M2 operands, dims that are not multiples of 16).
    """

    name = "cublas"

    def __init__(self, triton: TritonBackend | None = None) -> None:
        self.triton = triton or TritonBackend()

    def availability(self, device):
        base = device_availability(device)
        if not base:
            return base
        if device.type != "cuda" or torch.version.hip:
            return Availability(False, "cuBLAS blockwise FP8 exists on NVIDIA GPUs only")
        major, minor = torch.cuda.get_device_capability(device)
        if major != 9:
            return Availability(
                False, f"cuBLAS blockwise FP8 (1x128/128x128) runs on Hopper (sm_90) only; this is sm_{major}{minor}"
            )
        if not hasattr(torch.nn.functional, "scaled_mm"):
            return Availability(False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm (need >= 2.9)")
        return Availability(True)

    def quantize_act(self, x, params, *, rowwise, columnwise):
        return self.triton.quantize_act(x, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_weight(self, w, params):
        return self.triton.quantize_weight(w, params)

    @staticmethod
    def _mm(a, a_scale, b_kmajor, b_scale, b_recipe, out_dtype):
        F = torch.nn.functional
        return F.scaled_mm(a, b_kmajor.t(), a_scale, F.ScalingType.BlockWise1x128, b_scale, b_recipe, output_dtype=out_dtype)

    def gemm_fwd(self, x, w, bias, out_dtype):
        m, k = x.shape
        n = w.shape[0]
        if not _cublas_can(x, w, m, k, n):
            return self.triton.gemm_fwd(x, w, bias, out_dtype)
        F = torch.nn.functional
        # With a bias, add it to the fp32 result before the one rounding to out_dtype, as TE's
        # epilogue does (adding it to a bf16 output rounds twice: 2.9e-3 from TE's outputs).
        y = self._mm(
            x.rowwise_data, _scale_1x128(x.rowwise_scale_inv, m),
            w.rowwise_data, _scale_128x128(w.rowwise_scale_inv), F.ScalingType.BlockWise128x128,
            out_dtype if bias is None else torch.float32,
        )  # fmt: skip
        return y if bias is None else add_bias_rounding_once(y, bias, out_dtype)

    def gemm_dgrad(self, dy, w, out_dtype):
        m, n = dy.shape
        k = w.shape[1]
        if not _cublas_can(dy, w, m, k, n):
            return self.triton.gemm_dgrad(dy, w, out_dtype)
        F = torch.nn.functional
        return self._mm(
            dy.rowwise_data, _scale_1x128(dy.rowwise_scale_inv, m),
            w.columnwise_data, _scale_128x128(w.columnwise_scale_inv), F.ScalingType.BlockWise128x128, out_dtype,
        )  # fmt: skip

    def gemm_wgrad(self, dy, x, out_dtype, accumulate_into):
        m, n = dy.shape
        k = x.shape[1]
        if not _cublas_can(dy, x, m, n, k):
            return self.triton.gemm_wgrad(dy, x, out_dtype, accumulate_into)
        F = torch.nn.functional
        dw = self._mm(
            dy.columnwise_data, _scale_1x128(dy.columnwise_scale_inv, n),
            x.columnwise_data, _scale_1x128(x.columnwise_scale_inv, k), F.ScalingType.BlockWise1x128,
            torch.float32 if accumulate_into is not None else out_dtype,
        )  # fmt: skip
        if accumulate_into is not None:
            return accumulate_into.add_(dw)
        return dw
