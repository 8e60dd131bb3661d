"""Blockwise GEMMs: against an fp64 oracle on dequantized operands, ragged shapes, bad input."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import (
    BlockwiseRecipe,
    TensorRole,
    gemm_dgrad,
    gemm_fwd,
    gemm_wgrad,
    quantize_activation,
    quantize_weight,
)
from primus_fp8_plugin.validate import rel_frobenius, run_linear

from ..conftest import make_input

RECIPE = BlockwiseRecipe(pow2_scales=True)
P_X, P_W, P_G = (RECIPE.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))

# (M, N, K): M = 1, M not a multiple of 16, partial tiles in N and K, K/128 odd
SHAPES = [(1, 128, 128), (7, 136, 272), (200, 256, 384), (130, 48, 400), (256, 384, 640)]


def oracle(a_hp: torch.Tensor, b_hp: torch.Tensor) -> torch.Tensor:
    return a_hp.double() @ b_hp.double().t()


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_three_gemms_match_fp64_on_dequantized_operands(backend, m, n, k):
    x, w, dy = make_input((m, k), seed=m), make_input((n, k), seed=n + 1), make_input((m, n), seed=k + 2)
    bias = make_input((1, n), seed=3, spread=False).view(n)
    xq, wq, dyq = (
        quantize_activation(x, P_X, backend=backend),
        quantize_weight(w, P_W, backend=backend),
        quantize_activation(dy, P_G, backend=backend),
    )
    y = gemm_fwd(xq, wq, bias, out_dtype=torch.float32, backend=backend)
    ref = oracle(xq.dequantize(torch.float32), wq.dequantize(torch.float32)) + bias.double()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_frobenius(y, ref) < 1e-6

    dx = gemm_dgrad(dyq, wq, out_dtype=torch.float32, backend=backend)
    ref = dyq.dequantize(torch.float32).double() @ wq.dequantize(torch.float32, copy="columnwise").double()
    assert dx.shape == (m, k) and rel_frobenius(dx, ref) < 1e-6

    dw = gemm_wgrad(dyq, xq, out_dtype=torch.float32, backend=backend)
    ref = oracle(dyq.dequantize(torch.float32, copy="columnwise").t(), xq.dequantize(torch.float32, copy="columnwise").t())
    assert dw.shape == (n, k) and rel_frobenius(dw, ref) < 1e-6


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_dtypes(backend, out_dtype):
    x, w = make_input((64, 256), spread=False), make_input((128, 256), seed=1, spread=False)
    y = gemm_fwd(
        quantize_activation(x, P_X, backend=backend),
        quantize_weight(w, P_W, backend=backend),
        out_dtype=out_dtype,
        backend=backend,
    )
    assert y.dtype == out_dtype
    assert rel_frobenius(y, oracle(x, w)) < 0.05  # FP8 error against the unquantized product


def test_wgrad_accumulates_into_fp32_main_grad(backend):
    x, dy = make_input((96, 256), seed=1), make_input((96, 128), seed=2)
    xq, dyq = quantize_activation(x, P_X, backend=backend), quantize_activation(dy, P_G, backend=backend)
    main_grad = make_input((128, 256), dtype=torch.float32, seed=3)
    start = main_grad.clone()
    out = gemm_wgrad(dyq, xq, accumulate_into=main_grad, backend=backend)
    assert out is main_grad
    fresh = gemm_wgrad(dyq, xq, out_dtype=torch.float32, backend=backend)
    assert torch.allclose(main_grad, start + fresh, rtol=1e-6, atol=0)


def test_zero_rows(backend):
    """M = 0 (an MoE expert that got no tokens): empty outputs, zero weight gradient."""
    x, w, dy = torch.zeros(0, 256), make_input((128, 256)), torch.zeros(0, 128)
    xq, wq, dyq = (
        quantize_activation(x, P_X, backend=backend),
        quantize_weight(w, P_W, backend=backend),
        quantize_activation(dy, P_G, backend=backend),
    )
    assert gemm_fwd(xq, wq, backend=backend).shape == (0, 128)
    assert gemm_dgrad(dyq, wq, backend=backend).shape == (0, 256)
    dw = gemm_wgrad(dyq, xq, backend=backend)
    assert dw.shape == (128, 256) and torch.all(dw == 0)


def test_te_linear_goldens(linear_cases, backend):
    assert linear_cases
    for case in linear_cases:
        t = case.tensors
        ours = run_linear(BlockwiseRecipe(fp8_format=case.fmt), t["x"], t["weight"], t.get("bias"), t["grad_out"], backend)
        for name in ("out", "dgrad", "wgrad", "bgrad"):
            if name in t:
                assert rel_frobenius(ours[name], t[name]) < 2e-3, f"{case.name}/{name}"


def test_bad_gemm_input_is_refused(backend):
    x, w = make_input((64, 256)), make_input((128, 256))
    xq = quantize_activation(x, P_X, backend=backend)
    wq = quantize_weight(w, P_W, backend=backend)
    x_col = quantize_activation(x, P_X, rowwise=False, backend=backend)
    with pytest.raises(ValueError, match="no rowwise copy"):
        gemm_fwd(x_col, wq, backend=backend)
    with pytest.raises(ValueError, match="128x128"):
        gemm_fwd(xq, xq, backend=backend)
    with pytest.raises(ValueError, match="1x128"):
        gemm_fwd(wq, wq, backend=backend)
    with pytest.raises(ValueError, match="inner dims"):
        gemm_fwd(quantize_activation(make_input((64, 128)), P_X, backend=backend), wq, backend=backend)
    with pytest.raises(ValueError, match="bias"):
        gemm_fwd(xq, wq, torch.zeros(7), backend=backend)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_fwd(xq, wq, out_dtype=torch.int8, backend=backend)
    with pytest.raises(TypeError, match="BlockwiseFp8Tensor"):
        gemm_fwd(x, wq, backend=backend)
    dyq = quantize_activation(make_input((64, 128)), P_G, backend=backend)
    with pytest.raises(ValueError, match="dy must be"):
        gemm_dgrad(quantize_activation(make_input((64, 96)), P_G, backend=backend), wq, backend=backend)
    with pytest.raises(ValueError, match="same M"):
        gemm_wgrad(dyq, quantize_activation(make_input((32, 256)), P_X, backend=backend), backend=backend)
    with pytest.raises(ValueError, match="accumulate_into"):
        gemm_wgrad(dyq, xq, accumulate_into=torch.zeros(128, 256, dtype=torch.bfloat16), backend=backend)
    with pytest.raises(ValueError, match="accumulate_into"):
        gemm_wgrad(dyq, xq, accumulate_into=torch.zeros(256, 128), backend=backend)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_cublas_bias_epilogue_rounds_once_like_the_two_pass_form(out_dtype, bias_dtype):
    # The cuBLAS backend adds the bias to the fp32 GEMM result in one pass that writes out_dtype;
    # it must give the bits of "add in fp32, then round" (what TE's cuBLASLt epilogue does).
    from primus_fp8_plugin.backends.cublas import add_bias_rounding_once

    y = make_input((37, 272), seed=5).float() * 1e3
    bias = make_input((1, 272), seed=6, spread=False).view(272).to(bias_dtype)
    got = add_bias_rounding_once(y.clone(), bias, out_dtype)
    assert got.dtype == out_dtype and got.shape == y.shape
    assert torch.equal(got, y.clone().add_(bias).to(out_dtype))
