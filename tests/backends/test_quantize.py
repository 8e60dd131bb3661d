"""Quantization: bit-exact with TE's goldens, TE's scale rule, error bounds, edge cases, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from primus_fp8_plugin import BlockwiseFp8Tensor, QuantParams, quantize_activation, quantize_weight
from primus_fp8_plugin.backends.reference import scale_from_amax

from ..conftest import make_input

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (mantissa bits, smallest subnormal step) of each FP8 type
FP8_GRID = {E4M3: (3, 2.0**-9), E5M2: (2, 2.0**-16)}


def quantize(x, params, backend, **kw):
    if params.block_dim == 1:
        return quantize_activation(x, params, backend=backend, **kw)
    return quantize_weight(x, params, backend=backend, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in (E4M3, E5M2, torch.uint8):
        return t.view(torch.uint8)
    return t.view(torch.int32)


# ---- TE goldens -------------------------------------------------------------------------------
def test_bit_exact_with_te_goldens(quant_cases, backend):
    n_variants = 0
    for case in quant_cases:
        for v in case.variants:
            params = QuantParams(v.fp8_dtype, v.block_dim, pow2_scales=v.pow2_scales)
            ours = quantize(case.x, params, backend)
            te = BlockwiseFp8Tensor.from_te(shape=tuple(case.x.shape), block_dim=v.block_dim, fp8_dtype=v.fp8_dtype, **v.tensors)
            for which in ("rowwise", "columnwise"):
                what = f"{case.name}/{v.name}/{which}"
                assert torch.equal(bits(ours.to_te()[f"{which}_data"]), bits(te.to_te()[f"{which}_data"])), what
                assert torch.equal(bits(ours.scales(which)), bits(te.scales(which))), what
            n_variants += 1
    assert n_variants == 30


# ---- the scale rule, against an independent numpy oracle -------------------------------------
def numpy_scale(amax: np.ndarray, fmax: float, in_max: float, pow2: bool) -> np.ndarray:
    with np.errstate(divide="ignore", over="ignore"):
        scale = np.float32(fmax) / amax.astype(np.float32)  # IEEE fp32 division
    scale = np.where(np.isinf(scale), np.float32(in_max), scale).astype(np.float32)
    if pow2:
        scale = (scale.view(np.uint32) & np.uint32(0x7F800000)).view(np.float32)
    return np.where(amax == 0, np.float32(1.0), scale).astype(np.float32)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_scale_rule_matches_numpy_oracle(pow2, fp8, in_dtype):
    g = torch.Generator().manual_seed(11)
    amax = torch.exp2(torch.empty(20000).uniform_(-140, 127, generator=g)) * torch.rand(20000, generator=g)
    amax[:5] = torch.tensor([0.0, 1e-45, 1e-40, 3.0e38, 448.0])
    params = QuantParams(fp8, 1, pow2_scales=pow2)
    ours = scale_from_amax(amax, params, in_dtype).numpy()
    want = numpy_scale(amax.numpy(), params.fp8_max, torch.finfo(in_dtype).max, pow2)
    assert np.array_equal(ours.view(np.uint32), want.view(np.uint32))


def test_python_scalar_division_would_be_wrong():
    """Guards the reason scale_from_amax uses a tensor/tensor division (docs/NUMERICS.md, "Per tile", step 2)."""
    amax = torch.rand(20000, generator=torch.Generator().manual_seed(1)) + 0.01
    true_div = torch.full_like(amax, 448.0) / amax
    assert not torch.equal(true_div, 448.0 / amax)


# ---- error bounds on fresh random inputs ------------------------------------------------------
def check_error_bound(x: torch.Tensor, q: BlockwiseFp8Tensor, params: QuantParams) -> None:
    mant, step = FP8_GRID[params.fp8_dtype]
    xf = x.reshape(q.shape).float()
    for which in ("rowwise", "columnwise"):
        if (which == "rowwise" and not q.has_rowwise) or (which == "columnwise" and not q.has_columnwise):
            continue
        dq = q.dequantize(torch.float32, copy=which)
        s = q.scales(which)
        s_full = (
            s.repeat_interleave(128, 1)[:, : xf.shape[1] if which == "rowwise" else xf.shape[0]]
            if q.block_dim == 1
            else s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        )
        if q.block_dim == 1 and which == "columnwise":
            s_full = s_full.t()
        elif q.block_dim == 2:
            s_full = s_full[: xf.shape[0], : xf.shape[1]] if which == "rowwise" else s_full[: xf.shape[1], : xf.shape[0]].t()
        bound = (xf.abs() * 2.0 ** -(mant + 1) + s_full * (step / 2)) * (1 + 1e-5)
        err = (dq - xf).abs()
        assert torch.all(err <= bound), f"{which}: worst excess {(err - bound).max().item()}"
        if params.pow2_scales:
            m, _ = torch.frexp(s)
            assert torch.all(m == 0.5), "power-of-2 scales expected"


# Everything a quantization is parametrized by, drawn afresh by hypothesis (shapes drawn per test).
VARIANTS = dict(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    fp8=st.sampled_from([E4M3, E5M2]),
    block_dim=st.sampled_from([1, 2]),
    pow2=st.booleans(),
    eps=st.sampled_from([0.0, 1e-3]),
    seed=st.integers(0, 2**31 - 1),
)


def random_input(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows over many binades, scaled to stay inside fp16's range when dtype is fp16."""
    x = make_input((m, k), dtype=torch.float32, seed=seed)
    return (x / x.abs().max().clamp_min(1e-30) * (1000 if dtype is torch.float16 else 1e6)).to(dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 300), k=st.integers(1, 300), **VARIANTS)
