#!/usr/bin/env python3
"""Convergence comparison: train several configurations (or read finished runs) and plot them.

    python scripts/compare_convergence.py --out DIR --run bf16="fp8=bf16" --run bf16_s2="fp8=bf16 train.seed=4321" \\
        --run plugin="fp8=blockwise" [--read old=path/to/run_or_metrics.jsonl] [--baseline bf16] \\
        [--band bf16,bf16_s2] [--launcher "torchrun --nproc-per-node 8"] [--dry-run] \\
        model=gpt_125m train=convergence           # overrides common to every run (also after --)

Writes DIR/loss_curves.png, DIR/summary.md and DIR/summary.json (one record per run; the baseline's also
holds the noise band's numbers, ``noise_band``). The plot: the training loss of every
run (as logged, faint, and its EMA, ``--smooth`` steps), the same over the last ``--last`` steps (with
each run's final loss over its window), each run's relative gap to the baseline (mean over a trailing
window of ``--gap-window`` steps, DeepSeek-V3's 0.25% bound dashed), and, when the runs were evaluated
at least twice, the validation loss's gap. ``--band`` names the runs (two BF16 seeds, or a BF16 arm and
the same arm with other kernels) whose spread, min to max, is drawn as the noise band on those panels.
The title names the model, the steps, the seeds, the arms and the band.

The final loss of a run is the mean training loss over its last ``--final-steps`` steps (default: the
last 10%), from the losses logged in that window: exact when every step is logged (the runs this script
trains log every step, ``logging.log_interval=1``), otherwise the mean of the steps logged there (the
summary says how many). The window is counted in steps, not in logged records, so the definition does
not depend on the log interval, and the gap to the baseline compares the two runs' windows. The summary
also gives the last validation loss and its gap, the smoothed gap's range over the second half and its
largest excursion after the first 10% of steps, tokens/s (median, first logged step left out) and the
step time.

``--run NAME="overrides"`` trains (unless DIR/NAME/metrics.jsonl exists; ``--retrain`` moves an old run
aside and trains again) with ``--launcher`` (default: this Python) in the directory you run this from, so
relative paths mean what they mean there; a run that fails (e.g. no Transformer Engine) is reported and
left out. ``--read NAME=PATH`` reads a finished run: its directory or any metrics file the trainer writes
(``docs/results/*.metrics.jsonl`` too). ``--dry-run`` prints each run's command and composed config (the
trainer's ``--cfg job``) and what would be read, and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FP8_BOUND_PCT = 0.25  # DeepSeek-V3's relative loss-gap bound for FP8 training


class MetricsError(Exception):
    """A metrics file that cannot be read as one run (the message names the file)."""


# ---------------------------------------------------------------------------------------------- reading


def metrics_path(path: Path) -> Path:
    """The metrics file of ``path``: the file itself, or ``path/metrics.jsonl`` for a run directory."""
    return path / "metrics.jsonl" if path.is_dir() else path


def read_metrics(path: Path) -> dict:
    """One run from a run directory or a metrics file (JSON lines: a start event, a record per logged training
    step, validation records, events). A file that holds several runs (re-runs appended to one file) gives
    its last; a resumed run (a start event with ``start_step`` > 0) continues the one before it, and a step
    logged twice keeps its last record. A truncated last line (a run killed while writing) is left out.

    Returns ``steps`` (int array, ascending), ``loss``, ``tokens_per_s``, ``step_time_s`` (float arrays),
    ``valid`` (list of (step, loss)), ``start`` (the start event), ``config`` (the run's ``.hydra/config.yaml``
    when it sits next to the file, else {}), ``source`` and ``notes``."""
    file = metrics_path(path)
    try:
        lines = file.read_text().splitlines()
    except OSError as err:
        raise MetricsError(f"{file}: {err.strerror or err}") from None
    records, notes = [], []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:
                notes.append(f"{file}: left out its truncated last line")
                continue
            raise MetricsError(f"{file}:{i + 1}: not JSON ({err})") from None
    fresh = [i for i, r in enumerate(records) if r.get("event") == "start" and not r.get("start_step")]
    if len(fresh) > 1:
        notes.append(f"{file} holds {len(fresh)} runs (appended to one file); reading the last")
        records = records[fresh[-1] :]
    train, valid = {}, {}
    for r in records:
        if "event" in r or "step" not in r:
            continue
        if "loss" in r:
            train[int(r["step"])] = r
        if "valid_loss" in r:
            valid[int(r["step"])] = float(r["valid_loss"])
    if not train:
        raise MetricsError(f"{file}: no training step logged")
    steps = np.array(sorted(train))
    col = lambda key: np.array([float(train[s].get(key, math.nan)) for s in steps])  # noqa: E731
    start = next((r for r in records if r.get("event") == "start"), {})
    return {"steps": steps, "loss": col("loss"), "tokens_per_s": col("tokens_per_s"), "step_time_s": col("step_time_s"),
            "valid": sorted(valid.items()), "start": start, "config": run_config(file), "source": str(file),
            "notes": notes}  # fmt: skip


def run_config(file: Path) -> dict:
    """The run's composed config (Hydra's ``.hydra/config.yaml`` next to its metrics file), or {}."""
    cfg = file.parent / ".hydra" / "config.yaml"
    if not cfg.is_file():
        return {}
    try:
        import yaml

        return yaml.safe_load(cfg.read_text()) or {}
    except Exception:  # noqa: BLE001 - the title then says less; the numbers do not depend on it
        return {}


# ------------------------------------------------------------------------------------------------ numbers


def ema(steps: np.ndarray, values: np.ndarray, window: float) -> np.ndarray:
    """Exponential moving average with a time constant of ``window`` steps, for values logged at any steps:
    at logged step ``s_i`` the weighted mean of the values logged so far, value ``j`` weighted
    ``exp(-(s_i - s_j) / window)`` (normalised, so the first values are not pulled towards the very first
    one, as TensorBoard's debiased smoothing). ``window`` <= 0: ``values`` as they are."""
    values = np.asarray(values, dtype=float)
    if window <= 0 or len(values) == 0:
        return values.copy()
    decay = np.exp(-np.diff(np.asarray(steps, dtype=float)) / window)
    out = np.empty_like(values)
    num, den = values[0], 1.0
    out[0] = num
    for i in range(1, len(values)):
        num = decay[i - 1] * num + values[i]
        den = decay[i - 1] * den + 1.0
        out[i] = num / den
    return out


def trailing_mean(steps: np.ndarray, values: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """At each logged step ``s`` with a full window behind it (``s >= steps[0] + window - 1``): the mean of
    the values logged at steps in ``(s - window, s]``. Returns (those steps, their means)."""
    steps, values = np.asarray(steps), np.asarray(values, dtype=float)
    if len(steps) == 0:
        return steps, values
    lo = np.searchsorted(steps, steps - window, side="right")
    csum = np.concatenate([[0.0], np.cumsum(values)])
    means = (csum[1:] - csum[lo]) / (np.arange(1, len(steps) + 1) - lo)
    keep = steps >= steps[0] + window - 1
    return steps[keep], means[keep]


def final_loss(m: dict, final_steps: int | None = None) -> dict:
    """The run's final training loss: the mean of the losses logged at steps in ``(last - N, last]``, ``N`` =
    ``final_steps`` (default: 10% of the last step, at least 1). Returns ``loss``, ``window`` [first, last]
    step of the window and ``points`` (how many logged steps it averages)."""
    last = int(m["steps"][-1])
    n = final_steps or max(1, round(last / 10))
    inside = m["steps"] > last - n
    return {"loss": float(m["loss"][inside].mean()), "window": [last - n + 1, last], "points": int(inside.sum())}


def gap_pct(m: dict, base: dict) -> tuple[np.ndarray, np.ndarray]:
    """(common logged steps, relative training-loss gap of ``m`` to ``base`` in % at those steps)."""
    common = np.intersect1d(m["steps"], base["steps"])
    a = m["loss"][np.isin(m["steps"], common)]
    b = base["loss"][np.isin(base["steps"], common)]
    return common, 100 * (a - b) / b


def valid_gap_pct(m: dict, base: dict) -> tuple[np.ndarray, np.ndarray]:
    """(evaluation steps both runs have, relative validation-loss gap of ``m`` to ``base`` in % there)."""
    vb = dict(base["valid"])
    pairs = [(s, 100 * (v - vb[s]) / vb[s]) for s, v in m["valid"] if s in vb]
    return np.array([p[0] for p in pairs], dtype=int), np.array([p[1] for p in pairs], dtype=float)


def gap_ranges(m: dict, base: dict, window: int) -> dict:
    """The gap's trailing mean over ``window`` steps: its range over the second half of the common steps
    (steps > last / 2) and its largest excursion after the first 10% (warm-up): how far two runs drift
    apart, beyond the final value."""
    steps, gap = trailing_mean(*gap_pct(m, base), window)
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


def median_speed(m: dict) -> float:
    """Median tokens/s, leaving out the first logged step (compilation, warm-up)."""
    tps = m["tokens_per_s"]
    return float(np.median(tps[1:] if len(tps) > 1 else tps))


def summarize(runs: dict[str, dict], baseline: str, final_steps: int | None, gap_window: int) -> list[dict]:
    rows = []
    base = runs.get(baseline)
    bfinal = final_loss(base, final_steps) if base is not None else None
    for name, m in runs.items():
        fin = final_loss(m, final_steps)
        row = {"run": name, "steps": int(m["steps"][-1]), "final_loss": fin["loss"], "final_window": fin["window"],
               "final_points": fin["points"], "valid_loss": m["valid"][-1][1] if m["valid"] else None,
               "valid_evals": len(m["valid"]), "tokens_per_s": median_speed(m),
               "step_time_s": float(np.median(m["step_time_s"]))}  # fmt: skip
        if base is not None:
            row["gap_to_baseline_pct"] = 100 * (fin["loss"] - bfinal["loss"]) / bfinal["loss"]
            row["speed_vs_baseline"] = row["tokens_per_s"] / median_speed(base)
            vs, vg = valid_gap_pct(m, base)
            if m["valid"] and len(vs) and vs[-1] == m["valid"][-1][0]:  # the last evaluation, at a step both have
                row["valid_gap_to_baseline_pct"] = float(vg[-1])
            if name != baseline:
                row.update(gap_ranges(m, base, gap_window))
        rows.append(row)
    return rows


def band_summary(runs: dict[str, dict], band: list[str], baseline: str, rows: list[dict], gap_window: int) -> dict:
    """The noise band in numbers: the band runs' final-loss gaps to the baseline (min, max) and the range of
    their smoothed gaps over the second half of the steps."""
    by = {r["run"]: r for r in rows}
    finals = [by[n]["gap_to_baseline_pct"] for n in band if "gap_to_baseline_pct" in by[n]]
    out = {"runs": band, "final_gap_pct": [min(finals), max(finals)] if finals else None}
    steps, lo, hi = band_envelope({n: runs[n] for n in band}, runs[baseline], gap_window)
    if len(steps):
        half = steps > steps[-1] / 2
        out["gap_second_half_pct"] = [float(lo[half].min()), float(hi[half].max())] if half.any() else None
    return out


def band_envelope(members: dict[str, dict], base: dict | None, gap_window: int):
    """(steps, min, max) across ``members`` of their smoothed gap to ``base`` (the baseline itself: 0), at
    the steps all of them have."""
    curves = [trailing_mean(*gap_pct(m, base), gap_window) for m in members.values()]
    common = curves[0][0]
    for s, _ in curves[1:]:
        common = np.intersect1d(common, s)
    stack = np.array([g[np.isin(s, common)] for s, g in curves]).reshape(len(curves), len(common))
    return common, stack.min(0, initial=np.inf), stack.max(0, initial=-np.inf)


# ------------------------------------------------------------------------------------------------ output


def title(runs: dict[str, dict], band: list[str]) -> str:
    """Model, steps, seeds, arms and band, from the runs' configs (``.hydra/config.yaml``) and start events
    (``model``, ``seed``, ``params``); what no run recorded is said to be unknown."""
    models = {(m["config"].get("model") or {}).get("name") or m["start"].get("model") for m in runs.values()} - {None}
    seeds = {(m["config"].get("train") or {}).get("seed", m["start"].get("seed")) for m in runs.values()} - {None}
    params = {m["start"].get("params") for m in runs.values()} - {None}
    steps = sorted({int(m["steps"][-1]) for m in runs.values()})
    what = ", ".join(sorted(models)) if models else "model not recorded"
    if params:
        what += " (" + ", ".join(f"{p / 1e6:.1f} M params" for p in sorted(params)) + ")"
    seed_text = "seeds not recorded"
    if seeds:
        seed_text = ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(str(s) for s in sorted(seeds))
    step_text = f"{steps[0]} steps" if len(steps) == 1 else f"{steps[0]}-{steps[-1]} steps"
    out = f"{what}, {step_text}, {seed_text}\narms: {', '.join(runs)}"
    if band:
        out += f"; noise band: {', '.join(band)}"
    return out


def plot(runs: dict[str, dict], baseline: str, band: list[str], path: Path, *, smooth: float, last: int | None,
         final_steps: int | None, gap_window: int, heading: str) -> list[str]:  # fmt: skip
    """Write the figure to ``path``; returns the panels drawn (``loss``, ``zoom``, ``gap``, and ``valid`` when
    some run shares two or more evaluations with the baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = runs.get(baseline)
    # the validation panel only where some run shares two or more evaluations with the baseline
    with_valid = base is not None and any(len(valid_gap_pct(m, base)[0]) >= 2 for n, m in runs.items() if n != baseline)
    layout = [["loss", "zoom"], ["gap", "valid"]] if with_valid else [["loss", "zoom"], ["gap", "gap"]]
    fig, ax = plt.subplot_mosaic(layout, figsize=(15, 9.5))
    end = max(int(m["steps"][-1]) for m in runs.values())
    last = last or max(1, round(end / 4))
    smooth_text = f"EMA, time constant {smooth:g} steps" if smooth > 0 else "as logged"
    colors = {name: f"C{i}" for i, name in enumerate(runs)}
    zoom_values = []
    for name, m in runs.items():
        s, raw, sm = m["steps"], m["loss"], ema(m["steps"], m["loss"], smooth)
        for key in ("loss", "zoom"):
            if smooth > 0:
                ax[key].plot(s, raw, color=colors[name], lw=0.6, alpha=0.3)
            ax[key].plot(s, sm, color=colors[name], lw=1.6, label=name)
        inside = s > end - last
        zoom_values += list(sm[inside])
        fin = final_loss(m, final_steps)
        ax["zoom"].hlines(fin["loss"], fin["window"][0], fin["window"][1], color=colors[name], lw=4, alpha=0.6)
    if len(band) >= 2:
        env = loss_envelope({n: runs[n] for n in band}, smooth)
        for key in ("loss", "zoom"):
            ax[key].fill_between(*env, color="gray", alpha=0.3, lw=0, label=f"noise band: {', '.join(band)} (min-max)")
        zoom_values += list(env[1][env[0] > end - last]) + list(env[2][env[0] > end - last])
    ax["loss"].set_title(f"training loss ({smooth_text}; faint: as logged)")
    ax["zoom"].set_title(f"last {last} steps (bars: final loss, mean over each run's final window)")
    ax["zoom"].set_xlim(end - last, end + last * 0.02)
    if zoom_values:
        lo, hi = float(np.nanmin(zoom_values)), float(np.nanmax(zoom_values))
        pad = 0.15 * (hi - lo) or 0.01 * abs(hi) or 0.01
        ax["zoom"].set_ylim(lo - pad, hi + pad)
    for key in ("loss", "zoom"):
        ax[key].set_xlabel("step")
        ax[key].set_ylabel("training loss")
        ax[key].legend(fontsize=8)
    if base is not None:
        for name, m in runs.items():
            if name == baseline:
                continue
            s, g = trailing_mean(*gap_pct(m, base), gap_window)
            ax["gap"].plot(s, g, color=colors[name], lw=1.6, label=f"{name} vs {baseline}")
            vs, vg = valid_gap_pct(m, base)
            if with_valid and len(vs) >= 2:
                ax["valid"].plot(vs, vg, "o-", color=colors[name], label=f"{name} vs {baseline}")
        if len(band) >= 2:
            steps, lo, hi = band_envelope({n: runs[n] for n in band}, base, gap_window)
            label = f"noise band: {', '.join(band)}"
            if len(steps):
                ax["gap"].fill_between(steps, lo, hi, color="gray", alpha=0.3, lw=0, label=label)
            curves = [valid_gap_pct(runs[n], base) for n in band]
            common = sorted(set.intersection(*(set(s.tolist()) for s, _ in curves)))
            if with_valid and len(common) >= 2:
                vals = np.array([[dict(zip(s.tolist(), g))[c] for c in common] for s, g in curves])
                ax["valid"].fill_between(common, vals.min(0), vals.max(0), color="gray", alpha=0.3, lw=0, label=label)
        ax["gap"].set_title(f"training-loss gap to {baseline}, mean over the last {gap_window} steps\n"
                            f"(dashed: +-{FP8_BOUND_PCT}%, DeepSeek-V3's FP8 bound)")  # fmt: skip
        panels = ("gap", "valid") if with_valid else ("gap",)
        for key in panels:
            ax[key].axhline(0, color="gray", lw=0.8)
            for y in (FP8_BOUND_PCT, -FP8_BOUND_PCT):
                ax[key].axhline(y, color="gray", ls="--", lw=0.8)
            ax[key].set_xlabel("step")
            ax[key].set_ylabel(f"relative gap to {baseline} (%)")
            if ax[key].get_legend_handles_labels()[0]:
                ax[key].legend(fontsize=8)
        if with_valid:
            ax["valid"].set_title(f"validation-loss gap to {baseline}")
    fig.suptitle(heading, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ["loss", "zoom", "gap", "valid"] if with_valid else ["loss", "zoom", "gap"]


def loss_envelope(members: dict[str, dict], smooth: float):
    """(steps, min, max) of the members' smoothed training losses at the steps all of them logged."""
    common = None
    for m in members.values():
        common = m["steps"] if common is None else np.intersect1d(common, m["steps"])
    curves = np.array([ema(m["steps"], m["loss"], smooth)[np.isin(m["steps"], common)] for m in members.values()])
    return common, curves.min(0), curves.max(0)


def markdown(rows: list[dict], baseline: str, band: dict | None, final_steps: int | None, gap_window: int) -> str:
    lines = [f"| run | steps | final loss | gap to {baseline} | smoothed gap, 2nd half | largest smoothed gap after 10% "
             f"| valid loss | valid gap | tokens/s | speed vs {baseline} | step time (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        gap = f"{r['gap_to_baseline_pct']:+.3f}%" if "gap_to_baseline_pct" in r else "-"
        speed = f"{r['speed_vs_baseline']:.2f}x" if "speed_vs_baseline" in r else "-"
        valid = f"{r['valid_loss']:.4f}" if r["valid_loss"] is not None else "-"
        vgap = f"{r['valid_gap_to_baseline_pct']:+.3f}%" if "valid_gap_to_baseline_pct" in r else "-"
        half = "{:+.2f} .. {:+.2f}%".format(*r["gap_second_half_pct"]) if "gap_second_half_pct" in r else "-"
        big = r.get("gap_largest_after_10pct")
        largest = f"{big['pct']:+.2f}% (step {big['step']})" if big else "-"
        cells = [r["run"], r["steps"], f"{r['final_loss']:.4f}", gap, half, largest, valid, vgap,
                 f"{r['tokens_per_s']:.0f}", speed, f"{r['step_time_s']:.3f}"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    windows = sorted({(r["final_window"][0], r["final_window"][1], r["final_points"]) for r in rows})
    lines += ["", "Final loss: the mean training loss over the last "
              + (f"{final_steps} steps" if final_steps else "10% of the steps")
              + " of each run (" + "; ".join(f"steps {a}-{b}: {p} logged" for a, b, p in windows) + "). "
              f"Smoothed gap: the mean over the last {gap_window} steps."]  # fmt: skip
    if band:
        fin = band.get("final_gap_pct")
        half = band.get("gap_second_half_pct")
        text = f"Noise band ({', '.join(band['runs'])}): final-loss gaps to {baseline} "
        text += "{:+.3f} .. {:+.3f}%".format(*fin) if fin else "-"
        if half:
            text += "; smoothed gap over the second half {:+.2f} .. {:+.2f}%".format(*half)
        lines.append(text + ".")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ running


def trainer_env() -> dict:
    """This checkout's package first on PYTHONPATH, whatever directory the runs start in."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


# before the user's overrides (which may change them): every step logged, so that the final loss and the gaps
# use every step's loss; no progress bar in the output of several runs
RUN_DEFAULTS = ("logging.log_interval=1", "logging.progress=false")


def run_command(name: str, overrides: list[str], out: Path, launcher: list[str]) -> list[str]:
    """The command that trains run ``name`` into ``out/name`` (its logging.dir)."""
    return [*launcher, "-m", "primus_fp8_plugin.train", *RUN_DEFAULTS, *overrides, f"logging.dir={out / name}"]


def train(name: str, cmd: list[str]) -> bool:
    """Run ``cmd`` in this process's directory; whether it succeeded."""
    print(f"[compare] {name}: {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=trainer_env())
    if proc.returncode != 0:
        print(f"[compare] {name} failed (exit {proc.returncode}); left out", file=sys.stderr)
    return proc.returncode == 0


def dry_run(commands: dict[str, list[str]], launcher: list[str]) -> bool:
    """Print each run's command and its composed config (the trainer's ``--cfg job``, all composed at once);
    whether every config composed."""
    compose = {name: subprocess.Popen([sys.executable, "-m", "primus_fp8_plugin.train", "--cfg", "job",
                                       *cmd[len(launcher) + 2 :]], env=trainer_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
               for name, cmd in commands.items()}  # fmt: skip
    ok = True
    for name, cmd in commands.items():
        text = compose[name].communicate()[0]
        print(f"[compare] {name}: {shlex.join(cmd)}\n[compare] {name}: composed config:\n{text}", end="", flush=True)
        ok &= compose[name].returncode == 0
    return ok


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's options, the trainer's common overrides): everything after ``--`` is an override."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    own, after = split_argv(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(
        usage="%(prog)s --out DIR (--run NAME=OVERRIDES | --read NAME=PATH)... [options] [OVERRIDES...] [-- OVERRIDES...]",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, required=True, help="output directory (relative: to where you run this)")
    ap.add_argument("--run", action="append", default=[], help='NAME="override override ..." (trained unless done)')
    ap.add_argument("--read", action="append", default=[], help="NAME=PATH: a finished run's directory or metrics file")
    ap.add_argument("--baseline", default=None, help="the run the others are compared with (default: the first)")
    ap.add_argument("--band", default="", help="NAME,NAME[,...]: runs whose min-max spread is drawn as the noise band")
    ap.add_argument("--smooth", type=float, default=None, help="EMA time constant of the loss panels, in steps "
                    "(default: 5%% of the steps; 0: as logged)")  # fmt: skip
    ap.add_argument("--last", type=int, default=None, help="steps in the zoom panel (default: the last 25%%)")
    ap.add_argument("--final-steps", type=int, default=None, help="steps the final loss averages (default: last 10%%)")
    ap.add_argument("--gap-window", type=int, default=None, help="trailing window of the smoothed gap, in steps "
                    "(default: 5%% of the steps)")  # fmt: skip
    ap.add_argument("--title", default=None, help="the plot's title (default: model, steps, seeds, arms, band)")
    ap.add_argument("--launcher", default=sys.executable, help='what runs the trainer, e.g. "torchrun --nproc-per-node 8"')
    ap.add_argument("--retrain", action="store_true", help="train --run runs again (an old run directory is moved aside)")
    ap.add_argument("--dry-run", action="store_true", help="print commands, composed configs and what would be read")
    args, extra = ap.parse_known_args(own)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)} (overrides are key=value; give others after --)")
    common = [*extra, *after]
    if not args.run and not args.read:
        ap.error("give at least one --run or --read")
    specs = []
    for flag, items in (("--run", args.run), ("--read", args.read)):
        for spec in items:
            name, eq, value = spec.partition("=")
            if not eq or not name or (flag == "--read" and not value):
                ap.error(f"{flag} {spec!r}: give NAME=" + ("PATH" if flag == "--read" else '"overrides"'))
            specs.append((flag, name, value))
    names = [n for _, n, _ in specs]
    if len(set(names)) != len(names):
        ap.error(f"run names repeat: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    band = [b for b in args.band.split(",") if b]
    if band and (len(band) < 2 or set(band) - set(names)):
        ap.error(f"--band {args.band}: name two or more of the runs ({', '.join(names)})")
    if args.baseline and args.baseline not in names:
        ap.error(f"--baseline {args.baseline}: not one of the runs ({', '.join(names)})")
    out = args.out.resolve()  # relative to where this runs, also for the trainer's logging.dir
    launcher = shlex.split(args.launcher)

    dirs: dict[str, Path] = {}
    to_train: dict[str, list[str]] = {}
    for flag, name, value in specs:
        if flag == "--read":
            dirs[name] = Path(value).resolve()
            if args.dry_run:
                print(f"[compare] {name}: reads {metrics_path(dirs[name])}", flush=True)
        elif (out / name / "metrics.jsonl").exists() and not args.retrain:
            print(f"[compare] {name}: {out / name / 'metrics.jsonl'} exists, not trained again (--retrain trains it)")
            dirs[name] = out / name
        else:
            to_train[name] = run_command(name, [*common, *shlex.split(value)], out, launcher)
    if args.dry_run:
        ok = dry_run(to_train, launcher)
        print("[compare] dry run: nothing trained, read or written", flush=True)
        return 0 if ok else 2
    for name, cmd in to_train.items():
        if (out / name).exists():  # --retrain: the old run stays, aside
            aside = out / f"{name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            (out / name).rename(aside)
            print(f"[compare] {name}: moved the old run to {aside}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        if train(name, cmd):
            dirs[name] = out / name
    runs_order = [n for _, n, _ in specs if n in dirs]  # as given, read and trained runs interleaved
    dirs = {n: dirs[n] for n in runs_order}

    runs = {}
    for name, d in dirs.items():
        try:
            runs[name] = read_metrics(d)
        except MetricsError as err:
            print(f"[compare] cannot read {name}: {err}", file=sys.stderr)
            continue
        for note in runs[name]["notes"]:
            print(f"[compare] {name}: {note}", file=sys.stderr)
    if not runs:
        print("[compare] no run to compare", file=sys.stderr)
        return 1
    baseline = args.baseline if args.baseline in runs else next(iter(runs))
    if args.baseline and baseline != args.baseline:
        print(f"[compare] the baseline {args.baseline} is missing; comparing with {baseline}", file=sys.stderr)
    band = [b for b in band if b in runs]
    if len(band) == 1:
        print(f"[compare] the noise band needs two of its runs; only {band[0]} is here: no band", file=sys.stderr)
        band = []
    end = max(int(m["steps"][-1]) for m in runs.values())
    smooth = args.smooth if args.smooth is not None else max(1.0, round(end / 20))
    gap_window = args.gap_window or max(1, round(end / 20))
    rows = summarize(runs, baseline, args.final_steps, gap_window)
    band_info = band_summary(runs, band, baseline, rows, gap_window) if band else None
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, baseline, band, out / "loss_curves.png", smooth=smooth, last=args.last, final_steps=args.final_steps,
         gap_window=gap_window, heading=args.title or title(runs, band))  # fmt: skip
    text = markdown(rows, baseline, band_info, args.final_steps, gap_window)
    (out / "summary.md").write_text(text)
    if band_info:  # measured against the baseline: it goes with the baseline's row
        next(r for r in rows if r["run"] == baseline)["noise_band"] = band_info
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    print(text)
    print(f"wrote {out / 'loss_curves.png'}, {out / 'summary.md'}, {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
