"""TE's core attention for the TE-hybrid spec (``fp8_te_gpt_layer_spec``), its output marked for the plugin's
FP8 output projection. Needs Transformer Engine (import this module only where it imports).

TE's ``FusedAttnFunc`` saves its output for backward, and TE's own ``Linear`` shares that tensor as its saved
input. The plugin's projection keeps its own columnwise FP8 copy of its input unless the input is marked
(``linear.mark_saved_elsewhere``): without the mark the hybrid layer holds 16.5 MiB more per layer than TE's at
Llama-3-8B width, micro batch 2 x 2048 (docs/PERFORMANCE.md). ``Fp8TEDotProductAttention`` marks its output
only when the node that made it (through views) is ``FusedAttnFunc``'s and one of that node's saved tensors
is the output's whole storage; TE's other backends (flash-attn, unfused) and FP8 attention leave it unmarked,
and the projection then saves its FP8 copy as before.
"""

from __future__ import annotations

import torch
from megatron.core.extensions.transformer_engine import TEDotProductAttention

from ..linear import mark_saved_elsewhere

_VIEW_NODES = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"})
_TE_NODES_SAVING_OUTPUT = frozenset({"FusedAttnFuncBackward"})


def saves_its_output(out: torch.Tensor) -> bool:
    """Whether ``out`` (through views) is the output of TE's fused attention node and that node saves its whole
    storage for backward."""
    fn = out.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_NODES:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ not in _TE_NODES_SAVING_OUTPUT or not out.is_contiguous():
        return False
    st = out.untyped_storage()
    if st.nbytes() != out.numel() * out.element_size():
        return False
    try:
        saved = fn.saved_tensors
    except RuntimeError:  # already freed, or not a custom Function's context
        return False
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == st.data_ptr() for t in saved)


class Fp8TEDotProductAttention(TEDotProductAttention):
    """Megatron's ``TEDotProductAttention`` (same arguments, numerics and output) whose output is marked for the
    plugin's FP8 output projection where TE's fused attention saves it anyway (module docstring)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad and saves_its_output(out):
            mark_saved_elsewhere(out)
        return out
