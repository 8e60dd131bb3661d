"""Fp8GroupedLinear / fp8_grouped_linear: forward and backward equal the plugin's dense linear run on each
expert's tokens, bit for bit; the grouped weight cache; main_grad accumulation; what is saved; bad input."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, Fp8BlockwiseLinear, Fp8GroupedLinear, available_backends, fp8_grouped_linear

from .conftest import make_input

CPU_BACKENDS = [n for n, a in available_backends("cpu").items() if a]


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def dense_experts(layer: Fp8GroupedLinear, backend) -> list[Fp8BlockwiseLinear]:
    """One dense plugin layer per expert, holding the grouped layer's weights (copies)."""
    out = []
    for i in range(layer.num_gemms):
        d = Fp8BlockwiseLinear(layer.in_features, layer.out_features, bias=layer.use_bias, dtype=layer.weight0.dtype,
                               recipe=layer.recipe, backend=backend)  # fmt: skip
        with torch.no_grad():
            d.weight.copy_(getattr(layer, f"weight{i}"))
            if layer.use_bias:
                d.bias.copy_(getattr(layer, f"bias{i}"))
        out.append(d)
    return out


def run_dense(experts, x, dy, counts):
    x = x.detach().clone().requires_grad_(True)
    ys = [m(part) for m, part in zip(experts, torch.split(x, counts))]
    y = torch.cat(ys)
    y.backward(dy)
    return y, x.grad


