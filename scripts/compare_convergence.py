#!/usr/bin/env python3
"""Convergence comparison: train several configurations (or read finished runs) and plot them.

    python scripts/compare_convergence.py --out DIR --run bf16="fp8=bf16" --run plugin="fp8=blockwise" \
        [--run te="fp8=te_blockwise"] [--read old=path/to/run] [--baseline bf16] [--launcher "torchrun ..."] \
        -- model=gpt_125m train=convergence        # overrides common to every run

Writes DIR/loss_curves.png (training loss per run, and its relative gap to the baseline run),
DIR/summary.md (final loss, gap to baseline, the smoothed gap's range over the second half and its
largest excursion after the first 10% of steps, validation loss, tokens/s, step time) and
DIR/summary.json. A run whose metrics already exist is not trained again unless --retrain.
A run that fails (for instance TE not installed) is reported and left out of the plot.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SMOOTH = 10  # logged steps in the moving mean of the plotted gap


def read_metrics(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r and "event" not in r]
    valid = [r for r in records if "valid_loss" in r]
    start = next((r for r in records if r.get("event") == "start"), {})
    col = lambda key: np.array([r[key] for r in train])  # noqa: E731
    return {"steps": col("step"), "loss": col("loss"), "tokens_per_s": col("tokens_per_s"), "step_time_s": col("step_time_s"),
            "valid": [(r["step"], r["valid_loss"]) for r in valid], "start": start}  # fmt: skip


def train(name: str, overrides: list[str], out: Path, launcher: list[str]) -> bool:
    cmd = [*launcher, "-m", "primus_fp8_plugin.train", *overrides, f"logging.dir={out / name}", "logging.progress=false"]
    print(f"[compare] {name}: {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        print(f"[compare] {name} failed (exit {proc.returncode}); left out", file=sys.stderr)
    return proc.returncode == 0


def _speed(m: dict) -> float:
    """Median tokens/s, leaving out the first logged step (compilation, warm-up)."""
    return float(np.median(m["tokens_per_s"][1:] if len(m["tokens_per_s"]) > 1 else m["tokens_per_s"]))


def smoothed_gap(m: dict, base: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(steps, per-step gap %, smoothed steps, smoothed gap %) of ``m``'s training loss relative to
    ``base`` over their common logged steps; smoothed: moving mean of SMOOTH logged steps (per-step
    gaps are noisy)."""
    common = np.intersect1d(m["steps"], base["steps"])
    a = m["loss"][np.isin(m["steps"], common)]
    b = base["loss"][np.isin(base["steps"], common)]
    gap = 100 * (a - b) / b
    if len(gap) == 0:  # no common logged step
        return common, gap, common, gap
    w = min(SMOOTH, len(gap))
    return common, gap, common[w - 1 :], np.convolve(gap, np.ones(w) / w, mode="valid")


def gap_ranges(m: dict, base: dict) -> dict:
    """The smoothed gap's range over the second half of the common steps, and its largest excursion
    after the first 10% (warm-up; step 200 of 2000): how far two runs drift apart, beyond the final
    value."""
    _, _, steps, gap = smoothed_gap(m, base)
    if len(steps) == 0:
        return {}
    last = steps[-1]
    half = gap[steps > last / 2]
    late = steps > last / 10
    out = {}
    if len(half):
        out["gap_second_half_pct"] = [float(half.min()), float(half.max())]
    if late.any():
        i = int(np.argmax(np.abs(np.where(late, gap, 0.0))))
        out["gap_largest_after_10pct"] = {"pct": float(gap[i]), "step": int(steps[i])}
    return out


