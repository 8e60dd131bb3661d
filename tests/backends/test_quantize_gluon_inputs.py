"""The Hopper Gluon quantizers and their heuristics on any machine: valid inputs the kernels do not take
(not a Hopper GPU, dims not multiples of 16, other dtypes, non-contiguous) are refused by their
``unsupported_reason``, so that the heuristics pick the Triton kernels (whose bits are the same), and a
wrapper called anyway raises GluonUnsupported before anything is allocated or launched. The kernels
themselves are checked on the GPU (tests/gpu, tools/check_quant_hopper.py) and compiled in CI
(tests/tools/test_triton_aot.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from primus_fp8_plugin import QuantParams
from primus_fp8_plugin.backends.triton import hopper_or_portable_act_quant, hopper_or_portable_weight_quant
from primus_fp8_plugin.kernels.sm90 import heuristics as H
from primus_fp8_plugin.kernels.sm90.quantize_act import quantize_1x128_dual_gluon
from primus_fp8_plugin.kernels.sm90.quantize_tiles import MAX_DIM
from primus_fp8_plugin.kernels.sm90.quantize_weight import quantize_128x128_gluon, unsupported_reason
from primus_fp8_plugin.kernels.sm90.target import GluonUnsupported

from ..conftest import make_input

P = QuantParams(torch.float8_e4m3fn, 2)


def test_off_hopper_is_unsupported():
    w = torch.randn(256, 256, dtype=torch.bfloat16)
    with pytest.raises(GluonUnsupported, match="sm_90"):
        quantize_128x128_gluon(w, P)
    with pytest.raises(GluonUnsupported, match="sm_90"):
        quantize_1x128_dual_gluon(w, QuantParams(torch.float8_e4m3fn, 1), rowwise=True, columnwise=True)
    assert issubclass(GluonUnsupported, NotImplementedError)
    assert not H.weight_quant(w, P) and not H.act_quant(w, QuantParams(torch.float8_e4m3fn, 1))


@pytest.mark.parametrize(
    "w, match",
    [
        (torch.empty(130, 256, dtype=torch.bfloat16), "multiples of 16"),
        (torch.empty(256, 136, dtype=torch.bfloat16), "multiples of 16"),
        (torch.empty(256, 256, dtype=torch.float64), "dtype"),
        (torch.empty(256, 512, dtype=torch.bfloat16)[:, ::2], "contiguous"),
        (torch.empty(16 * 16 + 1, dtype=torch.bfloat16)[1:].view(16, 16), "16-byte aligned"),
        (torch.empty(16, MAX_DIM, dtype=torch.bfloat16, device="meta"), "must stay below"),
    ],
)
def test_shape_and_dtype_rules(w, match, monkeypatch):
    """The reasons past the device check, shared by both kernels (quantize_gluon_tiles.py; device
    check bypassed: this machine has no Hopper GPU)."""
    import primus_fp8_plugin.kernels.sm90.quantize_act as act_mod
    import primus_fp8_plugin.kernels.sm90.quantize_tiles as tiles

    monkeypatch.setattr(tiles, "runs_on", lambda device: True)
    assert match in unsupported_reason(w, P)
    assert match in act_mod.unsupported_reason(w, QuantParams(torch.float8_e4m3fn, 1))
    assert not H.weight_quant(w, P) and not H.act_quant(w, QuantParams(torch.float8_e4m3fn, 1))
    ok = torch.empty(256, 512, dtype=torch.bfloat16)
    assert H.weight_quant(ok, P) and H.act_quant(ok, QuantParams(torch.float8_e4m3fn, 1))


def test_dims_past_the_grid_axis_limit_go_to_the_triton_kernel(monkeypatch):
    """Grid axis 1 holds at most 65535 programs: K blocks for activations, the larger dim's blocks for
    weights (either tile order); longer dims are refused, so the Triton kernel's clear error applies."""
    import primus_fp8_plugin.kernels.sm90.quantize_act as act_mod
    import primus_fp8_plugin.kernels.sm90.quantize_tiles as tiles
    from primus_fp8_plugin.kernels.triton.quantize_act import MAX_GRID_Y

    monkeypatch.setattr(tiles, "runs_on", lambda device: True)
    long_k = torch.empty(16, MAX_GRID_Y + 16, dtype=torch.bfloat16, device="meta")
    tall = torch.empty(MAX_GRID_Y + 16, 16, dtype=torch.bfloat16, device="meta")
    assert "65535" in act_mod.unsupported_reason(long_k, QuantParams(torch.float8_e4m3fn, 1))
    assert "65535" in unsupported_reason(long_k, P) and "65535" in unsupported_reason(tall, P)
    assert "65535" not in (act_mod.unsupported_reason(tall, QuantParams(torch.float8_e4m3fn, 1)) or "")


@pytest.mark.parametrize("n, k", [(256, 1024), (1024, 256), (512, 512), (144, 400), (2064, 1040)])
def test_weight_tile_order_and_grid(monkeypatch, n, k):
    """The weight kernel walks along rows of blocks first for tall weights (N > K), down columns
    otherwise: grid axis 0 (fastest) is K blocks then, N blocks else, matching ROW_FIRST."""
    import primus_fp8_plugin.kernels.sm90.quantize_tiles as tiles
    import primus_fp8_plugin.kernels.sm90.quantize_weight as weight_mod

    launched = []
    monkeypatch.setattr(tiles, "runs_on", lambda device: True)
    monkeypatch.setattr(
        weight_mod, "_launch", SimpleNamespace(hinted=lambda hint, grid, *args, **options: launched.append((grid, args)))
    )
    weight_mod.quantize_128x128_gluon(torch.empty(n, k, dtype=torch.bfloat16), P)
    ((grid, args),) = launched
    nb, kb = -(-n // 128), -(-k // 128)
    row_first = args[14]  # the 13 runtime arguments, then POW2, ROW_FIRST, L, ...
    assert isinstance(row_first, bool) and row_first == (n > k)
    assert grid == ((kb, nb) if n > k else (nb, kb))


def test_act_kernel_takes_1x128_tiles_only():
    import primus_fp8_plugin.kernels.sm90.quantize_act as act_mod

    w = torch.empty(256, 256, dtype=torch.bfloat16)
    assert "block_dim=1" in act_mod.unsupported_reason(w, P)


def test_backend_falls_back_to_the_triton_kernels_off_hopper():
    """Off Hopper the backend's quantizers are the Triton kernels (bit-exact with the reference)."""
    from primus_fp8_plugin.kernels.triton import INTERPRETED

    if not INTERPRETED:
        pytest.skip("the Triton kernel runs on CPU tensors through the interpreter only")
    from primus_fp8_plugin.backends.reference import ReferenceBackend

    w = make_input((144, 272), dtype=torch.float32, seed=3).to(torch.bfloat16)
    ref = ReferenceBackend()
    pa = QuantParams(torch.float8_e4m3fn, 1)

    def bits(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)

    both = {"rowwise": True, "columnwise": True}
    pairs = [
        (hopper_or_portable_weight_quant(w, P), ref.quantize_weight(w, P)),
        (hopper_or_portable_act_quant(w, pa, **both), ref.quantize_act(w, pa, **both)),
    ]
    for ours, theirs in pairs:
        ref_parts = theirs.to_te()
        for name, t in ours.to_te().items():
            assert torch.equal(bits(t), bits(ref_parts[name])), name
