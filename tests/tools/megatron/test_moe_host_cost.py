"""tools/moe_host_cost.py on the CPU: its instant backend answers a step's k-th call of an operation with the
reference backend's result for the first step's, and the MoE
layer it measures (the fast spec's, under Megatron's DDP) makes no weight-sized copy per expert in backward, and
with single grouped weights its host work does not grow with the experts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tools import moe_host_cost as tool


@pytest.fixture
def world():
    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    init_cpu_distributed(port=int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")))


def test_instant_backend_answers_with_the_references_first_result():
    from primus_fp8_plugin.backends import get_backend
    from primus_fp8_plugin.recipe import BlockwiseRecipe, TensorRole

    ref = get_backend("reference", "cpu")
    instant = tool.instant_backend(ref)
    params = BlockwiseRecipe().params(TensorRole.INPUT)
    g = torch.Generator().manual_seed(3)
    x1, x2 = (torch.randn(64, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    first = instant.quantize_act(x1, params, rowwise=True, columnwise=False)
    want = ref.quantize_act(x1, params, rowwise=True, columnwise=False)
    assert torch.equal(first.rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8))
    instant.new_step()
    again = instant.quantize_act(x2, params, rowwise=True, columnwise=False)  # a step's first call: the first result
    assert again is first
    other = instant.quantize_act(x2, params, rowwise=True, columnwise=False)  # its second call: computed from x2
    want2 = ref.quantize_act(x2, params, rowwise=True, columnwise=False)
    assert torch.equal(other.rowwise_data.view(torch.uint8), want2.rowwise_data.view(torch.uint8))
    w = torch.randn(256, 256, generator=g).to(torch.bfloat16)
    wq = ref.quantize_weight(w, BlockwiseRecipe().params(TensorRole.WEIGHT))
    y1 = instant.gemm_fwd(want, wq, None, torch.bfloat16)
    instant.new_step()
    y2 = instant.gemm_fwd(want, wq, None, torch.bfloat16)
    assert torch.equal(y1, ref.gemm_fwd(want, wq, None, torch.bfloat16)) and torch.equal(y1, y2) and y1 is not y2


def run_tool(tmp_path, experts: int) -> dict:
    out = tmp_path / f"host{experts}.json"
    assert tool.main(["--experts", str(experts), "--topk", "2", "--tokens", "64", "--iters", "2", "--top", "60",
                      "--json", str(out)]) == 0  # fmt: skip
    return json.loads(out.read_text())["results"]


def test_moe_layer_backward_copies_no_expert_gradient(world, tmp_path, capsys):
    results = run_tool(tmp_path, 4)
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("routed/single", "megatron/single", "routed/per_expert", "megatron/per_expert"))
    assert {"optimizer/single", "optimizer/per_expert"} < results.keys()
    for name, r in results.items():
        assert r["ms"] > 0 and 0 < r["aten_kernel_ops"] < r["aten_ops"] and r["python_calls"] > 0
        if name.startswith("optimizer/"):  # the optimizer step: no layer forward or backward
            continue
        # autograd's copy of a gradient it cannot take as .grad as it is: one per expert weight before the fix
        assert "new_empty_strided" not in r["aten_by_name"], r["aten_by_name"]
        # the placeholder's alias per weight parameter, taken as .grad: 2 per expert, or 2 single grouped weights
        assert r["aten_by_name"].get("detach", 0) >= (2 if name.endswith("single") else 2 * 4), (name, r["aten_by_name"])


def test_single_grouped_weights_keep_the_layers_host_work_flat_in_the_experts(world, tmp_path):
    """One ``[E, out, in]`` weight per grouped linear: with the routed dispatch the layer's aten operations and Python
    calls (autograd's and Megatron's DDP hooks' per-parameter work included) are the same at 4 and at 12 experts; with
    one weight per expert they grow by at least the 16 further weights' hooks (four Python calls and two aten
    operations each). So does the layer's optimizer step (Megatron's Adam, fp32 masters, gradient norm, zeroing):
    flat with the single weights, growing with per-expert ones (measured: ~85 Python calls and ~15 aten operations a
    weight). Megatron's dispatcher does a few operations more or less from one process to the next (seen in CI: 9
    Python calls, 2 aten operations), so there both changes are checked with half the per-expert hooks' work as the
    margin."""
    few, more = run_tool(tmp_path, 4), run_tool(tmp_path, 12)
    added = 2 * (12 - 4)  # further weight parameters of the per-expert layout
    for dispatch in ("routed", "megatron", "optimizer"):
        single_few, single_more = few[f"{dispatch}/single"], more[f"{dispatch}/single"]
        experts_few, experts_more = few[f"{dispatch}/per_expert"], more[f"{dispatch}/per_expert"]
        if dispatch != "megatron":
            assert (single_few["aten_ops"], single_few["python_calls"]) == (single_more["aten_ops"], single_more["python_calls"])
        exact = dispatch != "megatron"
        for what, per_weight in (("python_calls", 4), ("aten_ops", 2)):
            grown = per_weight * added
            assert experts_more[what] - experts_few[what] >= (grown if exact else grown / 2), (dispatch, what)
            assert abs(single_more[what] - single_few[what]) < grown / 2, (dispatch, what)


def test_the_aten_counter_counts_a_hand_counted_function():
    """``AtenCounter`` against a function whose aten operations are counted by hand: add, mm, view, sum (one each);
    the view is the one that launches no kernel."""
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with tool.AtenCounter() as counter:
        (a + b).mm(b).view(16).sum()
    assert dict(counter.counts) == {"add": 1, "mm": 1, "view": 1, "sum": 1}
    assert {op for op in counter.counts if op in tool.METADATA_OPS} == {"view"}


def test_the_python_call_counter_counts_a_hand_counted_function():
    """``python_calls`` against functions counted by hand: ``outer`` calls ``inner`` twice and a C function (``len``,
    not counted) once: 3 calls; a lambda around them: 4."""

    def inner():
        return 1

    def outer():
        return inner() + inner() + len("ab")

    assert tool.python_calls(outer) == 3
    assert tool.python_calls(lambda: outer()) == 4
