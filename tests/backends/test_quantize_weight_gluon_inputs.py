"""The Hopper Gluon weight quantizer's wrapper on any machine: valid inputs it does not take (not a
Hopper GPU, N or K not a multiple of 16, other dtypes, non-contiguous) raise GluonWeightUnsupported
before anything is allocated or launched, so the triton backend falls back to the Triton kernel,
whose bits are the same. The kernel itself is checked on the GPU (tests/gpu,
scripts/check_quant_weight_gluon.py) and compiled in CI (test_triton_aot.py)."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin import QuantParams
from primus_fp8_plugin.backends.triton import hopper_or_portable_weight_quant
from primus_fp8_plugin.backends.triton.quantize_weight_gluon import (
    GluonWeightUnsupported,
    quantize_128x128_gluon,
    unsupported_reason,
)

from ..conftest import make_input

P = QuantParams(torch.float8_e4m3fn, 2)


def test_off_hopper_is_unsupported():
    w = torch.randn(256, 256, dtype=torch.bfloat16)
    with pytest.raises(GluonWeightUnsupported, match="sm_90"):
        quantize_128x128_gluon(w, P)
    assert issubclass(GluonWeightUnsupported, NotImplementedError)


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.empty(130, 256, dtype=torch.bfloat16), "multiples of 16"),
        (torch.empty(256, 136, dtype=torch.bfloat16), "multiples of 16"),
        (torch.empty(256, 256, dtype=torch.float64), "dtype"),
        (torch.empty(256, 512, dtype=torch.bfloat16)[:, ::2], "contiguous"),
    ],
)
def test_shape_and_dtype_rules(w, match, monkeypatch):
    """The reasons past the device check (device check bypassed: this machine has no Hopper GPU)."""
    import primus_fp8_plugin.backends.triton.quantize_weight_gluon as mod

    monkeypatch.setattr(mod, "runs_on", lambda device: True)
    assert match in unsupported_reason(w, P)


def test_backend_falls_back_to_the_triton_kernel_off_hopper():
    """Off Hopper the backend's weight quantizer is the Triton kernel (bit-exact with the reference)."""
    import os

    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        pytest.skip("the Triton kernel runs on CPU tensors through the interpreter only")
    from primus_fp8_plugin.backends.reference import ReferenceBackend

    w = make_input((144, 272), dtype=torch.float32, seed=3).to(torch.bfloat16)
    ours, ref = hopper_or_portable_weight_quant(w, P), ReferenceBackend().quantize_weight(w, P)
    def bits(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)

    ref_parts = ref.to_te()
    for name, t in ours.to_te().items():
        assert torch.equal(bits(t), bits(ref_parts[name])), name
