"""Grouped (MoE) FP8 kernels and the grouped linear on the GPU: equal bit for bit to a loop of the dense kernels
per expert, close to (and, where TE runs one GEMM per expert, equal to) TE's ``te.GroupedLinear`` under
Float8BlockScaling, replayable in a CUDA graph with the routing changing between replays. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import (
    BlockwiseRecipe,
    Fp8GroupedLinear,
    TensorRole,
    backend_availability,
    gemm_dgrad,
    gemm_fwd,
    gemm_wgrad,
    quantize_activation,
    quantize_weight,
)
from primus_fp8_plugin.grouped import (
    gemm_dgrad_grouped,
    gemm_fwd_grouped,
    gemm_wgrad_grouped,
    group_layout,
    quantize_activation_grouped,
    quantize_weight_grouped,
)
from primus_fp8_plugin.kernels.triton.gemm import blockwise_gemm
from primus_fp8_plugin.validate import rel_frobenius

from ..conftest import make_input

pytestmark = pytest.mark.gpu
COPIES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.fixture(params=["triton", "cublas", "hopper", "flydsl"])  # each skipped where unavailable
def gpu_backend(request):
    avail = backend_availability(request.param, "cuda")
    if not avail:
        pytest.skip(f"{request.param}: {avail.reason}")
    return request.param


def skewed(num_experts: int, tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, num_experts + 1).float() ** 1.3
    p = p[torch.randperm(num_experts, generator=g)]
    counts = (p / p.sum() * tokens).floor().long()
    counts[counts < 3] = 0  # a few empty experts
    counts[int(p.argmax())] += tokens - int(counts.sum())
    return counts.tolist()


ROUTINGS = [  # name, counts, K, N
    ("edges", [0, 1, 15, 16, 127, 128, 129, 1000], 1024, 768),
    ("skewed-64", skewed(64, 6000, 0), 512, 1536),
    ("qwen-like-128", skewed(128, 8192, 1), 2048, 1536),
]


def _case(counts, k, n, fmt):
    recipe = BlockwiseRecipe(fp8_format=fmt)
    t = sum(counts)
    x = make_input((t, k), seed=1).cuda()
    dy = make_input((t, n), seed=2).cuda()
    ws = [make_input((n, k), seed=10 + e, spread=False).cuda() for e in range(len(counts))]
    bias = make_input((len(counts), n), seed=3, spread=False).cuda()
    p = [recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT)]
    return recipe, x, dy, ws, bias, p


def _grouped(backend, x, dy, ws, bias, counts, p, device_counts):
    layout = group_layout(torch.tensor(counts, device="cuda") if device_counts else counts, x.shape[0], "cuda")
    xq = quantize_activation_grouped(x, layout, p[0], backend=backend)
    dyq = quantize_activation_grouped(dy, layout, p[2], backend=backend)
    wq = quantize_weight_grouped(ws, p[1], backend=backend)
    mg = [torch.randn(w.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(e)) for e, w in enumerate(ws)]
    start = [m.clone() for m in mg]
    gemm_wgrad_grouped(dyq, xq, accumulate_into=mg, backend=backend)
    return {
        "xq": xq.split(), "dyq": dyq.split(), "wq": [wq.expert(e) for e in range(len(ws))],
        "y": gemm_fwd_grouped(xq, wq, bias, backend=backend), "dx": gemm_dgrad_grouped(dyq, wq, backend=backend),
        "dw": gemm_wgrad_grouped(dyq, xq, backend=backend), "mg": mg, "start": start,
    }  # fmt: skip


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
@pytest.mark.parametrize("name, counts, k, n", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_grouped_kernels_equal_a_loop_of_the_portable_dense_kernels(name, counts, k, n, fmt):
    """The Triton grouped kernels against the portable Triton dense GEMM (``kernels/triton/gemm.py``, the
    same per-128-K promotion) and the triton backend's dense quantizers, expert by expert, bit for bit."""
    if not backend_availability("triton", "cuda"):
        pytest.skip(backend_availability("triton", "cuda").reason)
    _, x, dy, ws, bias, p = _case(counts, k, n, fmt)
    for device_counts in (False, True):
        got = _grouped("triton", x, dy, ws, bias, counts, p, device_counts)
        off = 0
        for e, c in enumerate(counts):
            xq = quantize_activation(x[off : off + c], p[0], backend="triton")
            dyq = quantize_activation(dy[off : off + c], p[2], backend="triton")
            wq = quantize_weight(ws[e], p[1], backend="triton")
            for ours, dense in ((got["xq"][e], xq), (got["dyq"][e], dyq), (got["wq"][e], wq)):
                assert all(same(getattr(ours, part), getattr(dense, part)) for part in COPIES), f"expert {e} quantization"
            y = blockwise_gemm(xq.rowwise_data, xq.rowwise_scale_inv, wq.rowwise_data, wq.rowwise_scale_inv,
                               b_block_dim=2, out_dtype=torch.bfloat16, bias=bias[e])  # fmt: skip
            dx = blockwise_gemm(dyq.rowwise_data, dyq.rowwise_scale_inv, wq.columnwise_data, wq.columnwise_scale_inv,
                                b_block_dim=2, out_dtype=torch.bfloat16)  # fmt: skip
            wgrad = (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv)
            dw = blockwise_gemm(*wgrad, b_block_dim=1, out_dtype=torch.bfloat16)
            mg = blockwise_gemm(*wgrad, b_block_dim=1, out_dtype=torch.float32, accumulate_into=got["start"][e].clone())
            assert same(got["y"][off : off + c], y), f"fwd, expert {e} (count {c})"
            assert same(got["dx"][off : off + c], dx), f"dgrad, expert {e} (count {c})"
            assert same(got["dw"][e], dw), f"wgrad, expert {e} (count {c})"
            assert same(got["mg"][e], mg), f"wgrad into main_grad, expert {e} (count {c})"
            off += c


