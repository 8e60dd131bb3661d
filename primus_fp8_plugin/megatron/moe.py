"""Megatron's MoE layer with the tokens going straight from the router into the grouped FP8 layout.

``Fp8MoELayer`` is Megatron's ``MoELayer`` (same constructor, submodules, parameters and checkpoint keys). Where
``routed_dispatch_blocker`` finds nothing in the way (dropless top-k routing; the experts ``Fp8GroupedMLP`` with
SwiGLU fused; Megatron's allgather dispatcher type, or alltoall at expert TP = 1), its token dispatcher
is a ``RoutedTokenDispatcher``. Per MoE layer forward and backward it does, with the token counts on the device
throughout (where this rank holds every expert nothing is read on the host: the rows are ``T * topk``; with
experts on other ranks, one read: this rank's number of rows, or the all-to-all's split sizes;
``RoutedTokenDispatcher`` says how tokens cross ranks):

Forward:  router -> routing map [T, E] --``permutation.route``--> the permutation (expert-major, token order) and
          the experts' counts; fc1 quantizes ``x[sorted_indices]`` straight from the tokens (``fp8_grouped_linear``
          with the ``Routing``: no permuted bf16 copy); SwiGLU x routing probability quantized into fc2's input;
          the combine: each token's rows of fc2's output summed in one pass (``permutation.unpermute``).
Backward: the combine's gather; fc2, fc1 as the grouped op; x's gradient: each token's rows of dX added
          (``exchange.Permuted``).

The same bits, outputs and gradients (the router's included), as the layer with Megatron's dispatcher on the
CPU (Megatron's ``permute``/``unpermute`` torch paths; ``tests/megatron/test_moe_routed.py``). On a GPU Megatron's
``unpermute`` and ``permute``'s backward add a token's rows with atomics in bf16 in no fixed order; the plugin's
combine and dX add them in fp32 in the rows' order and round once: the same bits on every run and device
(``docs/NUMERICS.md``, "The MoE token permutation").

Megatron's dispatcher runs instead, for the layer's life, where a blocker is found (``routed_dispatch_off``
names it), and for a forward given a ``padding_mask`` (padded tokens are routed nowhere: the rows are no longer
``T * topk``).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.moe_layer import MoELayer

from .. import env
from ..permutation import permute, permute_probs, route, unpermute
from .grouped import Fp8GroupedMLP


def routed_dispatch_blocker(layer) -> str | None:
    """Why ``layer`` (a built ``MoELayer``) cannot route its tokens straight into the grouped FP8 layout, or None."""
    config, experts, dispatcher = layer.config, layer.experts, layer.token_dispatcher
    kind = config.moe_token_dispatcher_type
    checks = [
        (env.moe_routed(), f"{env.MOE_ROUTED}=0 in the environment"),
        (isinstance(experts, Fp8GroupedMLP) and experts.fused_swiglu,
         "the experts are not Fp8GroupedMLP with SwiGLU fused (grouped_swiglu_fusable)"),
        (kind == "allgather" or (kind == "alltoall" and getattr(dispatcher, "tp_size", None) == 1),
         f"moe_token_dispatcher_type={kind!r} with an expert TP size above 1 (routed: allgather, or alltoall at "
         "expert TP = 1)"),
        (kind != "allgather" or hasattr(dispatcher, "tp_ep_group"), "this Megatron's allgather dispatcher has no tp_ep_group"),
        (config.moe_expert_capacity_factor is None and not config.moe_pad_expert_input_to_capacity,
         "token dropping / capacity padding (moe_expert_capacity_factor)"),
        (not (getattr(config, "moe_router_padding_for_quantization", False)
              or getattr(config, "moe_router_padding_for_fp8", False)),
         "the router pads the experts' tokens (moe_router_padding_for_quantization)"),
        (not config.moe_apply_probs_on_input, "moe_apply_probs_on_input (the input is scaled before fc1)"),
        (not config.moe_shared_expert_overlap, "moe_shared_expert_overlap (Megatron's dispatcher runs the shared experts)"),
        (not _captures_moe(config), "CUDA-graph capture of MoE parts (cuda_graph_modules / cuda_graph_scope)"),
        (not getattr(config, "overlap_moe_expert_parallel_comm", False),
         "overlap_moe_expert_parallel_comm (Megatron's schedule drives its own dispatcher)"),
    ]  # fmt: skip
    return next((reason for ok, reason in checks if not ok), None)


def _captures_moe(config) -> bool:
    scopes = [*(getattr(config, "cuda_graph_modules", None) or ()), *(getattr(config, "cuda_graph_scope", None) or ())]
    return getattr(config, "cuda_graph_impl", "none") != "none" and any("moe" in str(s) for s in scopes)


class RoutedTokenDispatcher:
    """Megatron's token-dispatcher protocol with the plugin's permutation (module docstring). ``exchange`` says how
    tokens cross ranks:

    * ``"none"``: this rank holds every expert;
    * ``"allgather"`` (Megatron's allgather type): the tokens, probabilities and routing map all-gathered over the
      expert tensor x expert parallel group, the combined output reduce-scattered back, in the probabilities' dtype,
      as ``MoEAllGatherTokenDispatcher``;
    * ``"alltoall"`` (Megatron's alltoall type, expert TP = 1): each token's copies, permuted expert-major
      (``permutation.permute``), sent to their experts' ranks with their probabilities (all-to-all over the expert
      parallel group, as ``MoEAlltoAllTokenDispatcher``); there the received rows are the experts' tokens (each routed
      to one local expert: the ``Routing`` of a one-hot map, which also sorts the source ranks' chunks expert-major,
      read through by fc1's quantization); the outputs go back in the order they came and each token's rows are
      summed in fp32 in the expert-major order of a single rank: every token's output and input gradient have the
      bits of EP = 1.

    ``dispatch_postprocess`` hands the experts the tokens (or received rows) in their order, the ``Routing`` of this
    rank's experts in place of the counts and the permuted probabilities; ``combine_preprocess`` is the fused combine.
    Megatron's dispatcher (``megatron``) serves every other attribute and, while ``active`` is False, every step.

    Host reads: none where this rank holds every expert (``T * topk`` rows); allgather: one (the number of this
    rank's rows), where Megatron's dispatcher makes three; alltoall: one (the all-to-all's split sizes, both ways)."""

    def __init__(self, megatron, topk: int, backend: str) -> None:
        self.megatron, self.topk, self.backend = megatron, topk, backend
        indices = list(megatron.local_expert_indices)
        self.local = slice(indices[0], indices[-1] + 1)
        self.exchange, self.group = "none", None
        if megatron.tp_size > 1 or megatron.ep_size > 1:
            alltoall = megatron.config.moe_token_dispatcher_type == "alltoall"
            self.exchange = "alltoall" if alltoall else "allgather"
            self.group = megatron.ep_group if alltoall else megatron.tp_ep_group
        self.active = True
        self.hidden_shape = self.routing_map = self.routing = self.probs_dtype = None
        self.sent = None  # alltoall: (the tokens' Routing, split sizes sent, split sizes received)
        self.recv_counts = None  # alltoall: rows received [EP, local experts], from dispatch to postprocess

    def __getattr__(self, name):
        return getattr(self.__dict__["megatron"], name)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if not self.active:
            return self.megatron.dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape, self.routing_map = hidden_states.shape, routing_map
        return hidden_states.view(-1, hidden_states.shape[-1]), probs

    def token_dispatch(self, hidden_states, probs, *args, **kwargs):
        if not self.active:
            return self.megatron.token_dispatch(hidden_states, probs, *args, **kwargs)
        self.probs_dtype = probs.dtype
        if self.exchange == "alltoall":
            return self._send_to_experts(hidden_states, probs)
        if self.group is not None:
            with torch.no_grad():
                self.routing_map = gather_from_sequence_parallel_region(self.routing_map, group=self.group)
            probs = gather_from_sequence_parallel_region(probs, group=self.group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.group, use_global_buffer=True)
        return hidden_states, probs

    def _send_to_experts(self, hidden_states, probs):
        """alltoall: each token's copies, expert-major, to their experts' ranks; returns the received rows and their
        probabilities ``[R]``, and keeps the routing and split sizes for the way back."""
        routing = route(self.routing_map, hidden_states.shape[0] * self.topk)
        ep, local = self.megatron.ep_size, self.local.stop - self.local.start
        send_counts = routing.layout.counts.view(ep, local)  # rows for each rank's experts, on the device
        recv_counts = torch.empty_like(send_counts)
        torch.distributed.all_to_all_single(recv_counts, send_counts, group=self.group)
        splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the one host read
        send_splits, recv_splits = splits[:ep], splits[ep:]
        rows = all_to_all(self.group, permute(hidden_states, routing, backend=self.backend), recv_splits, send_splits)
        row_probs = all_to_all(self.group, permute_probs(probs, routing), recv_splits, send_splits)
        self.sent, self.recv_counts = (routing, send_splits, recv_splits), recv_counts
        return rows, row_probs

    def dispatch_postprocess(self, hidden_states, probs):
        """``(tokens [T, H], Routing of this rank's experts, their permuted probabilities [N])``; alltoall: the
        received rows in place of the tokens (each routed to one expert)."""
        if not self.active:
            return self.megatron.dispatch_postprocess(hidden_states, probs)
        if self.exchange == "alltoall":  # the received rows, by source rank, then expert: routed to their experts
            local, rows = self.local.stop - self.local.start, hidden_states.shape[0]
            experts = torch.arange(local, device=hidden_states.device).repeat(self.megatron.ep_size)
            expert_of_row = torch.repeat_interleave(experts, self.recv_counts.reshape(-1), output_size=rows)
            one_hot = torch.zeros(rows, local, dtype=torch.bool, device=hidden_states.device)
            one_hot[torch.arange(rows, device=hidden_states.device), expert_of_row] = True
            self.routing, self.routing_map, self.recv_counts = route(one_hot, rows), None, None
            return hidden_states, self.routing, probs.index_select(0, self.routing.sorted_indices)
        routing_map, probs = self.routing_map, probs
        if routing_map.shape[1] != self.local.stop - self.local.start:  # experts on other ranks
            routing_map, probs = routing_map[:, self.local].contiguous(), probs[:, self.local].contiguous()
            rows = int(routing_map.sum())  # the one host read: this rank's rows
        else:
            rows = hidden_states.shape[0] * self.topk
        self.routing = route(routing_map, rows)
        self.routing_map = None
        return hidden_states, self.routing, permute_probs(probs, self.routing)

    def combine_preprocess(self, hidden_states):
        if not self.active:
            return self.megatron.combine_preprocess(hidden_states)
        routing, self.routing = self.routing, None
        return unpermute(hidden_states, routing, backend=self.backend)

    def token_combine(self, hidden_states, *args, **kwargs):
        if not self.active:
            return self.megatron.token_combine(hidden_states, *args, **kwargs)
        if self.exchange == "alltoall":  # the rows back in the order they were sent; each token's summed in fp32
            routing, send_splits, recv_splits = self.sent
            self.sent = None
            rows = all_to_all(self.group, hidden_states, send_splits, recv_splits)
            return unpermute(rows, routing, backend=self.backend)
        if self.group is None:
            return hidden_states
        summed = reduce_scatter_to_sequence_parallel_region(hidden_states.to(self.probs_dtype), group=self.group)
        return summed.to(hidden_states.dtype)

    def combine_postprocess(self, hidden_states):
        if not self.active:
            return self.megatron.combine_postprocess(hidden_states)
        return hidden_states.view(self.hidden_shape)


class Fp8MoELayer(MoELayer):
    """Megatron's ``MoELayer`` whose tokens go straight from the router into the grouped FP8 layout where
    ``routed_dispatch_blocker`` allows (module docstring); ``routed_dispatch_off``: the blocker, or None."""

    def __init__(self, config, submodules=None, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.routed_dispatch_off = routed_dispatch_blocker(self)
        self.routed_dispatcher = None
        if self.routed_dispatch_off is None:
            backend = self.experts.linear_fc2.fp8_backend
            self.routed_dispatcher = RoutedTokenDispatcher(self.token_dispatcher, config.moe_router_topk, backend)
            self.token_dispatcher = self.routed_dispatcher
            if hasattr(self, "_training_token_dispatcher"):  # Megatron swaps it back in for training forwards
                self._training_token_dispatcher = self.routed_dispatcher

    def forward(self, hidden_states, *args, **kwargs):
        if self.routed_dispatcher is not None:
            padding_mask = kwargs.get("padding_mask", args[1] if len(args) > 1 else None)
            self.routed_dispatcher.active = padding_mask is None
        return super().forward(hidden_states, *args, **kwargs)
