"""The promotion range on the GPU (docs/NUMERICS.md, "Range"): X ~ 1e38 with W ~ 1e-3, whose true
outputs (~1e36) are finite in fp32, through every GPU backend and TE's ``te.Linear``. TE (cuBLAS),
the ``cublas`` backend and the reference promote ``(partial * scale_X) * scale_W`` and overflow; the
Gluon fprop (``triton`` and ``hopper`` backends on Hopper) multiplies the scales first and stays
finite. Prints one line per contender. Run: ``python -m pytest -q -s tests/gpu/test_gpu_range.py``."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import backend_availability, fp8_blockwise_linear
from primus_fp8_plugin.validate import rel_frobenius

pytestmark = pytest.mark.gpu

M, K, N = 2048, 4096, 1024


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN, the same infinities."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(torch.where(nan, 0.0, a), torch.where(nan, 0.0, b))


def _te_forward(x, w):
    te = pytest.importorskip("transformer_engine.pytorch")
    from transformer_engine.common.recipe import Float8BlockScaling

    layer = te.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        layer.weight.copy_(w)
        with te.autocast(enabled=True, recipe=Float8BlockScaling()):
            return layer(x)


def test_huge_inputs_against_transformer_engine():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, generator=g, device="cuda")
    x = (x / x.abs().max() * 1e38).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g, device="cuda") * 1e-3).to(torch.bfloat16)
    truth = x.double() @ w.double().t()
    assert truth.abs().max() < torch.finfo(torch.float32).max / 4
    outs = {}
    for name in ("reference", "triton", "cublas", "hopper"):
        if backend_availability(name, "cuda"):
            with torch.no_grad():
                outs[name] = fp8_blockwise_linear(x, w, backend=name)
    te_out = None
    try:
        te_out = _te_forward(x, w)
        outs["te.Linear"] = te_out
    except pytest.skip.Exception:
        print("transformer_engine not installed: TE's row is missing")
    print(f"true outputs: max |y| {truth.abs().max().item():.3g} (finite in fp32)")
    for name, y in outs.items():
        finite = torch.isfinite(y)
        err = rel_frobenius(y.double()[finite], truth[finite]) if finite.any() else float("nan")
        vs_te = "" if te_out is None else f", bits equal to TE's: {_same(y, te_out)}"
        print(f"{name:>10}: NaN {torch.isnan(y).float().mean().item():.1%}, Inf {torch.isinf(y).float().mean().item():.1%}, "
              f"finite outputs' error vs fp64 {err:.2e}{vs_te}")  # fmt: skip
    assert not torch.isfinite(outs["reference"]).all()  # the documented overflow
    for name in ("triton", "cublas", "hopper"):
        if name in outs:  # Gluon and cuBLAS fprop stay finite here
            assert torch.isfinite(outs[name]).all() and rel_frobenius(outs[name].double(), truth) < 0.08, name
    if te_out is not None:
        # measured on the H200 with TE 2.20.2: TE's (cuBLAS's) fprop stays finite, and the Hopper
        # backends' outputs equal it bit for bit; only the reference's promotion order overflows
        assert torch.isfinite(te_out).all()
        for name in ("triton", "cublas", "hopper"):
            if name in outs:
                assert _same(outs[name], te_out), name