def test_portable_kernels_through_unaligned_pointer_tables_give_the_aligned_bits():
    """The portable batched weight quantizer and grouped wgrad read and write the per-expert weights and
    main_grads through a pointer table in 16-byte accesses where every address allows it, in element accesses
    where one does not (here: every tensor one element off): the same bits, and no misaligned access."""
    from primus_fp8_plugin.kernels.triton.gemm_grouped import grouped_wgrad
    from primus_fp8_plugin.kernels.triton.pointer_table import pointer_table
    from primus_fp8_plugin.kernels.triton.quantize_grouped import quantize_128x128_batched

    counts, k, n = [0, 1, 16, 129, 256, 300], 1024, 768
    _, x, dy, ws, _, p = _case(counts, k, n, "E4M3")
    flat = torch.empty(len(ws) * n * k + 1, dtype=ws[0].dtype, device="cuda")
    shifted = [flat[1 + e * n * k :][: n * k].view(n, k).copy_(w) for e, w in enumerate(ws)]
    assert pointer_table(ws).align == 16 and pointer_table(shifted).align == 1
    wa, wb = quantize_128x128_batched(ws, p[1]), quantize_128x128_batched(shifted, p[1])
    assert all(same(getattr(wa, part), getattr(wb, part)) for part in COPIES)
    layout = group_layout(torch.tensor(counts, device="cuda"), x.shape[0], "cuda")
    xq = quantize_activation_grouped(x, layout, p[0], backend="triton")
    dyq = quantize_activation_grouped(dy, layout, p[2], backend="triton")
    ops = (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, layout)
    start = torch.randn(len(counts), n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    aligned = [s.clone() for s in start]
    mg_buf = torch.empty(len(counts) * n * k + 1, device="cuda")
    unaligned = [mg_buf[1 + e * n * k :][: n * k].view(n, k).copy_(s) for e, s in enumerate(start)]
    assert pointer_table(aligned).align == 16 and pointer_table(unaligned).align == 1
    for mg in (aligned, unaligned):
        grouped_wgrad(*ops, out_dtype=torch.float32, accumulate_into=mg)
    assert all(same(a, b) for a, b in zip(aligned, unaligned))
    assert not same(aligned[-1], start[-1]), "dW was added"


def test_backend_wgrad_into_main_grad_over_many_tokens_per_expert_equals_the_dense_loop():
    """At 512 or more tokens per expert the triton backend accumulates into main_grads lying in one span (Megatron's
    gradient buffer) with the Gluon grouped wgrad on Hopper (kernels/sm90/heuristics.grouped_wgrad): bit for bit
    the portable dense kernel per expert, over repeated calls."""
    from primus_fp8_plugin.kernels.sm90 import heuristics as H

    counts, k, n = [600, 700, 0, 1000, 513, 1300], 1024, 768
    _, x, dy, _, _, p = _case(counts, k, n, "E4M3")
    layout = group_layout(torch.tensor(counts, device="cuda"), x.shape[0], "cuda")
    xq = quantize_activation_grouped(x, layout, p[0], backend="triton")
    dyq = quantize_activation_grouped(dy, layout, p[2], backend="triton")
    buf = torch.randn(len(counts) * n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    mg = list(buf.view(len(counts), n, k).unbind(0))
    from primus_fp8_plugin.kernels.sm90.target import runs_on

    chosen = H.grouped_wgrad(dyq.columnwise_data, xq.columnwise_data, torch.float32, mg)
    assert (chosen is H.GROUPED_WGRAD_MAIN_GRAD_256x128) == runs_on(x.device), "Hopper takes the Gluon kernel here"
    start = [m.clone() for m in mg]
    for _ in range(3):
        gemm_wgrad_grouped(dyq, xq, accumulate_into=mg, backend="triton")
    xs, dys = xq.split(), dyq.split()
    for e in range(len(counts)):
        args = (dys[e].columnwise_data, dys[e].columnwise_scale_inv, xs[e].columnwise_data, xs[e].columnwise_scale_inv)
        ref = start[e].clone()
        for _ in range(3):
            ref = blockwise_gemm(*args, b_block_dim=1, out_dtype=torch.float32, accumulate_into=ref)
        assert same(mg[e], ref), f"expert {e} (count {counts[e]})"


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
def test_grouped_gemms_against_the_backends_own_dense_gemms(gpu_backend, fmt):
    """Against the backend's dense GEMMs (on Hopper: Gluon for triton; cuBLAS for cublas; both for hopper).
    fwd and dgrad must be bit-identical (every dense fwd/dgrad kernel is bit-identical to TE's te.Linear and
    promotes each 128-K block's tensor-core product the same way); the wgrad kernels (1x128 x 1x128) may sum
    inside a block in another order (cuBLAS's and Gluon's differ by ~1e-7 relative, docs: hopper.py), so
    wgrad is held to 1e-6 relative and whether it is bit-identical is printed."""
    counts, k, n = [0, 1, 16, 129, 256, 300], 1024, 1536
    _, x, dy, ws, bias, p = _case(counts, k, n, fmt)
    got = _grouped(gpu_backend, x, dy, ws, bias, counts, p, device_counts=True)
    off, bad = 0, []
    for e, c in enumerate(counts):
        xq = quantize_activation(x[off : off + c], p[0], backend=gpu_backend)
        dyq = quantize_activation(dy[off : off + c], p[2], backend=gpu_backend)
        wq = quantize_weight(ws[e], p[1], backend=gpu_backend)
        dense = {
            "y": gemm_fwd(xq, wq, bias[e], backend=gpu_backend), "dx": gemm_dgrad(dyq, wq, backend=gpu_backend),
            "dw": gemm_wgrad(dyq, xq, backend=gpu_backend),
            "mg": gemm_wgrad(dyq, xq, accumulate_into=got["start"][e].clone(), backend=gpu_backend),
        }  # fmt: skip
        ours = {"y": got["y"][off : off + c], "dx": got["dx"][off : off + c], "dw": got["dw"][e], "mg": got["mg"][e]}
        base = {"mg": got["start"][e]}  # main_grad: compare what was added
        for key in dense:
            if not same(ours[key], dense[key]):
                a, b = ours[key] - base.get(key, 0), dense[key] - base.get(key, 0)
                bad.append((key, e, c, rel_frobenius(a, b) if c else None))
        off += c
    print(f"{gpu_backend} {fmt}: not bit-identical to the dense GEMMs (gemm, expert, count, rel. error): {bad or 'none'}")
    assert not [b for b in bad if b[0] in ("y", "dx")], f"{gpu_backend}: fwd/dgrad differ from the dense GEMMs: {bad}"
    assert all(b[3] is not None and b[3] <= 1e-6 for b in bad), f"{gpu_backend}: wgrad beyond 1e-6: {bad}"


def test_grouped_linear_matches_te_grouped_linear(gpu_backend):
    """Same weights and inputs as TE's te.GroupedLinear under Float8BlockScaling (counts multiples of 16, as
    Megatron pads them for TE): within 2e-3 (the recipe's tolerance); printed, and 0.0 where TE runs
    cuBLAS's blockwise GEMM per expert (bit-identical dense GEMMs, docs/NUMERICS.md)."""
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import Float8BlockScaling

    counts, k, n = [0, 16, 128, 144, 512, 1040], 1024, 768
    torch.manual_seed(0)
    ours = Fp8GroupedLinear(len(counts), k, n, bias=True, device="cuda", dtype=torch.bfloat16, backend=gpu_backend)
    theirs = te.GroupedLinear(len(counts), k, n, bias=True, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for i in range(len(counts)):
            getattr(theirs, f"weight{i}").copy_(getattr(ours, f"weight{i}"))
            getattr(theirs, f"bias{i}").copy_(getattr(ours, f"bias{i}"))
    x = make_input((sum(counts), k), seed=3).cuda()
    dy = make_input((sum(counts), n), seed=4).cuda()
    res = []
    for layer in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        if layer is theirs:
            ctx = te.autocast(enabled=True, recipe=Float8BlockScaling()) if hasattr(te, "autocast") else \
                te.fp8_autocast(enabled=True, fp8_recipe=Float8BlockScaling())  # fmt: skip
            with ctx:
                y = layer(xi, counts)
        else:
            y = layer(xi, counts)
        y.backward(dy)
        grads = [getattr(layer, f"weight{i}").grad for i in range(len(counts))]
        bgrads = [getattr(layer, f"bias{i}").grad for i in range(len(counts))]
        res.append((y.detach(), xi.grad, torch.cat([g.flatten() for g in grads]), torch.cat(bgrads)))
    errs = {name: rel_frobenius(a, b) for name, a, b in zip(("out", "dgrad", "wgrad", "bgrad"), *res, strict=True)}
    print(f"{gpu_backend} grouped vs TE te.GroupedLinear: {errs}")
    assert all(e <= 2e-3 for e in errs.values()), errs


def test_cuda_graph_replays_follow_the_routing_on_the_device(gpu_backend):
    """The grouped linear's forward with device-side counts, captured once: replays after the counts (and the
    tokens) change in place compute what an eager uncached layer computes for the new routing."""
    torch.manual_seed(0)
    e, k, n, t = 8, 512, 768, 2048
    layer = Fp8GroupedLinear(e, k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=gpu_backend)
    eager = Fp8GroupedLinear(e, k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=gpu_backend,
                             cache_weight=False)  # fmt: skip
    eager.load_state_dict(layer.state_dict())
    counts = torch.tensor([256] * e, device="cuda", dtype=torch.int32)
    x = make_input((t, k), seed=5).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up: compiles, builds the pointer tables
        for _ in range(2):
            layer(x, counts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y = layer(x, counts)
    for i, routing in enumerate(([0, 0, 2048, 0, 0, 0, 0, 0], [1, 2, 3, 500, 0, 1000, 42, 500], skewed(e, t, 7))):
        counts.copy_(torch.tensor(routing, dtype=torch.int32))
        x.copy_(make_input((t, k), seed=20 + i).cuda())
        graph.replay()
        with torch.no_grad():
            expected = eager(x, routing)
        assert same(y, expected), f"replay {i} (routing {routing}) differs from the eager layer"


TE_ROUTINGS = [  # name, counts, K, N: the edge counts, a skewed routing with empty experts, Megatron's 16-aligned
    ("edges", [0, 1, 15, 16, 127, 128, 129, 200], 1024, 768),
    ("skewed-32", skewed(32, 4000, 3), 512, 1024),
    ("aligned16", [0, 16, 128, 144, 512, 1040], 1024, 768),
]


def _te_autocast(te, recipe):
    return te.autocast(enabled=True, recipe=recipe) if hasattr(te, "autocast") else \
        te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # fmt: skip


def _pad(t, counts, align):
    return torch.cat([q for p, c in zip(torch.split(t, counts), counts) for q in (p, t.new_zeros((-c) % align, t.shape[1]))])


def _unpad(t, counts, align):
    return torch.cat([p[:c] for p, c in zip(torch.split(t, [c + (-c) % align for c in counts]), counts)])


def _te_grouped(te, recipe, ws, bias, x, dy, counts, align=0):
    """te.GroupedLinear forward + backward (tokens padded per expert with zero rows to ``align`` if > 0, the padding
    rows dropped again): (out, dgrad, wgrad [E, N, K], bgrad [E, N])."""
    e, (n, k) = len(ws), ws[0].shape
    layer = te.GroupedLinear(e, k, n, bias=True, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for i in range(e):
            getattr(layer, f"weight{i}").copy_(ws[i])
            getattr(layer, f"bias{i}").copy_(bias[i])
    splits = [c + (-c) % align for c in counts] if align else counts
    xi = (_pad(x, counts, align) if align else x).clone().requires_grad_(True)
    with _te_autocast(te, recipe):
        y = layer(xi, splits)
    y.backward(_pad(dy, counts, align) if align else dy)
    dx, out = xi.grad, y.detach()
    if align:
        out, dx = _unpad(out, counts, align), _unpad(dx, counts, align)
    grad = lambda p, shape: torch.zeros(shape, device="cuda", dtype=torch.bfloat16) if p.grad is None else p.grad  # noqa: E731
    dw = torch.stack([grad(getattr(layer, f"weight{i}"), (n, k)) for i in range(e)])
    db = torch.stack([grad(getattr(layer, f"bias{i}"), (n,)) for i in range(e)])
    return out, dx, dw, db


def _te_dense_per_expert(te, recipe, ws, bias, x, dy, counts):
    """te.Linear on each expert's tokens (an expert without tokens: zero gradients), padded to 16 rows where
    te.Linear refuses the count: what TE's per-expert path computes."""
    outs, dxs, dws, dbs = [], [], [], []
    for i, (xe, dye) in enumerate(zip(torch.split(x, counts), torch.split(dy, counts))):
        n, k = ws[i].shape
        if xe.shape[0] == 0:
            outs.append(xe.new_zeros(0, n)), dxs.append(xe.new_zeros(0, k))
            dws.append(ws[i].new_zeros(n, k)), dbs.append(bias[i].new_zeros(n))
            continue
        lin = te.Linear(k, n, bias=True, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            lin.weight.copy_(ws[i])
            lin.bias.copy_(bias[i])
        for pad in (0, 16):  # te.Linear may accept a count in forward and refuse it in wgrad: try both passes
            xi = (_pad(xe, [xe.shape[0]], pad) if pad else xe).clone().requires_grad_(True)
            lin.weight.grad = lin.bias.grad = None
            try:
                with _te_autocast(te, recipe):
                    y = lin(xi)
                y.backward(_pad(dye, [dye.shape[0]], pad) if pad else dye)
                break
            except (RuntimeError, AssertionError, ValueError):
                if pad:
                    raise
        c = xe.shape[0]
        outs.append(y.detach()[:c]), dxs.append(xi.grad[:c]), dws.append(lin.weight.grad), dbs.append(lin.bias.grad)
    return torch.cat(outs), torch.cat(dxs), torch.stack(dws), torch.stack(dbs)


@pytest.mark.parametrize("fmt", ["E4M3", "HYBRID"])
@pytest.mark.parametrize("name, counts, k, n", TE_ROUTINGS, ids=[r[0] for r in TE_ROUTINGS])
def test_grouped_linear_against_te_grouped_linear_at_edge_counts(gpu_backend, name, counts, k, n, fmt):
    """Fp8GroupedLinear against te.GroupedLinear under Float8BlockScaling (same weights, bias, inputs; counts 0, 1, 15,
    16, 127, 128, 129, skewed, 16-aligned; E4M3 and HYBRID): fwd, dgrad, wgrad, bgrad. Where TE's grouped results
    equal te.Linear run on each expert (TE's per-expert path), fwd, dgrad and bgrad must be TE's bits and wgrad within
    1e-6 (the wgrad kernels may sum inside a 128-block in another order; bit-exactness is printed); otherwise all
    within 2e-3. Where TE refuses counts that are not multiples of 16, TE runs on the tokens padded per expert with zero
    rows (Megatron's padding; zero rows change no scale and no product) and the padding rows are dropped."""
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import Float8BlockScaling, Format

    recipe = Float8BlockScaling(fp8_format=getattr(Format, fmt))
    ours_recipe, x, dy, ws, bias, _ = _case(counts, k, n, fmt)
    align = 0
    try:
        theirs = _te_grouped(te, recipe, ws, bias, x, dy, counts)
    except (RuntimeError, AssertionError, ValueError) as err:
        assert any(c % 16 for c in counts), f"TE refused 16-aligned counts: {err}"
        align = 16
        print(f"{name}: TE refused the raw counts ({type(err).__name__}: {str(err)[:160]}); TE runs on 16-padded tokens")
        theirs = _te_grouped(te, recipe, ws, bias, x, dy, counts, align=16)
    te_dense = _te_dense_per_expert(te, recipe, ws, bias, x, dy, counts)
    layer = Fp8GroupedLinear(len(counts), k, n, bias=True, device="cuda", dtype=torch.bfloat16, recipe=ours_recipe,
                             backend=gpu_backend)  # fmt: skip
    with torch.no_grad():
        for i in range(len(counts)):
            getattr(layer, f"weight{i}").copy_(ws[i])
            getattr(layer, f"bias{i}").copy_(bias[i])
    xi = x.clone().requires_grad_(True)
    y = layer(xi, counts)
    y.backward(dy)
    ours = (y.detach(), xi.grad, torch.stack([w.grad for w in layer.weights]), torch.stack([b.grad for b in layer.biases]))
    kinds = ("out", "dgrad", "wgrad", "bgrad")
    report, bad = [], []
    for kind, a, b, d in zip(kinds, ours, theirs, te_dense, strict=True):
        per_expert_path = same(b, d)
        exact, err = same(a, b), rel_frobenius(a, b)
        report.append(f"{kind}: rel {err:.2e}, {'bits equal' if exact else 'bits differ'}, TE per-expert path "
                      f"{'yes' if per_expert_path else 'no'}")  # fmt: skip
        if per_expert_path and kind != "wgrad":
            ok = exact
        elif per_expert_path:
            ok = err <= 1e-6
        else:
            ok = err <= 2e-3
        if not ok:
            bad.append(f"{kind} (ours vs TE's te.Linear per expert: rel {rel_frobenius(a, d):.2e})")
    print(f"{gpu_backend} {name} {fmt}{' (TE on 16-padded tokens)' if align else ''}: " + "; ".join(report))
    assert not bad, f"{gpu_backend} {name} {fmt}: {bad}; {report}"