def give_main_grads(params, seed):
    """fp32 main_grads, views of one buffer in reverse order with gaps (Megatron's buffers are not adjacent)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [p.numel() for p in params]
    buf = torch.randn(sum(sizes) + 64 * len(params), generator=g)
    off = 0
    for p, size in zip(reversed(params), reversed(sizes)):
        p.main_grad = buf[off : off + size].view(p.shape)
        p.grad_added_to_main_grad = False
        off += size + 64
    return [p.main_grad.clone() for p in params]


CASES = [
    # counts, K, N, bias, format, x dtype, main_grad
    ([0, 130, 1, 16], 144, 128, True, "E4M3", torch.bfloat16, False),
    ([129, 0, 15, 127, 128], 128, 136, False, "HYBRID", torch.bfloat16, True),
    ([40, 7], 256, 128, True, "HYBRID", torch.float32, True),
]


@pytest.mark.parametrize("counts, k, n, bias, fmt, dtype, main_grad", CASES)
def test_grouped_linear_equals_dense_linear_per_expert(backend, counts, k, n, bias, fmt, dtype, main_grad):
    torch.manual_seed(0)
    layer = Fp8GroupedLinear(len(counts), k, n, bias=bias, dtype=dtype, recipe=BlockwiseRecipe(fp8_format=fmt), backend=backend)
    experts = dense_experts(layer, backend)
    t = sum(counts)
    x = make_input((t, k), dtype=dtype, seed=1)
    dy = make_input((t, n), dtype=dtype, seed=2)
    if main_grad:
        start = give_main_grads(layer.weights, seed=3)
        for d, mg in zip(experts, start):
            d.weight.main_grad = mg.clone()
            d.weight.grad_added_to_main_grad = False
    y_ref, dx_ref = run_dense(experts, x, dy, counts)

    xg = x.clone().requires_grad_(True)
    y = layer(xg, counts)
    y.backward(dy)
    assert same(y, y_ref) and same(xg.grad, dx_ref)
    for i, d in enumerate(experts):
        w = getattr(layer, f"weight{i}")
        if main_grad:
            assert same(w.main_grad, d.weight.main_grad), f"main_grad of expert {i} (count {counts[i]})"
            assert w.grad_added_to_main_grad and w.grad is not None and w.grad.shape == w.shape  # dummy for the hooks
        else:
            assert same(w.grad, d.weight.grad), f"weight grad of expert {i} (count {counts[i]})"
        if bias:  # counts on the host: the dense layer's bias gradient, bit for bit
            assert same(getattr(layer, f"bias{i}").grad, d.bias.grad), f"bias grad of expert {i}"


def test_single_grouped_weight_is_the_per_expert_layer_in_one_parameter(backend):
    """``single_grouped_weight=True``: one ``weight [E, out, in]`` parameter, the per-expert layer's initial weights for
    a seed, its output and every gradient bit for bit (expert ``i``'s in ``weight.grad[i]``; ``main_grad`` accumulated
    twice), and state dicts of either layout load into the other."""
    counts, k, n = [33, 0, 140, 20], 128, 136
    layers = []
    for single in (False, True):
        torch.manual_seed(4)
        layers.append(Fp8GroupedLinear(4, k, n, bias=True, dtype=torch.bfloat16, backend=backend,
                                       single_grouped_weight=single))  # fmt: skip
    per_expert, single = layers
    assert [name for name, _ in single.named_parameters()] == ["weight", *(f"bias{i}" for i in range(4))]
    assert single.weight.shape == (4, n, k) and "single_grouped_weight=True" in repr(single)
    assert all(torch.equal(single.weight[i], w) for i, w in enumerate(per_expert.weights))
    x, dy = make_input((193, k), seed=6), make_input((193, n), seed=7)
    outs = []
    for layer in layers:
        xg = x.clone().requires_grad_(True)
        y = layer(xg, counts)
        y.backward(dy)
        outs.append((y, xg.grad, [w.grad for w in layer.weights], [b.grad for b in layer.biases]))
    (y0, dx0, dw0, db0), (y1, dx1, dw1, db1) = outs
    assert same(y0, y1) and same(dx0, dx1) and all(same(a, b) for a, b in zip(db0, db1))
    assert len(dw1) == 1 and all(same(dw1[0][i], g) for i, g in enumerate(dw0))
    assert dw1[0][0].abs().sum() > 0 and dw1[0][1].abs().sum() == 0  # expert 1 has no tokens
    # main_grad: the grouped wgrad accumulates into the single weight's main_grad, twice
    for layer in layers:
        for w in layer.weights:
            w.grad, w.main_grad, w.grad_added_to_main_grad = None, torch.zeros(w.shape), False
        for _ in range(2):
            layer(x, counts).backward(dy)
    assert all(same(single.weight.main_grad[i], w.main_grad) for i, w in enumerate(per_expert.weights))
    # state dicts both ways (new weights first, so that a no-op load would fail)
    with torch.no_grad():
        single.weight.mul_(0.5)
    per_expert.load_state_dict(single.state_dict())
    assert all(torch.equal(w, single.weight[i]) for i, w in enumerate(per_expert.weights))
    with torch.no_grad():
        for w in per_expert.weights:
            w.mul_(-1)
    single.load_state_dict(per_expert.state_dict())
    assert torch.equal(single.weight, torch.stack(per_expert.weights))
    state = single.state_dict()
    state["weight"] = state["weight"][:3]
    with pytest.raises(RuntimeError, match=r"cannot split weight of shape \(3, 136, 128\) into 4 experts"):
        per_expert.load_state_dict(state)


def test_device_counts_give_the_host_counts_results(backend):
    counts = [3, 0, 140, 20]
    torch.manual_seed(1)
    layer = Fp8GroupedLinear(4, 128, 128, bias=True, dtype=torch.bfloat16, backend=backend)
    x, dy = make_input((163, 128), seed=4), make_input((163, 128), seed=5)
    grads = []
    for m_splits in (counts, torch.tensor(counts)):
        layer.zero_grad()
        xg = x.clone().requires_grad_(True)
        y = layer(xg, m_splits)
        y.backward(dy)
        grads.append((y, xg.grad, [w.grad.clone() for w in layer.weights], [b.grad.clone() for b in layer.biases]))
    (ya, dxa, dwa, dba), (yb, dxb, dwb, dbb) = grads
    assert same(ya, yb) and same(dxa, dxb)
    assert all(same(a, b) for a, b in zip(dwa + dba, dwb + dbb))


def test_weight_cache_quantizes_once_per_weight_change(backend):
    torch.manual_seed(2)
    layer = Fp8GroupedLinear(3, 128, 128, bias=False, dtype=torch.bfloat16, backend=backend)
    cache = layer.weight_cache
    x = make_input((50, 128), seed=6)
    counts = [20, 0, 30]
    y0 = layer(x, counts)
    layer(x, counts)
    assert cache.refreshes == 1 and layer.weight_cache_nbytes > 0
    first = cache._value
    # an optimizer step re-quantizes all experts once
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x.clone().requires_grad_(True), counts).float().sum().backward()
    assert cache.refreshes == 1  # backward reuses the cached copies
    opt.step()
    y1 = layer(x, counts)
    layer(x, counts)
    assert cache.refreshes == 2 and cache._value is not first and not same(y0, y1)
    # an in-place edit of one expert's weight: every expert's copy is re-made, the edited one from its new values
    with torch.no_grad():
        layer.weight1.mul_(2)
    layer(x, counts)
    assert cache.refreshes == 3
    uncached = fp8_grouped_linear(x, counts, layer.weights, recipe=layer.recipe, backend=backend)
    assert same(layer(x, counts), uncached)
    # is_first_microbatch forces one refresh
    layer.is_first_microbatch = True
    layer(x, counts)
    assert cache.refreshes == 4 and layer.is_first_microbatch is False
    assert not [k for k in layer.state_dict() if "cache" in k.lower()]
    assert sorted(layer.state_dict()) == ["weight0", "weight1", "weight2"]


def test_saved_activation_is_only_the_padded_columnwise_copy(backend):
    """What autograd keeps between forward and backward: X's columnwise FP8 copy (T rounded up per expert to
    128) and scales, plus the weights; never the high-precision input."""
    layer = Fp8GroupedLinear(2, 256, 128, bias=False, dtype=torch.bfloat16, backend=backend)
    counts = [128, 128]
    x = make_input((256, 256), seed=7).requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, counts)
    params = {p.data_ptr() for p in layer.parameters()}
    act = [t for t in saved if t.data_ptr() not in params]
    assert sum(t.numel() * t.element_size() for t in act) == 256 * 256 + 2 * 256 * 4  # FP8 bytes + fp32 scales
    assert not any(t.dtype == torch.bfloat16 for t in act)


def test_bad_input_is_refused():
    layer = Fp8GroupedLinear(2, 128, 128, bias=False, dtype=torch.bfloat16, backend="reference")
    x = make_input((10, 128), seed=0)
    with pytest.raises(ValueError, match="sum to"):
        layer(x, [3, 3])
    with pytest.raises(ValueError, match="2 experts"):
        layer(x, [10, 0, 0])
    with pytest.raises(ValueError, match="in_features"):
        layer(make_input((10, 64), seed=0), [5, 5])
    layer.weight0.main_grad = torch.zeros(128, 128)
    xg = x.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="every expert weight has a main_grad"):
        layer(xg, [5, 5]).float().sum().backward()
    layer.weight1.main_grad = torch.zeros(128, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight 1's main_grad must be a contiguous float32"):
        layer(x.clone().requires_grad_(True), [5, 5]).float().sum().backward()
    with pytest.raises(ValueError, match="num_gemms"):
        Fp8GroupedLinear(0, 128, 128)


def test_backward_twice_with_retain_graph_gives_the_same_gradients(backend):
    torch.manual_seed(5)
    layer = Fp8GroupedLinear(3, 128, 128, bias=True, dtype=torch.bfloat16, backend=backend)
    x = make_input((150, 128), seed=11).requires_grad_(True)
    dy = make_input((150, 128), seed=12)
    y = layer(x, [20, 0, 130])
    y.backward(dy, retain_graph=True)
    first = [t.grad.clone() for t in (x, *layer.parameters())]
    for t in (x, *layer.parameters()):
        t.grad = None
    y.backward(dy)
    assert all(same(a, t.grad) for a, t in zip(first, (x, *layer.parameters())))


def test_fused_wgrad_returns_one_shared_placeholder_not_one_per_expert(backend):
    """Under Megatron's protocol (``grad_added_to_main_grad``) the gradients go into ``main_grad`` and autograd
    gets a placeholder per weight: one tensor per shape shared by every expert (what TE returns too), so backward
    does not allocate ``E`` weight-sized tensors at once; the parameters' hooks still run."""
    torch.manual_seed(6)
    layer = Fp8GroupedLinear(4, 128, 256, bias=False, dtype=torch.bfloat16, backend=backend)
    give_main_grads(layer.weights, seed=3)
    x = make_input((200, 128), seed=13).requires_grad_(True)
    seen = []
    for w in layer.weights:
        w.register_hook(lambda g: seen.append((g.untyped_storage().data_ptr(), tuple(g.shape))))
    layer(x, [50, 0, 100, 50]).backward(make_input((200, 256), seed=14))
    assert len(seen) == 4 and set(seen) == {(seen[0][0], (256, 128))}  # every hook saw the one placeholder tensor
    assert all(w.grad_added_to_main_grad for w in layer.weights)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_a_layer_of_other_weight_dtypes_is_refused_with_the_fix(dtype):
    with pytest.raises(TypeError, match=r"Fp8GroupedLinear keeps bfloat16, float16 or float32 weights \(pass dtype"):
        Fp8GroupedLinear(2, 128, 128, dtype=dtype)