def summarize(runs: dict[str, dict], baseline: str) -> list[dict]:
    rows = []
    base = runs.get(baseline)
    for name, m in runs.items():
        tail = max(1, len(m["loss"]) // 10)  # final loss: mean of the last 10% of logged steps
        final = float(m["loss"][-tail:].mean())
        row = {"run": name, "steps": int(m["steps"][-1]), "final_loss": final,
               "valid_loss": m["valid"][-1][1] if m["valid"] else None,
               "tokens_per_s": _speed(m),
               "step_time_s": float(np.median(m["step_time_s"]))}  # fmt: skip
        if base is not None:
            btail = float(base["loss"][-tail:].mean())
            row["gap_to_baseline_pct"] = 100 * (final - btail) / btail
            row["speed_vs_baseline"] = row["tokens_per_s"] / float(
                np.median(base["tokens_per_s"][1:] if len(base["tokens_per_s"]) > 1 else base["tokens_per_s"])
            )
            if name != baseline:
                row.update(gap_ranges(m, base))
        rows.append(row)
    return rows


def plot(runs: dict[str, dict], baseline: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 4.5))
    base = runs.get(baseline)
    for i, (name, m) in enumerate(runs.items()):
        color = f"C{i}"
        ax1.plot(m["steps"], m["loss"], label=name, lw=1.2, color=color)
        if base is None or name == baseline:
            continue
        common, gap, s_steps, s_gap = smoothed_gap(m, base)
        ax2.plot(common, gap, lw=0.6, alpha=0.35, color=color)
        ax2.plot(s_steps, s_gap, lw=2, color=color, label=f"{name} vs {baseline} (mean of {min(SMOOTH, len(gap))} logged steps)")
        vb = dict(base["valid"])
        vg = [(s, 100 * (v - vb[s]) / vb[s]) for s, v in m["valid"] if s in vb]
        if vg:
            ax3.plot(*zip(*vg), "o-", color=color, label=f"{name} vs {baseline}")
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.set_yscale("log")
    ax1.set_title("training loss")
    ax1.legend()
    for ax, what in ((ax2, "training loss"), (ax3, "validation loss")):
        ax.axhline(0, color="gray", lw=0.8)
        ax.axhline(0.25, color="gray", ls="--", lw=0.8)
        ax.axhline(-0.25, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel(f"relative gap to {baseline} (%)")
        ax.set_title(f"{what} gap (dashed: +-0.25%, DeepSeek-V3's FP8 bound)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def markdown(rows: list[dict], baseline: str) -> str:
    lines = [f"| run | steps | final loss | gap to {baseline} | smoothed gap, 2nd half | largest smoothed gap after 10% "
             f"| valid loss | tokens/s | speed vs {baseline} | step time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        gap = f"{r['gap_to_baseline_pct']:+.3f}%" if "gap_to_baseline_pct" in r else "-"
        speed = f"{r['speed_vs_baseline']:.2f}x" if "speed_vs_baseline" in r else "-"
        valid = f"{r['valid_loss']:.4f}" if r["valid_loss"] is not None else "-"
        half = "{:+.2f} .. {:+.2f}%".format(*r["gap_second_half_pct"]) if "gap_second_half_pct" in r else "-"
        big = r.get("gap_largest_after_10pct")
        largest = f"{big['pct']:+.2f}% (step {big['step']})" if big else "-"
        cells = [
            r["run"],
            r["steps"],
            f"{r['final_loss']:.4f}",
            gap,
            half,
            largest,
            valid,
            f"{r['tokens_per_s']:.0f}",
            speed,
            f"{r['step_time_s']:.3f}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    common = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--run", action="append", default=[], help='NAME="override override ..." (trained unless done)')
    ap.add_argument("--read", action="append", default=[], help="NAME=RUN_DIR of a finished run (its metrics.jsonl)")
    ap.add_argument("--baseline", default=None, help="run to compare against (default: the first)")
    ap.add_argument("--launcher", default=f"{sys.executable}", help='e.g. "torchrun --nproc-per-node 8"')
    ap.add_argument("--retrain", action="store_true")
    args = ap.parse_args(argv)
    if not args.run and not args.read:
        ap.error("give at least one --run or --read")
    args.out.mkdir(parents=True, exist_ok=True)
    launcher = shlex.split(args.launcher)
    dirs: dict[str, Path] = {}
    for spec in args.run:
        name, _, overrides = spec.partition("=")
        if args.retrain or not (args.out / name / "metrics.jsonl").exists():
            if not train(name, [*common, *shlex.split(overrides)], args.out, launcher):
                continue
        dirs[name] = args.out / name
    for spec in args.read:
        name, _, path = spec.partition("=")
        dirs[name] = Path(path)
    runs = {}
    for name, d in dirs.items():
        try:
            runs[name] = read_metrics(d)
        except (OSError, StopIteration, KeyError, ValueError) as err:
            print(f"[compare] cannot read {d}: {err}", file=sys.stderr)
    if not runs:
        print("[compare] no run to compare", file=sys.stderr)
        return 1
    baseline = args.baseline or next(iter(runs))
    rows = summarize(runs, baseline)
    plot(runs, baseline, args.out / "loss_curves.png")
    (args.out / "summary.md").write_text(markdown(rows, baseline))
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(markdown(rows, baseline))
    print(f"wrote {args.out / 'loss_curves.png'}, {args.out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
