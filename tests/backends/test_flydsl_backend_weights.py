"""The flydsl backend's weight path on CPU (Triton interpreter): which weights it stores preshuffled,
and that a preshuffled weight meeting an operand the FlyDSL kernels do not take (E5M2 gradient) is
unshuffled for the Triton GEMM and gives the reference's result."""

from __future__ import annotations

import os

import pytest
import torch

from primus_fp8_plugin import QuantParams
from primus_fp8_plugin.backends.flydsl import FlydslBackend
from primus_fp8_plugin.backends.reference import ReferenceBackend
from primus_fp8_plugin.preshuffle import preshuffle

from ..conftest import make_input

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="CPU interpreter test (GPU: tests/gpu)")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REF = ReferenceBackend()


@pytest.mark.parametrize("shape,fp8,want", [((256, 128), E4M3, "preshuffle16"), ((256, 160), E4M3, "k_major"),
                                            ((128, 256), E5M2, "k_major")])  # fmt: skip
def test_which_weights_are_preshuffled(shape, fp8, want):
    w = make_input(shape, seed=1)
    p = QuantParams(fp8, 2)
    ours, ref = FlydslBackend().quantize_weight(w, p), REF.quantize_weight(w, p)
    assert ours.layout == want
    row = preshuffle(ref.rowwise_data) if want == "preshuffle16" else ref.rowwise_data
    assert torch.equal(ours.rowwise_data.view(torch.uint8), row.view(torch.uint8))


def test_e5m2_gradient_against_a_preshuffled_weight_uses_the_k_major_copy():
    be = FlydslBackend()
    w = be.quantize_weight(make_input((128, 128), seed=2), QuantParams(E4M3, 2))
    assert w.layout == "preshuffle16"
    dy = REF.quantize_act(make_input((32, 128), seed=3), QuantParams(E5M2, 1), rowwise=True, columnwise=False)
    ours = be.gemm_dgrad(dy, w, torch.float32)
    torch.testing.assert_close(ours, REF.gemm_dgrad(dy, w.k_major(), torch.float32), rtol=1e-5, atol=1e-5)
