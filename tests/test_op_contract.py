"""The contract every FP8 op of the package keeps, on every backend this machine has.

Ops: the plain, norm and SwiGLU linears, the grouped (MoE) linear (given permuted rows, or the tokens and an MoE
layer's ``Routing``: read through the permutation), the grouped SwiGLU linear (rows weighted by routing
probabilities, a differentiable input), and the plain and norm linears under sequence parallelism (a
one-rank gloo group here: the exchange's code runs; tests/test_sequence_parallel.py runs two ranks).
Weight sources: quantized per call, and (``*_held``) FP8 primary weights: a weight cache holding W only as the
weights' primary form (``WeightCache.own``), the weights' high-precision data then replaced by NaN, so that any read
of them would show, and dgrad's W^T made on demand.
Behaviours: backward twice with ``retain_graph``, bias-only training, a frozen weight, inference mode,
``torch.compile``, ``torch.autocast``, ``main_grad`` accumulated twice (``.grad`` left empty), saved-tensor hooks,
zero rows, K not a multiple of 128, bad counts / bad dtypes. The grouped ops also take the experts' weights
stacked in one ``[E, N, K]`` tensor (``*_stacked``). A new op joins ``OPS`` before it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from primus_fp8_plugin import (
    available_backends,
    fp8_blockwise_linear,
    fp8_grouped_linear,
    fp8_grouped_swiglu_linear,
    fp8_norm_linear,
    fp8_swiglu_linear,
)
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.permutation import route
from primus_fp8_plugin.recipe import BlockwiseRecipe, TensorRole
from primus_fp8_plugin.tensor import HIGH_PRECISION_DTYPES
from primus_fp8_plugin.weight_cache import GroupedWeightCache, WeightCache

from .conftest import make_input

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine: every GPU backend
BACKENDS = [n for n, a in available_backends(DEVICE).items() if a]
E = 3  # experts of the grouped op
ROWS, N = 72, 96  # rows and out_features: neither a multiple of 128 (ragged tiles), small for the interpreter


def _group():
    """A one-rank gloo group for the sequence-parallel ops (made once per process)."""
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD


@dataclass
class Op:
    name: str
    grouped: bool = False
    norm: bool = False
    swiglu: bool = False
    sequence_parallel: bool = False
    held: bool = False  # the weights' FP8 primary form held by a weight cache, their bf16 data gone
    routed: bool = False  # grouped: the tokens in token order and a ``Routing`` (each token to 0-2 experts)
    stacked: bool = False  # grouped: the experts' weights as one [E, N, K] tensor (t["w"] holds that one tensor)

    def leaves(self, rows: int, k: int, n: int, seed: int, dtype=torch.bfloat16, bias: bool = True) -> dict:
        """The op's differentiable inputs: ``x`` (or ``h``), norm parameters, weights, biases."""
        width = 2 * k if self.swiglu else k
        lead = (rows, 1) if self.sequence_parallel else (rows,)
        t = {"x": make_input((*lead, width), dtype=dtype, seed=seed, device=DEVICE)}
        if self.norm:
            t["gamma"] = (1 + 0.1 * make_input((k,), seed=seed + 1, spread=False, device=DEVICE)).to(dtype)
            t["beta"] = (0.1 * make_input((k,), seed=seed + 2, spread=False, device=DEVICE)).to(dtype)
        nw = E if self.grouped else 1
        t["w"] = [(0.05 * make_input((n, k), seed=seed + 10 + i, spread=False, device=DEVICE)).to(dtype) for i in range(nw)]
        if self.stacked:
            t["w"] = [torch.stack(t["w"])]
        t["b"] = None
        if bias:
            t["b"] = [(0.1 * make_input((n,), seed=seed + 20 + i, spread=False, device=DEVICE)).to(dtype) for i in range(nw)]
        if self.grouped and self.routed:  # experts 0 and 2 take random tokens, expert 1 none
            g = torch.Generator().manual_seed(seed + 4)
            routing_map = torch.rand((rows, E), generator=g) < torch.tensor([0.7, 0.0, 0.5])
            t["routing"] = route(routing_map.to(DEVICE), int(routing_map.sum()))
            t["counts"] = routing_map.sum(0).tolist()  # the rows of the output, per expert
        elif self.grouped:
            cut = [rows // 3, 0, rows - rows // 3]  # an expert with no tokens
            t["counts"] = cut
        if self.grouped and self.swiglu:  # routing probabilities, one per token (fp32, as Megatron's router gives)
            t["probs"] = torch.rand(lead, generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE)
        return t

    def hold(self, t: dict, backend: str) -> None:
        """Make the weights' FP8 copy their primary form (once per leaves) and replace their data by NaN."""
        if not self.held or "cache" in t or 0 in t["w"][0].shape or t["w"][0].dtype not in HIGH_PRECISION_DTYPES:
            return  # nothing to hold where the op computes without FP8 or refuses the weights
        cache = GroupedWeightCache(keep_transpose=False) if self.grouped else WeightCache(keep_transpose=False)
        impl = get_backend(backend, DEVICE)
        cache.own(self.weights(t), BlockwiseRecipe().params(TensorRole.WEIGHT), impl)
        if not torch.is_inference_mode_enabled():
            for w in t["w"]:
                w.data = torch.full((), float("nan"), dtype=w.dtype, device=w.device).expand(w.shape)
        t["cache"] = cache

    def weights(self, t: dict):
        """What the op takes as its weights: the list of experts' weights, the stacked tensor, or the one weight."""
        return t["w"] if self.grouped and not self.stacked else t["w"][0]

    def __call__(self, t: dict, backend: str, **kw) -> torch.Tensor:
        self.hold(t, backend)
        if "cache" in t:
            kw["weight_cache"] = t["cache"]
        b = t["b"]
        if self.sequence_parallel:
            kw["sequence_parallel_group"] = _group()
        w = self.weights(t)
        if self.grouped and self.swiglu:
            return fp8_grouped_swiglu_linear(t["x"], t["counts"], w, b, probs=t["probs"], backend=backend, **kw)
        if self.grouped:
            return fp8_grouped_linear(t["x"], t.get("routing", t["counts"]), w, b, backend=backend, **kw)
        bias = None if b is None else b[0]
        if self.norm:
            return fp8_norm_linear(t["x"], t["gamma"], t["beta"], t["w"][0], bias, backend=backend, **kw)
        if self.swiglu:
            return fp8_swiglu_linear(t["x"], t["w"][0], bias, backend=backend, **kw)
        return fp8_blockwise_linear(t["x"], t["w"][0], bias, backend=backend, **kw)


OPS = [
    Op("linear"),
    Op("norm_linear", norm=True),
    Op("swiglu_linear", swiglu=True),
    Op("grouped_linear", grouped=True),
    Op("routed_grouped_linear", grouped=True, routed=True),
    Op("grouped_swiglu_linear", grouped=True, swiglu=True),
    Op("sp_linear", sequence_parallel=True),
    Op("sp_norm_linear", norm=True, sequence_parallel=True),
    Op("linear_held", held=True),
    Op("grouped_linear_held", grouped=True, held=True),
    Op("routed_grouped_linear_stacked", grouped=True, routed=True, stacked=True),
    Op("grouped_swiglu_linear_stacked", grouped=True, swiglu=True, stacked=True),
    Op("grouped_linear_held_stacked", grouped=True, held=True, stacked=True),
]


@pytest.fixture(params=OPS, ids=lambda o: o.name)
def op(request):
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def params_of(t: dict) -> list[torch.Tensor]:
    out = [t["x"]] + [t[k] for k in ("gamma", "beta", "probs") if k in t] + t["w"]
    return out + (t["b"] or [])


def train(op: Op, t: dict, backend: str, dy_seed: int = 99, **kw):
    """One forward and backward; returns the output and every leaf's gradient (None where it has none)."""
    y = op(t, backend, **kw)
    y.backward(make_input(tuple(y.shape), seed=dy_seed, device=DEVICE))
    return y.detach(), [None if p.grad is None else p.grad.clone() for p in params_of(t)]


def requires(t: dict, *, x=True, norm=True, w=True, b=True) -> dict:
    t["x"].requires_grad_(x)
    for k in ("gamma", "beta", "probs"):  # the stage's other inputs
        if k in t:
            t[k].requires_grad_(norm)
    for p in t["w"]:
        p.requires_grad_(w)
    for p in t["b"] or []:
        p.requires_grad_(b)
    return t


def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_backward_twice_with_retain_graph(op, backend):
    t = requires(op.leaves(ROWS, 128, N, seed=1))
    y = op(t, backend)
    dy = make_input(tuple(y.shape), seed=5, device=DEVICE)
    y.backward(dy, retain_graph=True)
    first = [p.grad.clone() for p in params_of(t)]
    for p in params_of(t):
        p.grad = None
    y.backward(dy)
    assert all(same(a, p.grad) for a, p in zip(first, params_of(t)))


def test_bias_only_training(op, backend):
    """Frozen input, norm and weights, trainable bias: the bias gradient is the sum of dY over rows (per expert: the
    counts are given on the host here, so each expert's ``dY_e.sum(0)``)."""
    t = requires(op.leaves(ROWS, 128, N, seed=2), x=False, norm=False, w=False, b=True)
    y = op(t, backend)
    dy = make_input(tuple(y.shape), seed=6, device=DEVICE)
    y.backward(dy)
    dy2d = dy.reshape(-1, dy.shape[-1])
    want = [p.sum(0) for p in torch.split(dy2d, t["counts"])] if op.grouped else [dy2d.sum(0)]
    assert all(same(b.grad, w) for b, w in zip(t["b"], want))
    assert all(p.grad is None for p in params_of(t)[: -len(t["b"])])


def test_frozen_weight_gives_the_same_input_gradient(op, backend):
    full = requires(op.leaves(ROWS, 128, N, seed=3))
    _, grads = train(op, full, backend)
    frozen = requires(op.leaves(ROWS, 128, N, seed=3), w=False)
    _, frozen_grads = train(op, frozen, backend)
    nw = len(full["w"])
    ni = len(params_of(full)) - nw - len(full["b"])
    assert all(same(a, b) for a, b in zip(grads[:ni], frozen_grads[:ni]))
    assert all(g is None for g in frozen_grads[ni : ni + nw])


def test_inference_mode_gives_the_training_output(op, backend):
    t = op.leaves(ROWS, 128, N, seed=4)
    with torch.no_grad():
        expected = op(t, backend)
    with torch.inference_mode():
        got = op(op.leaves(ROWS, 128, N, seed=4), backend)
    assert same(expected, got)


def test_torch_compile_runs_the_op_eagerly_with_the_same_bits(op, backend):
    eager_y, eager_grads = train(op, requires(op.leaves(ROWS, 128, N, seed=7)), backend)
    compiled = torch.compile(lambda t: op(t, backend) * 1.0, backend="eager", fullgraph=False)
    t = requires(op.leaves(ROWS, 128, N, seed=7))
    op.hold(t, backend)  # held before compiling (a training loop holds weights between steps, outside the model)
    y = compiled(t)
    y.backward(make_input(tuple(y.shape), seed=99, device=DEVICE))
    assert same(eager_y, y.detach())
    assert all(same(a, None if p.grad is None else p.grad) for a, p in zip(eager_grads, params_of(t)))


def test_autocast_runs_in_the_autocast_dtype(op, backend):
    """fp32 leaves under ``torch.autocast(bfloat16)``: the op computes on the input cast to bf16 (as ``F.linear``
    under autocast), its output is bf16, and the leaves' gradients come back in their own dtype."""
    t = requires(op.leaves(ROWS, 128, N, seed=8, dtype=torch.float32))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = op(t, backend)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in params_of(t))
    ref = op.leaves(ROWS, 128, N, seed=8, dtype=torch.float32)
    ref["x"] = ref["x"].to(torch.bfloat16)
    with torch.no_grad():
        assert same(op(ref, backend), y.detach())


