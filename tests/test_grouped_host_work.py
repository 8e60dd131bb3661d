"""The host work of a grouped FP8 linear does not grow with its number of experts, and its bias gradients follow
their rounding rule without a host synchronisation.

A forward and backward of ``Fp8GroupedLinear`` on the ``triton`` backend (the GPU's kernels, through Triton's
interpreter on the CPU) in the steady state (weights cached) makes as many Python-level calls at 128 experts as at
2 (``host_calls.py`` says what is counted): no loop over the experts in Python, no attribute set per weight, one
shared placeholder gradient, the biases stacked by one C-level call, the bias gradients summed on the device.
The reference backend (a Python loop of the dense operations over the experts) makes more at 128: the count sees
per-expert work."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import Fp8GroupedLinear, backend_availability
from primus_fp8_plugin.grouped_tensor import group_layout
from primus_fp8_plugin.ops.layouts import segment_sums

from .conftest import make_input, row_sums_in_order
from .host_calls import python_calls

K = N = 128


def fwd_bwd_calls(num_experts: int, backend: str, *, device_counts: bool, megatron: bool, bias: bool) -> int:
    """Python calls of the second forward + backward (the first fills the weight cache and Triton's caches)."""
    torch.manual_seed(0)
    layer = Fp8GroupedLinear(num_experts, K, N, bias=bias, dtype=torch.bfloat16, backend=backend)
    if megatron:  # Megatron's DDP: an fp32 main_grad per weight and its hook's flag
        for w in layer.weights:
            w.main_grad, w.grad_added_to_main_grad = torch.zeros(N, K), False
    counts = [0] * num_experts
    counts[0], counts[-1] = 70, 130  # ragged, most experts empty: the interpreter's time stays small
    counts_arg = torch.tensor(counts) if device_counts else counts
    x = make_input((sum(counts), K), seed=1).requires_grad_(True)
    dy = make_input((sum(counts), N), seed=2)

    def step():
        layer(x, counts_arg).backward(dy)

    step()
    calls = python_calls(step)
    assert layer.weight_cache.refreshes == 1
    if megatron:
        assert all(w.grad_added_to_main_grad for w in layer.weights) and layer.weight0.main_grad.abs().sum() > 0
    return calls


@pytest.mark.parametrize(
    "device_counts, megatron, bias",
    [(True, True, True), (False, False, False)],
    ids=["device_counts-main_grad-bias", "host_counts-grad"],
)
def test_a_grouped_forward_backward_makes_as_many_python_calls_at_128_experts_as_at_2(device_counts, megatron, bias):
    if not backend_availability("triton", "cpu"):
        pytest.skip(backend_availability("triton", "cpu").reason)
    kw = dict(device_counts=device_counts, megatron=megatron, bias=bias)
    calls = {e: fwd_bwd_calls(e, "triton", **kw) for e in (2, 128)}
    assert calls[2] == calls[128], calls


def test_the_count_sees_per_expert_work():
    kw = dict(device_counts=False, megatron=False, bias=False)
    loop = {e: fwd_bwd_calls(e, "reference", **kw) for e in (2, 16)}
    assert loop[16] >= loop[2] + 14, loop  # the reference backend's loop over the experts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_gradients_are_row_sums_in_token_order_rounded_once(dtype):
    """``segment_sums`` against a Python loop of fp32 row additions, on a ragged routing with long segments; and
    close to torch's ``dY_e.sum(0)`` (another fp32 summation order: within both orders' fp32 error bounds, then one
    rounding to dY's dtype)."""
    counts = [0, 1, 2000, 37, 129, 0, 3000]
    dy = make_input((sum(counts), 48), dtype=dtype, seed=3, spread=dtype != torch.float16)  # fp16: no overflow
    dy[5, 7] = float("inf")  # a non-finite value stays in its own expert
    got = segment_sums(dy, group_layout(torch.tensor(counts), sum(counts)))
    assert got.dtype == dtype and got.shape == (len(counts), 48)
    want = row_sums_in_order(dy, counts)
    bits = {2: torch.int16, 4: torch.int32}[dy.element_size()]
    for e, (g, w, part) in enumerate(zip(got, want, torch.split(dy, counts))):
        assert torch.equal(g.view(bits), w.view(bits)), f"expert {e} (count {counts[e]})"
        torch_sum = part.sum(0)
        finite = torch.isfinite(torch_sum)
        assert torch.equal(finite, torch.isfinite(g))
        gap = (g.float() - torch_sum.float()).abs()[finite]
        bound = counts[e] * 2.0**-23 * part.float().abs().sum(0) + torch.finfo(dtype).eps * torch_sum.float().abs()
        assert (gap <= bound[finite]).all(), f"expert {e}: {(gap - bound[finite]).max()} beyond the error bounds"
    assert torch.isinf(got[2, 7]) and torch.isfinite(got[[0, 1, 3, 4, 5, 6]]).all()
    assert not got[0].any() and not got[5].any()
