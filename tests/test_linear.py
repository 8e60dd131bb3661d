"""Fp8BlockwiseLinear / fp8_blockwise_linear: numerics, saved memory, main_grad fusion, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from primus_fp8_plugin import (
    BackendUnavailableError,
    BlockwiseRecipe,
    Fp8BlockwiseLinear,
    TensorRole,
    available_backends,
    fp8_blockwise_linear,
)
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.validate import rel_frobenius

from .conftest import make_input

CPU_BACKENDS = [n for n, a in available_backends("cpu").items() if a]


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


def oracle(x, w, b, dy, recipe, backend):
    """fp64 linear on the operands as the layer quantizes them (the layer's exact target)."""
    impl = get_backend(backend, "cpu")
    k, n = w.shape[1], w.shape[0]
    xq = impl.quantize_act(x.reshape(-1, k).contiguous(), recipe.params(TensorRole.INPUT), rowwise=True, columnwise=True)
    wq = impl.quantize_weight(w.contiguous(), recipe.params(TensorRole.WEIGHT))
    dyq = impl.quantize_act(dy.reshape(-1, n).contiguous(), recipe.params(TensorRole.GRAD_OUTPUT), rowwise=True, columnwise=True)
    xr, wr, dyr = (t.dequantize(torch.float64) for t in (xq, wq, dyq))
    out = xr @ wr.t() + (0 if b is None else b.double())
    dgrad = dyr @ wq.dequantize(torch.float64, copy="columnwise")
    wgrad = dyq.dequantize(torch.float64, copy="columnwise").t() @ xq.dequantize(torch.float64, copy="columnwise")
    return out, dgrad, wgrad


@pytest.mark.parametrize(
    "lead, k, n, dtype, bias, fmt",
    [
        ((77,), 256, 384, torch.bfloat16, True, "E4M3"),
        ((3, 5, 7), 272, 144, torch.bfloat16, False, "HYBRID"),
        ((1,), 128, 256, torch.float16, True, "E4M3"),
        ((130,), 400, 128, torch.float32, True, "HYBRID"),
    ],
)
def test_forward_backward_match_fp64_oracle(backend, lead, k, n, dtype, bias, fmt):
    recipe = BlockwiseRecipe(fp8_format=fmt)
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(k, n, bias=bias, dtype=dtype, recipe=recipe, backend=backend)
    spread = dtype is not torch.float16  # rows spanning 40 binades overflow fp16
    x = make_input((*lead, k), dtype=dtype, seed=1, spread=spread).view(*lead, k).requires_grad_(True)
    dy = make_input((*lead, n), dtype=dtype, seed=2, spread=spread).view(*lead, n)
    y = layer(x)
    y.backward(dy)
    assert y.shape == (*lead, n) and y.dtype == dtype and x.grad.shape == x.shape
    out, dgrad, wgrad = oracle(x.detach(), layer.weight.detach(), None if not bias else layer.bias.detach(), dy, recipe, backend)
    tol = 1e-2 if dtype is torch.float16 else 5e-3  # one rounding to the output dtype
    assert rel_frobenius(y.reshape(out.shape), out) < tol
    assert rel_frobenius(x.grad.reshape(dgrad.shape), dgrad) < tol
    assert rel_frobenius(layer.weight.grad, wgrad) < tol
    if bias:  # the formula TE uses under Float8BlockScaling (grad_output.sum(dim=0), in dY's dtype)
        assert torch.equal(layer.bias.grad, dy.reshape(-1, n).sum(0))
        assert torch.allclose(layer.bias.grad.double(), dy.reshape(-1, n).double().sum(0), rtol=1e-2, atol=1e-2)
    # and it is FP8-close to the unquantized linear
    ref = nn.functional.linear(x.detach().double(), layer.weight.detach().double())
    assert rel_frobenius(y.detach() - (0 if not bias else layer.bias.detach()), ref) < 0.08


def test_saved_activation_memory_is_at_most_053x_of_bf16_linear(backend):
    def saved_activation_bytes(module, x):
        total = 0
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}

        def pack(t):
            nonlocal total
            if t.untyped_storage().data_ptr() not in params:  # weights (and views of them) aside
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)
        return total

    x = make_input((512, 1024)).requires_grad_(True)
    ours = saved_activation_bytes(Fp8BlockwiseLinear(1024, 256, dtype=torch.bfloat16, backend=backend), x)
    bf16 = saved_activation_bytes(nn.Linear(1024, 256, dtype=torch.bfloat16), x)
    assert bf16 == 2 * 512 * 1024
    assert ours / bf16 <= 0.53, ours / bf16


