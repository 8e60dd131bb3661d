"""benchmarks/bench_grouped.py on the CPU: the routings it times (counts against an independent count), its
options, and its refusal without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_grouped", ROOT / "benchmarks" / "bench_grouped.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("experts, tokens", [(8, 8192), (128, 32768), (32, 8200), (128, 1000)])
def test_routings_are_aligned_and_add_up(bench, experts, tokens):
    for kind in ("balanced", "skewed"):
        counts = bench.routing(kind, experts, tokens, 16)
        assert len(counts) == experts and all(c >= 0 and c % 16 == 0 for c in counts)
        assert sum(counts) == tokens // 16 * 16
    balanced = bench.routing("balanced", experts, tokens, 16)
    assert max(balanced) - min(balanced) <= 16
    skewed = bench.routing("skewed", experts, tokens, 16)
    # Zipf 1.2: the busiest expert gets 1 / H(E, 1.2) of the tokens (H the generalised harmonic number)
    share = 1 / sum(1 / i**1.2 for i in range(1, experts + 1))
    assert abs(max(skewed) - share * tokens) <= 32  # a count is off its share by < 16 (rounding) + tokens % 16
    assert skewed != sorted(skewed, reverse=True)  # permuted over the experts


def test_models_are_the_issue_shapes(bench):
    assert bench.MODELS == {"mixtral": (8, 4096, 14336), "qwen3": (128, 2048, 768), "dsv3": (32, 7168, 2048)}
    assert bench.parser().parse_args(["--models", "moe_proxy"]).models == ["moe_proxy"]  # asked for, not default
    args = bench.parser().parse_args(["--models", "qwen3", "--tokens", "16384", "--sustained", "2"])
    assert args.models == ["qwen3"] and args.tokens == [16384] and args.sustained == 2.0 and args.backends == ["triton"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_needs_a_gpu(bench, capsys):
    assert bench.main(["--models", "qwen3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_the_default_run_is_sustained_and_fits_in_eight_minutes(bench):
    args = bench.parser().parse_args([])
    assert args.sustained > 0 and args.tokens == [8192, 32768] and args.routing == ["balanced", "skewed"]
    assert set(args.models) == {"mixtral", "qwen3", "dsv3"} and args.linears == ["fc1", "fc2"] and not args.no_sequential
    shapes = len(args.models) * len(args.linears) * len(args.tokens) * len(args.routing)
    # ours, TE, the sequential path, BF16; each two sustained timings (fresh, cached) of settle + S seconds
    seconds = bench.expected_seconds(shapes, 4, args.sustained)
    assert seconds == pytest.approx(shapes * (4 * 2 * (bench.SETTLE_S + args.sustained + 0.1) + bench.SETUP_S))
    assert 120 < seconds < 8 * 60, seconds


def test_geomeans_are_over_the_shapes_of_each_contender(bench):
    import statistics

    rows = [
        {"impl": "ours-triton", "vs TE": 1.5, "vs bf16": 2.0, "cached vs TE": 1.2, "cached vs bf16": 3.0},
        {"impl": "ours-triton", "vs TE": 0.9, "vs bf16": 1.0, "cached vs TE": 1.6, "cached vs bf16": 1.5},
        {"impl": "TE", "vs bf16": 1.3, "cached vs bf16": 1.1},
        {"impl": "TE", "vs bf16": 1.7, "cached vs bf16": 1.4},
    ]
    notes = bench.geomean_notes(rows)
    want = statistics.geometric_mean([1.5, 0.9])
    assert f"ours-triton: vs TE geomean {want:.3f} (min 0.900, 2 shapes)" in notes
    assert f"TE: cached vs bf16 geomean {statistics.geometric_mean([1.1, 1.4]):.3f} (min 1.100, 2 shapes)" in notes
    assert not [n for n in notes if n.startswith("TE: vs TE")] and len(notes) == 6


def test_memory_floor_of_the_issue_shape_against_counted_bytes(bench):
    """128 experts x 256 tokens, 2048 -> 1536, gradients into fp32 main_grad: counted tensor by tensor."""
    t, k, n, e = 128 * 256, 2048, 1536, 128
    x = dx = t * k * 2  # bf16 in, bf16 gradient out
    y = dy = t * n * 2
    w_fp8, wt_fp8 = e * n * k, e * n * k  # W in fprop, W^T in dgrad, one byte an element
    main_grad = e * n * k * 4 * 2  # fp32 read and written
    assert bench.memory_floor_bytes(t, k, n, e, main_grad=True) == x + dx + y + dy + w_fp8 + wt_fp8 + main_grad
    assert bench.memory_floor_bytes(t, k, n, e, main_grad=False) == x + dx + y + dy + w_fp8 + wt_fp8 + e * n * k * 2
    assert bench.memory_floor_bytes(t, k, n, e, True) / 4.8e12 * 1e3 == pytest.approx(0.937, abs=1e-3)  # ms on an H200


def test_hbm_bandwidth_by_device_name(bench):
    assert bench.hbm_tbps("NVIDIA H200") == 4.8 and bench.hbm_tbps("NVIDIA H20") == 4.0  # the longer name first
    assert bench.hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35 and bench.hbm_tbps("AMD Instinct MI355X") == 8.0
    assert bench.hbm_tbps("NVIDIA GeForce RTX 4090") is None


def test_fine_grained_expert_options(bench):
    args = bench.parser().parse_args(["--models", "qwen3", "e256", "--tokens-per-expert", "128", "2048", "--main-grad",
                                      "--hbm-tbps", "4.8", "--no-sequential"])  # fmt: skip
    assert args.models == ["qwen3", "e256"] and args.tokens_per_expert == [128, 2048] and args.main_grad
    assert bench.parser().parse_args(["--single-grouped-weight"]).single_grouped_weight
    assert not bench.parser().parse_args([]).single_grouped_weight
    assert bench.EXTRA_MODELS["e256"] == (256, 2048, 768) and "e256" not in bench.parser().parse_args([]).models
    counts = bench.routing("balanced", 256, 256 * 2048, 16)
    assert counts == [2048] * 256
