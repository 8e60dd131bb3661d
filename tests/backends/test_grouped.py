"""Grouped (MoE) quantization and GEMMs: bit for bit equal to a loop of the same backend's dense operations
over the experts, on ragged routings (counts 0, 1, 15, 16, 127, 128, 129, skewed, 1 to 64 experts), E4M3 and
HYBRID, with and without a bias, into fresh gradients and into ``main_grad`` buffers that are not adjacent.

On the CPU the Triton kernels run through Triton's interpreter (tests/conftest.py); the reference backend's
grouped operations are its dense ones in a loop, so for it this checks the grouped layouts (assembly and
``split``)."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import (
    BlockwiseRecipe,
    QuantParams,
    TensorRole,
    backend_availability,
    gemm_dgrad,
    gemm_fwd,
    gemm_wgrad,
    quantize_activation,
    quantize_weight,
)
from primus_fp8_plugin.backends.base import Availability, Backend
from primus_fp8_plugin.grouped import (
    gemm_dgrad_grouped,
    gemm_fwd_grouped,
    gemm_wgrad_grouped,
    group_layout,
    quantize_activation_grouped,
    quantize_weight_grouped,
)
from primus_fp8_plugin.tensor import ceil_div, pad4

from ..conftest import make_input

COPIES = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def skewed(num_experts: int, seed: int) -> list[int]:
    """Most tokens on two experts, a few on some, none on the rest."""
    g = torch.Generator().manual_seed(seed)
    counts = [0] * num_experts
    counts[num_experts // 3] = 260
    counts[-1] = 129
    for i in torch.randperm(num_experts, generator=g)[: num_experts // 4].tolist():
        counts[i] += int(torch.randint(1, 17, (1,), generator=g))
    return counts


EDGES = [0, 1, 15, 16, 127, 128, 129]
# (name, counts, K, N, fp8 format, bias, wgrad into main_grad (else into new tensors))
ROUTINGS = [
    ("edges", EDGES, 144, 136, "E4M3", True, True),
    ("edges-reversed", EDGES[::-1], 400, 128, "HYBRID", True, False),
    ("skewed-64", skewed(64, 0), 128, 128, "HYBRID", False, True),
    ("one-expert", [200], 256, 144, "E4M3", True, False),
    ("balanced-8", [37, 64, 90, 21, 50, 77, 64, 33], 144, 128, "E4M3", False, True),
]


def make_case(counts, k, n, seed=0, nan_expert=None):
    t = sum(counts)
    x = make_input((t, k), seed=seed + 1)
    dy = make_input((t, n), seed=seed + 2)
    if nan_expert is not None and counts[nan_expert]:
        x[sum(counts[:nan_expert]), 3] = float("nan")  # one NaN tile in each copy of that expert
    ws = [make_input((n, k), seed=seed + 10 + e, spread=False) for e in range(len(counts))]
    bias = make_input((len(counts), n), seed=seed + 3, spread=False)
    return x, dy, ws, bias


def scattered_main_grads(e: int, n: int, k: int, seed: int) -> list[torch.Tensor]:
    """``E`` fp32 [N, K] views of one buffer, in reverse expert order with gaps (as Megatron's buffers can be)."""
    g = torch.Generator().manual_seed(seed)
    gap = 37
    buf = torch.randn(e * (n * k + gap), generator=g)
    return [buf[(e - 1 - i) * (n * k + gap) :][: n * k].view(n, k) for i in range(e)]


def dense_loop(backend, recipe, x, dy, ws, bias, counts, main_grads):
    """What the grouped operations must equal: the dense ones, one expert at a time."""
    p_x, p_w, p_g = (recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))
    out = {"xq": [], "dyq": [], "wq": [], "y": [], "dx": [], "dw": [], "mg": []}
    off = 0
    for e, c in enumerate(counts):
        xq = quantize_activation(x[off : off + c], p_x, backend=backend)
        dyq = quantize_activation(dy[off : off + c], p_g, backend=backend)
        wq = quantize_weight(ws[e], p_w, backend=backend)
        out["xq"].append(xq), out["dyq"].append(dyq), out["wq"].append(wq)
        out["y"].append(gemm_fwd(xq, wq, None if bias is None else bias[e], backend=backend))
        out["dx"].append(gemm_dgrad(dyq, wq, backend=backend))
        if main_grads is None:
            out["dw"].append(gemm_wgrad(dyq, xq, backend=backend))
        else:
            out["mg"].append(gemm_wgrad(dyq, xq, accumulate_into=main_grads[e].clone(), backend=backend))
        off += c
    return out


