"""The preshuffled weight quantizer (Triton) compiled for this GPU, bit for bit against a torch
permutation of the reference backend's copies, W^T's padded storage included (K % 256 == 128: 128 zero
rows, scale rows of 1.0); runs on any CUDA/ROCm GPU, not only MI355X."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import QuantParams
from primus_fp8_plugin.backends.reference import ReferenceBackend
from primus_fp8_plugin.preshuffle import dgrad_padded_rows, padded_rows, preshuffle

from ..conftest import make_input

pytestmark = pytest.mark.gpu
REF = ReferenceBackend()


@pytest.mark.parametrize("n,k", [(256, 384), (160, 96), (4096, 1024), (1056, 4128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_preshuffled_copies_bit_exact(n, k, dtype, fp8):
    from primus_fp8_plugin.kernels.triton.quantize_weight_preshuffle import quantize_128x128_preshuffled

    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    w = make_input((n, k), dtype=dtype, seed=n * k)
    w[5, 7] = float("nan")
    p = QuantParams(fp8, 2)
    if dtype == torch.float32:  # refused on a GPU until its W^T copy is bit-exact there (see the quantizer)
        with pytest.raises(NotImplementedError, match="fp32 weights"):
            quantize_128x128_preshuffled(w.cuda(), p)
        return
    ours, ref = quantize_128x128_preshuffled(w.cuda(), p), REF.quantize_weight(w, p)
    u8 = lambda t: t.cpu().view(torch.uint8)  # noqa: E731
    assert torch.equal(u8(ours.rowwise_data), preshuffle(ref.rowwise_data).view(torch.uint8))
    assert torch.equal(u8(ours.columnwise_data), preshuffle(ref.columnwise_data).view(torch.uint8))
    assert torch.equal(ours.rowwise_scale_inv.cpu().view(torch.int32), ref.rowwise_scale_inv.view(torch.int32))
    assert torch.equal(ours.columnwise_scale_inv.cpu().view(torch.int32), ref.columnwise_scale_inv.view(torch.int32))
    kp = dgrad_padded_rows(k) if k % 128 == 0 else k  # K % 256 == 128: W^T's storage holds 128 zero rows more
    data, scales = padded_rows(ours.columnwise_data, kp), padded_rows(ours.columnwise_scale_inv, -(-kp // 128))
    want = torch.zeros(kp, n, dtype=torch.uint8)
    want[:k] = ref.columnwise_data.view(torch.uint8)
    assert torch.equal(u8(data), preshuffle(want))
    want_s = torch.ones(scales.shape)
    want_s[: ref.columnwise_scale_inv.shape[0]] = ref.columnwise_scale_inv
    assert torch.equal(scales.cpu().view(torch.int32), want_s.view(torch.int32))
