"""Megatron's MoE layer with the tokens going straight from the router into the grouped FP8 layout.

``Fp8MoELayer`` is Megatron's ``MoELayer`` (same constructor, submodules, parameters and checkpoint keys). Where
``routed_dispatch_blocker`` finds nothing in the way (dropless top-k routing; the experts ``Fp8GroupedMLP`` with
SwiGLU fused; Megatron's allgather dispatcher type, or alltoall where no token crosses ranks), its token dispatcher
is a ``RoutedTokenDispatcher``. Per MoE layer forward and backward it does, with the token counts on the device
throughout (where this rank holds every expert nothing is read on the host: the rows are ``T * topk``; with
experts on other ranks, one read, this rank's number of rows):

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
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from megatron.core.transformer.moe.moe_layer import MoELayer

from .. import env
from ..permutation import permute_probs, route, unpermute
from .grouped import Fp8GroupedMLP


def routed_dispatch_blocker(layer) -> str | None:
    """Why ``layer`` (a built ``MoELayer``) cannot route its tokens straight into the grouped FP8 layout, or None."""
    config, experts, dispatcher = layer.config, layer.experts, layer.token_dispatcher
    kind = config.moe_token_dispatcher_type
    local = getattr(dispatcher, "ep_size", None) == 1 and getattr(dispatcher, "tp_size", None) == 1
    checks = [
        (env.moe_routed(), f"{env.MOE_ROUTED}=0 in the environment"),
        (isinstance(experts, Fp8GroupedMLP) and experts.fused_swiglu,
         "the experts are not Fp8GroupedMLP with SwiGLU fused (grouped_swiglu_fusable)"),
        (kind == "allgather" or (kind == "alltoall" and local),
         f"moe_token_dispatcher_type={kind!r} with tokens crossing ranks (routed: allgather, or alltoall at "
         "EP = expert TP = 1)"),
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
    """Megatron's token-dispatcher protocol with the plugin's permutation (module docstring). The token exchange is
    Megatron's allgather one where tokens cross ranks (the tokens, probabilities and routing map all-gathered over
    the expert tensor x expert parallel group, the combined output reduce-scattered back, in the probabilities'
    dtype, as ``MoEAllGatherTokenDispatcher``), none otherwise. ``dispatch_postprocess`` hands the experts the tokens
    in token order, the ``Routing`` of this rank's experts in place of the counts and the permuted probabilities;
    ``combine_preprocess`` is the fused combine. Megatron's dispatcher (``megatron``) serves every other attribute
    and, while ``active`` is False, every step.

    Host reads: none where this rank holds every expert (``T * topk`` rows); with experts on other ranks, one (the
    number of this rank's rows), where Megatron's dispatcher makes three."""

    def __init__(self, megatron, topk: int, backend: str) -> None:
        self.megatron, self.topk, self.backend = megatron, topk, backend
        indices = list(megatron.local_expert_indices)
        self.local = slice(indices[0], indices[-1] + 1)
        self.group = megatron.tp_ep_group if megatron.tp_size > 1 or megatron.ep_size > 1 else None
        self.active = True
        self.hidden_shape = self.routing_map = self.routing = self.probs_dtype = None

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
        if self.group is not None:
            with torch.no_grad():
                self.routing_map = gather_from_sequence_parallel_region(self.routing_map, group=self.group)
            probs = gather_from_sequence_parallel_region(probs, group=self.group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.group, use_global_buffer=True)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """``(tokens [T, H], Routing of this rank's experts, their permuted probabilities [N])``."""
        if not self.active:
            return self.megatron.dispatch_postprocess(hidden_states, probs)
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
