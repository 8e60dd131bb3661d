"""The MoE token permutation fused with the FP8 kernels (``permutation.py``) against Megatron's own ``permute`` /
``unpermute`` (``megatron.core.transformer.moe.moe_utils``, the torch paths) on fresh random ragged routings (top-k
of random scores, experts without tokens), on every CPU backend (triton through the interpreter): the grouped FP8
copies of the permuted tokens, the permuted probabilities, the combine and its gradients, bit for bit."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, TensorRole, available_backends
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.permutation import permute, permute_probs, permute_quantize, route, unpermute

from .conftest import make_input

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
BACKENDS = [n for n, a in available_backends("cpu").items() if a]
COPIES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def routing_case(tokens: int, experts: int, topk: int, seed: int):
    """A top-k routing of random scores (some experts starved), its probabilities [T, E] (fp32, 0 off the map)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=g)
    scores[:, : experts // 4] -= 10  # a quarter of the experts almost never chosen
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(scores, dim=1) * routing_map
    return routing_map, probs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens, experts, topk, k, seed", [(200, 8, 2, 256, 1), (97, 16, 4, 200, 2)])
def test_permute_quantize_equals_megatrons_permute_then_the_grouped_quantizer(backend, tokens, experts, topk, k, seed):
    routing_map, probs = routing_case(tokens, experts, topk, seed)
    x = make_input((tokens, k), seed=seed)
    n = tokens * topk
    want_x, want_probs, want_idx, *_ = moe_utils.permute(x, routing_map, probs=probs, num_out_tokens=n)
    r = route(routing_map, n)
    assert torch.equal(r.sorted_indices, want_idx) and same(permute_probs(probs, r), want_probs)
    assert r.layout.counts.tolist() == routing_map.sum(0).tolist() and 0 in r.layout.counts.tolist()
    params = BlockwiseRecipe().params(TensorRole.INPUT)
    want = get_backend("reference", "cpu").quantize_act_grouped(want_x, r.layout, params, rowwise=True, columnwise=True)
    got = permute_quantize(x, r, params, backend=backend)
    cut = int(r.layout.padded_offsets[-1])  # device counts: the columns past the experts' are unspecified
    parts = {"columnwise_data": (slice(None), slice(0, cut)), "columnwise_scale_inv": (slice(0, cut // 128),)}
    for copy in COPIES:
        where = parts.get(copy, (slice(None),))
        assert same(getattr(got, copy)[where], getattr(want, copy)[where]), copy


def test_each_tokens_rows_in_order_and_their_sum_is_index_adds():
    """``route``'s per-token table against a Python walk of the permutation, with tokens routed nowhere and up to 8
    rows a token; ``Routing.rows_sum`` without probabilities (the permutation's backward) equals ``index_add_`` of the
    rows into zeros (the CPU's fp32 sum in row order, rounded once) on every CPU backend."""
    tokens, experts, h = 90, 12, 160
    g = torch.Generator().manual_seed(11)
    routing_map = torch.rand(tokens, experts, generator=g) < torch.rand(tokens, 1, generator=g) * 0.7
    routing_map[:5] = False  # tokens no expert takes
    assert routing_map.sum(1).max() >= 8
    n = int(routing_map.sum())
    r = route(routing_map, n)
    for t in range(tokens):
        rows = r.token_rows[r.token_offsets[t] : r.token_offsets[t + 1]].tolist()
        assert rows == [i for i in range(n) if int(r.sorted_indices[i]) == t], t
    assert r.token_rows.dtype == r.token_offsets.dtype == torch.int32 and int(r.token_offsets[-1]) == n
    y = make_input((n, h), seed=12, spread=False)
    want = torch.zeros(tokens, h, dtype=y.dtype).index_add_(0, r.sorted_indices, y)
    for backend in BACKENDS:
        assert same(r.rows_sum(y, None, get_backend(backend, "cpu")), want), backend


def test_unpermute_without_probabilities_saves_nothing_for_backward():
    """Without probabilities the combine's gradient is a gather of dY: it keeps no activation for backward (with
    them it keeps y and the probabilities)."""
    routing_map, probs = routing_case(64, 8, 2, seed=13)
    r = route(routing_map, 128)
    y = make_input((128, 96), seed=14).requires_grad_(True)
    for p, want in ((None, 0), (permute_probs(probs, r).requires_grad_(True), 2)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = unpermute(y, r, probs=p, backend="reference")
        assert len(saved) == want
        out.float().sum().backward()
    assert y.grad is not None and y.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_permute_equals_megatrons_permute_and_its_gradient(backend):
    """The permuted bf16 copy (the alltoall exchange sends it) and its gradient: Megatron's ``permute`` and the
    gradient autograd gives it on the CPU, bit for bit."""
    tokens, experts, topk, h = 130, 8, 3, 96
    routing_map, _ = routing_case(tokens, experts, topk, seed=7)
    n = tokens * topk
    r = route(routing_map, n)
    x0, dy = make_input((tokens, h), seed=8, spread=False), make_input((n, h), seed=9, spread=False)
    x = x0.clone().requires_grad_(True)
    want, *_ = moe_utils.permute(x, routing_map, num_out_tokens=n)
    want.backward(dy)
    got_x = x0.clone().requires_grad_(True)
    got = permute(got_x, r, backend=backend)
    got.backward(dy)
    assert same(got, want) and same(got_x.grad, x.grad) and x.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="the tokens the routing map routes"):
        permute(x0[:-1], r, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16])
def test_unpermute_equals_megatrons_unpermute_and_its_gradients(backend, probs_dtype):
    tokens, experts, topk, h = 150, 8, 3, 200
    routing_map, probs = routing_case(tokens, experts, topk, seed=3)
    if probs_dtype is not None:
        probs = probs.to(probs_dtype)
    n = tokens * topk
    r = route(routing_map, n)
    y0 = make_input((n, h), seed=4, spread=False)
    dout = make_input((tokens, h), seed=5, spread=False)

    y, p = y0.clone().requires_grad_(True), probs.clone().requires_grad_(probs_dtype is not None)
    want = moe_utils.unpermute(y, r.sorted_indices, torch.Size((tokens, h)),
                               probs=None if probs_dtype is None else p, routing_map=routing_map)  # fmt: skip
    want.backward(dout)
    want_grads = (y.grad, None if probs_dtype is None else permute_probs(p.grad, r))

    y = y0.clone().requires_grad_(True)
    pp = None if probs_dtype is None else permute_probs(probs, r).detach().requires_grad_(True)
    got = unpermute(y, r, probs=pp, backend=backend)
    got.backward(dout)
    assert same(got, want)
    assert same(y.grad, want_grads[0])
    if pp is not None:
        assert same(pp.grad, want_grads[1]) and pp.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens, experts, topk, k, n, seed", [(150, 6, 2, 256, 192, 3), (61, 8, 3, 200, 72, 4)])
def test_grouped_linear_on_routed_tokens_equals_megatrons_permute_then_the_grouped_linear(
    backend, tokens, experts, topk, k, n, seed
):
    """``fp8_grouped_linear(x, routing, ...)`` reads the tokens through the permutation: the output and the
    gradients of x (each token's copies summed), the weights and the biases equal Megatron's ``permute`` followed by
    the grouped linear on the permuted copy, bit for bit."""
    from primus_fp8_plugin import fp8_grouped_linear

    routing_map, _ = routing_case(tokens, experts, topk, seed)
    num_out = tokens * topk
    x = make_input((tokens, k), seed=seed).requires_grad_(True)
    ws = [(0.05 * make_input((n, k), seed=seed + 10 + e, spread=False)).requires_grad_(True) for e in range(experts)]
    bs = [(0.1 * make_input((n,), seed=seed + 40 + e, spread=False)).requires_grad_(True) for e in range(experts)]
    dy = make_input((num_out, n), seed=seed + 99)
    r = route(routing_map, num_out)

    def run(fn):
        y = fn()
        y.backward(dy)
        grads = [p.grad for p in (x, *ws, *bs)]
        for p in (x, *ws, *bs):
            p.grad = None
        return y.detach(), grads

    got = run(lambda: fp8_grouped_linear(x, r, ws, bs, backend=backend))
    counts = routing_map.sum(0).tolist()
    want = run(lambda: fp8_grouped_linear(moe_utils.permute(x, routing_map, num_out_tokens=num_out)[0], counts, ws, bs,
                                          backend=backend))  # fmt: skip
    assert same(got[0], want[0])
    assert all(same(a, b) for a, b in zip(got[1], want[1]))


def test_routed_tokens_must_be_the_routings_tokens():
    """A routing of T tokens refuses an input with another number of rows, naming both."""
    from primus_fp8_plugin import fp8_grouped_linear

    routing_map, _ = routing_case(40, 4, 2, 9)
    r = route(routing_map, 80)
    ws = [make_input((64, 128), seed=20 + e, spread=False) for e in range(4)]
    with pytest.raises(ValueError, match=r"routes 40 tokens on cpu; the input has 39 rows"):
        fp8_grouped_linear(make_input((39, 128), seed=1), r, ws, backend="reference")


def test_the_combine_kernel_refuses_tables_that_are_not_int32():
    pytest.importorskip("triton")
    from primus_fp8_plugin.kernels.triton.permute import unpermute as kernel_unpermute

    r = route(routing_case(20, 4, 2, 5)[0], 40)
    y = make_input((40, 128), seed=6)
    with pytest.raises(TypeError, match="must be int32"):
        kernel_unpermute(y, r.token_rows.long(), r.token_offsets, None, torch.bfloat16)
