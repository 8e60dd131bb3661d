import pytest
import torch

from primus_fp8_plugin import BlockwiseFp8Tensor, QuantParams, quantize_activation, quantize_weight
from primus_fp8_plugin.tensor import scale_inv_shape

from .conftest import make_input

P1 = QuantParams(torch.float8_e4m3fn, 1)
P2 = QuantParams(torch.float8_e4m3fn, 2)


@pytest.mark.parametrize(
    "rows, cols, dim, want",
    [
        (200, 320, 1, (3, 200)),  # X [M, K] rowwise: [ceil(K/128), pad4(M)]
        (320, 200, 1, (2, 320)),  # X^T [K, M] columnwise: [ceil(M/128), pad4(K)]
        (7, 130, 1, (2, 8)),
        (136, 272, 2, (2, 4)),  # W [N, K]: [ceil(N/128), pad4(ceil(K/128))]
        (272, 136, 2, (3, 4)),
        (1280, 29568, 2, (10, 232)),
    ],
)
def test_scale_layouts_are_te_layouts(rows, cols, dim, want):
    assert scale_inv_shape(rows, cols, dim) == want


def test_activation_copies_shapes_and_padding():
    x = make_input((7, 130))
    q = quantize_activation(x, P1, backend="reference")
    assert q.shape == (7, 130) and q.block_dim == 1
    assert q.rowwise_data.shape == (7, 130) and q.columnwise_data.shape == (130, 7)
    assert q.rowwise_scale_inv.shape == (2, 8) and q.columnwise_scale_inv.shape == (1, 132)
    assert torch.all(q.rowwise_scale_inv[:, 7:] == 1.0)  # padding is defined
    assert q.scales("rowwise").shape == (7, 2) and q.scales("columnwise").shape == (130, 1)
    assert q.nbytes == 2 * 7 * 130 + 4 * (2 * 8 + 132)


def test_weight_columnwise_is_exact_transpose():
    w = make_input((136, 272), seed=3)
    q = quantize_weight(w, P2, backend="reference")
    assert torch.equal(q.columnwise_data.view(torch.uint8), q.rowwise_data.view(torch.uint8).t())
    assert torch.equal(q.scales("columnwise"), q.scales("rowwise").t())
    assert torch.equal(q.dequantize(copy="columnwise"), q.dequantize(copy="rowwise"))


def test_activation_columnwise_is_quantized_from_high_precision():
    x = make_input((256, 256), seed=4)
    q = quantize_activation(x, P1, backend="reference")
    qt = quantize_activation(x.t().contiguous(), P1, rowwise=True, columnwise=False, backend="reference")
    assert torch.equal(q.columnwise_data.view(torch.uint8), qt.rowwise_data.view(torch.uint8))
    # ...and differs from transposing the rowwise copy (different tiles, different scales).
    assert not torch.equal(q.columnwise_data.view(torch.uint8), q.rowwise_data.view(torch.uint8).t())


def test_te_round_trip_is_identity():
    x = make_input((136, 272), seed=5)
    for q in (quantize_activation(x, P1, backend="reference"), quantize_weight(x, P2, backend="reference")):
        te = q.to_te()
        assert te["rowwise_data"].dtype == torch.uint8
        back = BlockwiseFp8Tensor.from_te(shape=q.shape, block_dim=q.block_dim, fp8_dtype=q.fp8_dtype, **te)
        for which in ("rowwise", "columnwise"):
            assert torch.equal(back.dequantize(copy=which), q.dequantize(copy=which))


def test_layout_violations_are_refused():
    x = make_input((64, 256), seed=6)
    q = quantize_activation(x, P1, backend="reference")
    good = dict(shape=q.shape, block_dim=1, fp8_dtype=q.fp8_dtype, orig_dtype=x.dtype)
    with pytest.raises(ValueError, match="scale_inv must be float32 of shape"):
        BlockwiseFp8Tensor(**good, rowwise_data=q.rowwise_data, rowwise_scale_inv=q.rowwise_scale_inv.t().contiguous())
    with pytest.raises(ValueError, match="rowwise_data has shape"):
        BlockwiseFp8Tensor(**good, rowwise_data=q.columnwise_data, rowwise_scale_inv=q.rowwise_scale_inv)
    with pytest.raises(ValueError, match="dtype"):
        BlockwiseFp8Tensor(**good, rowwise_data=q.rowwise_data.view(torch.uint8), rowwise_scale_inv=q.rowwise_scale_inv)
    with pytest.raises(ValueError, match="both be given"):
        BlockwiseFp8Tensor(**good, rowwise_data=q.rowwise_data)
    with pytest.raises(ValueError, match="needs a rowwise or a columnwise copy"):
        BlockwiseFp8Tensor(**good)
    with pytest.raises(ValueError, match="no columnwise copy"):
        BlockwiseFp8Tensor(**good, rowwise_data=q.rowwise_data, rowwise_scale_inv=q.rowwise_scale_inv).scales("columnwise")