def test_weight_gradient_accumulates_into_main_grad(backend):
    layer = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend=backend)
    w = layer.weight
    w.main_grad = torch.zeros(128, 256, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    x, dy = make_input((64, 256), seed=1), make_input((64, 128), seed=2)
    layer(x).backward(dy)
    assert w.grad_added_to_main_grad is True
    first = w.main_grad.clone()
    plain = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend=backend)
    with torch.no_grad():
        plain.weight.copy_(w)
    plain(x).backward(dy)
    assert rel_frobenius(first, plain.weight.grad.double()) < 5e-3  # bf16 grad vs fp32 main_grad
    layer(x).backward(dy)
    assert torch.allclose(w.main_grad, 2 * first, rtol=1e-6, atol=1e-6)
    assert w.grad is not None  # a dummy gradient lets Megatron's parameter hooks run


@pytest.mark.parametrize("bad", ["bf16", "shape", "strided"])
def test_a_wrong_main_grad_is_refused_not_written(bad):
    layer = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend="reference")
    main_grad = {
        "bf16": torch.zeros(128, 256, dtype=torch.bfloat16),
        "shape": torch.zeros(256, 128, dtype=torch.float32),
        "strided": torch.zeros(256, 128, dtype=torch.float32).t(),
    }[bad]
    layer.weight.main_grad = main_grad
    before = main_grad.clone()
    with pytest.raises(ValueError, match="main_grad must be a contiguous float32"):
        layer(make_input((32, 256), seed=4)).backward(make_input((32, 128), seed=5))
    assert torch.equal(main_grad, before)


def test_a_bf16_gradient_buffer_under_megatrons_protocol_gets_dw_through_grad():
    """Megatron's gradient buffers without ``grad_reduce_in_fp32`` are bf16; the kernels accumulate in fp32 only, so
    ``dW`` goes to ``.grad`` (the weight's dtype), which Megatron's hook adds, as for its own unfused layers."""
    layer = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend="reference")
    w = layer.weight
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(128, 256, dtype=torch.bfloat16), False
    x, dy = make_input((32, 256), seed=4), make_input((32, 128), seed=5)
    layer(x).backward(dy)
    plain = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend="reference")
    plain.load_state_dict(layer.state_dict())
    plain(x).backward(dy)
    assert torch.equal(w.grad, plain.weight.grad) and w.grad.abs().sum() > 0
    assert w.grad_added_to_main_grad is False and not w.main_grad.any()


def test_drop_in_for_nn_linear():
    torch.manual_seed(3)
    ref = nn.Linear(64, 32)
    torch.manual_seed(3)
    ours = Fp8BlockwiseLinear(64, 32)
    assert torch.equal(ref.weight, ours.weight) and torch.equal(ref.bias, ours.bias)
    assert set(ours.state_dict()) == {"weight", "bias"}
    no_bias = Fp8BlockwiseLinear(64, 32, bias=False, dtype=torch.float16)
    assert no_bias.bias is None and no_bias.weight.dtype == torch.float16
    no_bias.reset_parameters()
    y = ours(torch.randn(4, 64))
    assert y.shape == (4, 32) and y.dtype == torch.float32