def test_dequantize_error_bound(backend, m, k, dtype, fp8, block_dim, pow2, eps, seed):
    x = random_input(m, k, dtype, seed)
    params = QuantParams(fp8, block_dim, pow2_scales=pow2, amax_epsilon=eps)
    q = quantize(x, params, backend)
    assert q.shape == (m, k) and q.orig_dtype == dtype
    check_error_bound(x, q, params)


# ---- special inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("block_dim", [1, 2])
def test_all_zero_tiles_have_unit_scale(backend, block_dim):
    x = make_input((256, 384), seed=2, spread=False)  # amax ~ 4: real scales are ~64, not 1
    x[:128, 128:256] = 0
    q = quantize(x, QuantParams(E4M3, block_dim), backend)
    zero_scales = q.scales()[:128, 1] if block_dim == 1 else q.scales()[0, 1]
    assert torch.all(zero_scales == 1.0)
    assert torch.all(q.rowwise_data.float()[:128, 128:256] == 0)
    others = torch.ones_like(q.scales(), dtype=torch.bool)
    if block_dim == 1:
        others[:128, 1] = False
    else:
        others[0, 1] = False
    assert torch.all(q.scales()[others] != 1.0)  # non-zero tiles got real scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_huge_and_tiny_values(backend, dtype):
    big = torch.finfo(dtype).max / 2
    x = make_input((4, 512), seed=3).to(dtype)
    x[0, :128] = big  # saturating magnitude
    x[1, :128] = torch.finfo(dtype).tiny  # smallest normal: scale overflows to inf -> input max
    x[2, :128] = 0
    x[2, 5] = -big
    q = quantize(x, QuantParams(E4M3, 1), backend)
    s = q.scales()
    assert s[0, 0].item() > 0 and math.isfinite(s[0, 0].item())
    assert q.rowwise_data[0, :128].float().abs().max().item() == 256.0  # pow2 scale leaves headroom
    dq = q.dequantize(torch.float32)
    assert torch.allclose(dq[0, :128], x[0, :128].float(), rtol=2**-4)
    assert torch.all(torch.isfinite(dq)), "tiny and huge values must stay finite"
    assert dq[2, 5].item() == pytest.approx(-big, rel=2**-4)


