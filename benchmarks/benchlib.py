"""Shared helpers of the benchmark scripts: timing, environment facts, tables, JSON and plots."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
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


def step_peak_mib(step, before=None) -> float:
    """Peak CUDA memory of one training step: the most bytes allocated (torch's caching allocator) at any
    time during ``step()`` above what was allocated when it started, in MiB. ``before()`` (not measured)
    runs first, e.g. to drop the previous step's gradients, which the step would allocate again. So the
    figure is what a step adds on top of the model and its inputs: saved activations, gradients, weight
    caches made in the step, and transients. Not meaningful for CUDA-graph replays (their memory is
    allocated at capture)."""
    if before is not None:
        before()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


SETTLE_S = 0.3  # untimed run before a sustained timing: the clock takes ~0.1-0.2 s to reach the power cap


def sustained_ms(fn, seconds: float) -> tuple[float, float, float]:
    """Mean GPU time per call of ``fn`` run back to back for about ``seconds`` after an untimed
    ``SETTLE_S`` of the same, and the timed run's wall-clock start and end (``time.time()``, as
    ``PowerLog`` stamps its samples). CUDA events around the whole timed run; no L2 flush between
    calls (``bench_ms`` flushes before each call and takes the median). Long enough for the H200's
    power limit to hold the SM clock where a training run holds it (docs/PERFORMANCE.md).
    Returns (ms per call, t0, t1)."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = max((time.perf_counter() - t) / 3, 1e-6)
    for _ in range(int(SETTLE_S / per_call)):
        fn()
    calls = max(10, int(seconds / per_call))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    start.synchronize()  # the settle run has drained: t0 is when the timed calls start running
    t0 = time.time()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, t0, time.time()


