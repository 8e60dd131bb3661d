"""The Triton backend's grouped (mixture-of-experts) operations: one launch per operation for all experts
(``quantize_grouped.py``; GEMMs: ``gemm_grouped_gluon.py`` on Hopper where ``grouped_heuristics`` picks it,
else the portable ``gemm_grouped.py``: the same bits either way), except the weight quantization of a few
experts on Hopper, one dense Gluon launch per expert (``quantize_grouped_gluon.py``; same bits)."""

from __future__ import annotations

import torch

from ..kernels.sm90.gemm_grouped import grouped_gemm_gluon, grouped_wgrad_gluon
from ..kernels.sm90.heuristics import use_gluon, weight_quant_per_expert
from ..kernels.sm90.quantize_grouped import quantize_128x128_per_expert_gluon
from ..kernels.sm90.target import GluonUnsupported
from ..kernels.triton.gemm_grouped import grouped_gemm, grouped_wgrad
from ..kernels.triton.quantize_grouped import quantize_128x128_batched, quantize_grouped_1x128


def _gemm(op, a, a_s, b, b_s, layout, out_dtype, bias=None):
    if use_gluon(a.device, op, out_dtype, (b.shape[1], b.shape[2])):
        try:
            return grouped_gemm_gluon(a, a_s, b, b_s, layout, out_dtype=out_dtype, bias=bias)
        except GluonUnsupported:
            pass
    return grouped_gemm(a, a_s, b, b_s, layout, out_dtype=out_dtype, bias=bias)


class TritonGrouped:
    """Mixin for a ``Backend``: the five grouped operations on the Triton grouped kernels."""

    def quantize_act_grouped(self, x, layout, params, *, rowwise, columnwise):
        return quantize_grouped_1x128(x, layout, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_weight_grouped(self, weights, params, out=None):
        e = weights.shape[0] if isinstance(weights, torch.Tensor) else len(weights)
        if weight_quant_per_expert(weights[0].device, e):
            try:
                return quantize_128x128_per_expert_gluon(weights, params, out)
            except GluonUnsupported:  # raised before any launch
                pass
        return quantize_128x128_batched(weights, params, out)

    def gemm_fwd_grouped(self, x, w, bias, out_dtype):
        return _gemm("fwd", x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv, x.layout,
                     out_dtype, bias)  # fmt: skip

    def gemm_dgrad_grouped(self, dy, w, out_dtype):
        return _gemm("dgrad", dy.rowwise_data, dy.rowwise_scale_inv, w.columnwise_data, w.columnwise_scale_inv,
                     dy.layout, out_dtype)  # fmt: skip

    def gemm_wgrad_grouped(self, dy, x, out_dtype, accumulate_into):
        args = (dy.columnwise_data, dy.columnwise_scale_inv, x.columnwise_data, x.columnwise_scale_inv, x.layout)
        m, n = dy.columnwise_data.shape[0], x.columnwise_data.shape[0]
        if use_gluon(dy.columnwise_data.device, "wgrad", out_dtype, (m, n), accumulate_into is not None):
            try:
                return grouped_wgrad_gluon(*args, out_dtype=out_dtype, accumulate_into=accumulate_into)
            except GluonUnsupported:
                pass
        return grouped_wgrad(*args, out_dtype=out_dtype, accumulate_into=accumulate_into)