def grouped(backend, recipe, x, dy, ws, bias, counts, main_grads):
    p_x, p_w, p_g = (recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))
    layout = group_layout(counts, x.shape[0])
    xq = quantize_activation_grouped(x, layout, p_x, backend=backend)
    dyq = quantize_activation_grouped(dy, layout, p_g, backend=backend)
    wq = quantize_weight_grouped(ws, p_w, backend=backend)
    out = {"xq": xq, "dyq": dyq, "wq": wq}
    out["y"] = gemm_fwd_grouped(xq, wq, bias, backend=backend)
    out["dx"] = gemm_dgrad_grouped(dyq, wq, backend=backend)
    if main_grads is None:
        out["dw"] = gemm_wgrad_grouped(dyq, xq, backend=backend)
    else:
        mg = [m.clone() for m in main_grads]
        out["mg"] = gemm_wgrad_grouped(dyq, xq, accumulate_into=mg, backend=backend)
        assert all(a is b for a, b in zip(out["mg"], mg))  # in place
    return out


def assert_equal_to_loop(got, want, counts):
    for name in ("xq", "dyq"):
        for e, (g, w) in enumerate(zip(got[name].split(), want[name])):
            for part in COPIES:
                assert same(getattr(g, part), getattr(w, part)), f"{name} expert {e} (count {counts[e]}): {part}"
    for e, w in enumerate(want["wq"]):
        g = got["wq"].expert(e)
        for part in COPIES:
            assert same(getattr(g, part), getattr(w, part)), f"weight {e}: {part}"
    splits = torch.tensor(counts).cumsum(0).tolist()
    for name in ("y", "dx"):
        parts = torch.tensor_split(got[name], splits[:-1])
        for e, (g, w) in enumerate(zip(parts, want[name])):
            assert same(g, w), f"{name} of expert {e} (count {counts[e]}) differs from the dense GEMM"
    for name in ("dw", "mg"):
        assert len(got.get(name, [])) == len(want[name])
        for e, (g, w) in enumerate(zip(got.get(name, []), want[name])):
            assert same(g, w), f"{name} of expert {e} (count {counts[e]}) differs from the dense wgrad"


