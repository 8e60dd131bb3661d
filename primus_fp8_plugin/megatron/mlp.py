"""``Fp8SwigluMLP``: Megatron's ``MLP`` whose fc2 computes SwiGLU of fc1's output fused with the FP8 quantization of
its own input (the ``"swiglu"`` input stage of ``Fp8RowParallelLinear``): the bf16 activation is never written.

Whether it fuses is decided once, when the layer is built: with a plain SwiGLU activation (``swiglu_fusable``) and
an ``Fp8RowParallelLinear`` fc2, fc2 is built with ``input_stage="swiglu"`` and ``forward`` runs fc1 -> (fc1's bias)
-> fc2; otherwise it is exactly Megatron's ``MLP``. ``fused_swiglu`` says which. The same parameters and checkpoint
keys as ``MLP``, and the same bits, outputs and gradients, as the unfused plugin MLP.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec

from .layers import Fp8RowParallelLinear


def swiglu_fusable(config) -> bool:
    """Whether ``config``'s MLP activation is plain SwiGLU (``silu(gate) * up``), which the fused kernel computes."""
    return (
        bool(getattr(config, "gated_linear_unit", False))
        and getattr(config, "activation_func", None) is F.silu
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0.0)
    )


def _with_swiglu_stage(fc2):
    """fc2's spec building an ``Fp8RowParallelLinear`` with the swiglu input stage, or None where fc2 is another
    module (a class or a ModuleSpec of one)."""
    spec = fc2 if isinstance(fc2, ModuleSpec) else ModuleSpec(module=fc2)
    if not (isinstance(spec.module, type) and issubclass(spec.module, Fp8RowParallelLinear)):
        return None
    return ModuleSpec(module=spec.module, params={**(spec.params or {}), "input_stage": "swiglu"}, submodules=spec.submodules)


class Fp8SwigluMLP(MLP):
    """Megatron's ``MLP`` (same constructor, parameters and checkpoint keys) with SwiGLU fused into fc2's input
    quantization where the config and fc2 allow it (module docstring)."""

    def __init__(self, config, submodules, *args, **kwargs):
        fc2 = _with_swiglu_stage(submodules.linear_fc2) if swiglu_fusable(config) else None
        if fc2 is not None:
            submodules = dataclasses.replace(submodules, linear_fc2=fc2)
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_swiglu = fc2 is not None

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        if not self.fused_swiglu:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None:
            raise NotImplementedError("Fp8SwigluMLP: per_token_scale (MoE expert MLPs) is not fused")
        h, fc1_bias = self.linear_fc1(hidden_states)
        if fc1_bias is not None:
            h = h + fc1_bias
        return self.linear_fc2(h)
