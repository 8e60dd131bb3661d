"""Grouped (mixture-of-experts) operations as a loop of a backend's dense ones: the definition of what the
grouped kernels compute, and the reference backend's implementation.

Every method reads the per-expert counts on the host (a device synchronisation where they live on a GPU)
and calls the backend's dense ``quantize_act`` / ``quantize_weight`` / ``gemm_*`` once per expert on that
expert's tokens, then arranges the results in the grouped layouts of ``grouped_tensor.py``.
"""

from __future__ import annotations

import torch

from ..grouped_tensor import GroupedFp8Tensor, GroupedFp8Weight
from .reference_fused import weight_rows


def _segments(layout):
    off = 0
    for c in layout.counts_list():
        yield off, c
        off += c


class DenseLoopGrouped:
    """Mixin for a ``Backend``: the grouped operations by looping its dense ones over the experts."""

    def quantize_act_grouped(self, x, layout, params, *, rowwise, columnwise, rows=None):
        if rows is not None:
            x = x.index_select(0, rows)
        parts = [self.quantize_act(x[o : o + c], params, rowwise=rowwise, columnwise=columnwise) for o, c in _segments(layout)]
        return GroupedFp8Tensor.from_experts(parts, layout, x.shape[1])

    def quantize_swiglu_act_grouped(self, h, layout, params, *, rowwise, columnwise, probs=None):
        parts = []
        for o, c in _segments(layout):
            act = self.swiglu_fwd(h[o : o + c])
            if probs is not None:
                act = weight_rows(act, probs[o : o + c])
            parts.append(self.quantize_act(act, params, rowwise=rowwise, columnwise=columnwise))
        return GroupedFp8Tensor.from_experts(parts, layout, h.shape[1] // 2)

    def quantize_weight_grouped(self, weights, params, out=None):
        value = GroupedFp8Weight.from_experts([self.quantize_weight(w.contiguous(), params) for w in weights])
        if out is None:
            return value
        for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
            getattr(out, name).copy_(getattr(value, name))
        return out

    def gemm_fwd_grouped(self, x, w, bias, out_dtype):
        y = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
        for e, (xe, (o, c)) in enumerate(zip(x.split(), _segments(x.layout))):
            y[o : o + c] = self.gemm_fwd(xe, w.expert(e), None if bias is None else bias[e], out_dtype)
        return y

    def gemm_dgrad_grouped(self, dy, w, out_dtype):
        dx = torch.empty(dy.shape[0], w.shape[1], dtype=out_dtype, device=dy.device)
        for e, (dye, (o, c)) in enumerate(zip(dy.split(), _segments(dy.layout))):
            dx[o : o + c] = self.gemm_dgrad(dye, w.expert(e), out_dtype)
        return dx

    def gemm_wgrad_grouped(self, dy, x, out_dtype, accumulate_into):
        pairs = list(zip(dy.split(), x.split()))
        if accumulate_into is None:
            n, k = dy.shape[1], x.shape[1]
            out = torch.empty(len(pairs), n, k, dtype=out_dtype, device=x.device)
            for e, (dye, xe) in enumerate(pairs):
                out[e] = self.gemm_wgrad(dye, xe, out_dtype, None)
            return list(out.unbind(0))
        for (dye, xe), acc in zip(pairs, accumulate_into):
            self.gemm_wgrad(dye, xe, torch.float32, acc)
        return list(accumulate_into)