@pytest.mark.parametrize(
    "counts, f, n, probs_dtype, fmt",
    [([0, 70, 129, 1], 144, 136, torch.float32, "E4M3"), ([200, 0, 33], 128, 128, torch.bfloat16, "HYBRID"),
     ([40, 90], 256, 128, None, "E4M3")],
)  # fmt: skip
def test_grouped_swiglu_linear_equals_megatrons_activation_then_the_grouped_linear(backend, counts, f, n, probs_dtype, fmt):
    """``fp8_grouped_swiglu_linear(h, probs=p)`` against what Megatron's grouped experts compute between fc1 and
    fc2 (``(F.silu(gate) * up * p[:, None]).to(h.dtype)``, torch's own ops) followed by ``fp8_grouped_linear``: the
    same output, and the same gradients of h, probs, the weights (into ``main_grad``) and the biases, bit for bit."""
    import torch.nn.functional as F

    from primus_fp8_plugin import fp8_grouped_swiglu_linear

    recipe = BlockwiseRecipe(fp8_format=fmt)
    t = sum(counts)
    g = torch.Generator().manual_seed(f)
    h0 = make_input((t, 2 * f), seed=5, spread=False) * 3
    p0 = None if probs_dtype is None else torch.rand(t, generator=g).to(probs_dtype)
    ws0 = [(0.05 * make_input((n, f), seed=20 + e, spread=False)) for e in range(len(counts))]
    bs0 = [(0.1 * make_input((n,), seed=40 + e, spread=False)) for e in range(len(counts))]
    dy = make_input((t, n), seed=6)

    def leaves():
        h = h0.clone().requires_grad_(True)
        p = None if p0 is None else p0.clone().requires_grad_(True)
        ws = [w.clone().requires_grad_(True) for w in ws0]
        for w in ws:
            w.main_grad, w.grad_added_to_main_grad = torch.zeros(n, f), False
        return h, p, ws, [b.clone().requires_grad_(True) for b in bs0]

    h, p, ws, bs = leaves()
    gate, up = torch.chunk(h, 2, dim=-1)
    act = F.silu(gate) * up
    if p is not None:
        act = (act * p.unsqueeze(-1)).to(h.dtype)
    y_ref = fp8_grouped_linear(act, counts, ws, bs, recipe=recipe, backend=backend)
    y_ref.backward(dy)
    ref = [h.grad, None if p is None else p.grad, *[w.main_grad for w in ws], *[b.grad for b in bs]]

    h, p, ws, bs = leaves()
    y = fp8_grouped_swiglu_linear(h, torch.tensor(counts), ws, bs, probs=p, recipe=recipe, backend=backend)
    y.backward(dy)
    got = [h.grad, None if p is None else p.grad, *[w.main_grad for w in ws], *[b.grad for b in bs]]
    assert same(y, y_ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert (a is None and b is None) or same(a, b), f"gradient {i}"
    assert h.grad.abs().sum() > 0 and (p is None or p.grad.abs().sum() > 0)