class WeightSizedAllocations(TorchDispatchMode):
    """The ``new_empty_strided`` calls of a weight's shape while active: what autograd's AccumulateGrad runs to copy
    a gradient it cannot take as ``.grad`` as it is (one that another tensor refers to)."""

    def __init__(self, shapes: set) -> None:
        super().__init__()
        self.shapes, self.seen = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.new_empty_strided and tuple(out.shape) in self.shapes:
            self.seen.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("megatron", [False, True], ids=["plain", "megatron_protocol"])
def test_main_grad_accumulates_twice_and_grad_stays_empty(op, backend, megatron):
    t = requires(op.leaves(ROWS, 128, N, seed=9))
    _, grads = train(op, requires(op.leaves(ROWS, 128, N, seed=9)), backend)
    nw, ni = len(t["w"]), len(params_of(t)) - len(t["w"]) - len(t["b"])
    for w in t["w"]:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEVICE)
        if megatron:
            w.grad_added_to_main_grad = False
    for _ in range(2):
        y = op(t, backend)
        with WeightSizedAllocations({tuple(w.shape) for w in t["w"]}) as allocations:
            y.backward(make_input(tuple(y.shape), seed=99, device=DEVICE))
        assert not allocations.seen, allocations.seen  # autograd took the placeholders as .grad: no copies
        for w in t["w"]:
            if megatron:
                assert w.grad_added_to_main_grad
                w.grad_added_to_main_grad = False
                w.grad = None  # Megatron's hook discards the placeholder
            assert w.grad is None
    for w, g in zip(t["w"], grads[ni : ni + nw]):
        once = w.main_grad / 2
        torch.testing.assert_close(once.to(g.dtype), g, rtol=0, atol=0)
        assert torch.isfinite(w.main_grad).all()