class PowerLog:
    """SM clock, board power, temperature and clock-throttle reasons of one GPU, sampled by
    ``nvidia-smi`` in the background every ``interval_ms``. Use as a context manager; the samples are
    read when it exits, and ``window(t0, t1)`` then summarises a time window. ``device``: a torch CUDA
    device (default: the current one), matched to nvidia-smi by UUID, so that other GPUs of the node
    do not mix in. Power is the instantaneous reading where the driver has one (``power.draw`` is a
    1-second average on recent GPUs). Without ``nvidia-smi``, or when it gives no readable sample, it
    warns and ``window`` gives None."""

    def __init__(self, interval_ms: int = 50, device: int | None = None):
        self.interval_ms = interval_ms
        self.device = device
        self.samples: list[tuple[float, float, float, float, str]] = []
        self.proc = None
        self.file = None

    @staticmethod
    def _query_ok(fields: str, select: list[str]) -> bool:
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader", *select],
                                  capture_output=True, text=True, timeout=20)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    def _select(self) -> list[str]:
        if not torch.cuda.is_available():
            return []
        try:
            props = torch.cuda.get_device_properties(self.device if self.device is not None else torch.cuda.current_device())
            select = ["-i", f"GPU-{props.uuid}"]
        except (AttributeError, RuntimeError):
            return []
        if self._query_ok("uuid", select):
            return select
        print(f"PowerLog: nvidia-smi does not know {select[1]}; sampling every GPU", file=sys.stderr)
        return []

    def __enter__(self) -> PowerLog:
        select = self._select()
        # timestamp first; the throttle field was renamed clocks_event_reasons in newer drivers
        power = "power.draw.instant" if self._query_ok("power.draw.instant", select) else "power.draw"
        throttle = (
            "clocks_throttle_reasons.active" if self._query_ok("clocks_throttle_reasons.active", select)
            else "clocks_event_reasons.active"
        )  # fmt: skip
        self.fields = f"timestamp,clocks.sm,{power},temperature.gpu,{throttle}"
        # into a file, not a pipe: nothing reads a pipe until the end, and a full one stops nvidia-smi
        self.file = tempfile.TemporaryFile(mode="w+")
        cmd = ["nvidia-smi", f"--query-gpu={self.fields}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}",
               *select]  # fmt: skip
        try:
            self.proc = subprocess.Popen(cmd, stdout=self.file, stderr=subprocess.STDOUT, text=True)
        except OSError as err:
            print(f"PowerLog: cannot run nvidia-smi ({err}); no clock or power figures", file=sys.stderr)
            self.proc = None
            return self
        # its first sample comes ~0.5 s after the start: wait for it, so the first timed run has samples
        deadline = time.time() + 3.0
        while time.time() < deadline and self.proc.poll() is None and os.fstat(self.file.fileno()).st_size == 0:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.file is None:
            return
        self.file.seek(0)
        text = self.file.read()
        self.file.close()
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:  # 2026/12/01 07:30:00.123, 1980, 690.5, 60, 0x0000000000000004 (local time, as time.mktime reads it)
                t = time.mktime(time.strptime(parts[0][:19], "%Y/%m/%d %H:%M:%S")) + float("0" + parts[0][19:])
                self.samples.append((t, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
            except (ValueError, IndexError):
                continue
        if self.proc is not None and not self.samples:
            print(f"PowerLog: no readable nvidia-smi sample ({self.fields}): {text.strip()[:300]!r}", file=sys.stderr)

    def window(self, t0: float, t1: float, settle: float = 0.0) -> dict:
        """Median SM clock (MHz) and power (W), peak temperature (C) and the throttle reasons seen over
        [t0, t1] (the first ``settle`` fraction left out); None where no sample fell inside."""
        t0 = t0 + settle * (t1 - t0)
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {"sm_mhz": None, "power_w": None, "temp_c": None, "throttle": ""}
        return {
            "sm_mhz": statistics.median(s[1] for s in inside),
            "power_w": statistics.median(s[2] for s in inside),
            "temp_c": max(s[3] for s in inside),
            # 0x4: software power cap, 0x20/0x40: thermal slowdown (nvidia-smi -q -d PERFORMANCE)
            "throttle": ",".join(sorted({s[4] for s in inside})),
        }


class Timing:
    """How a benchmark times its contenders: ``bench_ms`` by default; with ``sustained_s`` > 0,
    ``sustained_ms`` under a ``PowerLog``, each run's SM clock, power and throttle reasons written into
    the row it belongs to as ``"{label} MHz"``, ``"{label} W"``, ``"{label} throttle"`` when the
    ``with`` block ends. ``order(names, i)`` reverses the contenders of every other group in sustained
    runs, so that none always runs first (after a pause, the clock starts above the cap)."""

    def __init__(self, sustained_s: float = 0.0):
        self.sustained_s = sustained_s
        self.power = PowerLog() if sustained_s > 0 else None
        self._runs: list[tuple[dict, str, float, float]] = []

    def __enter__(self) -> Timing:
        if self.power is not None:
            self.power.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.power is None:
            return
        self.power.__exit__(*exc)
        for row, label, t0, t1 in self._runs:
            w = self.power.window(t0, t1)
            row.update({f"{label} MHz": w["sm_mhz"], f"{label} W": w["power_w"], f"{label} throttle": w["throttle"]})

    def ms(self, fn, row: dict | None = None, label: str = "") -> float:
        """ms per call of ``fn``; in sustained runs the clock and power of this run go into ``row``."""
        if self.power is None:
            return bench_ms(fn)
        ms, t0, t1 = sustained_ms(fn, self.sustained_s)
        if row is not None:
            self._runs.append((row, label, t0, t1))
        return ms

    def order(self, names, i: int) -> list:
        names = list(names)
        return names[::-1] if self.power is not None and i % 2 else names

    def describe(self) -> str:
        if self.power is None:
            return "triton do_bench (L2 flushed, median)"
        return (f"sustained {self.sustained_s:g} s per contender after {SETTLE_S:g} s untimed, order alternating "
                "(SM clock and power: median over each timed run)")  # fmt: skip


def report(name: str, env: dict, rows: list[dict], columns: list[tuple[str, str]], args, plot_fn=None,
           notes: list[str] = (), **json_extra) -> None:  # fmt: skip
    """The end of every benchmark: the environment, the table, ``notes`` (a line each), and, as the
    options ``--json`` / ``--plot`` ask, the JSON (``env``, ``rows`` and ``json_extra``) and the plot."""
    print(f"\n# {name}  {env}")
    print_table(rows, columns)
    for line in notes:
        print(line)
    if args.json:
        save_json(args.json, {"env": env, "rows": rows, **json_extra})
    if args.plot and plot_fn is not None:
        plot_fn(rows, args.plot)


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


def bench_parser(doc: str, shape_help: str | None = None) -> argparse.ArgumentParser:
    """The options every benchmark takes: --json, --plot, and --shapes where the benchmark takes shapes
    (``shape_help`` says their form)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows and the environment as JSON")
    ap.add_argument("--plot", help="write a PNG")
    if shape_help is not None:
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
