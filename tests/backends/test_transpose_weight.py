"""W^T on demand: every backend's transpose of a weight held as W only gives, bit for bit, the W^T copy its own
quantizer makes (data and scales, padding entries 1.0), dense and stacked experts, on fresh random ragged shapes,
with NaN blocks, E4M3 and E5M2; and the layouts make it only where the weight has no W^T."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.grouped_tensor import GroupedFp8Weight
from primus_fp8_plugin.ops.layouts import Dense, Grouped
from primus_fp8_plugin.recipe import QuantParams
from primus_fp8_plugin.tensor import transpose_blocks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def ragged_shapes(seed: int, count: int) -> list[tuple[int, int]]:
    """Fresh random shapes each run of a seed: mostly not multiples of 128, some below one block."""
    g = torch.Generator().manual_seed(seed)
    return [(int(n), int(k)) for n, k in torch.randint(1, 400, (count, 2), generator=g)]


def weight(n: int, k: int, seed: int, dtype=torch.bfloat16, nan_block: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-12, 12, (n, 1), generator=g).float())  # blocks with different scales
    w = torch.randn(n, k, generator=g) * rows
    if nan_block:
        w[min(130, n - 1), min(5, k - 1)] = float("nan")
    return w.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.uint8 if a.dtype in (E4M3, E5M2) else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_dense_transpose_is_the_quantizers_own_w_t(backend, fp8_dtype):
    impl = get_backend(backend, "cpu")
    params = QuantParams(fp8_dtype, 2)
    for i, (n, k) in enumerate([*ragged_shapes(seed=int(torch.randint(0, 2**31, ())), count=3), (256, 128), (1, 1)]):
        for dtype in (torch.bfloat16, torch.float32):
            full = impl.quantize_weight(weight(n, k, seed=i, dtype=dtype, nan_block=i == 0), params)
            held = full.rowwise_only()
            assert not held.has_columnwise
            made = impl.transpose_weight(held)
            what = f"{backend} [{n}, {k}] {dtype}"
            assert made.rowwise_data is held.rowwise_data, what  # W itself untouched, not copied
            assert same(made.columnwise_data, full.columnwise_data), what
            assert same(made.columnwise_scale_inv, full.columnwise_scale_inv), what
            torch.testing.assert_close(made.dequantize(copy="columnwise"), full.dequantize(), rtol=0, atol=0, equal_nan=True)


def test_grouped_transpose_is_the_quantizers_own_w_t(backend):
    impl = get_backend(backend, "cpu")
    params = QuantParams(E4M3, 2)
    (n, k), e = ragged_shapes(seed=int(torch.randint(0, 2**31, ())), count=1)[0], 3
    weights = [weight(n, k, seed=10 + j, nan_block=j == 1) for j in range(e)]
    full = impl.quantize_weight_grouped(weights, params)
    held = full.rowwise_only()
    assert not held.has_columnwise and held.nbytes < full.nbytes
    made = impl.transpose_weight_grouped(held)
    assert same(made.columnwise_data, full.columnwise_data) and same(made.columnwise_scale_inv, full.columnwise_scale_inv)
    for j in range(e):  # each expert's W^T is the dense quantizer's
        dense = impl.quantize_weight(weights[j], params)
        assert same(made.expert(j).columnwise_data, dense.columnwise_data)


def test_reference_form_is_the_transpose_of_the_blocks():
    """``transpose_blocks`` on hand-made blocks: bytes transposed, each block's scale at its transposed place."""
    data = torch.arange(200 * 300, dtype=torch.int32).remainder(251).to(torch.uint8).view(E4M3).view(200, 300)
    scale = torch.ones(2, 4)
    scale[:, :3] = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]])
    data_t, scale_t = transpose_blocks(data, scale)
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t())
    assert scale_t.shape == (3, 4) and torch.equal(scale_t, torch.tensor([[1.0, 8, 1, 1], [2, 16, 1, 1], [4, 32, 1, 1]]))


def test_layouts_transpose_only_a_weight_held_as_w(backend):
    impl = get_backend(backend, "cpu")
    params = QuantParams(E4M3, 2)
    full = impl.quantize_weight(weight(130, 200, seed=3), params)
    assert Dense().with_transpose(impl, full) is full
    made = Dense().with_transpose(impl, full.rowwise_only())
    assert same(made.columnwise_data, full.columnwise_data)
    grouped = impl.quantize_weight_grouped([weight(130, 200, seed=4), weight(130, 200, seed=5)], params)
    assert Grouped(None).with_transpose(impl, grouped) is grouped
    assert same(Grouped(None).with_transpose(impl, grouped.rowwise_only()).columnwise_data, grouped.columnwise_data)


def test_grouped_weight_needs_w():
    w = torch.zeros(2, 4, 4, dtype=E4M3)
    with pytest.raises(ValueError, match="holds W"):
        GroupedFp8Weight((4, 4), E4M3, torch.bfloat16, None, None, w, torch.ones(2, 1, 4))
