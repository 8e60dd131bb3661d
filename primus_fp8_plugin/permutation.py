"""An MoE layer's token permutation fused with the kernels around it: tokens go from the routing map straight into
the grouped FP8 layout (no permuted bf16 copy), and the experts' outputs come back in token order weighted by the
routing probabilities in one pass.

* ``route(routing_map, num_out_tokens)``: the permutation of Megatron's argsort-based ``permute`` (expert-major,
  each expert's tokens in token order; ``num_out_tokens`` rows, a host int such as tokens x top-k for dropless
  routing, so nothing is read on the host), the experts' ``GroupLayout`` (counts from the map, on the device) and
  each token's rows (the combine reads a token's top-k rows, not a row per expert);
* ``permute_quantize(x, routing, params)``: the grouped quantization (rowwise and padded columnwise copies) of
  ``x[routing.sorted_indices]``, reading ``x`` through the permutation (``backend.quantize_act_grouped(rows=)``);
  the same bits as Megatron's ``permute`` followed by ``quantize_act_grouped``;
* ``permute(x, routing)`` (differentiable): the permuted bf16 copy, where rows must exist (sent to other ranks);
  its backward is the sum ``unpermute`` makes;
* ``permute_probs(probs, routing)``: the routing probabilities ``[T, E]`` in permuted order ``[N]``;
* ``unpermute(y, routing, probs=)`` (differentiable): token ``t``'s output is the sum of its rows of ``y``, each
  times its probability (rounded to the product's dtype), added in fp32 in the rows' order, rounded once to the
  product's dtype and cast to y's dtype: Megatron's ``unpermute`` bit for bit where torch sums each output so (the
  CPU; a GPU under ``torch.use_deterministic_algorithms``, where it uses ``index_add_``;
  ``kernels/triton/permute.py``); its backward is the gather autograd gives. The same sum without probabilities is
  the permutation's backward (``ops/exchange.Permuted``): deterministic on a GPU, no atomics.

Tested as operations against Megatron's ``permute`` / ``unpermute`` (``tests/test_moe_permutation.py``); the grouped
FP8 linear reads routed tokens with a ``Routing`` (``ops.fp8_grouped_linear``); ``megatron/moe.py`` routes a
Megatron MoE layer's tokens this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import Backend, get_backend
from .backends.reference_fused import ROW_WEIGHT_DTYPES
from .grouped_tensor import GroupedFp8Tensor, GroupLayout, group_layout
from .recipe import QuantParams


@dataclass(frozen=True, eq=False)
class Routing:
    """Where each token's copies go: ``sorted_indices [N]`` (int64, the token of each permuted row), ``flat [N]``
    (int64, ``e * T + t`` of each row), ``token_rows [N]`` (int32, the permuted rows grouped by token, each token's
    in increasing order: token ``t``'s are ``token_rows[token_offsets[t] : token_offsets[t + 1]]``),
    ``token_offsets [T + 1]`` (int32), ``layout`` (the experts' counts and offsets, on the device), ``num_tokens``
    ``T``."""

    sorted_indices: torch.Tensor
    flat: torch.Tensor
    token_rows: torch.Tensor
    token_offsets: torch.Tensor
    layout: GroupLayout
    num_tokens: int

    def rows_sum(self, y: torch.Tensor, probs: torch.Tensor | None, backend: Backend) -> torch.Tensor:
        """``[T, H]``: token ``t`` the sum of its rows of ``y [N, H]`` (times ``probs [N]`` where given), in fp32 in
        row order, rounded once (``Backend.unpermute``)."""
        return backend.unpermute(y, self.sorted_indices, self.token_rows, self.token_offsets, probs)


def route(routing_map: torch.Tensor, num_out_tokens: int) -> Routing:
    """The permutation of ``routing_map [T, E]`` (bool or 0/1) into ``num_out_tokens`` rows, as Megatron's
    argsort-based ``permute`` orders them; no host synchronisation."""
    if routing_map.dim() != 2:
        raise ValueError(f"routing_map must be [tokens, experts], got shape {tuple(routing_map.shape)}")
    t, e = routing_map.shape
    by_expert = routing_map.bool().T.contiguous()
    flat = by_expert.reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    tokens = flat % t
    by_token = tokens.argsort(stable=True)  # stable: each token's rows stay in increasing order
    bounds = torch.arange(t + 1, device=routing_map.device)
    token_offsets = torch.searchsorted(tokens[by_token], bounds, out_int32=True)
    layout = group_layout(by_expert.sum(1), int(num_out_tokens), routing_map.device)
    return Routing(tokens, flat, by_token.to(torch.int32), token_offsets, layout, t)


def permute_quantize(x: torch.Tensor, routing: Routing, params: QuantParams, *, rowwise: bool = True,
                     columnwise: bool = True, backend: str | Backend = "auto") -> GroupedFp8Tensor:  # fmt: skip
    """The grouped FP8 copies of the permuted tokens ``x[routing.sorted_indices]`` (``x [T, K]``), read through the
    permutation."""
    if x.dim() != 2 or x.shape[0] != routing.num_tokens:
        raise ValueError(f"x must be [{routing.num_tokens}, K] (the tokens the routing map routes), got {tuple(x.shape)}")
    impl = backend if isinstance(backend, Backend) else get_backend(backend, x.device)
    return impl.quantize_act_grouped(x.contiguous(), routing.layout, params, rowwise=rowwise, columnwise=columnwise,
                                     rows=routing.sorted_indices)  # fmt: skip


def permute(x: torch.Tensor, routing: Routing, *, backend: str | Backend = "auto") -> torch.Tensor:
    """The permuted copy ``x[routing.sorted_indices]`` ``[N, H]`` of the tokens ``x [T, H]``, where the rows must exist
    (to be sent to other ranks). Differentiable: each token's gradient is the sum of its rows' in fp32 in row order,
    rounded once (``Routing.rows_sum``; the sum ``ops/exchange.Permuted`` makes)."""
    if x.dim() != 2 or x.shape[0] != routing.num_tokens:
        raise ValueError(f"x must be [{routing.num_tokens}, H] (the tokens the routing map routes), got {tuple(x.shape)}")
    impl = backend if isinstance(backend, Backend) else get_backend(backend, x.device)
    return _TokenRowsFn.apply(x, None, routing, impl, True)


def permute_probs(probs: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``probs [T, E]`` in permuted order ``[N]`` (differentiable)."""
    return probs.T.contiguous().reshape(-1)[routing.flat]


class _TokenRowsFn(torch.autograd.Function):
    """The permutation's two directions, each the other's gradient: ``gather`` (``permute``): ``t [T, H]`` ->
    ``t[sorted_indices]`` ``[N, H]``; otherwise (``unpermute``): ``t [N, H]`` -> each token's rows (times ``probs``)
    summed in fp32 in row order (``Routing.rows_sum``)."""

    @staticmethod
    def forward(ctx, t, probs, routing, backend, gather):
        ctx.routing, ctx.backend, ctx.gather, ctx.t_dtype = routing, backend, gather, t.dtype
        if gather:
            return t.index_select(0, routing.sorted_indices)
        ctx.save_for_backward(*((t, probs) if probs is not None else ()))  # without probs dY needs no y
        return routing.rows_sum(t, probs, backend)

    @staticmethod
    def backward(ctx, grad):
        if ctx.gather:
            return ctx.routing.rows_sum(grad.contiguous(), None, ctx.backend), None, None, None, None
        if not ctx.saved_tensors:
            return grad.to(ctx.t_dtype).index_select(0, ctx.routing.sorted_indices), None, None, None, None
        y, probs = ctx.saved_tensors
        rows = grad.to(torch.promote_types(y.dtype, probs.dtype)).index_select(0, ctx.routing.sorted_indices)
        dy = (rows * probs.unsqueeze(-1)).to(y.dtype) if ctx.needs_input_grad[0] else None
        dprobs = (rows * y).sum(-1, keepdim=True).to(probs.dtype).view(probs.shape) if ctx.needs_input_grad[1] else None
        return dy, dprobs, None, None, None


def unpermute(y: torch.Tensor, routing: Routing, *, probs: torch.Tensor | None = None,
              backend: str | Backend = "auto") -> torch.Tensor:  # fmt: skip
    """``[T, H]``: token ``t`` the sum of its permuted rows of ``y [N, H]``, each times its ``probs [N]`` entry (fp32,
    bf16 or fp16) where given (module docstring)."""
    n = routing.sorted_indices.numel()
    if y.dim() != 2 or y.shape[0] != n:
        raise ValueError(f"y must be [{n}, H] (the permuted rows), got {tuple(y.shape)}")
    if probs is not None and (probs.shape != (n,) or probs.dtype not in ROW_WEIGHT_DTYPES):
        raise ValueError(f"probs must be [{n}] in one of {ROW_WEIGHT_DTYPES}, got {probs.dtype} {tuple(probs.shape)}")
    impl = backend if isinstance(backend, Backend) else get_backend(backend, y.device)
    return _TokenRowsFn.apply(y.contiguous(), probs, routing, impl, False)
