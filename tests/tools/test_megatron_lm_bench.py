"""benchmarks/megatron_lm.py on the CPU: log parsing, the summary's arithmetic, the spec check."""

from __future__ import annotations

import importlib.util
import random
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mlm = _load("megatron_lm")


def _megatron_line(it: int, total: int, ms: float, tflops: float, loss: float, gbs: int) -> str:
    # the format strings of megatron/training/training.py's training_log
    s = " [2026-12-02 05:00:00.000000]"
    s += f" iteration {it:8d}/{total:8d} |"
    s += f" consumed samples: {it * gbs:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {3e-4:.6E} |"
    s += f" global batch size: {gbs:5d} |"
    s += " {}: {:.6E} |".format("lm loss", loss)
    s += f" loss scale: {1.0:.1f} |"
    s += f" grad norm: {1.234:.3f} |"
    return s


def test_parse_and_summarize_against_independent_arithmetic():
    rng = random.Random(7)
    total, gbs, seq, warmup = 12, 16, 2048, 3
    ms = [round(rng.uniform(300, 900), 1) for _ in range(total)]
    tf = [round(rng.uniform(100, 400), 1) for _ in range(total)]
    loss = [10.0 - 0.3 * i + rng.uniform(-0.01, 0.01) for i in range(total)]
    lines = ["> compiling dataset index builder ...", "noise iteration without fields"]
    for i in range(total):
        lines.append(_megatron_line(i + 1, total, ms[i], tf[i], loss[i], gbs))
        if i in (0, 1):
            lines.append(
                f"[Rank 0] (after {i + 1} iterations) memory (MB) | allocated: 100.00 | "
                f"max allocated: {5000.5 + i * 10:.2f} | reserved: 6000.00 | max reserved: 6000.00"
            )
    parsed = mlm.parse_log("\n".join(lines))
    assert [r["iteration"] for r in parsed["iterations"]] == list(range(1, total + 1))
    assert parsed["max_allocated_mb"] == pytest.approx(5010.5)
    s = mlm.summarize(parsed, seq, warmup)
    want_ms = statistics.median(ms[warmup:])
    assert s["ms_per_iter"] == pytest.approx(want_ms)
    assert s["tokens_per_s"] == pytest.approx(gbs * seq / (want_ms / 1000))
    assert s["tflops_per_gpu"] == pytest.approx(statistics.median(tf[warmup:]))
    assert s["first_loss"] == pytest.approx(loss[0], rel=1e-6)
    assert s["last_loss"] == pytest.approx(loss[-1], rel=1e-6)
    assert s["ms_spread"] == [min(ms[warmup:]), max(ms[warmup:])]
    assert s["timed_iterations"] == total - warmup


def test_summarize_refuses_a_log_without_timed_iterations():
    parsed = mlm.parse_log(_megatron_line(1, 2, 500.0, 100.0, 9.0, 8))
    with pytest.raises(ValueError, match="raise --iters"):
        mlm.summarize(parsed, 1024, warmup=3)


def test_arms_and_spec_check():
    model = mlm.MODELS["moe_proxy"]
    assert "--moe-grouped-gemm" in mlm.arm_args("te_fp8", model, plugin_grouped=False)
    assert "--moe-grouped-gemm" not in mlm.arm_args("plugin", model, plugin_grouped=False)
    assert "--moe-grouped-gemm" in mlm.arm_args("plugin", model, plugin_grouped=True)
    assert "--fp8-recipe blockwise" in mlm.arm_args("te_fp8", mlm.MODELS["gpt125m"], False)
    with pytest.raises(SystemExit, match="unknown arm"):
        mlm.arm_args("nope", model, False)
    with pytest.raises(SystemExit, match="importing no_such_module_xyz failed"):
        mlm.check_spec("--spec no_such_module_xyz fn")
    with pytest.raises(SystemExit, match="has no attribute"):
        mlm.check_spec("--spec json no_such_name")
    mlm.check_spec("--spec json dumps")  # importable: passes


def test_cli_refuses_a_directory_without_pretrain_gpt(tmp_path, capsys):
    with pytest.raises(SystemExit):
        mlm.main(["--megatron-lm", str(tmp_path)])
    assert "has no pretrain_gpt.py" in capsys.readouterr().err


def test_entry_shim_usage(tmp_path, monkeypatch):
    entry = _load("megatron_lm_entry")
    monkeypatch.setattr(sys, "argv", ["megatron_lm_entry.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="usage"):
        entry.main()
