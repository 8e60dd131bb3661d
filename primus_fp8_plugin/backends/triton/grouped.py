"""The Triton backend's grouped (mixture-of-experts) operations: one launch per operation for all experts
(``quantize_grouped.py``, ``gemm_grouped.py``); portable Triton on every device the backend runs on."""

from __future__ import annotations

from .gemm_grouped import grouped_gemm, grouped_wgrad
from .quantize_grouped import quantize_128x128_batched, quantize_grouped_1x128


class TritonGrouped:
    """Mixin for a ``Backend``: the five grouped operations on the Triton grouped kernels."""

    def quantize_act_grouped(self, x, layout, params, *, rowwise, columnwise):
        return quantize_grouped_1x128(x, layout, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_weight_grouped(self, weights, params, out=None):
        return quantize_128x128_batched(weights, params, out)

    def gemm_fwd_grouped(self, x, w, bias, out_dtype):
        return grouped_gemm(x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv, x.layout,
                            out_dtype=out_dtype, bias=bias)  # fmt: skip

    def gemm_dgrad_grouped(self, dy, w, out_dtype):
        return grouped_gemm(dy.rowwise_data, dy.rowwise_scale_inv, w.columnwise_data, w.columnwise_scale_inv, dy.layout,
                            out_dtype=out_dtype)  # fmt: skip

    def gemm_wgrad_grouped(self, dy, x, out_dtype, accumulate_into):
        return grouped_wgrad(dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data, x.columnwise_scale_inv,
                             x.layout, out_dtype=out_dtype, accumulate_into=accumulate_into)  # fmt: skip
