"""The MoE fusions on the GPU, bit for bit against their unfused compositions on the same GPU (the CPU tests check
them through Triton's interpreter): SwiGLU times the routing probabilities fused into the grouped quantizer
(``fp8_grouped_swiglu_linear``, outputs and gradients), the permutation fused into the grouped quantizer, and the
weighted combine (against Megatron's ``unpermute`` under ``torch.use_deterministic_algorithms``, where it adds each
token's rows in order in fp32)."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, TensorRole, fp8_grouped_linear, fp8_grouped_swiglu_linear
from primus_fp8_plugin.permutation import permute_probs, permute_quantize, route, unpermute
from primus_fp8_plugin.swiglu import swiglu

from ..conftest import make_input

pytestmark = pytest.mark.gpu
COPIES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("probs_dtype", [torch.float32, torch.bfloat16, None])
def test_grouped_swiglu_linear_equals_the_composition_on_the_gpu(probs_dtype):
    counts, f, n = [512, 0, 129, 1, 1000, 300], 768, 2048
    t = sum(counts)
    g = torch.Generator().manual_seed(0)
    h0 = (make_input((t, 2 * f), seed=1, spread=False) * 3).cuda()
    p0 = None if probs_dtype is None else torch.rand(t, generator=g).to(probs_dtype).cuda()
    ws0 = [(0.05 * make_input((n, f), seed=10 + e, spread=False)).cuda() for e in range(len(counts))]
    dy = make_input((t, n), seed=2).cuda()
    results = []
    for fused in (False, True):
        h = h0.clone().requires_grad_(True)
        p = None if p0 is None else p0.clone().requires_grad_(True)
        ws = [w.clone().requires_grad_(True) for w in ws0]
        if fused:
            y = fp8_grouped_swiglu_linear(h, torch.tensor(counts, device="cuda"), ws, probs=p, backend="triton")
        else:
            act = swiglu(h, backend="triton")  # the plugin's SwiGLU (NUMERICS.md), not torch's CUDA silu_backward
            act = act if p is None else (act * p.unsqueeze(-1)).to(h.dtype)
            y = fp8_grouped_linear(act, counts, ws, backend="triton")
        y.backward(dy)
        results.append([y, h.grad, *[w.grad for w in ws]] + ([] if p is None else [p.grad]))
    for i, (a, b) in enumerate(zip(*results)):
        assert same(a, b), f"result {i}"


def test_permute_quantize_and_the_weighted_combine_on_the_gpu():
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    tokens, experts, topk, k = 4096, 64, 8, 1024
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(tokens, experts, generator=g)
    scores[:, :8] -= 10  # starved experts
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, scores.topk(topk, 1).indices, True).cuda()
    probs = (torch.softmax(scores, 1).cuda() * routing_map).requires_grad_(True)
    x = make_input((tokens, k), seed=4).cuda()
    n = tokens * topk
    r = route(routing_map, n)
    want_x, want_probs, want_idx, *_ = moe_utils.permute(x, routing_map, probs=probs, num_out_tokens=n)
    assert torch.equal(r.sorted_indices, want_idx) and same(permute_probs(probs, r), want_probs)
    params = BlockwiseRecipe().params(TensorRole.INPUT)
    from primus_fp8_plugin.backends import get_backend

    want = get_backend("triton", "cuda").quantize_act_grouped(want_x, r.layout, params, rowwise=True, columnwise=True)
    got = permute_quantize(x, r, params, backend="triton")
    cut = int(r.layout.padded_offsets[-1])
    parts = {"columnwise_data": (slice(None), slice(0, cut)), "columnwise_scale_inv": (slice(0, cut // 128),)}
    for copy in COPIES:
        where = parts.get(copy, (slice(None),))
        assert same(getattr(got, copy)[where], getattr(want, copy)[where]), copy

    y0 = make_input((n, k), seed=5, spread=False).cuda()
    dout = make_input((tokens, k), seed=6, spread=False).cuda()
    torch.use_deterministic_algorithms(True)
    try:
        y = y0.clone().requires_grad_(True)
        ref = moe_utils.unpermute(y, r.sorted_indices, torch.Size((tokens, k)), probs=probs, routing_map=routing_map)
        ref.backward(dout)
    finally:
        torch.use_deterministic_algorithms(False)
    y2 = y0.clone().requires_grad_(True)
    pp = permute_probs(probs, r).detach().requires_grad_(True)
    out = unpermute(y2, r, probs=pp, backend="triton")
    out.backward(dout)
    assert same(out, ref) and same(y2.grad, y.grad) and same(pp.grad, permute_probs(probs.grad, r))
