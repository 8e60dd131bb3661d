"""The two layouts of the FP8 linear core: one weight (``Dense``) or ``E`` experts' weights over permuted tokens
(``Grouped``). A layout owns what differs between them: which backend operations quantize the activations (plain or
SwiGLU of fc1's output) and the weights, run the three GEMMs and sum the bias gradients. The core (``core.py``) is
written once over this interface.

=====================  ======================================  =====================================================
                       ``Dense``                               ``Grouped(layout)``
=====================  ======================================  =====================================================
activations            ``BlockwiseFp8Tensor`` ``[M, K]``       ``GroupedFp8Tensor`` ``[T, K]`` (``grouped_tensor.py``)
weights                one ``[N, K]``, ``WeightCache``         ``E`` x ``[N, K]``, or one ``[E, N, K]`` (``stacked``);
                                                               ``GroupedWeightCache``
W^T for dgrad          held, or ``transpose_weight``           held, or ``transpose_weight_grouped``
bias gradient          ``dY`` summed over rows (torch's sum)   host counts: each expert's ``dY_e.sum(0)``; device counts:
                                                               each expert's rows summed in token order (``segment_sums``)
=====================  ======================================  =====================================================
"""

from __future__ import annotations

import operator

import torch

from ..backends import Backend
from ..grouped_tensor import GroupedFp8Tensor, GroupLayout
from ..recipe import QuantParams
from ..tensor import BlockwiseFp8Tensor