def test_zero_out_wgrad_placeholders_are_each_weights_own_zeros(backend):
    """Megatron's hook adds ``.grad`` into ``main_grad`` for a weight that asks ``zero_out_wgrad`` (a tied
    embedding): each such weight gets zeros of its own, so a write into one ``.grad`` reaches no other."""
    ws = [torch.nn.Parameter(make_input((N, 128), seed=40 + i, device=DEVICE)) for i in range(2)]
    for w in ws:
        w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = torch.zeros(w.shape, device=DEVICE), False, True
    x = make_input((ROWS, 128), seed=42, device=DEVICE).requires_grad_(True)
    fp8_blockwise_linear(x, ws[0], backend=backend).sum().backward()
    assert ws[0].grad is not None and not ws[0].grad.any()
    ws[0].grad.add_(3.0)  # what an accumulation into a surviving .grad does
    fp8_blockwise_linear(x, ws[1], backend=backend).sum().backward()
    assert not ws[1].grad.any() and ws[0].grad.eq(3.0).all()
    assert all(w.main_grad.abs().sum() > 0 for w in ws)


def test_saved_tensor_hooks_keep_main_grad_and_gradients(op, backend):
    _, grads = train(op, requires(op.leaves(ROWS, 128, N, seed=10)), backend)
    t = requires(op.leaves(ROWS, 128, N, seed=10))
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x.clone(), lambda x: x):
        _, hooked = train(op, t, backend)
    assert all(same(a, b) for a, b in zip(grads, hooked))
    t = requires(op.leaves(ROWS, 128, N, seed=10))
    for w in t["w"]:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEVICE)
    with torch.autograd.graph.save_on_cpu():
        train(op, t, backend)
    assert all(w.grad is None for w in t["w"]) and sum(w.main_grad.abs().sum() for w in t["w"]) > 0


