"""norm -> FP8 linear and SwiGLU -> FP8 linear with the activation quantized in the fused kernel: the same
bits as the unfused composition (``normalization.norm`` / ``swiglu.swiglu``, then ``fp8_blockwise_linear``)
in the output and in every gradient, on every CPU backend (the Triton interpreter counts)."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import (
    BlockwiseRecipe,
    WeightCache,
    available_backends,
    fp8_blockwise_linear,
    fp8_norm_linear,
    fp8_swiglu_linear,
)
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.normalization import norm
from primus_fp8_plugin.swiglu import swiglu

from .conftest import make_input

CPU_BACKENDS = [n for n, a in available_backends("cpu").items() if a]


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a, b, what):
    assert a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(bits(a), bits(b)), f"{what}: {int((bits(a) != bits(b)).sum())} of {a.numel()} differ"


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def run(fn, inputs, dy):
    y = fn(*inputs)
    y.backward(dy)
    return y.detach(), [None if t is None else t.grad for t in inputs]


# (backend, lead dims of x, H, N, dtype, normalization, bias, format, zero-centred gamma); the triton
# cases are small (interpreter); M = product of the lead dims, never a multiple of 128 but for one case
NORM_CASES = [
    ("reference", (3, 70), 300, 192, torch.bfloat16, "LayerNorm", True, "E4M3", False),
    ("reference", (130,), 256, 136, torch.float32, "RMSNorm", False, "HYBRID", True),
    ("reference", (256,), 128, 128, torch.bfloat16, "RMSNorm", True, "HYBRID", False),
    ("reference", (5, 7), 136, 64, torch.float16, "LayerNorm", False, "E4M3", True),
    ("triton", (100,), 136, 136, torch.bfloat16, "LayerNorm", True, "HYBRID", False),
    ("triton", (2, 9), 256, 128, torch.float32, "RMSNorm", False, "E4M3", True),
]


@pytest.mark.parametrize("backend, lead, h, n, dtype, normalization, bias, fmt, zero_centered", NORM_CASES)
def test_norm_linear_is_the_unfused_composition_bit_for_bit(backend, lead, h, n, dtype, normalization, bias, fmt,
                                                             zero_centered):  # fmt: skip
    if backend not in CPU_BACKENDS:
        pytest.skip(f"{backend} does not run here")
    recipe = BlockwiseRecipe(fp8_format=fmt)
    g = torch.Generator().manual_seed(h + n)
    x = (make_input((*lead, h), dtype=torch.float32, seed=h, spread=False) * 2 + 0.3).to(dtype)
    nw = ((torch.rand(h, generator=g) - 0.5) if zero_centered else (torch.rand(h, generator=g) + 0.5)).to(dtype)
    nb = torch.randn(h, generator=g).to(dtype) if normalization == "LayerNorm" else None
    w = (torch.randn(n, h, generator=g) / h**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    dy = make_input((*lead, n), dtype=dtype, seed=n, spread=False)
    kw = {"normalization": normalization, "eps": 1e-5, "zero_centered_gamma": zero_centered}

    def fused(x, nw, nb, w, b):
        return fp8_norm_linear(x, nw, nb, w, b, recipe=recipe, backend=backend, **kw)

    def unfused(x, nw, nb, w, b):
        normed = norm(x, normalization, nw, nb, 1e-5, zero_centered, backend=backend)
        return fp8_blockwise_linear(normed, w, b, recipe=recipe, backend=backend)

    y_f, grads_f = run(fused, leaves(x, nw, nb, w, b), dy)
    y_u, grads_u = run(unfused, leaves(x, nw, nb, w, b), dy)
    assert_same(y_f, y_u, "output")
    for name, a, c in zip(("dx", "dgamma", "dbeta", "dW", "db"), grads_f, grads_u):
        if c is not None or a is not None:
            assert_same(a, c, name)
    assert grads_f[0].abs().sum() > 0 and grads_f[3].abs().sum() > 0  # real gradients, not zeros


@pytest.mark.parametrize(
    "backend, lead, f, n, dtype, bias, fmt",
    [
        ("reference", (3, 70), 300, 192, torch.bfloat16, True, "HYBRID"),
        ("reference", (129,), 128, 256, torch.float32, False, "E4M3"),
        ("reference", (64,), 136, 64, torch.float16, True, "E4M3"),
        ("triton", (100,), 136, 136, torch.bfloat16, False, "HYBRID"),
        ("triton", (2, 9), 256, 128, torch.float32, True, "E4M3"),
    ],
)
def test_swiglu_linear_is_the_unfused_composition_bit_for_bit(backend, lead, f, n, dtype, bias, fmt):
    if backend not in CPU_BACKENDS:
        pytest.skip(f"{backend} does not run here")
    recipe = BlockwiseRecipe(fp8_format=fmt)
    g = torch.Generator().manual_seed(f + n)
    h = (make_input((*lead, 2 * f), dtype=torch.float32, seed=f, spread=False) * 3).to(dtype)
    w = (torch.randn(n, f, generator=g) / f**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    dy = make_input((*lead, n), dtype=dtype, seed=n, spread=False)

    def fused(h, w, b):
        return fp8_swiglu_linear(h, w, b, recipe=recipe, backend=backend)

    def unfused(h, w, b):
        return fp8_blockwise_linear(swiglu(h, backend=backend), w, b, recipe=recipe, backend=backend)

    y_f, grads_f = run(fused, leaves(h, w, b), dy)
    y_u, grads_u = run(unfused, leaves(h, w, b), dy)
    assert_same(y_f, y_u, "output")
    for name, a, c in zip(("dh", "dW", "db"), grads_f, grads_u):
        if c is not None or a is not None:
            assert_same(a, c, name)


def test_main_grad_weight_cache_and_frozen_norm():
    """Megatron's gradient-accumulation fusion (main_grad), a weight cache across two microbatches, and a
    norm whose parameters need no gradient: the same bits as the unfused composition."""
    torch.manual_seed(0)
    h, n = 256, 128
    x = make_input((70, h), spread=False)
    nw, nb = torch.rand(h).bfloat16() + 0.5, torch.randn(h).bfloat16()
    w0 = (torch.randn(n, h) / 16).bfloat16()
    results = []
    for fused in (True, False):
        w = w0.clone().requires_grad_(True)
        w.main_grad = torch.zeros(n, h)
        w.grad_added_to_main_grad = False
        cache = WeightCache()
        xs = []
        for mb in range(2):
            xi = (x * (mb + 1)).requires_grad_(True)
            if fused:
                y = fp8_norm_linear(xi, nw, nb, w, None, backend="reference", weight_cache=cache, refresh_weight_cache=mb == 0)
            else:
                normed = norm(xi, "LayerNorm", nw, nb, 1e-5, backend="reference")
                y = fp8_blockwise_linear(normed, w, None, backend="reference", weight_cache=cache, refresh_weight_cache=mb == 0)
            y.backward(make_input((70, n), seed=mb, spread=False))
            xs.append(xi.grad)
        assert cache.refreshes == 1 and w.grad_added_to_main_grad
        results.append((w.main_grad.clone(), *xs))
    for a, c in zip(*results):
        assert torch.equal(a, c)
    assert results[0][0].abs().sum() > 0


def test_fused_norm_linear_saves_no_high_precision_norm_output():
    """Saved for backward: x (the residual stream, kept by the model anyway), gamma, the fp32 row statistics
    and the columnwise FP8 copy (about half a bf16 copy) -- not a bf16 copy of the norm's output."""
    m, h, n = 512, 256, 128
    x = make_input((m, h), spread=False).requires_grad_(True)
    nw = torch.ones(h, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fp8_norm_linear(x, nw, None, w, None, normalization="RMSNorm", backend="reference")
    params = {t.untyped_storage().data_ptr() for t in (x, nw, w)}
    extra = sum(b for ptr, b in saved.items() if ptr not in params)
    fp8_copy = m * h + 4 * (h * m // 128)  # the columnwise copy and its scales
    assert fp8_copy <= extra <= fp8_copy + 8 * m  # + rstd; a bf16 norm output would add m*h*2


def test_norm_and_swiglu_autograd_give_the_backends_gradients():
    be = get_backend("reference", "cpu")
    x = make_input((40, 136), spread=False)
    nw = torch.rand(136).bfloat16() + 0.5
    dy = make_input((40, 136), seed=3, spread=False)
    xs, ws = leaves(x, nw)
    norm(xs, "RMSNorm", ws, None, 1e-6, True).backward(dy)  # zero-centred: the scale is w + 1
    _, rstd = be.norm_fwd(x, nw + 1, None, 1e-6, "RMSNorm")[1:]
    dx, dgamma, _ = be.norm_bwd(dy, x, nw + 1, None, rstd, need_dgamma=True, need_dbeta=False)
    assert torch.equal(xs.grad, dx) and torch.equal(ws.grad, dgamma)
    h = make_input((3, 5, 64), spread=False).requires_grad_(True)
    g = make_input((3, 5, 32), seed=4, spread=False)
    swiglu(h).backward(g)
    assert torch.equal(h.grad, be.swiglu_bwd(g.reshape(15, 32), h.detach().reshape(15, 64)).view(3, 5, 64))


def test_bad_input_raises_clear_errors():
    x = make_input((8, 64), spread=False)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="normalization must be one of"):
        fp8_norm_linear(x, torch.ones(64, dtype=torch.bfloat16), None, w, normalization="BatchNorm")
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        norm(x, "RMSNorm", torch.ones(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"norm weight must be a \[64\]"):
        norm(x, "LayerNorm", torch.ones(63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="need 2x"):
        fp8_swiglu_linear(make_input((8, 96), spread=False), w)
    with pytest.raises(ValueError, match="last dim 2F"):
        swiglu(make_input((8, 7), spread=False))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        swiglu(torch.zeros(4, 8, dtype=torch.float64))
