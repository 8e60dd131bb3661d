"""The CPU-checkable parts of te_compare (the TE/plugin/BF16 model builders run on the GPU):
weight copying across spec naming, the worst-gradient helper, and their refusals."""

from __future__ import annotations

import pytest
import torch

from tools import te_compare as tc


class _Fused(torch.nn.Module):
    """Parameter names of the fused-norm spec (TE's and the plugin's)."""

    def __init__(self):
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = torch.nn.Linear(4, 6)
        self.self_attention.linear_qkv.layer_norm_weight = torch.nn.Parameter(torch.randn(4))


class _Local(torch.nn.Module):
    """The same parameters as Megatron's local spec names them (separate input_layernorm)."""

    def __init__(self, qkv_out=6):
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = torch.nn.Linear(4, qkv_out)
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.zeros(4))


def test_copy_weights_maps_fused_norm_names_onto_local_ones():
    src, dst = _Fused(), _Local()
    tc.copy_weights(src, dst)
    assert torch.equal(dst.input_layernorm.weight, src.self_attention.linear_qkv.layer_norm_weight)
    assert torch.equal(dst.self_attention.linear_qkv.weight, src.self_attention.linear_qkv.weight)
    same = _Fused()
    tc.copy_weights(src, same)  # identical names copy as they are
    assert torch.equal(same.self_attention.linear_qkv.layer_norm_weight, src.self_attention.linear_qkv.layer_norm_weight)


def test_copy_weights_refuses_what_does_not_match():
    with pytest.raises(ValueError, match="parameter names differ"):
        tc.copy_weights(_Local(), _Fused())  # local names do not map back onto fused ones
    with pytest.raises(ValueError, match=r"linear_qkv.weight: shape \(6, 4\) in source, \(8, 4\) in target"):
        tc.copy_weights(_Fused(), _Local(qkv_out=8))


def test_worst_grad_error_names_the_worst_parameter_and_refuses_other_names():
    ref = {"a": torch.ones(8), "b": torch.ones(8)}
    got = {"a": torch.ones(8) * 1.01, "b": torch.ones(8) * 1.5}
    name, err = tc.worst_grad_error(got, ref)
    assert name == "b" and err == pytest.approx(0.5)
    with pytest.raises(ValueError, match="gradient names differ"):
        tc.worst_grad_error({"a": ref["a"]}, ref)


def test_build_gpt_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        tc.build_gpt(tc.GptShape(), "fp4")


def test_build_gpt_refuses_an_attention_choice_for_te():
    with pytest.raises(ValueError, match="does not apply to TE's spec"):
        tc.build_gpt(tc.GptShape(), "te_bf16", attention="sdpa")