def test_zero_rows(op, backend):
    t = requires(op.leaves(0, 128, N, seed=11))
    for w in t["w"]:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEVICE)
    y, grads = train(op, t, backend)
    assert y.shape[-1] == N and y.numel() == 0
    assert grads[0].shape == t["x"].shape
    assert all(w.grad is None and not w.main_grad.any() for w in t["w"])
    assert all(g is not None and not g.any() for g in grads[len(grads) - len(t["b"]) :])


def test_k_not_a_multiple_of_128_gives_finite_gradients_of_every_leaf(op, backend):
    t = requires(op.leaves(ROWS, 200, 72, seed=12))
    y, grads = train(op, t, backend)
    assert y.shape[-1] == 72 and torch.isfinite(y.float()).all()
    assert all(g is not None and g.shape == p.shape and torch.isfinite(g.float()).all() for g, p in zip(grads, params_of(t)))


@pytest.mark.parametrize("k, n", [(0, N), (128, 0)])
def test_empty_in_or_out_features_compute_exactly(op, k, n):
    """No FP8 to do: ``y = bias`` (per expert) for ``in_features == 0``, an empty output for ``out_features == 0``;
    the stages that need features (a norm over K, SwiGLU of 2K) refuse K = 0 by name."""
    if k == 0 and (op.norm or op.swiglu):
        with pytest.raises(ValueError, match="non-empty last dim|2F > 0"):
            op(requires(op.leaves(ROWS, k, n, seed=15)), "reference")
        return
    t = requires(op.leaves(ROWS, k, n, seed=15))
    y, grads = train(op, t, "reference")
    parts = t["counts"] if op.grouped else [ROWS]
    if k == 0:
        expected = torch.cat([b.detach().expand(c, n) for b, c in zip(t["b"], parts)]).to(y.dtype)
        assert torch.equal(y.reshape(-1, n), expected)
    assert y.shape[-1] == n and all(g is None or g.shape == p.shape for g, p in zip(grads, params_of(t)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.complex64])
def test_weights_of_other_dtypes_are_refused_with_the_fix(op, dtype):
    t = op.leaves(ROWS, 128, N, seed=13)
    t["w"] = [w.to(dtype) for w in t["w"]]
    with pytest.raises(TypeError, match=r"float32 weights: (convert it|use torch.nn.Linear for complex)"):
        op(t, "reference")