@pytest.mark.parametrize("name, counts, k, n, fmt, use_bias, main_grad", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_grouped_equals_loop_of_dense_ops(backend, name, counts, k, n, fmt, use_bias, main_grad):
    recipe = BlockwiseRecipe(fp8_format=fmt)
    x, dy, ws, bias = make_case(counts, k, n, seed=len(counts), nan_expert=min(1, len(counts) - 1))
    bias = bias if use_bias else None
    mgs = scattered_main_grads(len(counts), n, k, seed=5) if main_grad else None
    want = dense_loop(backend, recipe, x, dy, ws, bias, counts, mgs)
    got = grouped(backend, recipe, x, dy, ws, bias, counts, mgs)
    assert_equal_to_loop(got, want, counts)
    assert got["y"].shape == (sum(counts), n) and got["dx"].shape == (sum(counts), k)


def test_device_counts_need_no_host_values_and_give_the_same_results(backend):
    """Counts as a device tensor (no host synchronisation; the columnwise copy sized by the bound
    T // 128 + E tiles): every expert's copies and GEMM results equal those made from host counts."""
    counts = [129, 0, 3, 128, 0, 40]
    recipe = BlockwiseRecipe(fp8_format="HYBRID")
    x, dy, ws, bias = make_case(counts, 144, 128, seed=3)
    p_x, p_g = recipe.params(TensorRole.INPUT), recipe.params(TensorRole.GRAD_OUTPUT)
    wq = quantize_weight_grouped(torch.stack(ws), recipe.params(TensorRole.WEIGHT), backend=backend)  # one [E, N, K]
    results = []
    for spec in (counts, torch.tensor(counts, dtype=torch.int64)):
        layout = group_layout(spec, x.shape[0])
        xq = quantize_activation_grouped(x, layout, p_x, backend=backend)
        dyq = quantize_activation_grouped(dy, layout, p_g, backend=backend)
        results.append((xq, dyq, gemm_fwd_grouped(xq, wq, bias, backend=backend), gemm_wgrad_grouped(dyq, xq, backend=backend)))
    (xa, dya, ya, dwa), (xb, dyb, yb, dwb) = results
    assert xa.layout.capacity == 128 * 5 and xb.layout.capacity == 128 * (340 // 128 + 6)
    for qa, qb in ((xa, xb), (dya, dyb)):
        for pa, pb in zip(qa.split(), qb.split()):
            assert all(same(getattr(pa, part), getattr(pb, part)) for part in COPIES)
    assert same(ya, yb) and all(same(a, b) for a, b in zip(dwa, dwb))


def test_columnwise_padding_rows_are_fp8_zeros_and_scale_padding_is_one(backend):
    counts = [5, 0, 130]
    x = make_input((sum(counts), 200), seed=9)
    q = quantize_activation_grouped(x, counts, BlockwiseRecipe().params(TensorRole.INPUT), backend=backend)
    col = bits(q.columnwise_data)
    assert torch.all(col[:, 5:128] == 0) and torch.all(col[:, 128 + 130 : 384] == 0)
    assert torch.any(col[:, :5] != 0) and torch.any(col[:, 128 + 129] != 0)
    assert torch.all(q.columnwise_scale_inv[:, 200:] == 1.0)  # pad4(K) entries
    assert q.rowwise_scale_inv.shape == (2, pad4(135)) and torch.all(q.rowwise_scale_inv[:, 135:] == 1.0)
    # the rowwise copy is the dense one of all tokens (1x128 tiles never cross a token)
    dense = quantize_activation(x, BlockwiseRecipe().params(TensorRole.INPUT), columnwise=False, backend=backend)
    assert same(q.rowwise_data, dense.rowwise_data) and same(q.rowwise_scale_inv, dense.rowwise_scale_inv)


def test_no_tokens_at_all(backend):
    """T = 0: empty outputs; wgrad gives zero gradients and adds nothing (but +0.0) to main_grad."""
    counts = [0, 0, 0]
    recipe = BlockwiseRecipe()
    x, dy = torch.zeros(0, 128, dtype=torch.bfloat16), torch.zeros(0, 256, dtype=torch.bfloat16)
    ws = [make_input((256, 128), seed=e, spread=False) for e in range(3)]
    xq = quantize_activation_grouped(x, counts, recipe.params(TensorRole.INPUT), backend=backend)
    dyq = quantize_activation_grouped(dy, counts, recipe.params(TensorRole.GRAD_OUTPUT), backend=backend)
    wq = quantize_weight_grouped(ws, recipe.params(TensorRole.WEIGHT), backend=backend)
    assert gemm_fwd_grouped(xq, wq, backend=backend).shape == (0, 256)
    dw = gemm_wgrad_grouped(dyq, xq, out_dtype=torch.float32, backend=backend)
    assert len(dw) == 3 and all(d.shape == (256, 128) and torch.all(d == 0) for d in dw)
    mg = scattered_main_grads(3, 256, 128, seed=1)
    before = [m.clone() for m in mg]
    gemm_wgrad_grouped(dyq, xq, accumulate_into=mg, backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(mg, before))


def test_grouped_triton_quantization_equals_reference():
    """The Triton grouped quantizers against the reference backend's grouped layouts, bit for bit
    (NaN tiles included), for activations and weights."""
    if not backend_availability("triton", "cpu"):
        pytest.skip("the Triton interpreter is not active")
    counts = [3, 0, 200, 128]
    x, _, ws, _ = make_case(counts, 200, 144, seed=4, nan_expert=2)
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        p1, p2 = QuantParams(fmt, 1), QuantParams(torch.float8_e4m3fn, 2)
        a = quantize_activation_grouped(x, counts, p1, backend="triton")
        b = quantize_activation_grouped(x, counts, p1, backend="reference")
        for pa, pb in zip(a.split(), b.split()):
            assert all(same(getattr(pa, part), getattr(pb, part)) for part in COPIES)
    wa, wb = (quantize_weight_grouped(ws, p2, backend=b) for b in ("triton", "reference"))
    assert all(same(getattr(wa, part), getattr(wb, part)) for part in COPIES)


def test_bad_input_is_refused(backend):
    recipe = BlockwiseRecipe()
    with pytest.raises(ValueError, match="sum to"):
        group_layout([3, 4], 8)
    with pytest.raises(ValueError, match=">= 0"):
        group_layout([9, -1], 8)
    x = make_input((8, 128), seed=0)
    xq = quantize_activation_grouped(x, [3, 5], recipe.params(TensorRole.INPUT), backend=backend)
    other = quantize_activation_grouped(x, [8, 0, 0], recipe.params(TensorRole.INPUT), backend=backend)
    with pytest.raises(ValueError, match="different routings"):
        gemm_wgrad_grouped(xq, other, backend=backend)
    with pytest.raises(ValueError, match="accumulate_into\\[1\\]"):
        gemm_wgrad_grouped(xq, xq, accumulate_into=[torch.zeros(128, 128), torch.zeros(128, 128).t()], backend=backend)
    with pytest.raises(ValueError, match="2 tensors for 2 experts|holds 1 tensors"):
        gemm_wgrad_grouped(xq, xq, accumulate_into=[torch.zeros(128, 128)], backend=backend)
    wq = quantize_weight_grouped([make_input((64, 128), seed=1)] * 3, recipe.params(TensorRole.WEIGHT), backend=backend)
    with pytest.raises(ValueError, match="3 experts"):
        gemm_fwd_grouped(xq, wq, backend=backend)
    with pytest.raises(ValueError, match="one shape"):
        quantize_weight_grouped([make_input((64, 128), seed=1), make_input((64, 256), seed=1)], recipe.params(TensorRole.WEIGHT))


def test_a_backend_without_grouped_kernels_says_what_to_use():
    class DenseOnly(Backend):
        name = "dense-only"

        def availability(self, device):
            return Availability(True)

        quantize_act = quantize_weight = gemm_fwd = gemm_dgrad = gemm_wgrad = lambda *a, **k: None

    with pytest.raises(NotImplementedError, match="backend 'dense-only' has no grouped.*SequentialMLP"):
        DenseOnly().quantize_act_grouped(torch.zeros(1, 128), group_layout([1], 1), BlockwiseRecipe().params(TensorRole.INPUT),
                                         rowwise=True, columnwise=True)  # fmt: skip


def test_padded_capacity_bound_holds_for_any_routing():
    """sum_e ceil(c_e / 128) <= T // 128 + E (the device-count layout's capacity) on random routings."""
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        e = int(torch.randint(1, 70, (1,), generator=g))
        counts = torch.randint(0, 300, (e,), generator=g) * (torch.rand(e, generator=g) < 0.6)
        t = int(counts.sum())
        exact = group_layout(counts.tolist(), t)
        bound = group_layout(counts, t)
        assert exact.capacity == sum(ceil_div(int(c), 128) * 128 for c in counts) <= bound.capacity
        assert torch.equal(exact.padded_offsets, bound.padded_offsets) and torch.equal(exact.offsets, bound.offsets)


def test_few_experts_take_the_dense_kernel_per_expert_with_the_batched_bits(monkeypatch):
    """The per-expert weight path's wiring (the heuristic, each expert's slice of the stacked buffers, ``out``
    reused, the batched kernel past the expert limit or where the dense Gluon kernel refuses a weight), with
    the dense Gluon kernel, which needs an H200 (tests/gpu/test_gpu_grouped.py runs it), stood in for by the
    portable dense kernel writing into ``out``: the same bits as the batched kernel."""
    if not backend_availability("triton", "cpu"):
        pytest.skip("the Triton interpreter is not active")
    import primus_fp8_plugin.kernels.sm90.heuristics as H
    import primus_fp8_plugin.kernels.sm90.quantize_grouped as qg
    from primus_fp8_plugin.backends import get_backend
    from primus_fp8_plugin.kernels.triton.quantize_grouped import quantize_128x128_batched
    from primus_fp8_plugin.kernels.triton.quantize_weight import quantize_128x128

    launches = []

    def dense_into(w, params, out):
        launches.append(w.data_ptr())
        t = quantize_128x128(w, params)
        for part in COPIES:
            getattr(out, part).copy_(getattr(t, part))
        return out

    refuse = set()
    monkeypatch.setattr(qg, "quantize_128x128_gluon", dense_into)
    # the dense Gluon kernel's rules, device check included (no H200 here): every weight but those refused
    monkeypatch.setattr(qg, "weight_unsupported_reason", lambda w, p: "refused" if w.data_ptr() in refuse else None)
    p = QuantParams(torch.float8_e4m3fn, 2)
    ws = [make_input((144, 272), seed=20 + e) for e in range(5)]  # ragged blocks on both axes
    ws[3][5, 7] = float("nan")
    batched = quantize_128x128_batched(ws, p)
    got = quantize_weight_grouped(ws, p, backend="triton")
    assert launches == [w.data_ptr() for w in ws], "one dense launch per expert, in order"
    assert all(same(getattr(got, part), getattr(batched, part)) for part in COPIES)
    stacked = torch.stack(ws)
    again = get_backend("triton", torch.device("cpu")).quantize_weight_grouped(stacked, p, out=got)
    assert again is got and len(launches) == 2 * len(ws), "a stacked [E, N, K] goes per expert into out"
    assert all(same(getattr(got, part), getattr(batched, part)) for part in COPIES)
    launches.clear()
    many = [make_input((16, 128), seed=e) for e in range(H.WEIGHT_PER_EXPERT_MAX_GROUPS + 1)]
    assert all(same(getattr(a, part), getattr(b, part))
               for a, b in [(quantize_weight_grouped(many, p, backend="triton"), quantize_128x128_batched(many, p))]
               for part in COPIES) and not launches, "past the expert limit: the batched kernel"  # fmt: skip
    refuse.add(ws[2].data_ptr())
    assert not H.weight_quant_per_expert(ws, p)
    assert all(same(getattr(quantize_weight_grouped(ws, p, backend="triton"), part), getattr(batched, part))
               for part in COPIES) and not launches, "one weight the Gluon kernel refuses: the batched kernel"  # fmt: skip


def test_per_expert_gluon_path_refuses_before_launching():
    """Weights of different shapes are a ValueError; a weight the dense Gluon kernel refuses (here: not on an
    sm_90 GPU) is a reason naming the expert, so that the heuristics pick the batched kernel, and a
    GluonUnsupported from the wrapper called anyway."""
    from primus_fp8_plugin.kernels.sm90 import heuristics as H
    from primus_fp8_plugin.kernels.sm90.quantize_grouped import quantize_128x128_per_expert_gluon, unsupported_reason
    from primus_fp8_plugin.kernels.sm90.target import GluonUnsupported

    p = QuantParams(torch.float8_e4m3fn, 2)
    with pytest.raises(ValueError, match="differ in shape"):
        quantize_128x128_per_expert_gluon([make_input((128, 128), seed=1), make_input((128, 256), seed=2)], p)
    ws = [make_input((128, 128), seed=1)] * 2
    assert "sm_90" in unsupported_reason(ws, p) and not H.weight_quant_per_expert(ws, p)
    with pytest.raises(GluonUnsupported, match="expert 0: .*sm_90"):
        quantize_128x128_per_expert_gluon(ws, p)


@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h_dtype, f, device_counts", [(torch.bfloat16, 144, False), (torch.float16, 200, True)])
def test_grouped_swiglu_quantization_equals_swiglu_then_the_grouped_quantizer(h_dtype, f, device_counts, probs_dtype):
    """``quantize_swiglu_act_grouped`` (SwiGLU of fc1's ``[gate | up]``, each row times its routing probability, made
    inside the grouped quantizer) on both backends against the unfused composition: the backend's ``swiglu_fwd``,
    ``reference_fused.weight_rows``, then ``quantize_act_grouped`` (the reference backend's: a loop of the dense
    quantizer); fresh random ragged counts with empty experts and a NaN gate."""
    from primus_fp8_plugin.backends import get_backend
    from primus_fp8_plugin.backends.reference_fused import weight_rows

    g = torch.Generator().manual_seed(f)
    counts = torch.randint(0, 150, (7,), generator=g)
    counts[torch.randperm(7, generator=g)[:2]] = 0
    t = int(counts.sum())
    h = make_input((t, 2 * f), dtype=h_dtype, seed=f, spread=h_dtype != torch.float16)
    h[min(3, t - 1), 5] = float("nan")
    probs = None if probs_dtype is None else torch.rand(t, generator=g).to(probs_dtype)
    layout = group_layout(counts if device_counts else counts.tolist(), t)
    params = BlockwiseRecipe().params(TensorRole.INPUT)
    ref = get_backend("reference", "cpu")
    for name in ("reference", "triton"):
        if not backend_availability(name, "cpu"):
            continue
        be = get_backend(name, "cpu")
        act = be.swiglu_fwd(h)
        if probs is not None:
            act = weight_rows(act, probs)
        want = ref.quantize_act_grouped(act, layout, params, rowwise=True, columnwise=True)
        got = be.quantize_swiglu_act_grouped(h, layout, params, rowwise=True, columnwise=True, probs=probs)
        cut = int(layout.padded_offsets[-1])  # device counts: the columns past the experts' are unspecified
        parts = {"columnwise_data": (slice(None), slice(0, cut)), "columnwise_scale_inv": (slice(0, cut // 128),)}
        for copy in COPIES:
            where = parts.get(copy, (slice(None),))
            assert same(getattr(got, copy)[where], getattr(want, copy)[where]), f"{name}: {copy}"
        assert got.shape == (t, f) and got.orig_dtype == h_dtype


def test_pointer_tables_declare_16_byte_alignment_only_where_every_address_has_it():
    """A kernel declares a table's alignment for the pointers it loads from it (16-byte loads and stores of the
    experts' weights and main_grads); one address off by an element makes the whole table's alignment 1."""
    from primus_fp8_plugin.kernels.triton.pointer_table import pointer_table

    buf = torch.zeros(4 * 64 + 1)
    aligned = [buf[i * 64 : (i + 1) * 64] for i in range(4)]  # fp32: 256-byte steps from an aligned base
    table = pointer_table(aligned)
    assert table.align == 16 and table.addresses.tolist() == [t.data_ptr() for t in aligned]
    assert pointer_table([*aligned[:2], buf[129:193], aligned[3]]).align == 1


def test_weights_and_main_grads_at_unaligned_addresses_give_the_aligned_bits():
    """The per-expert weights and main_grads reached through a pointer table, at 16-byte aligned addresses (the
    kernels' vectorised path) and one element off (the table's alignment 1): the same bits."""
    if not backend_availability("triton", "cpu"):
        pytest.skip("the Triton interpreter is not active")
    from primus_fp8_plugin.kernels.triton.pointer_table import pointer_table

    counts = [130, 0, 7, 128]
    x, dy, ws, _ = make_case(counts, 256, 128, seed=6)
    p_x, p_w, p_g = QuantParams(torch.float8_e4m3fn, 1), QuantParams(torch.float8_e4m3fn, 2), QuantParams(torch.float8_e5m2, 1)
    flat = torch.empty(len(ws) * ws[0].numel() + 1, dtype=ws[0].dtype)
    shifted = [flat[1 + e * w.numel() :][: w.numel()].view_as(w).copy_(w) for e, w in enumerate(ws)]
    assert pointer_table(ws).align == 16 and pointer_table(shifted).align == 1
    wa, wb = (quantize_weight_grouped(w, p_w, backend="triton") for w in (ws, shifted))
    assert all(same(getattr(wa, part), getattr(wb, part)) for part in COPIES)
    xq = quantize_activation_grouped(x, counts, p_x, backend="triton")
    dyq = quantize_activation_grouped(dy, counts, p_g, backend="triton")
    start = [make_input(w.shape, seed=30 + e) for e, w in enumerate(ws)]
    mg_aligned = [s.float().clone() for s in start]
    mg_buf = torch.empty(len(ws) * ws[0].numel() + 1)
    mg_shifted = [mg_buf[1 + e * s.numel() :][: s.numel()].view(s.shape).copy_(s.float()) for e, s in enumerate(start)]
    assert pointer_table(mg_aligned).align == 16 and pointer_table(mg_shifted).align == 1
    for mg in (mg_aligned, mg_shifted):
        gemm_wgrad_grouped(dyq, xq, accumulate_into=mg, backend="triton")
    assert all(same(a, b) for a, b in zip(mg_aligned, mg_shifted))
    assert not all(same(a, s.float()) for a, s in zip(mg_aligned, start)), "dW was added"
