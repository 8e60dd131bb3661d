"""Shared helpers of the benchmark scripts: timing, environment facts, tables, JSON and plots."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
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