@pytest.mark.parametrize(
    "counts, match",
    [
        ([30, 0, 52], r"sum to the number of tokens 72 \(they sum to 82\)"),
        ([50, -10, 32], r"must be >= 0"),
        ([72, 0], r"2 counts given for 3 experts"),
        (torch.tensor([30, 0, 52]), r"sum to the number of tokens \(72\).*got \[30, 0, 52\]"),
        (torch.tensor([82, -10, 0]), r"must be >= 0 .*got \[82, -10, 0\]"),
        (torch.tensor([72, 0]), r"counts describe 2 experts; the layer has 3"),
        (torch.tensor([30.0, 0.0, 42.0]), r"integer tensor"),
    ],
)
def test_bad_counts_are_refused_naming_the_counts(backend, counts, match):
    if DEVICE == "cuda" and isinstance(counts, torch.Tensor) and not counts.dtype.is_floating_point:
        pytest.skip("on a GPU device counts are checked by a device-side assert: tests/gpu/test_gpu_counts.py")
    op = OPS[3]
    t = op.leaves(ROWS, 128, N, seed=14)
    t["counts"] = counts
    with pytest.raises(ValueError, match=match):
        op(t, backend)


@pytest.mark.parametrize("stacked_op", [o for o in OPS if o.stacked], ids=lambda o: o.name)
@pytest.mark.parametrize("megatron", [False, True], ids=["grad", "main_grad"])
def test_stacked_weights_give_the_expert_lists_bits(stacked_op, backend, megatron):
    """The experts' weights stacked in one ``[E, N, K]`` tensor: the output, every other leaf's gradient and each
    expert's weight gradient (or ``main_grad``, accumulated twice) are the bits of the same op on ``E`` tensors."""
    listed = next(o for o in OPS if o.name == stacked_op.name.removesuffix("_stacked"))
    runs = []
    for o in (listed, stacked_op):
        t = requires(o.leaves(ROWS, 128, N, seed=16))
        if megatron:
            for w in t["w"]:
                w.main_grad, w.grad_added_to_main_grad = torch.zeros(w.shape, device=DEVICE), False
        y, grads = train(o, t, backend)
        if megatron:
            train(o, t, backend)
        dw = [w.main_grad if megatron else g for w, g in zip(t["w"], grads[-len(t["w"]) - len(t["b"]) : -len(t["b"])])]
        runs.append((y, grads[: -len(t["w"]) - len(t["b"])], torch.stack(dw) if o is listed else dw[0], grads[-len(t["b"]) :]))
    (y1, other1, dw1, db1), (y2, other2, dw2, db2) = runs
    assert same(y1, y2) and all(same(a, b) for a, b in zip(other1 + db1, other2 + db2))
    assert same(dw1, dw2) and dw1.abs().sum() > 0


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda w: w[0], ValueError, r"3-D \[experts, out_features, in_features\].*got shape \(96, 128\)"),
        (lambda w: w[:0], ValueError, r"at least one expert, got shape \(0, 96, 128\)"),
        (lambda w: w[..., :64], ValueError, r"last dim is 128 but in_features is 64"),
        (lambda w: w.to(torch.int32), TypeError, r"stacked expert weights have dtype torch.int32"),
        (lambda w: w.to("meta"), ValueError, r"weights are on meta"),
    ],
    ids=["2d", "no_experts", "in_features", "dtype", "device"],
)
def test_bad_stacked_weights_are_refused_with_the_fix(make, error, match):
    op = next(o for o in OPS if o.name == "grouped_swiglu_linear_stacked")
    t = op.leaves(ROWS, 128, N, seed=17)
    t["w"] = [make(t["w"][0])]
    with pytest.raises(error, match=match):
        op(t, "reference")


def test_stack_experts_returns_their_buffer_or_a_stacked_copy():
    """The stacked weight gradient: the buffer the backend's ``E`` results are consecutive slices of (no copy), else
    ``torch.stack`` (slices in another order, separate tensors)."""
    from primus_fp8_plugin.ops.layouts import stack_experts

    buffer = make_input((3, 8, 16), seed=18)
    whole = stack_experts(list(buffer.unbind(0)))
    assert whole.data_ptr() == buffer.data_ptr() and torch.equal(whole, buffer)
    for parts in (list(buffer.unbind(0))[::-1], [p.clone() for p in buffer.unbind(0)]):
        stacked = stack_experts(parts)
        assert torch.equal(stacked, torch.stack(parts)) and stacked.data_ptr() != buffer.data_ptr()


def test_every_public_op_is_in_the_matrix():
    import primus_fp8_plugin

    public = {n for n in primus_fp8_plugin.__all__ if n.startswith("fp8_") and n.endswith("linear")}
    covered = {"fp8_blockwise_linear", "fp8_norm_linear", "fp8_swiglu_linear", "fp8_grouped_linear",
               "fp8_grouped_swiglu_linear"}  # fmt: skip
    assert public == covered, f"an FP8 op outside the contract matrix: {public - covered}"
