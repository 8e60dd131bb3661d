"""Where a process's peak of allocated GPU memory falls and what is live there, from a CUDA caching-allocator trace.

    python -m tools.memory_peak SNAPSHOT.pickle [--top 25] [--json out.json] [--plot out.png]

``SNAPSHOT`` is ``torch.cuda.memory._snapshot()`` taken after ``torch.cuda.memory._record_memory_history()`` (the
trace of every allocation and free, with the Python stack of each allocation). ``benchmarks/megatron_lm.py
--memory-peak`` records one per arm through Megatron-LM's ``pretrain_gpt.py`` and prints this report.

The allocated bytes, as requested (the allocator rounds each block up, to 512 bytes or more, so
``torch.cuda.max_memory_allocated`` reads a little higher), are replayed over the trace: ``alloc`` adds a block,
``free_completed`` removes it, as the allocator's own ``allocated_bytes`` counts them, starting from what the end
state and the trace imply was allocated before the trace's first event. At the maximum the report gives:

* ``peak_bytes``; ``start_bytes`` (allocated before the trace's first event) and ``end_bytes`` (the snapshot's live
  blocks);
* ``peak_site``: the allocation that reached the peak (its first frame outside torch, and the phase);
* ``by_site``: the bytes live at the peak by allocation site (the innermost frame outside torch's own files),
  largest first, with the phase each was allocated in; memory allocated before the trace began is one row,
  ``(before the trace)``;
* ``timeline``: ``TIMELINE_POINTS`` to twice as many points ``(event index, the most bytes allocated since the previous
  point)``, for a plot (``--plot``: the timeline with the peak marked, and the largest sites at the peak);
* ``by_phase``: the same bytes by phase, from the stack's outer frames: ``forward`` / ``backward`` (Megatron's
  ``forward_step`` / ``backward_step``, or torch's autograd), ``optimizer`` (``megatron/core/optimizer``),
  ``setup`` (building the model, the optimizer's state), ``other``.

Stacks are Python frames only (``_record_memory_history(stacks="python")``); an allocation made by the autograd
engine's thread in a backward shows the frames of a Python ``backward`` only, and one made there by a built-in
op's backward has no frame at all (``(no stack)``, phase ``other``).
"""

from __future__ import annotations

import argparse
import collections
import json
import pickle
import sys
from pathlib import Path

TIMELINE_POINTS = 2000
"""The report's timeline keeps about this many points: each the most bytes allocated since the previous one."""

TORCH_PARTS = ("/torch/", "/site-packages/torch/", "<frozen")
"""Frames in these files are skipped when naming an allocation's site: the caller outside torch is what allocated."""

PHASE_RULES = (  # (phase, substring of any frame's "file:function"): the first rule that some frame matches wins
    ("optimizer", "megatron/core/optimizer/"),
    ("backward", ":backward_step"),
    ("forward", ":forward_step"),
    ("setup", ":setup_model_and_optimizer"),
    ("backward", ":backward"),
)


def _short(filename: str) -> str:
    """A frame's file from its package root (``.../site-packages/megatron/core/x.py`` -> ``megatron/core/x.py``)."""
    for root in ("primus_fp8_plugin/", "megatron/", "transformer_engine/", "torch/", "benchmarks/", "tools/"):
        at = filename.rfind("/" + root)
        if at >= 0:
            return filename[at + 1 :]
    return filename.rsplit("/", 2)[-1] if "/" in filename else filename


def site_of(frames: list[dict] | None) -> str:
    """``file:line(function)`` of the innermost frame outside torch (frames innermost first, as the allocator records
    them); ``(no stack)`` without frames."""
    if not frames:
        return "(no stack)"
    for f in frames:
        name = str(f.get("filename", ""))
        if not any(p in name for p in TORCH_PARTS):
            return f"{_short(name)}:{f.get('line', '?')}({f.get('name', '?')})"
    f = frames[0]
    return f"{_short(str(f.get('filename', '')))}:{f.get('line', '?')}({f.get('name', '?')})"


def phase_of(frames: list[dict] | None) -> str:
    """The step phase an allocation happened in, from its stack's outer frames (``PHASE_RULES``)."""
    if not frames:
        return "other"
    keys = [f"{_short(str(f.get('filename', '')))}:{f.get('name', '')}" for f in reversed(frames)]
    for phase, needle in PHASE_RULES:
        if any(needle in k for k in keys):
            return phase
    return "other"


def live_blocks(snapshot: dict, device: int = 0) -> dict[int, int]:
    """Address -> requested bytes of the blocks allocated at the snapshot (``segments``' blocks not ``inactive``: a
    block freed while a stream still used it is ``active_pending_free`` until its ``free_completed``; the trace's
    events carry requested sizes too, not the allocator's rounded block sizes)."""
    live = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        addr = seg["address"]
        for block in seg.get("blocks", []):
            if block.get("state", "inactive") != "inactive":  # active_pending_free: freed, no free_completed yet
                live[block.get("address", addr)] = block.get("requested_size", block["size"])
            addr += block["size"]
    return live


