"""scripts/compare_convergence.py on finished runs: the table and the plot."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def fake_run(path: Path, final: float, tok_s: float) -> None:
    path.mkdir(parents=True)
    lines = [{"event": "start", "fp8": "x"}]
    for step in range(1, 101):
        loss = final + 5.0 / step  # falls towards `final`
        lines.append({"step": step, "loss": loss, "tokens_per_s": tok_s, "step_time_s": 1.0, "lr": 1e-3})
    lines.append({"step": 100, "valid_loss": final + 0.1})
    path.joinpath("metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines))


def test_reads_runs_and_writes_table_and_plot(tmp_path):
    fake_run(tmp_path / "a", 3.0, 1000.0)
    fake_run(tmp_path / "b", 3.03, 1500.0)
    out = tmp_path / "cmp"
    cmd = [sys.executable, str(ROOT / "scripts" / "compare_convergence.py"), "--out", str(out),
           "--read", f"bf16={tmp_path / 'a'}", "--read", f"fp8={tmp_path / 'b'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    rows = {r["run"]: r for r in json.loads((out / "summary.json").read_text())}
    assert abs(rows["fp8"]["gap_to_baseline_pct"] - 1.0) < 0.05  # (3.03 + tail) vs (3.0 + tail)
    assert rows["fp8"]["speed_vs_baseline"] == 1.5 and rows["bf16"]["valid_loss"] == 3.1
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert "| fp8 | 100 |" in (out / "summary.md").read_text()


def test_nothing_to_compare_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_convergence.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "give at least one --run or --read" in proc.stderr


def test_gap_ranges_follow_the_smoothed_gap(monkeypatch):
    """The second-half range and the largest excursion after the first 10% of steps: a run 2% above
    the baseline with a 5% bump at steps 20-29 (its smoothed trace ends inside the first half) reads +2 .. +2% over the second
    half and its largest smoothed excursion at the bump's end, 5%."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from compare_convergence import gap_ranges

    steps = np.arange(1, 101)
    base = {"steps": steps, "loss": np.full(100, 2.0)}
    loss = np.full(100, 2.04)
    loss[19:29] = 2.10
    ranges = gap_ranges({"steps": steps, "loss": loss}, base)
    assert np.allclose(ranges["gap_second_half_pct"], [2.0, 2.0])
    assert abs(ranges["gap_largest_after_10pct"]["pct"] - 5.0) < 1e-9 and ranges["gap_largest_after_10pct"]["step"] == 29
    assert gap_ranges({"steps": steps + 1000, "loss": loss}, base) == {}  # no common step: nothing, no crash
