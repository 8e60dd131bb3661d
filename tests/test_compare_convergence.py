"""scripts/compare_convergence.py: the numbers it reports against hand computations and against the stored
summaries of docs/results, the plot's panels, the noise band, paths relative to where it runs, training
through a launcher, and the dry run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_convergence.py"
RESULTS = ROOT / "docs" / "results"
DOCS_RUN = "convergence_125m_h200_2026-11-30"


@pytest.fixture(scope="module")
def cc():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import compare_convergence

        yield compare_convergence
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def compare(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def write_run(path: Path, loss, *, every: int = 1, valid: dict | None = None, config: dict | None = None,
              start: dict | None = None) -> None:  # fmt: skip
    """A metrics.jsonl as the trainer writes it: a start event, the first step and every ``every``-th step of the
    per-step losses ``loss`` (step s = loss[s - 1]), validation records, the end event."""
    path.mkdir(parents=True, exist_ok=True)
    steps = len(loss)
    lines = [{"event": "start", "params": 1_000_000, "fp8": "x", "start_step": 0, **(start or {})}]
    for s in range(1, steps + 1):
        if s == 1 or s % every == 0 or s == steps:
            lines.append({"step": s, "loss": float(loss[s - 1]), "tokens_per_s": 1000.0 + s, "step_time_s": 1.0})
        if valid and s in valid:
            lines.append({"step": s, "valid_loss": valid[s]})
    lines.append({"event": "end", "step": steps, "loss": float(loss[-1])})
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    if config is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML


def test_table_and_plot_with_a_final_loss_by_hand(tmp_path):
    steps = np.arange(1, 101)
    write_run(tmp_path / "a", 3.0 + 5.0 / steps, valid={50: 3.2, 100: 3.1})
    write_run(tmp_path / "b", 3.03 + 5.0 / steps, valid={50: 3.25, 100: 3.13})
    proc = compare("--out", "cmp", "--read", "bf16=a", "--read", "fp8=b/metrics.jsonl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["run"]: r for r in json.loads((tmp_path / "cmp" / "summary.json").read_text())}
    # final loss: the mean over the last 10% of the steps, 91..100, of 3.0 + 5 / step (hand computation)
    by_hand = sum(3.0 + 5.0 / s for s in range(91, 101)) / 10
    assert rows["bf16"]["final_loss"] == pytest.approx(by_hand, rel=1e-12)
    assert rows["bf16"]["final_window"] == [91, 100] and rows["bf16"]["final_points"] == 10
    by_hand_b = sum(3.03 + 5.0 / s for s in range(91, 101)) / 10
    assert rows["fp8"]["gap_to_baseline_pct"] == pytest.approx(100 * (by_hand_b - by_hand) / by_hand, rel=1e-9)
    assert rows["fp8"]["valid_gap_to_baseline_pct"] == pytest.approx(100 * 0.03 / 3.1)
    assert rows["fp8"]["speed_vs_baseline"] == 1.0 and rows["bf16"]["valid_loss"] == 3.1
    assert (tmp_path / "cmp" / "loss_curves.png").stat().st_size > 10_000
    md = (tmp_path / "cmp" / "summary.md").read_text()
    assert "| fp8 | 100 |" in md and "steps 91-100: 10 logged" in md


def test_the_final_loss_and_gap_are_counted_in_steps_not_in_logged_records(cc):
    """The same per-step losses logged every step and every 10 steps: the final windows are the same steps
    and the gap between the two is 0 (the old rule, the last 10% of logged records of the run, averaged
    the baseline's last 10 records, steps 10..100, and reported a gap of several percent)."""
    steps = np.arange(1, 101)
    per_step = 2.0 + 1.0 / np.ceil(steps / 10)  # constant over each block of 10 steps: both logs see the same values
    every = {"steps": steps, "loss": per_step, "valid": [], "tokens_per_s": np.ones(100), "step_time_s": np.ones(100)}
    logged = np.r_[1, np.arange(10, 101, 10)]
    sparse = {**every, "steps": logged, "loss": per_step[logged - 1], "tokens_per_s": np.ones(11), "step_time_s": np.ones(11)}
    rows = {r["run"]: r for r in cc.summarize({"sparse": sparse, "every": every}, "sparse", None, 10)}
    assert rows["every"]["final_window"] == rows["sparse"]["final_window"] == [91, 100]
    assert rows["every"]["final_loss"] == pytest.approx(2.1, rel=1e-12)
    assert rows["sparse"]["final_loss"] == pytest.approx(2.1, rel=1e-12)
    assert rows["every"]["gap_to_baseline_pct"] == pytest.approx(0.0, abs=1e-10)


def test_ema_and_trailing_mean_by_hand(cc):
    steps, values = np.array([1, 2, 4]), np.array([3.0, 1.0, 2.0])
    d1, d2 = math.exp(-1 / 2), math.exp(-2 / 2)  # time constant 2 steps; gaps of 1 and 2 steps
    want = [3.0, (d1 * 3 + 1) / (d1 + 1), (d2 * d1 * 3 + d2 * 1 + 2) / (d2 * d1 + d2 + 1)]
    assert np.allclose(cc.ema(steps, values, 2), want, rtol=1e-12)
    assert np.array_equal(cc.ema(steps, values, 0), values)
    s, m = cc.trailing_mean(np.array([1, 2, 3, 5, 6]), np.array([1.0, 2.0, 3.0, 5.0, 6.0]), 3)
    assert s.tolist() == [3, 5, 6] and np.allclose(m, [2.0, 4.0, 5.5])  # (1..3], (2..5], (3..6]


def test_gap_ranges_follow_the_smoothed_gap(cc):
    """The second-half range and the largest excursion after the first 10% of steps: a run 2% above the
    baseline with a 5% bump at steps 20-29 (its smoothed trace ends inside the first half) reads
    +2 .. +2% over the second half and its largest smoothed excursion at the bump's end, 5%."""
    steps = np.arange(1, 101)
    base = {"steps": steps, "loss": np.full(100, 2.0)}
    loss = np.full(100, 2.04)
    loss[19:29] = 2.10
    ranges = cc.gap_ranges({"steps": steps, "loss": loss}, base, 10)
    assert np.allclose(ranges["gap_second_half_pct"], [2.0, 2.0])
    assert abs(ranges["gap_largest_after_10pct"]["pct"] - 5.0) < 1e-9 and ranges["gap_largest_after_10pct"]["step"] == 29
    assert cc.gap_ranges({"steps": steps + 1000, "loss": loss}, base, 10) == {}  # no common step: nothing, no crash


def test_reads_the_metrics_files_in_docs_results_as_their_summaries_say(tmp_path):
    """docs/results' metrics files (logged every 10 steps) give the final losses and gap ranges of the stored
    summaries the old tool wrote (its rule and this one cover the same 20 logged steps there), and a band."""
    reads = [f"--read={n}={RESULTS / f'{DOCS_RUN}_{n}.metrics.jsonl'}" for n in ("bf16", "plugin", "te_bf16")]
    proc = compare("--out", str(tmp_path / "cmp"), *reads, "--band", "bf16,te_bf16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["run"]: r for r in json.loads((tmp_path / "cmp" / "summary.json").read_text())}
    stored = {r["run"]: r for r in json.loads((RESULTS / f"{DOCS_RUN}_summary.json").read_text())}
    for name in ("bf16", "plugin", "te_bf16"):
        assert rows[name]["final_loss"] == pytest.approx(stored[name]["final_loss"], rel=1e-12)
        assert rows[name]["final_window"] == [1801, 2000] and rows[name]["final_points"] == 20
    for name in ("plugin", "te_bf16"):
        assert np.allclose(rows[name]["gap_second_half_pct"], stored[name]["gap_second_half_pct"], rtol=1e-12)
        assert rows[name]["gap_largest_after_10pct"]["step"] == stored[name]["gap_largest_after_10pct"]["step"]
    band = rows["bf16"]["noise_band"]  # with the baseline: bf16's gap is 0, te_bf16's its own
    assert band["runs"] == ["bf16", "te_bf16"]
    assert band["final_gap_pct"] == [rows["te_bf16"]["gap_to_baseline_pct"], 0.0]
    lo, hi = rows["te_bf16"]["gap_second_half_pct"]
    assert band["gap_second_half_pct"] == [min(lo, 0.0), max(hi, 0.0)]
    assert "Noise band (bf16, te_bf16)" in (tmp_path / "cmp" / "summary.md").read_text()


def test_the_validation_panel_needs_two_evaluations_and_the_title_names_the_runs(cc, tmp_path):
    steps = np.arange(1, 41)
    cfg = lambda seed: {"model": {"name": "tiny"}, "train": {"seed": seed}}  # noqa: E731
    write_run(tmp_path / "a", 3.0 + 1 / steps, valid={40: 3.1}, config=cfg(1))
    write_run(tmp_path / "b", 3.1 + 1 / steps, valid={40: 3.2}, config=cfg(2))
    runs = {n: cc.read_metrics(tmp_path / n) for n in ("a", "b")}
    kw = dict(smooth=4, last=None, final_steps=None, gap_window=4, heading="t")
    assert cc.plot(runs, "a", [], tmp_path / "one.png", **kw) == ["loss", "zoom", "gap"]  # one evaluation each
    write_run(tmp_path / "c", 3.1 + 1 / steps, valid={20: 3.3, 40: 3.2}, config=cfg(2))
    write_run(tmp_path / "d", 3.0 + 1 / steps, valid={20: 3.2, 40: 3.1}, config=cfg(1))
    runs = {n: cc.read_metrics(tmp_path / n) for n in ("d", "c", "a")}
    heading = cc.title(runs, ["d", "a"])
    assert heading == "tiny (1.0 M params), 40 steps, seeds 1, 2\narms: d, c, a; noise band: d, a"
    assert cc.plot(runs, "d", ["d", "a"], tmp_path / "two.png", **{**kw, "heading": heading}) == ["loss", "zoom", "gap", "valid"]
    assert (tmp_path / "two.png").stat().st_size > 10_000


def test_a_file_with_appended_runs_and_a_truncated_line(cc, tmp_path):
    write_run(tmp_path / "old", np.full(10, 9.0))
    write_run(tmp_path / "new", np.full(20, 2.0))
    text = (tmp_path / "old" / "metrics.jsonl").read_text() + (tmp_path / "new" / "metrics.jsonl").read_text()
    (tmp_path / "m.jsonl").write_text(text + '{"step": 21, "lo')  # a run killed while writing a line
    m = cc.read_metrics(tmp_path / "m.jsonl")
    assert m["steps"].tolist() == list(range(1, 21)) and set(m["loss"]) == {2.0}
    assert any("holds 2 runs" in n for n in m["notes"]) and any("truncated" in n for n in m["notes"])
    (tmp_path / "bad.jsonl").write_text('{"event": "start"}\nnot json\n{"step": 1, "loss": 1.0}\n')
    with pytest.raises(cc.MetricsError, match="bad.jsonl:2: not JSON"):
        cc.read_metrics(tmp_path / "bad.jsonl")


def test_bad_arguments(tmp_path):
    write_run(tmp_path / "a", np.full(10, 2.0))
    for args, message in ((["--band", "a,zz"], "--band a,zz: name two or more"), (["--baseline", "zz"], "not one of the runs"),
                          (["--band", "a"], "name two or more"), (["--bogus"], "unrecognized arguments: --bogus"),
                          ([], None)):  # fmt: skip
        proc = compare("--out", "cmp", "--read", "a=a", *args, cwd=tmp_path)
        if message is None:
            assert proc.returncode == 0, proc.stderr
        else:
            assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    proc = compare("--out", "cmp", cwd=tmp_path)
    assert proc.returncode == 2 and "give at least one --run or --read" in proc.stderr


FAKE_TRAINER = """
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
out = args["logging.dir"]
os.makedirs(out + "/.hydra", exist_ok=True)
steps, offset = int(args.get("train.steps", 30)), float(args.get("offset", 0))
with open(out + "/metrics.jsonl", "a") as f:
    f.write(json.dumps({"event": "start", "params": 2000000, "start_step": 0, "cwd": os.getcwd(), "argv": sys.argv[1:]}) + "\\n")
    for s in range(1, steps + 1):
        f.write(json.dumps({"step": s, "loss": 3.0 + offset + 1.0 / s, "tokens_per_s": 10.0, "step_time_s": 1.0}) + "\\n")
open(out + "/.hydra/config.yaml", "w").write(json.dumps({"model": {"name": "fake"}, "train": {"seed": 7}}))
"""


def test_runs_train_where_it_runs_and_a_relative_out_outside_the_checkout(tmp_path):
    """--run goes through --launcher in the directory this runs in, every step logged by default; a relative
    --out outside the checkout is written and read there; --retrain moves the old run aside."""
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    work = tmp_path / "work"
    work.mkdir()
    args = ["--out", "../cmp", "--launcher", f"{sys.executable} {tmp_path / 'fake_trainer.py'}", "--run", "a=offset=0",
            "--run", "b=offset=0.1", "train.steps=40"]  # fmt: skip
    proc = compare(*args, cwd=work)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "cmp"
    start = json.loads((out / "a" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["cwd"] == str(work)
    assert start["argv"][:4] == ["-m", "primus_fp8_plugin.train", "logging.log_interval=1", "logging.progress=false"]
    assert start["argv"][-3:] == ["train.steps=40", "offset=0", f"logging.dir={out / 'a'}"]
    rows = {r["run"]: r for r in json.loads((out / "summary.json").read_text())}
    assert rows["b"]["steps"] == 40 and rows["b"]["final_points"] == 4
    assert not (ROOT / "cmp").exists() and not (work / "cmp").exists()
    proc = compare(*args, cwd=work)  # done: read, not trained again
    assert proc.returncode == 0 and "exists, not trained again" in proc.stdout
    proc = compare(*args, "--retrain", "--run", "c=offset=0", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.glob("a.replaced-*"))) == 1 and len(list(out.glob("c.replaced-*"))) == 0
    assert len((out / "a" / "metrics.jsonl").read_text().splitlines()) == 41  # one run, not two appended


def test_convergence_recipe_dry_run_prints_each_arm_and_writes_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "VENV"}
    env.update(PYTHON=sys.executable, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "convergence_125m.sh"), "--dry-run", "train.steps=100"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for arm, mode in (("bf16", "bf16"), ("bf16_sdpa", "bf16"), ("plugin", "blockwise"), ("te", "te_blockwise"),
                      ("te_bf16", "te_bf16")):  # fmt: skip
        line = next(x for x in out.splitlines() if x.startswith(f"[compare] {arm}: ") and "-m primus_fp8_plugin.train" in x)
        assert f"fp8={mode}" in line and "train.steps=100" in line and "logging.log_interval=1" in line
        assert line.endswith(f"logging.dir={tmp_path / 'outputs' / 'convergence_125m' / arm}")
        config = out.split(f"[compare] {arm}: composed config:\n", 1)[1]
        assert f"\n  mode: {mode}\n" in config.split("[compare]")[0] and "\n  steps: 100\n" in config.split("[compare]")[0]
    assert "\n  attention: sdpa\n" in out.split("[compare] bf16_sdpa: composed config:\n", 1)[1].split("[compare]")[0]
    assert "dry run: nothing trained, read or written" in out
    assert not (tmp_path / "outputs").exists()