def test_bad_input_is_refused():
    layer = Fp8BlockwiseLinear(128, 64)
    with pytest.raises(ValueError, match="in_features is 128"):
        layer(torch.randn(4, 96))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        layer(torch.ones(4, 128, dtype=torch.int64))
    with pytest.raises(ValueError, match="is on meta"):
        layer(torch.randn(4, 128, device="meta"))
    with pytest.raises(BackendUnavailableError, match="'cublas' is not available on cpu"):
        Fp8BlockwiseLinear(128, 64, backend="cublas")
    with pytest.raises(BackendUnavailableError, match="cublas"):
        fp8_blockwise_linear(torch.randn(4, 128), layer.weight, backend="cublas")


# ---- frozen weights, retained graphs, main_grad without Megatron, compile, inference tensors ------


def test_bias_only_training(backend):
    """A frozen weight (BitFit, frozen layers): only the bias (and the input, if it asks) get gradients."""
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend=backend)
    layer.weight.requires_grad_(False)
    x, dy = make_input((48, 256), seed=1), make_input((48, 128), seed=2)
    layer(x).backward(dy)  # nothing but the bias needs a gradient: dY is not quantized at all
    assert layer.weight.grad is None and torch.equal(layer.bias.grad, dy.sum(0))
    xg = x.clone().requires_grad_(True)
    layer(xg).backward(dy)
    _, dgrad, _ = oracle(x, layer.weight, layer.bias.detach(), dy, layer.recipe, backend)
    assert rel_frobenius(xg.grad, dgrad) < 5e-3
    opt = torch.optim.SGD([layer.bias], lr=0.5)
    before = layer.weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        layer(x).float().square().mean().backward()
        opt.step()
    assert torch.equal(layer.weight, before)


def test_backward_twice_with_retain_graph(backend):
    torch.manual_seed(0)
    x = make_input((40, 256), seed=3).requires_grad_(True)
    dy = make_input((40, 128), seed=4)
    for cache_weight in (True, False):
        layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend=backend, cache_weight=cache_weight)
        x.grad = None
        y = layer(x)
        node = y.grad_fn
        y.backward(dy, retain_graph=True)
        first = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
        assert node.wq is not None  # kept for the next backward
        y.backward(dy)
        for name, got, once in zip(("dgrad", "wgrad", "bgrad"), (x.grad, layer.weight.grad, layer.bias.grad), first):
            assert torch.allclose(got.float(), 2 * once.float(), rtol=1e-2, atol=0), name
        assert node.wq is None  # the graph is gone: so is the quantized weight


def test_main_grad_without_megatrons_protocol_leaves_weight_grad_none(backend):
    """A standalone layer whose weight has a ``main_grad`` (and no ``grad_added_to_main_grad``,
    which Megatron's DDP adds together with a hook that discards ``weight.grad``): the gradient goes
    to ``main_grad`` only, ``weight.grad`` stays None over any number of backwards."""
    layer = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend=backend)
    w = layer.weight
    w.main_grad = torch.zeros(128, 256, dtype=torch.float32)
    x, dy = make_input((64, 256), seed=1), make_input((64, 128), seed=2)
    for i in range(3):
        layer(x).backward(dy)
        assert w.grad is None, f"backward {i + 1} put {w.grad.abs().max()} into weight.grad"
    assert not hasattr(w, "grad_added_to_main_grad")
    once = torch.zeros_like(w.main_grad)
    plain = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend=backend)
    plain.load_state_dict(layer.state_dict())
    plain.weight.main_grad = once
    plain(x).backward(dy)
    assert once.abs().sum() > 0 and torch.allclose(w.main_grad, 3 * once, rtol=1e-6, atol=1e-6)


def test_megatrons_zero_out_wgrad_gets_a_zero_dummy_gradient():
    layer = Fp8BlockwiseLinear(256, 128, bias=False, dtype=torch.bfloat16, backend="reference")
    w = layer.weight
    w.main_grad = torch.zeros(128, 256, dtype=torch.float32)
    w.grad_added_to_main_grad, w.zero_out_wgrad = False, True
    layer(make_input((32, 256), seed=1)).backward(make_input((32, 128), seed=2))
    assert w.grad_added_to_main_grad is True and torch.equal(w.grad, torch.zeros_like(w))


