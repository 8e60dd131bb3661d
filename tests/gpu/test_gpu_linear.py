"""Fp8BlockwiseLinear on the GPU: every GPU backend against the fp64 oracle, and against TE's te.Linear
(Float8BlockScaling) with the same weights and inputs when TE is installed."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, Fp8BlockwiseLinear, backend_availability
from primus_fp8_plugin.validate import rel_frobenius

from ..conftest import make_input

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["triton", "cublas", "flydsl"])  # each skipped where unavailable
def gpu_backend(request):
    avail = backend_availability(request.param, "cuda")
    if not avail:
        pytest.skip(f"{request.param}: {avail.reason}")
    return request.param


def _pair(backend, k, n, fmt, bias=True):
    torch.manual_seed(0)
    ours = Fp8BlockwiseLinear(
        k, n, bias=bias, device="cuda", dtype=torch.bfloat16, recipe=BlockwiseRecipe(fp8_format=fmt), backend=backend
    )
    ref = Fp8BlockwiseLinear(
        k, n, bias=bias, device="cuda", dtype=torch.bfloat16, recipe=BlockwiseRecipe(fp8_format=fmt), backend="reference"
    )
    ref.load_state_dict(ours.state_dict())
    return ours, ref


@pytest.mark.parametrize(
    "lead, k, n, fmt", [((2048,), 1024, 3072, "E4M3"), ((4, 200), 512, 768, "HYBRID"), ((1,), 256, 256, "E4M3")]
)
def test_layer_matches_reference_backend(gpu_backend, lead, k, n, fmt):
    ours, ref = _pair(gpu_backend, k, n, fmt)
    x = make_input((*lead, k), seed=1).view(*lead, k).cuda()
    dy = make_input((*lead, n), seed=2).view(*lead, n).cuda()
    outs = []
    for layer in (ours, ref):
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    for name, a, b in zip(("out", "dgrad", "wgrad", "bgrad"), *outs, strict=True):
        assert rel_frobenius(a, b) <= 2e-3, name


def test_layer_matches_transformer_engine(gpu_backend):
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import Float8BlockScaling

    k, n, m = 1024, 2048, 4096
    ours, _ = _pair(gpu_backend, k, n, "E4M3")
    te_layer = te.Linear(k, n, bias=True, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        te_layer.weight.copy_(ours.weight)
        te_layer.bias.copy_(ours.bias)
    x = make_input((m, k), seed=3).cuda()
    dy = make_input((m, n), seed=4).cuda()
    res = []
    for layer in (ours, te_layer):
        xi = x.clone().requires_grad_(True)
        ctx = te.autocast(enabled=True, recipe=Float8BlockScaling()) if layer is te_layer else torch.enable_grad()
        with ctx:
            y = layer(xi)
        y.backward(dy)
        res.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    errs = {name: rel_frobenius(a, b) for name, a, b in zip(("out", "dgrad", "wgrad", "bgrad"), *res, strict=True)}
    print(f"{gpu_backend} vs TE te.Linear: {errs}")
    assert all(e <= 3e-3 for e in errs.values()), errs
