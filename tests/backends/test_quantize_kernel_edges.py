"""The Triton quantization kernels at their edges, bit for bit against the reference backend: NaN,
-NaN and +-Inf tiles (NaN-propagating amax, scale NaN), zero and tiny tiles, interior tiles (the
unmasked path) next to edge tiles (masked), every row/column mode, non-default launch configs.

Runs through Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no
GPU): this checks the kernels' arithmetic, tiling, edges and padding, not the sm_90 code generation
(tests/gpu does that on a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from primus_fp8_plugin import QuantParams
from primus_fp8_plugin.backends.reference import ReferenceBackend

from ..conftest import make_input

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1", reason="CPU interpreter test (GPU: tests/gpu)")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
REF = ReferenceBackend()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same(ours, ref, rowwise: bool, columnwise: bool, what: str) -> None:
    assert ours.shape == ref.shape and ours.orig_dtype == ref.orig_dtype, what
    for which, on in (("rowwise", rowwise), ("columnwise", columnwise)):
        for part in ("data", "scale_inv"):
            a, b = getattr(ours, f"{which}_{part}"), getattr(ref, f"{which}_{part}")
            if not on:
                assert a is None, f"{what}: {which}_{part} should be absent"
                continue
            assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {which}_{part} {a.shape} vs {b.shape}"
            diff = (bits(a) != bits(b)).nonzero()
            assert diff.numel() == 0, f"{what}: {which}_{part} differs at {diff[:5].tolist()} ({len(diff)} entries)"


def random_x(m: int, k: int, dtype: torch.dtype, seed: int, bad: str | None = None) -> torch.Tensor:
    """Rows over many binades, a few zero rows/tiles and tiny values; optionally NaN/Inf entries."""
    x = make_input((m, k), dtype=torch.float32, seed=seed)
    x = x / x.abs().max().clamp_min(1e-30) * (1000 if dtype is torch.float16 else 1e6)
    g = torch.Generator().manual_seed(seed + 1)
    if m > 2:
        x[m // 2] = 0  # all-zero rows: scale 1
    if dtype is not torch.float16:
        # amax ~1e-38: fp8_max / amax overflows fp32, so the scale becomes the input dtype's max (with
        # pow2 scales 2^127, whose inverse is the subnormal 2^-127): a 1x128 row tile, and a whole
        # 128x128 block (so also 128x1 column tiles) where the shape has one past the first
        tiny = torch.finfo(torch.float32).tiny

        def tiny_like(t):
            return tiny * (1 + torch.rand(t.shape, generator=g)) * torch.sign(torch.randn(t.shape, generator=g))

        if m > 2:
            x[1, : min(k, 128)] = tiny_like(x[1, : min(k, 128)])
        if m > 128 and k > 128:
            x[128:256, 128:256] = tiny_like(x[128:256, 128:256])
    if bad is not None and m * k > 1:
        n = max(1, (m * k) // 1000)
        idx = torch.randint(0, m * k, (n,), generator=g)
        vals = {"nan": float("nan"), "-nan": -float("nan"), "inf": float("inf"), "-inf": -float("inf")}[bad]
        x.view(-1)[idx] = vals
    return x.to(dtype)


# (M, K, dtype, fp8, pow2, amax_eps, bad): ragged M (1, 17, 130: partial row tiles and scale padding),
# K multiples of 16 with partial 128-column tiles, interior tiles (M, K >= 256) next to edge tiles.
CASES = [
    (1, 16, torch.bfloat16, E4M3, True, 0.0, None),
    (17, 144, torch.float16, E5M2, False, 0.0, None),
    (130, 384, torch.float32, E4M3, False, 1e-3, None),
    (160, 144, torch.bfloat16, E5M2, True, 0.0, "nan"),
    (144, 384, torch.bfloat16, E4M3, False, 0.0, "inf"),
    (48, 16, torch.float32, E5M2, True, 1e-3, "-inf"),
    (144, 144, torch.float16, E4M3, True, 0.0, "-nan"),
    (256, 144, torch.bfloat16, E4M3, False, 1e-3, "nan"),
    (130, 144, torch.bfloat16, E4M3, True, 0.0, None),
    (16, 144, torch.bfloat16, E4M3, True, 0.0, None),
]
MODES = [(True, True), (True, False), (False, True)]


def _act():
    from primus_fp8_plugin.kernels.triton import quantize_act

    return quantize_act.quantize_1x128_dual


def _weight():
    from primus_fp8_plugin.kernels.triton import quantize_weight

    return quantize_weight.quantize_128x128


@pytest.mark.parametrize("case", range(len(CASES)))
def test_act_kernel_bit_exact_with_reference(case):
    m, k, dtype, fp8, pow2, eps, bad = CASES[case]
    params = QuantParams(fp8, 1, pow2_scales=pow2, amax_epsilon=eps)
    x = random_x(m, k, dtype, seed=100 + case, bad=bad)
    rowwise, columnwise = MODES[case % 3]  # the cases cycle through the three modes
    ref = REF.quantize_act(x, params, rowwise=rowwise, columnwise=columnwise)
    ours = _act()(x, params, rowwise=rowwise, columnwise=columnwise)
    what = f"M={m} K={k} {dtype} {fp8} pow2={pow2} eps={eps} bad={bad} row={rowwise} col={columnwise}"
    assert_same(ours, ref, rowwise, columnwise, what)


@pytest.mark.parametrize("case", [2, 3, 4, 6, 7])
def test_weight_kernel_bit_exact_with_reference(case):
    """128x128 blocks: whole-block NaN/Inf verdicts, tiny and zero blocks, interior and edge blocks."""
    m, k, dtype, fp8, pow2, eps, bad = CASES[case]
    params = QuantParams(fp8, 2, pow2_scales=pow2, amax_epsilon=eps)
    w = random_x(m, k, dtype, seed=200 + case, bad=bad)
    assert_same(_weight()(w, params), REF.quantize_weight(w, params), True, True, f"weight N={m} K={k} {dtype} bad={bad}")


def test_launch_configs_bit_exact():
    """The launch configs that benchmarks/bench_quant.py --variants times compute the same bits."""
    from primus_fp8_plugin.kernels.triton.heuristics import QuantizeConfig

    x = random_x(144, 144, torch.bfloat16, seed=7, bad="nan")
    params = QuantParams(E4M3, 1)
    ref = REF.quantize_act(x, params, rowwise=True, columnwise=True)
    for sub_m, warps in ((16, 4), (32, 2), (64, 4), (128, 8)):  # the chunked path, and the one-pass one at 8 warps
        ours = _act()(x, params, rowwise=True, columnwise=True, config=QuantizeConfig(sub_m, warps))
        assert_same(ours, ref, True, True, f"act sub_m={sub_m}")
    wp = QuantParams(E4M3, 2)
    ours = _weight()(x, wp, config=QuantizeConfig(32, 4))
    assert_same(ours, REF.quantize_weight(x, wp), True, True, "weight sub_m=32")


def test_empty_input():
    params = QuantParams(E4M3, 1)
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    ref = REF.quantize_act(x, params, rowwise=True, columnwise=True)
    assert_same(_act()(x, params, rowwise=True, columnwise=True), ref, True, True, "M=0")


def test_dims_past_32_bit_offsets_are_refused():
    """In-tile offsets are int32: a dim of 2**31 / 128 or more must be refused, not wrap around."""
    from primus_fp8_plugin.kernels.triton import quantize_act, quantize_weight

    big = torch.empty(quantize_act.MAX_DIM, 16, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="32-bit"):
        _act()(big, QuantParams(E4M3, 1), rowwise=True, columnwise=True)
    with pytest.raises(ValueError, match="32-bit"):
        _weight()(torch.empty(16, quantize_weight.MAX_DIM, dtype=torch.bfloat16, device="meta"), QuantParams(E4M3, 2))


def test_k_past_the_grid_axis_limit_is_refused():
    """K blocks run on grid axis 1 (at most 65535 programs): a longer K is refused with a clear error
    instead of a failed launch; the same K - 128 passes the check (M and N, on axis 0, are not capped)."""
    from primus_fp8_plugin.kernels.triton import quantize_act, quantize_weight

    k = quantize_act.MAX_GRID_Y + 16
    with pytest.raises(ValueError, match="65535"):
        quantize_act.quantize_1x128_dual(torch.empty(16, k, dtype=torch.bfloat16, device="meta"), QuantParams(E4M3, 1),
                                         rowwise=True, columnwise=True)  # fmt: skip
    with pytest.raises(ValueError, match="65535"):
        quantize_weight.quantize_128x128(torch.empty(16, k, dtype=torch.bfloat16, device="meta"), QuantParams(E4M3, 2))
