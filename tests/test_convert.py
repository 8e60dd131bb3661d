"""Fp8BlockwiseLinear.from_linear and convert_to_fp8_blockwise on the CPU: the converted layers compute
what a hand-built Fp8BlockwiseLinear with the same weights computes, hold the original Parameters,
and only the layers the rule and the filter allow are swapped, at any depth."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from primus_fp8_plugin import BlockwiseRecipe, Fp8BlockwiseLinear, convert_to_fp8_blockwise
from primus_fp8_plugin.convert import convertible, skip_reason


def _linear(k, n, bias=True, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():  # not nn.Linear's init range only: scales differ per 128x128 block
        lin.weight.mul_(torch.logspace(-2, 2, k, dtype=torch.float32).to(dtype))
    return lin


def _hand_built(lin: nn.Linear, **kw) -> Fp8BlockwiseLinear:
    """What from_linear should equal: a new layer with copies of ``lin``'s weight and bias."""
    out = Fp8BlockwiseLinear(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype, **kw)
    with torch.no_grad():
        out.weight.copy_(lin.weight)
        if lin.bias is not None:
            out.bias.copy_(lin.bias)
    return out


def _x(rows, k, dtype=torch.bfloat16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 8).to(dtype)


@pytest.mark.parametrize("bias, dtype, fmt", [(True, torch.bfloat16, "E4M3"), (False, torch.float32, "HYBRID")])
def test_from_linear_equals_a_hand_built_layer_and_keeps_the_parameters(bias, dtype, fmt):
    lin = _linear(272, 144, bias=bias, dtype=dtype)
    recipe = BlockwiseRecipe(fp8_format=fmt)
    ours = Fp8BlockwiseLinear.from_linear(lin, recipe=recipe, backend="reference")
    ref = _hand_built(lin, recipe=recipe, backend="reference")
    assert ours.weight is lin.weight and ours.bias is lin.bias  # the same Parameters, not copies
    assert ours.weight.dtype == dtype and ours.weight.device == lin.weight.device and ours.backend == "reference"
    assert list(ours.state_dict()) == list(lin.state_dict())
    x = _x(37, 272, dtype).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    dy = _x(37, 144, dtype, seed=2)
    y, y_ref = ours(x), ref(x_ref)
    assert torch.equal(y, y_ref)
    assert not torch.equal(y, lin(x.detach()))  # FP8: not the BF16/FP32 layer's output
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(lin.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(lin.bias.grad, ref.bias.grad)


def test_from_linear_keeps_requires_grad_and_mode_and_refuses_other_modules():
    lin = _linear(128, 128).eval()
    lin.weight.requires_grad_(False)
    ours = Fp8BlockwiseLinear.from_linear(lin)
    assert not ours.weight.requires_grad and ours.bias.requires_grad and not ours.training
    assert ours.recipe == BlockwiseRecipe() and ours.backend == "auto"
    with pytest.raises(TypeError, match="nn.Linear"):
        Fp8BlockwiseLinear.from_linear(nn.Conv1d(4, 4, 1))


class _Block(nn.Module):
    def __init__(self, width, seed):
        super().__init__()
        self.up = _linear(width, 2 * width, seed=seed)
        self.down = _linear(2 * width, width, bias=False, seed=seed + 1)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(128, 10), _Block(128, 20)])
        self.experts = nn.ModuleDict({"a": _linear(128, 256, seed=30)})
        self.odd = _linear(128, 100, seed=40)  # out_features % 16 != 0: stays nn.Linear
        self.head = _linear(128, 64, seed=50)
        self.tied = self.head  # one module under two names: converted once, still shared

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.tied(x), self.experts["a"](x), self.odd(x)


def test_convert_swaps_nested_linears_by_the_rule_and_the_filter():
    model = _Model()
    expected = copy.deepcopy(model)  # converted by hand below
    seen = []

    def keep_experts_out(module, fqn):
        seen.append(fqn)
        return not fqn.startswith("experts.")

    out = convert_to_fp8_blockwise(model, keep_experts_out, backend="reference")
    assert out is model
    for name in ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"):
        assert type(model.get_submodule(name)) is Fp8BlockwiseLinear, name
        assert model.get_submodule(name).backend == "reference"
    assert type(model.experts["a"]) is nn.Linear  # the filter said no
    assert type(model.odd) is nn.Linear  # the rule said no: 100 is not a multiple of 16
    assert model.tied is model.head  # still one module
    # the filter saw every candidate once, by its first name, and never what the rule refuses
    assert sorted(seen) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up", "experts.a", "head"]

    for block in expected.blocks:
        block.up, block.down = (_hand_built(m, backend="reference") for m in (block.up, block.down))
    expected.head = expected.tied = _hand_built(expected.head, backend="reference")
    x = _x(45, 128)
    for got, want in zip(model(x), expected(x), strict=True):
        assert torch.equal(got, want)
    assert list(model.state_dict()) == list(expected.state_dict())