class Dense:
    """One weight ``[N, K]``: ``Y = X W^T (+ b)``."""

    grouped = False

    def quantize_act(self, backend: Backend, x2d: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool):
        return backend.quantize_act(x2d, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_grad(self, backend: Backend, dy2d: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool):
        return backend.quantize_act(dy2d, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_swiglu_act(self, backend: Backend, h2d, params: QuantParams, *, rowwise: bool, columnwise: bool, probs):
        if probs is not None:
            raise NotImplementedError("row-weighted SwiGLU (probs) has a grouped form only")
        return backend.quantize_swiglu_act(h2d, params, rowwise=rowwise, columnwise=columnwise)

    def out_features(self, weights) -> int:
        return weights[0].shape[0]

    def quantize_weights(self, backend: Backend, weights, params: QuantParams, cache, refresh: bool):
        if cache is not None:
            return cache.get(weights[0], params, backend, refresh=refresh)
        with torch.no_grad():
            return backend.quantize_weight(weights[0].detach().contiguous(), params)

    def with_transpose(self, backend: Backend, wq):
        """``wq`` with its W^T copy for dgrad: the one it holds, or an exact transpose of its W blocks made now."""
        return wq if wq.has_columnwise else backend.transpose_weight(wq)

    def gemm_fwd(self, backend: Backend, xq, wq, biases, out_dtype: torch.dtype) -> torch.Tensor:
        return backend.gemm_fwd(xq, wq, biases[0] if biases else None, out_dtype)

    def gemm_dgrad(self, backend: Backend, dyq, wq, out_dtype: torch.dtype) -> torch.Tensor:
        return backend.gemm_dgrad(dyq, wq, out_dtype)

    def gemm_wgrad(self, backend: Backend, dyq, xq, out_dtype: torch.dtype, accumulate_into) -> list[torch.Tensor]:
        return [backend.gemm_wgrad(dyq, xq, out_dtype, None if accumulate_into is None else accumulate_into[0])]

    def columnwise(self, shape, fp8_dtype, orig_dtype, data, scale_inv) -> BlockwiseFp8Tensor:
        """The saved columnwise copy of the activation as the operand wgrad reads."""
        return BlockwiseFp8Tensor(shape, 1, fp8_dtype, orig_dtype, columnwise_data=data, columnwise_scale_inv=scale_inv)

    def bias_grads(self, dy2d: torch.Tensor) -> list[torch.Tensor]:
        # TE's own bias gradient under Float8BlockScaling (unfused): a sum in dY's dtype, accumulated in fp32
        return [dy2d.sum(0)]


class Grouped:
    """``E`` experts' weights over permuted tokens (expert 0's rows first): ``Y_e = X_e W_e^T (+ b_e)``.

    ``rows`` (int64 ``[N]``, with the ``exchange.Permuted`` exchange): the permuted tokens are ``x[rows]`` of the
    token-ordered input, read through the permutation by the quantization; plain stage only. ``stacked``: the
    weights are one ``[E, N, K]`` tensor (the core's only weight input), whose gradient is one ``[E, N, K]`` tensor
    and whose ``main_grad`` is one ``[E, N, K]`` fp32 tensor."""

    grouped = True

    def __init__(self, layout: GroupLayout, rows: torch.Tensor | None = None, stacked: bool = False) -> None:
        self.layout, self.rows, self.stacked = layout, rows, stacked

    def out_features(self, weights) -> int:
        return weights[0].shape[-2]

    def quantize_act(self, backend: Backend, x2d: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool):
        return backend.quantize_act_grouped(x2d, self.layout, params, rowwise=rowwise, columnwise=columnwise,
                                            rows=self.rows)  # fmt: skip

    def quantize_grad(self, backend: Backend, dy2d: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool):
        """dY's copies: its rows are the output's, already in expert order."""
        return backend.quantize_act_grouped(dy2d, self.layout, params, rowwise=rowwise, columnwise=columnwise)

    def quantize_swiglu_act(self, backend: Backend, h2d, params: QuantParams, *, rowwise: bool, columnwise: bool, probs):
        if self.rows is not None:
            raise NotImplementedError("the SwiGLU stage reads permuted rows only: permute before it (fc1's output is)")
        return backend.quantize_swiglu_act_grouped(h2d, self.layout, params, rowwise=rowwise, columnwise=columnwise,
                                                   probs=probs)  # fmt: skip

    def quantize_weights(self, backend: Backend, weights, params: QuantParams, cache, refresh: bool):
        source = weights[0] if self.stacked else weights
        if cache is not None:
            return cache.get(source, params, backend, refresh=refresh)
        with torch.no_grad():
            if self.stacked:
                return backend.quantize_weight_grouped(source.detach().contiguous(), params)
            return backend.quantize_weight_grouped([w.detach().contiguous() for w in weights], params)

    def with_transpose(self, backend: Backend, wq):
        return wq if wq.has_columnwise else backend.transpose_weight_grouped(wq)

    def gemm_fwd(self, backend: Backend, xq, wq, biases, out_dtype: torch.dtype) -> torch.Tensor:
        bias = torch.stack(biases) if biases else None  # one C-level call (grad mode is off in the op's forward)
        return backend.gemm_fwd_grouped(xq, wq, bias, out_dtype)

    def gemm_dgrad(self, backend: Backend, dyq, wq, out_dtype: torch.dtype) -> torch.Tensor:
        return backend.gemm_dgrad_grouped(dyq, wq, out_dtype)

    def gemm_wgrad(self, backend: Backend, dyq, xq, out_dtype: torch.dtype, accumulate_into) -> list[torch.Tensor]:
        """One gradient per weight input: ``E`` ``[N, K]`` tensors, or (``stacked``) one ``[E, N, K]``; with
        ``accumulate_into`` (one ``main_grad`` per weight input) added into those in place."""
        if not self.stacked:
            return backend.gemm_wgrad_grouped(dyq, xq, out_dtype, accumulate_into)
        if accumulate_into is not None:
            backend.gemm_wgrad_grouped(dyq, xq, out_dtype, list(accumulate_into[0].unbind(0)))
            return list(accumulate_into)
        return [stack_experts(backend.gemm_wgrad_grouped(dyq, xq, out_dtype, None))]

    def columnwise(self, shape, fp8_dtype, orig_dtype, data, scale_inv) -> GroupedFp8Tensor:
        return GroupedFp8Tensor(self.layout, shape, fp8_dtype, orig_dtype, columnwise_data=data, columnwise_scale_inv=scale_inv)

    def bias_grads(self, dy2d: torch.Tensor) -> list[torch.Tensor]:
        """Each expert's rows of dY summed. Counts given on the host: the dense layer's (and TE's) rule,
        ``dY_e.sum(0)`` per expert, bit for bit (the counts need no synchronisation; a call per expert, only where
        biases train). Counts on the device: ``segment_sums``, without a host synchronisation."""
        counts = self.layout.host_counts
        if counts is not None:
            return [part.sum(0) for part in torch.split(dy2d, counts)]
        return list(segment_sums(dy2d, self.layout).unbind(0))


_untyped_storage = operator.methodcaller("untyped_storage")


def stack_experts(views: list[torch.Tensor]) -> torch.Tensor:
    """``E`` ``[N, K]`` results as one ``[E, N, K]`` tensor: the buffer they are consecutive slices of (the backends
    return their grouped wgrad so, ``Backend.gemm_wgrad_grouped``), else a stacked copy."""
    first = views[0]
    n, k = first.shape
    offset = first.storage_offset()
    # C-level passes over the experts (no Python call per expert, as everywhere in the core)
    consecutive = (
        set(map(torch.UntypedStorage.data_ptr, map(_untyped_storage, views))) == {first.untyped_storage().data_ptr()}
        and list(map(torch.Tensor.storage_offset, views)) == list(range(offset, offset + len(views) * n * k, n * k))
        and all(map(torch.Tensor.is_contiguous, views))
    )
    if not consecutive:
        return torch.stack(views)
    return first.as_strided((len(views), n, k), (n * k, k, 1), offset)


def segment_sums(dy2d: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """``[E, N]`` in dY's dtype: row ``e`` is the sum of expert ``e``'s rows of ``dy2d [T, N]`` (0 for an expert
    without tokens), on the device, without a host synchronisation and without a call per expert.

    Rounding rule (``docs/NUMERICS.md``): the rows are added one after another in token order in fp32, starting from
    0, and the sum is rounded once to dY's dtype (``torch.segment_reduce`` over fp32 rows at the layout's device
    offsets: one thread per expert and column walks the rows in order, on every device). torch's ``dY_e.sum(0)``
    (the dense layer's rule, TE's) also accumulates in fp32 and rounds once, in another order: the two differ
    by the fp32 rounding of the two orders, which the final rounding to bf16 or fp16 mostly hides."""
    return torch.segment_reduce(dy2d.float(), "sum", offsets=layout.offsets, axis=0, unsafe=True).to(dy2d.dtype)