def test_values_at_bf16_max_overflow_on_dequantize_as_in_te(backend):
    """TE's rule rounds bf16 max * 2^-120 = 255 up to the E4M3 value 256, and 256 * 2^120 = 2^128
    is not an fp32 number: the FP8 data and scale are finite, only the dequantized product is inf."""
    x = torch.full((1, 128), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    q = quantize_activation(x, QuantParams(E4M3, 1), backend=backend)
    assert q.rowwise_data.float().max().item() == 256.0 and q.scales()[0, 0].item() == 2.0**120
    assert torch.isinf(q.dequantize(torch.float32)).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_non_finite_tiles_become_nan_and_stay_local(backend, bad, fp8):
    x = make_input((256, 384), seed=5)
    x_bad = x.clone()
    x_bad[130, 200] = bad  # rowwise tile (130, 1); columnwise tile (K=200, M-block 1)
    params = QuantParams(fp8, 1)
    q, q_ok = quantize(x_bad, params, backend), quantize(x, params, backend)
    assert torch.isnan(q.scales("rowwise")[130, 1])
    assert torch.isnan(q.rowwise_data[130, 128:256].float()).all()
    assert torch.isnan(q.scales("columnwise")[200, 1])
    assert torch.isnan(q.columnwise_data[200, 128:256].float()).all()
    # every other tile is untouched
    mask_r = torch.ones(256, 3, dtype=torch.bool)
    mask_r[130, 1] = False
    assert torch.equal(q.scales("rowwise")[mask_r], q_ok.scales("rowwise")[mask_r])
    assert torch.equal(bits(q.rowwise_data)[:130], bits(q_ok.rowwise_data)[:130])
    dq = q.dequantize(torch.float32)
    assert torch.isnan(dq[130, 128:256]).all() and torch.isfinite(dq[131:]).all()
    # weights: the whole 128x128 block
    qw = quantize(x_bad, QuantParams(E4M3, 2), backend)
    assert torch.isnan(qw.scales()[1, 1]) and torch.isnan(qw.dequantize(torch.float32)[128:256, 128:256]).all()
    assert torch.isfinite(qw.dequantize(torch.float32)[:128]).all()


def test_check_finite_raises(backend):
    x = make_input((16, 128))
    x[3, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite value"):
        quantize_activation(x, QuantParams(E4M3, 1), backend=backend, check_finite=True)
    with pytest.raises(ValueError, match=r"first at index \(3, 7\)"):
        quantize_weight(x, QuantParams(E4M3, 2), backend=backend, check_finite=True)


def test_m_equals_one_and_leading_dims(backend):
    x = make_input((1, 272), seed=8)
    q = quantize_activation(x, QuantParams(E4M3, 1), backend=backend)
    assert q.columnwise_data.shape == (272, 1) and q.scales("columnwise").shape == (272, 1)
    check_error_bound(x, q, QuantParams(E4M3, 1))
    x3 = make_input((6, 5, 256), seed=9).view(6, 5, 256)
    q3 = quantize_activation(x3, QuantParams(E4M3, 1), backend=backend)
    assert q3.shape == (30, 256)


def test_single_copy(backend):
    x = make_input((64, 256))
    r = quantize_activation(x, QuantParams(E4M3, 1), columnwise=False, backend=backend)
    c = quantize_activation(x, QuantParams(E4M3, 1), rowwise=False, backend=backend)
    assert r.has_rowwise and not r.has_columnwise and c.has_columnwise and not c.has_rowwise


# ---- bad input --------------------------------------------------------------------------------
def test_bad_input_is_refused(backend):
    p1, p2 = QuantParams(E4M3, 1), QuantParams(E4M3, 2)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_activation(torch.ones(4, 128, dtype=torch.int32), p1, backend=backend)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        quantize_activation(torch.ones(4, 128).to(E4M3), p1, backend=backend)
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize_activation(np.ones((4, 128)), p1, backend=backend)
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_activation(torch.ones(128), p1, backend=backend)
    with pytest.raises(ValueError, match="empty last dimension"):
        quantize_activation(torch.ones(4, 0), p1, backend=backend)
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.ones(2, 4, 128), p2, backend=backend)
    with pytest.raises(ValueError, match="quantize_weight"):
        quantize_activation(torch.ones(4, 128), p2, backend=backend)
    with pytest.raises(ValueError, match="quantize_activation"):
        quantize_weight(torch.ones(4, 128), p1, backend=backend)
    with pytest.raises(ValueError, match="at least one"):
        quantize_activation(torch.ones(4, 128), p1, rowwise=False, columnwise=False, backend=backend)


# ---- every backend agrees with the reference bit for bit -------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 260), k=st.integers(1, 20).map(lambda i: 16 * i), **VARIANTS)
def test_matches_reference_bit_for_bit(backend, m, k, dtype, fp8, block_dim, pow2, eps, seed):
    x = random_input(m, k, dtype, seed)
    if m > 3:
        x[m // 2, : min(k, 128)] = 0  # a zero tile (1D) / partly-zero block
    params = QuantParams(fp8, block_dim, pow2_scales=pow2, amax_epsilon=eps)
    ours, ref = quantize(x, params, backend), quantize(x, params, "reference")
    for name, t in ours.to_te().items():
        assert torch.equal(bits(t), bits(ref.to_te()[name])), name  # padding entries included
