"""Shared helpers of the benchmark scripts: timing, environment facts, tables, JSON and plots."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def bench_ms(fn, warmup_ms: float = 30, rep_ms: float = 150) -> float:
    """Median time of ``fn()`` in milliseconds, with CUDA events (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """GPU time per call of ``fn``, captured ``calls`` times in one CUDA graph and replayed: no host
    time and no L2 flush in the figure (``bench_ms`` flushes L2 before each call, and counts the
    host time of a call whose launch takes longer than the flush)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def sustained_ms(fn, seconds: float) -> tuple[float, float, float]:
    """GPU time per call of ``fn`` run back to back for about ``seconds`` (CUDA events around the
    whole run), and the run's wall-clock start and end (``time.time()``, to match ``PowerLog``).
    Unlike ``bench_ms`` (150 ms), long enough for the H200's power limit to pull the SM clock down
    to where a training run holds it (docs/PERFORMANCE.md, "Ceilings")."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls = max(10, int(seconds / max((time.perf_counter() - t) / 3, 1e-6)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.time()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, t0, time.time()


class PowerLog:
    """SM clock, board power, temperature and clock-throttle reasons sampled by ``nvidia-smi`` in the
    background (every ``interval_ms``); ``window(t0, t1)`` summarises the samples of a time window.
    Use as a context manager. Without ``nvidia-smi`` it records nothing (``window`` gives NaNs)."""

    FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __init__(self, interval_ms: int = 50):
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, float, float, str]] = []
        self.proc = None

    def __enter__(self) -> PowerLog:
        # into a file, not a pipe: nothing reads a pipe until the end, and a full one stops nvidia-smi
        self.file = tempfile.TemporaryFile(mode="w+")
        cmd = ["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.file.seek(0)
        for line in self.file.read().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:  # 2026/12/01 07:30:00.123, 1980, 690.5, 60, 0x0000000000000004
                t = time.mktime(time.strptime(parts[0][:19], "%Y/%m/%d %H:%M:%S")) + float("0" + parts[0][19:])
                self.samples.append((t, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
            except (ValueError, IndexError):
                continue
        self.file.close()

    def window(self, t0: float, t1: float, settle: float = 0.2) -> dict:
        """Median SM clock (MHz) and power (W), peak temperature and the throttle reasons seen over
        [t0, t1], leaving out its first ``settle`` fraction (the clock is still falling there)."""
        t0 = t0 + settle * (t1 - t0)
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {"sm_mhz": float("nan"), "power_w": float("nan"), "temp_c": float("nan"), "throttle": ""}
        return {
            "sm_mhz": statistics.median(s[1] for s in inside),
            "power_w": statistics.median(s[2] for s in inside),
            "temp_c": max(s[3] for s in inside),
            # 0x4: software power cap, 0x20/0x40: thermal slowdown (nvidia-smi -q -d PERFORMANCE)
            "throttle": ",".join(sorted({s[4] for s in inside})),
        }


def environment() -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import transformer_engine

        env["transformer_engine"] = transformer_engine.__version__
    except Exception:  # noqa: BLE001 - TE is optional; any import failure means "absent"
        pass
    return env


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """``columns``: (key, format spec) pairs; missing values print as '-'."""
    widths = []
    for key, fmt in columns:
        cells = [key] + [("-" if r.get(key) is None else format(r[key], fmt)) for r in rows]
        widths.append(max(len(c) for c in cells))
    print("  ".join(f"{k:>{w}}" for (k, _), w in zip(columns, widths)))
    for r in rows:
        print("  ".join(f"{('-' if r.get(k) is None else format(r[k], f)):>{w}}" for (k, f), w in zip(columns, widths)))


def save_json(path: str | Path, payload: dict) -> None:
    Path(path).write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")


def try_import_te():
    """(te, tex) or (None, reason)."""
    try:
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex

        return te, tex
    except Exception as err:  # noqa: BLE001
        return None, str(err)


def bench_parser(doc: str, shape_help: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: --json, --plot, --shapes."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows and the environment as JSON")
    ap.add_argument("--plot", help="write a PNG")
    ap.add_argument("--shapes", nargs="*", help=shape_help)
    return ap


def shapes_or(args: argparse.Namespace, default: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else default


def require_cuda(name: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"{name} needs a CUDA GPU", file=sys.stderr)
    return False


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