def peak_report(snapshot: dict, device: int = 0, top: int = 25, max_entries: int | None = None) -> dict:
    """The report of the module docstring for ``device``'s trace in ``snapshot``; ``max_entries``: the recording's
    limit (its ring buffer drops the oldest events when full: ``trace_full`` then says that the peak is the kept
    window's, which may miss an earlier, higher one)."""
    traces = snapshot.get("device_traces", [])
    raw = len(traces[device]) if device < len(traces) else 0
    events = [e for e in (traces[device] if device < len(traces) else []) if e["action"] in ("alloc", "free_completed")]
    if not events:
        raise ValueError("the snapshot holds no allocation trace: record it with torch.cuda.memory._record_memory_history() "
                         "before the allocations, then take torch.cuda.memory._snapshot()")  # fmt: skip
    end_bytes = sum(live_blocks(snapshot, device).values())
    delta = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in events)
    start_bytes = end_bytes - delta
    current, peak, peak_at = start_bytes, start_bytes, -1
    stride = max(1, len(events) // TIMELINE_POINTS)
    timeline, window_max = [], start_bytes  # (event index, the most allocated in the window ending there)
    for i, e in enumerate(events):
        current += e["size"] if e["action"] == "alloc" else -e["size"]
        window_max = max(window_max, current)
        if current > peak:
            peak, peak_at = current, i
        if i % stride == stride - 1 or i == len(events) - 1:
            timeline.append((i, window_max))
            window_max = current
    live: dict[int, dict] = {}
    freed_before_allocated = 0  # blocks allocated before the trace and freed in it, up to the peak
    for e in events[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif live.pop(e["addr"], None) is None:
            freed_before_allocated += e["size"]
    rows: dict[tuple, list] = collections.defaultdict(lambda: [0, 0])
    phases: dict[str, int] = collections.Counter()
    for e in live.values():
        frames = e.get("frames")
        key = (site_of(frames), phase_of(frames))
        rows[key][0] += e["size"]
        rows[key][1] += 1
        phases[key[1]] += e["size"]
    before = start_bytes - freed_before_allocated
    if before:
        rows[("(before the trace)", "setup")] = [before, 0]
        phases["setup"] += before
    by_site = sorted(([s, p, b, n] for (s, p), (b, n) in rows.items()), key=lambda r: -r[2])
    peak_event = events[peak_at] if peak_at >= 0 else None
    return {
        "peak_bytes": peak,
        "start_bytes": start_bytes,
        "end_bytes": end_bytes,
        "events": len(events),
        "peak_event_index": peak_at,
        "peak_site": None if peak_event is None else site_of(peak_event.get("frames")),
        "peak_phase": None if peak_event is None else phase_of(peak_event.get("frames")),
        "by_phase": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
        "by_site": by_site[:top],
        "other_sites_bytes": sum(r[2] for r in by_site[top:]),
        "timeline": timeline,
        "trace_full": max_entries is not None and raw >= max_entries,
    }


def format_report(report: dict, label: str = "") -> str:
    mib = 2**20
    lines = [f"peak allocated{' ' + label if label else ''}: {report['peak_bytes'] / mib:,.1f} MiB at event "
             f"{report['peak_event_index']} of {report['events']} ({report['peak_phase']}: {report['peak_site']})",
             "by phase: " + ", ".join(f"{k} {v / mib:,.1f}" for k, v in report["by_phase"].items()) + " MiB",
             f"{'MiB':>10}  {'blocks':>6}  {'phase':<9}  allocated at"]  # fmt: skip
    if report.get("trace_full"):
        lines.insert(1, "the trace filled its buffer: this is the peak of the events kept, not necessarily the run's")
    if report.get("max_memory_allocated") is not None:
        lines.insert(1, f"torch.cuda.max_memory_allocated over the run: {report['max_memory_allocated'] / mib:,.1f} MiB "
                        "(rounded block sizes)")  # fmt: skip
    for site, phase, nbytes, count in report["by_site"]:
        lines.append(f"{nbytes / mib:10.1f}  {count:6d}  {phase:<9}  {site}")
    if report["other_sites_bytes"]:
        lines.append(f"{report['other_sites_bytes'] / mib:10.1f}  {'':6}  {'':<9}  (other sites)")
    return "\n".join(lines)


def plot_report(report: dict, path: Path, title: str = "") -> None:
    """A PNG: allocated MiB over the trace's events with the peak marked, and the largest sites live at the peak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    xs, ys = zip(*report["timeline"]) if report["timeline"] else ((), ())
    ax.plot(xs, [y / mib for y in ys], lw=0.8)
    ax.axhline(report["peak_bytes"] / mib, color="tab:red", lw=0.6, ls="--")
    at = max(report["peak_event_index"], 0)
    ax.annotate(f"peak {report['peak_bytes'] / mib:,.1f} MiB ({report['peak_phase']})", (at, report["peak_bytes"] / mib),
                color="tab:red", fontsize=8, ha="right" if at > report["events"] / 2 else "left", va="bottom")  # fmt: skip
    ax.set_xlabel("allocator event")
    ax.set_ylabel("allocated MiB")
    ax.set_title(title or "allocated memory over the trace", fontsize=9)
    rows = report["by_site"][:10][::-1]
    bx.barh(range(len(rows)), [r[2] / mib for r in rows])
    bx.set_yticks(range(len(rows)), [f"{r[0][-48:]} [{r[1]}]" for r in rows], fontsize=6)
    bx.set_xlabel("MiB live at the peak")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot", type=Path, help="a pickle of torch.cuda.memory._snapshot() with its trace")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--top", type=int, default=25, help="allocation sites listed")
    ap.add_argument("--json", type=Path, help="write the report as JSON")
    ap.add_argument("--plot", type=Path, help="write a PNG: allocated memory over the trace, the sites at the peak")
    args = ap.parse_args(argv)
    with args.snapshot.open("rb") as f:
        snapshot = pickle.load(f)
    try:
        report = peak_report(snapshot, args.device, args.top)
    except ValueError as err:
        print(f"memory_peak: {err}", file=sys.stderr)
        return 2
    print(format_report(report, str(args.snapshot)))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot_report(report, args.plot, str(args.snapshot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