def test_convert_passes_the_recipe_and_converts_a_bare_linear():
    hybrid = BlockwiseRecipe(fp8_format="HYBRID")
    model = convert_to_fp8_blockwise(nn.Sequential(_linear(256, 128), nn.GELU(), _linear(128, 128)), recipe=hybrid)
    assert all(model[i].recipe is hybrid for i in (0, 2))
    lin = _linear(256, 128)
    new = convert_to_fp8_blockwise(lin)
    assert type(new) is Fp8BlockwiseLinear and new.weight is lin.weight
    assert convert_to_fp8_blockwise(lin, lambda m, fqn: False) is lin


def test_the_rule_skips_subclasses_odd_dims_and_non_float_weights():
    mha = nn.MultiheadAttention(128, 4)  # out_proj is a Linear subclass that MHA reads without calling
    assert type(mha.out_proj) is not nn.Linear and not convertible(mha.out_proj)
    assert convert_to_fp8_blockwise(mha).out_proj is mha.out_proj
    assert convertible(nn.Linear(16, 32)) and not convertible(nn.Linear(24, 32)) and not convertible(nn.Linear(16, 8))
    assert not convertible(nn.Linear(16, 16, dtype=torch.float64))


def test_the_report_names_each_linear_converted_or_skipped_and_why():
    model = _Model()
    model.attn = nn.MultiheadAttention(128, 4)  # out_proj: an nn.Linear subclass
    model.wide = nn.Linear(128, 128, dtype=torch.float64)
    model.norm = nn.LayerNorm(128)  # not a linear: not in the report
    out, report = convert_to_fp8_blockwise(model, lambda m, fqn: not fqn.startswith("experts."), report=True)
    assert out is model
    assert report.converted == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"]  # `tied` is `head`
    assert [n for n in report.converted if type(model.get_submodule(n)) is not Fp8BlockwiseLinear] == []
    assert set(report.skipped) == {"experts.a", "odd", "attn.out_proj", "wide"}
    assert report.skipped["experts.a"] == "module_filter_fn returned False"
    assert report.skipped["odd"].startswith("out_features=100 is not a multiple of 16")
    assert report.skipped["attn.out_proj"].startswith("NonDynamicallyQuantizableLinear subclasses nn.Linear")
    assert report.skipped["wide"].startswith("weight dtype torch.float64")
    for name, why in report.skipped.items():  # what skip_reason says of the module, or the filter
        assert why == (skip_reason(model.get_submodule(name)) or "module_filter_fn returned False")
    text = str(report).splitlines()
    assert text[0] == "converted 5 linear layer(s) to Fp8BlockwiseLinear, skipped 4"
    assert len(text) == 10 and text[1].split() == ["converted", "blocks.0.up"]
    assert any(line.split()[:2] == ["skipped", "odd"] for line in text)


def test_the_report_of_a_bare_linear_names_the_model():
    lin = nn.Linear(24, 32)
    same, report = convert_to_fp8_blockwise(lin, report=True)
    assert same is lin and report.converted == [] and list(report.skipped) == [""]
    assert report.skipped[""].startswith("in_features=24 is not a multiple of 16")
    assert "(model)" in str(report)
    new, report = convert_to_fp8_blockwise(nn.Linear(32, 32), report=True)
    assert type(new) is Fp8BlockwiseLinear and report.converted == [""] and report.skipped == {}


def test_a_shared_module_is_decided_at_the_name_named_modules_reports():
    """A module reachable as ``deep.inner`` (first, depth first) and as ``alias`` (a shallower, later name)
    is asked about and reported as ``deep.inner``, the name ``named_modules()`` gives it."""
    model = nn.Module()
    model.deep = nn.Sequential()
    model.deep.add_module("inner", nn.Linear(32, 32))
    model.alias = model.deep.inner
    seen = []
    _, report = convert_to_fp8_blockwise(model, lambda m, fqn: seen.append(fqn) or True, report=True)
    assert seen == report.converted == ["deep.inner"]
    assert model.alias is model.deep.inner and type(model.alias) is Fp8BlockwiseLinear
