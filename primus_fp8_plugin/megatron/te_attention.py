"""TE's core attention for the TE-hybrid spec (``fp8_te_gpt_layer_spec``), its output marked for the plugin's
FP8 output projection. Needs Transformer Engine (import this module only where it imports).

TE's ``FusedAttnFunc`` (its cuDNN fused attention) saves its output for backward, and TE's own ``Linear`` shares
that tensor as its saved input (``python -m tools.layer_saved_bytes --specs te``). The plugin's projection keeps
its own columnwise FP8 copy of its input unless the input is marked (``linear.mark_saved_elsewhere``): without
the mark the hybrid layer holds 16.5 MiB more per layer than TE's at Llama-3-8B width, micro batch 2 x 2048
(docs/PERFORMANCE.md). ``Fp8TEDotProductAttention`` marks its output where it is, through views, all of
``FusedAttnFunc``'s output (``attention.output_saved_by``); TE's other backends (flash-attn, unfused) leave it
unmarked, and the projection then saves its FP8 copy. TE's FP8 attention, which saves an FP8 output instead,
cannot run here: the plugin's specs refuse ``--fp8-format``.
"""

from __future__ import annotations

import torch
from megatron.core.extensions.transformer_engine import TEDotProductAttention

from ..ops import mark_saved_elsewhere
from .attention import output_saved_by

_TE_NODES_SAVING_OUTPUT = frozenset({"FusedAttnFuncBackward"})


class Fp8TEDotProductAttention(TEDotProductAttention):
    """Megatron's ``TEDotProductAttention`` (same arguments, numerics and output) whose output is marked for the
    plugin's FP8 output projection where TE's fused attention saves it anyway (module docstring)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad and output_saved_by(out, _TE_NODES_SAVING_OUTPUT):
            mark_saved_elsewhere(out)
        return out
