"""Megatron-core layers around the plugin's fused kernels (the TE-free fast stack of ``fast_specs.py``).

* ``Fp8FusedNormColumnParallelLinear``: the norm of ``linear_qkv`` / ``linear_fc1`` computed and
  quantized to FP8 in one kernel (``ops.fp8_norm_linear``); the bf16 norm output is never
  written. Parameters, names and checkpoint keys are ``Fp8LayerNormColumnParallelLinear``'s.
* ``Fp8SwigluRowParallelLinear`` + ``Fp8FusedSwigluMLP``: an MLP whose fc2 takes fc1's output
  ``[..., 2F]`` and applies SwiGLU and the quantization of its own input in one kernel
  (``ops.fp8_swiglu_linear``); the bf16 activation is never written.

Both give the same bits, outputs and gradients, as the unfused plugin layers (``normalization.norm``
or ``swiglu.swiglu``, then the FP8 linear): tests/megatron/test_fast_spec.py.

Tensor parallelism (column-parallel norm+linear): each rank's gradient of the normed input is a
partial sum over the ranks' output columns, and the norm's backward runs inside the fused op, so

* without sequence parallelism the input's gradient is all-reduced after the norm's backward (the
  norm backward is linear in its incoming gradient) and so are the gamma/beta gradients (an identity
  with an all-reducing backward on them);
* with sequence parallelism the norm runs on the local sequence shard, fused with its quantization,
  and its FP8 rowwise copy is all-gathered (``fp8_norm_linear(..., sequence_parallel_group=)``):
  saved are the local shard (for the norm's backward, as TE saves it) and its columnwise FP8 copy,
  re-gathered in backward; the gradient of the normed input is reduce-scattered before the norm's
  backward, and the gamma/beta gradients (this rank's tokens) are summed by Megatron's all-reduce
  of ``sequence_parallel`` parameters. The same bits as ``Fp8LayerNormColumnParallelLinear`` (norm
  of the shard, then the FP8 gather), outputs and gradients; a shard whose rows are not a multiple
  of 128 takes the unfused norm and the bf16 gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.mlp import MLP

from ..ops import fp8_norm_linear, fp8_swiglu_linear
from .layers import Fp8LayerNormColumnParallelLinear, Fp8RowParallelLinear, tp_group_of


def _run_fp8(layer, fn, *args, **kwargs):
    """``fn(*args)`` with the layer's FP8 keywords (``Fp8ColumnParallelLinear.fp8_options``)."""
    return fn(*args, **kwargs, **layer.fp8_options())


class Fp8FusedNormColumnParallelLinear(Fp8LayerNormColumnParallelLinear):
    """``Fp8LayerNormColumnParallelLinear`` (same constructor, parameters and checkpoint keys) whose norm is
    fused with the quantization of its output: LayerNorm or RMSNorm (``config.normalization``), then
    ``Y = norm(X) W^T (+ b)`` with ``X`` ``[s, b, h]`` (the local sequence shard under sequence
    parallelism) in bf16/fp16/fp32, any number of rows. Returns ``(Y [s(, gathered), b, n/tp], bias|None)``."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        # ColumnParallelLinear.forward: bias, TP input handling, _forward_impl (the fused op), gather_output.
        return super(Fp8LayerNormColumnParallelLinear, self).forward(input_, weight=weight,
                                                                     runtime_gather_output=runtime_gather_output)  # fmt: skip

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **_unused):  # fmt: skip
        gamma, beta = self.layer_norm_weight, self.layer_norm_bias
        weight.fuse_wgrad_accumulation = bool(gradient_accumulation_fusion)
        if sequence_parallel:
            return _run_fp8(self, _norm_linear, input, gamma, beta, weight, bias, self,
                            sequence_parallel_group=tp_group_of(tp_group))  # fmt: skip
        if allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
            gamma = copy_to_tensor_model_parallel_region(gamma, group=tp_group)
            beta = None if beta is None else copy_to_tensor_model_parallel_region(beta, group=tp_group)
        return _run_fp8(self, _norm_linear, input, gamma, beta, weight, bias, self)


def _norm_linear(x, gamma, beta, weight, bias, layer, **fp8):
    return fp8_norm_linear(x, gamma, beta, weight, bias, normalization=layer.normalization, eps=layer.eps,
                           zero_centered_gamma=layer.zero_centered_gamma, **fp8)  # fmt: skip


class Fp8SwigluRowParallelLinear(Fp8RowParallelLinear):
    """``Fp8RowParallelLinear`` (same constructor and parameters) that, once ``swiglu_input`` is set (by
    ``Fp8FusedSwigluMLP``), takes fc1's output ``h [s, b, 2F/tp] = [gate | up]`` and computes
    ``swiglu(h) W^T`` with SwiGLU fused into the quantization of its input. Unset: a plain FP8 fc2."""

    swiglu_input = False

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, **_unused):
        if not self.swiglu_input:
            return super()._forward_impl(input, weight, bias, gradient_accumulation_fusion)
        weight.fuse_wgrad_accumulation = bool(gradient_accumulation_fusion)
        return _run_fp8(self, fp8_swiglu_linear, input, weight, bias)


def swiglu_fusable(config) -> bool:
    """Whether ``config``'s MLP activation is plain SwiGLU (``silu(gate) * up``), which the fused kernel computes."""
    return (
        bool(getattr(config, "gated_linear_unit", False))
        and getattr(config, "activation_func", None) is F.silu
        and not getattr(config, "use_te_activation_func", False)
        and getattr(config, "activation_func_clamp_value", None) is None
        and not getattr(config, "glu_linear_offset", 0.0)
    )


class Fp8FusedSwigluMLP(MLP):
    """Megatron's ``MLP`` (same constructor, parameters and checkpoint keys) that, when ``swiglu_fusable(config)``
    and its fc2 is a ``Fp8SwigluRowParallelLinear``, runs fc1 -> (fc1's bias) -> SwiGLU fused with the
    quantization of fc2's input -> fc2; otherwise exactly ``MLP``. ``self.fused_swiglu`` says which."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.fused_swiglu = swiglu_fusable(config) and isinstance(self.linear_fc2, Fp8SwigluRowParallelLinear)
        if self.fused_swiglu:
            self.linear_fc2.swiglu_input = True

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        if not self.fused_swiglu:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if per_token_scale is not None:
            raise NotImplementedError("Fp8FusedSwigluMLP: per_token_scale (MoE expert MLPs) is not fused")
        h, fc1_bias = self.linear_fc1(hidden_states)
        if fc1_bias is not None:
            h = h + fc1_bias
        return self.linear_fc2(h)