def test_torch_compile_of_a_training_model_with_the_cache():
    """The FP8 linear runs eagerly between compiled graphs: the same losses as eager, bit for bit, and
    one weight quantization per optimizer step."""

    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference"), nn.ReLU(),
            Fp8BlockwiseLinear(128, 256, dtype=torch.bfloat16, backend="reference"),
        )  # fmt: skip

    def train(m, run):
        opt, out = torch.optim.SGD(m.parameters(), lr=0.5), []
        for step in range(3):
            for micro in range(2):
                loss = run(make_input((64, 256), seed=10 * step + micro, spread=False)).float().square().mean()
                loss.backward()
                out.append(loss.item())
            opt.step()
            opt.zero_grad()
        return out

    eager, compiled = model(), model()
    torch._dynamo.reset()
    assert train(compiled, torch.compile(compiled)) == train(eager, eager)
    assert [compiled[i].weight_cache.refreshes for i in (0, 2)] == [3, 3]


def fresh_output(layer, x):
    with torch.no_grad():
        return fp8_blockwise_linear(x, layer.weight.clone(), None if layer.bias is None else layer.bias.clone(),
                                    recipe=layer.recipe, backend=layer.backend)  # fmt: skip


def test_a_layer_made_or_loaded_under_inference_mode():
    x = make_input((16, 256), seed=5)
    with torch.inference_mode():
        torch.manual_seed(0)
        made = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")
        y1, y2 = made(x), made(x)
        assert made.weight_cache.refreshes == 2  # inference tensors: no version counter to trust in here
        made.weight.mul_(-1.0)  # an untracked in-place write, allowed in inference mode
        y3 = made(x)
    assert torch.equal(y1, y2) and torch.equal(y3, fresh_output(made, x)) and not torch.equal(y3, y1)
    with torch.no_grad():  # outside inference mode an inference tensor cannot be written: cached
        assert torch.equal(made(x), y3) and torch.equal(made(x), y3)
    assert made.weight_cache.refreshes == 4
    with pytest.raises(RuntimeError, match="inference tensor .* build or load the layer outside inference_mode"):
        made(x.clone().requires_grad_(True))
    # a normal layer loaded under inference mode trains as usual
    layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")
    layer(x)
    with torch.inference_mode():
        layer.load_state_dict(made.state_dict())
    assert torch.equal(layer(x), fresh_output(made, x))
    layer(x).float().sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool, torch.complex64])
def test_unsupported_weight_dtypes_are_named_with_the_fix(dtype):
    x = torch.randn(4, 128)
    w = torch.ones(64, 128, dtype=dtype)
    fix = "use torch.nn.Linear for complex weights" if dtype.is_complex else r"convert it, e.g. layer.to\(torch.bfloat16\)"
    with pytest.raises(TypeError, match=rf"weight has dtype {dtype}; .*: {fix}"):
        fp8_blockwise_linear(x, w)
    layer = Fp8BlockwiseLinear(128, 64)
    if dtype.is_floating_point or dtype.is_complex:
        layer.to(dtype)  # nn.Module.to converts floating weights, complex ones via .to(complex)
        with pytest.raises(TypeError, match=f"weight has dtype {dtype}"):
            layer(x.to(torch.float32))
    if dtype in (torch.float64, torch.complex64):
        with pytest.raises(TypeError, match=rf"dtype={dtype}: Fp8BlockwiseLinear keeps bfloat16, float16 or float32"):
            Fp8BlockwiseLinear(128, 64, dtype=dtype)


@pytest.mark.parametrize("k, n", [(0, 128), (256, 0), (0, 0)])
def test_empty_in_or_out_features_compute_exactly(k, n):
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(k, n, dtype=torch.bfloat16, backend="reference")
    ref = nn.Linear(k, n, dtype=torch.bfloat16)
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(6, 3, k, dtype=torch.bfloat16)
    dy = torch.randn(6, 3, n, dtype=torch.bfloat16)
    outs = []
    for lay in (layer, ref):
        xi = x.clone().requires_grad_(True)
        y = lay(xi)
        y.backward(dy)
        outs.append((y, xi.grad, lay.weight.grad, lay.bias.grad))
    for a, b in zip(*outs):
        assert a.shape == b.shape and torch.equal(a, b)


