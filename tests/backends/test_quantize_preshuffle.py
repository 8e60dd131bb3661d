"""The preshuffled weight quantizer (FlyDSL's (16, 16) layout), bit for bit against a plain torch
permutation of the reference backend's K-major copies, through Triton's CPU interpreter; the layout's
shape rules; the tensor type's unshuffling views (dequantize, to_te)."""

from __future__ import annotations

import os

import pytest
import torch

from primus_fp8_plugin import BlockwiseFp8Tensor, QuantParams
from primus_fp8_plugin.backends.reference import ReferenceBackend
from primus_fp8_plugin.preshuffle import check_preshuffle_shape, preshuffle, preshuffle_fits, preshuffle_offset, unshuffle

from ..conftest import make_input

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REF = ReferenceBackend()
interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="CPU interpreter test (GPU: tests/gpu)")


def flydsl_view_permutation(b: torch.Tensor) -> torch.Tensor:
    """The layout as FlyDSL's tests define it: [R, C] viewed (R/16, 16, C/32, 2, 16), permuted (0, 2, 3, 1, 4)."""
    r, c = b.shape
    return b.view(r // 16, 16, c // 32, 2, 16).permute(0, 2, 3, 1, 4).contiguous().view(r, c)


def test_layout_matches_the_byte_formula_and_round_trips():
    r, c = 48, 96
    b = torch.randperm(r * c, generator=torch.Generator().manual_seed(3)).view(r, c)
    flat = flydsl_view_permutation(b).flatten()
    rr, cc = torch.meshgrid(torch.arange(r), torch.arange(c), indexing="ij")
    # the form of the formula, written out independently of preshuffle_offset
    want = ((((rr // 16) * (c // 32) + cc // 32) * 2 + (cc % 32) // 16) * 16 + rr % 16) * 16 + cc % 16
    assert torch.equal(flat[want], b)
    assert torch.equal(preshuffle_offset(rr, cc, c), want)
    assert torch.equal(preshuffle(b), flydsl_view_permutation(b))
    assert torch.equal(unshuffle(preshuffle(b)), b)


@pytest.mark.parametrize("shape", [(16, 31), (8, 64), (0, 32)])
def test_shapes_the_layout_cannot_hold_raise(shape):
    with pytest.raises(ValueError, match="preshuffled layout"):
        check_preshuffle_shape(*shape)
    assert not preshuffle_fits(*shape)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@interpreter
@pytest.mark.parametrize(
    "n,k,dtype,fp8,pow2",
    [(256, 384, torch.bfloat16, E4M3, True), (160, 96, torch.float32, E4M3, False), (96, 288, torch.float16, E5M2, True)],
)
def test_quantizer_is_the_reference_permuted(n, k, dtype, fp8, pow2):
    from primus_fp8_plugin.kernels.triton.quantize_weight_preshuffle import quantize_128x128_preshuffled

    w = make_input((n, k), dtype=dtype, seed=n + k)
    w[:3, :7] = 0
    if dtype is not torch.float16:
        w[130 % n, 5] = float("nan")  # a NaN block: scale NaN, data NaN, in both copies
    params = QuantParams(fp8, 2, pow2_scales=pow2)
    ours = quantize_128x128_preshuffled(w, params)
    ref = REF.quantize_weight(w, params)
    assert ours.layout == "preshuffle16" and ref.layout == "k_major"
    assert torch.equal(_bits(ours.rowwise_data), _bits(flydsl_view_permutation(ref.rowwise_data)))
    assert torch.equal(_bits(ours.columnwise_data), _bits(flydsl_view_permutation(ref.columnwise_data)))
    assert torch.equal(_bits(ours.rowwise_scale_inv), _bits(ref.rowwise_scale_inv))
    assert torch.equal(_bits(ours.columnwise_scale_inv), _bits(ref.columnwise_scale_inv))
    # the tensor's K-major views undo the shuffle
    te, te_ref = ours.to_te(), ref.to_te()
    for key in te:
        assert torch.equal(_bits(te[key]), _bits(te_ref[key])), key
    torch.testing.assert_close(ours.dequantize(torch.float32), ref.dequantize(torch.float32), equal_nan=True, rtol=0, atol=0)


@interpreter
@pytest.mark.parametrize("n,k", [(256, 384), (128, 128), (384, 256), (160, 640)])
def test_quantizer_pads_wt_storage_for_256_wide_dgrad_tiles(n, k):
    """K % 256 == 128: W^T's storage holds K + 128 rows, the padded view being bit for bit the reference's
    W^T with 128 zero rows, preshuffled, and its scales with a row of 1.0; other K: no padding."""
    from primus_fp8_plugin.kernels.triton.quantize_weight_preshuffle import quantize_128x128_preshuffled
    from primus_fp8_plugin.preshuffle import dgrad_padded_rows, padded_rows

    w = make_input((n, k), dtype=torch.bfloat16, seed=n * k)
    params = QuantParams(E4M3, 2)
    ours, ref = quantize_128x128_preshuffled(w, params), REF.quantize_weight(w, params)
    kp = dgrad_padded_rows(k)
    assert kp == (k + 128 if k % 256 == 128 else k)
    assert ours.columnwise_data.shape == (k, n) and ours.columnwise_scale_inv.shape == ref.columnwise_scale_inv.shape
    data, scales = padded_rows(ours.columnwise_data, kp), padded_rows(ours.columnwise_scale_inv, kp // 128)
    assert data.shape == (kp, n) and scales.shape == (kp // 128, ref.columnwise_scale_inv.shape[1])
    want = torch.zeros(kp, n, dtype=torch.uint8)
    want[:k] = ref.columnwise_data.view(torch.uint8)
    assert torch.equal(_bits(data), flydsl_view_permutation(want))
    want_s = torch.ones(scales.shape)
    want_s[: k // 128] = ref.columnwise_scale_inv
    assert torch.equal(_bits(scales), _bits(want_s))
    if kp == k:
        assert ours.columnwise_data.untyped_storage().nbytes() == k * n
    else:  # a copy drops the padding: the dgrad then uses the tensors as they are (128-wide tiles)
        assert padded_rows(ours.columnwise_data.clone(), kp) is None


def test_padded_rows_needs_the_storage():
    from primus_fp8_plugin.preshuffle import padded_rows

    store = torch.arange(12 * 4, dtype=torch.uint8)
    t = store[: 8 * 4].view(8, 4)
    assert torch.equal(padded_rows(t, 12), store.view(12, 4))
    assert padded_rows(t, 13) is None and padded_rows(t, 8) is t
    assert padded_rows(store[4:36].view(8, 4), 9) is None  # not at the storage's start
    assert padded_rows(t.clone(), 12) is None


@interpreter
def test_quantizer_rejects_shapes_it_cannot_hold():
    from primus_fp8_plugin.kernels.triton.quantize_weight_preshuffle import quantize_128x128_preshuffled

    with pytest.raises(ValueError, match="weight W\\^T .* cannot be stored"):
        quantize_128x128_preshuffled(torch.randn(48, 64), QuantParams(E4M3, 2))  # W fits, W^T [64, 48] does not


def test_tensor_checks_the_layout():
    data = torch.zeros(32, 48, dtype=E4M3)
    s = torch.ones(1, 4)
    with pytest.raises(ValueError, match="cannot be stored"):
        BlockwiseFp8Tensor((32, 48), 2, E4M3, torch.bfloat16, rowwise_data=data, rowwise_scale_inv=s, layout="preshuffle16")
    with pytest.raises(ValueError, match="layout must be one of"):
        BlockwiseFp8Tensor((32, 48), 2, E4M3, torch.bfloat16, rowwise_data=data, rowwise_scale_inv=s, layout="nk")