# ---- range: where the per-block promotion overflows ----------------------------------------------

FP32_MAX = torch.finfo(torch.float32).max
SAFE_INPUT = FP32_MAX / (128 * 448 * 17 / 16)  # docs/NUMERICS.md: a block's partial * A's scale stays finite


def test_promotion_range_limit(backend):
    """The reference (and portable Triton) GEMM promotes each K block as ``(partial * a_scale) * b_scale``,
    the order of TE's cuBLAS GEMMs: inputs up to SAFE_INPUT (~5.6e33) give finite outputs for any
    weight, even in the worst case (every product of a block with one sign); above it the intermediate
    ``partial * a_scale`` can overflow although the true output is finite, as in TE."""
    k, n = 256, 128
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(n, k, generator=g) * 1e-3 + 1e-3).to(torch.bfloat16)  # ~1e-3, one sign: worst case
    for amax, finite in ((2.0**112, True), (2.0**116, False), (1e38, False)):
        assert (amax <= SAFE_INPUT) == finite
        x = (torch.rand(64, k, generator=g) * 0.5 + 0.5) * amax
        x[:, :128] = amax  # a block whose partial * a_scale is 128 * 448 * (its value / 448) * 448
        x = x.to(torch.bfloat16)
        truth = x.double() @ w.double().t()
        assert truth.abs().max() < FP32_MAX / 4  # the true output is well inside fp32
        y = fp8_blockwise_linear(x.float(), w, backend=backend).double()
        if finite:
            assert torch.isfinite(y).all() and rel_frobenius(y, truth) < 0.08
        else:
            assert not torch.isfinite(y).any(), "the documented overflow did not happen"


@pytest.mark.parametrize("main_grad", [False, True])
def test_an_input_saved_elsewhere_is_kept_and_requantized_with_the_same_bits(backend, main_grad):
    """``mark_saved_elsewhere``: the op keeps the input (no bytes of its own) instead of its columnwise FP8
    copy and quantizes that copy in backward: outputs and every gradient bit-identical to the unmarked op."""
    from primus_fp8_plugin.ops import mark_saved_elsewhere

    k, n = 384, 256
    dy = make_input((3, 100, n), seed=7)

    def run(mark):
        x = make_input((3, 100, k), seed=5).requires_grad_(True)
        w = (make_input((n, k), seed=6) / 16).requires_grad_(True)
        b = make_input((n,), seed=8).requires_grad_(True)
        if main_grad:
            w.main_grad = torch.full((n, k), 0.5)
            w.grad_added_to_main_grad = False
        h = x * 1.0  # the marked tensor is the op's own input object, as the attention output is
        if mark:
            mark_saved_elsewhere(h)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fp8_blockwise_linear(h, w, b, backend=backend)
        y.backward(dy)
        wgrad = w.main_grad if main_grad else w.grad
        return y, x.grad, wgrad, b.grad, saved, h

    plain, marked = run(False), run(True)
    for a, b_ in zip(plain[:4], marked[:4]):
        assert torch.equal(a, b_)
    h = marked[5]
    assert [t.untyped_storage().data_ptr() for t in marked[4]] == [h.untyped_storage().data_ptr()]
    assert not any(t.dtype == h.dtype for t in plain[4])  # unmarked: FP8 data and fp32 scales only


def test_a_marked_input_that_must_be_copied_saves_the_fp8_copy(backend):
    """A non-contiguous marked input is copied before quantization: keeping it would add bytes, so the op
    saves its columnwise FP8 copy as usual."""
    from primus_fp8_plugin.ops import mark_saved_elsewhere

    x = make_input((256, 128), seed=1).t()  # [128, 256], non-contiguous
    w = (make_input((64, 256), seed=2) / 16).requires_grad_(True)
    mark_saved_elsewhere(x)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fp8_blockwise_linear(x, w, backend=backend)
    assert saved and not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
