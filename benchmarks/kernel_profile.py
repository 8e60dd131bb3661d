"""Where one profiled training step spends the GPU's time: the share of the step in which a kernel runs, and the
kernel time by category, from a PyTorch profiler chrome trace (``torch.profiler``'s ``export_chrome_trace``;
Megatron-LM's ``--profile --use-pytorch-profiler`` writes one).

* the step: the last ``ProfilerStep#N`` span of the trace (the CPU's view of the iteration), extended to the end of
  the last kernel that starts inside it (the GPU finishes after the CPU has queued everything);
* busy: the union of the kernels' intervals inside the step (overlapping kernels, e.g. on two streams, count once),
  over the step's length;
* categories (``kernel_category``, first matching rule wins): GEMM, attention, quantization, permutation,
  elementwise, optimizer, communication, other; each with its kernels' summed durations (overlaps counted in each)
  and count;
* idle (``idle_by_host_frame``): where no kernel runs, what the host was doing. Each idle gap is charged to the
  thread that launched the kernel ending the gap (the step's thread after the last kernel), at the gap's middle:
  its innermost host event there (a Python frame, an aten op, a CUDA runtime call such as a synchronisation) with
  up to two enclosing Python frames; the gaps are summed by that chain. A step with many short gaps under the
  same chain is host-bound in that code.

* kernels by name: the most launched ones; given two traces (A and B), the names launched a different number of
  times in B's step than in A's, by the difference.

    python benchmarks/kernel_profile.py TRACE.json[.gz]
    python benchmarks/kernel_profile.py TRACE_A.json[.gz] TRACE_B.json[.gz]
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import sys
from pathlib import Path

# (category, pattern over the kernel's name, case-insensitive): the first that matches names the category
RULES: tuple[tuple[str, str], ...] = (
    ("communication", r"nccl|rccl|all_?reduce|all_?gather|reduce_?scatter|alltoall"),
    ("optimizer", r"multi_tensor|adam|l2norm|sgd_|lamb(?!da)"),  # not the {lambda()#1} of torch's kernel names
    ("attention", r"flash|fmha|attn|attention|sdpa|cudnn_generated"),
    # GEMMs before quantization: FP8 GEMM kernels often name their input type
    ("GEMM", r"gemm|wgmma|cutlass|xmma|nvjet|matmul|_mm_|cublas|hipblas|tensile|wgrad|dgrad|grouped_fwd"),
    ("quantization", r"quantiz|cast_transpose|fp8|amax|scale_inv"),
    ("permutation", r"permut|index|scatter|gather|sort|masked_select|nonzero|unique|topk|radix|embedding"),
    ("elementwise", r"elementwise|vectorized|reduce|norm|copy|cat|fill|silu|swiglu|gelu|rope|softmax|add|mul|"
                    r"apply_kernel|stats_kernel|column_sum"),
)
CATEGORIES = tuple(dict.fromkeys([c for c, _ in RULES] + ["other"]))
_COMPILED = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in RULES)
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")


def kernel_category(name: str) -> str:
    """The category of a GPU kernel by its name (``RULES``), ``"other"`` where no rule matches."""
    for category, rx in _COMPILED:
        if rx.search(name):
            return category
    return "other"


def load_trace(path: str | Path) -> list[dict]:
    """The events of a chrome trace (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def find_trace(root: str | Path) -> Path | None:
    """The newest chrome trace under ``root`` (Megatron-LM writes ``torch_profile/rank-0.json.gz`` next to the
    TensorBoard directory; ``tensorboard_trace_handler`` writes ``*.pt.trace.json[.gz]``)."""
    found = [p for pat in ("**/rank-0.json.gz", "**/*.pt.trace.json", "**/*.pt.trace.json.gz") for p in Path(root).glob(pat)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


HOST_CATS = ("python_function", "cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")


def _idle_gaps(kernels: list[tuple[float, float]], t0: float, t1: float) -> list[tuple[float, float]]:
    """The sub-intervals of [t0, t1] where none of ``kernels`` (start, end) runs."""
    gaps, end = [], t0
    for a, b in sorted(kernels):
        if a > end:
            gaps.append((end, min(a, t1)))
        end = max(end, b)
    if end < t1:
        gaps.append((end, t1))
    return [(a, b) for a, b in gaps if b > a]


class _HostThread:
    """One thread's host events (start, end, category, name), nested as the profiler records them: ``parent[i]`` is
    the innermost event enclosing event ``i`` (-1 for none)."""

    def __init__(self, frames: list[tuple[float, float, str, str]]) -> None:
        self.frames = sorted(frames, key=lambda f: (f[0], -f[1]))
        self.starts = [f[0] for f in self.frames]
        self.parent, stack = [], []
        for i, (a, _, _, _) in enumerate(self.frames):
            while stack and self.frames[stack[-1]][1] <= a:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def chain(self, at: float, depth: int = 3) -> str:
        """``outer > ... > innermost``: the innermost event containing ``at``, then the Python frames enclosing it,
        ``depth`` names at most; "" where no event contains ``at``."""
        i = bisect.bisect_right(self.starts, at) - 1
        while i >= 0 and not self.frames[i][1] > at:
            i = self.parent[i]
        names = []
        while i >= 0 and len(names) < depth:
            if not names or self.frames[i][2] == "python_function":
                names.append(self.frames[i][3])
            i = self.parent[i]
        return " > ".join(reversed(names))


def idle_by_host_frame(events: list[dict], t0: float, t1: float, step_tid, top: int = 12) -> list[dict]:
    """The idle gaps of [t0, t1] (us) summed by the host chain charged with them (module docstring), largest
    first: ``[{"chain", "idle_ms", "gaps"}]``, ``top`` entries at most."""
    kernels = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("args", {}).get("correlation"))
                     for e in events if e.get("ph") == "X" and e.get("cat") == "kernel")  # fmt: skip
    launcher = {e.get("args", {}).get("correlation"): e.get("tid") for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    frames: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_CATS and not STEP_RE.match(str(e.get("name", ""))):
            a = float(e["ts"])
            frames.setdefault(e.get("tid"), []).append((a, a + float(e.get("dur", 0)), e["cat"], str(e["name"])))
    threads = {tid: _HostThread(f) for tid, f in frames.items()}
    kernel_starts = [k[0] for k in kernels]
    totals: dict[str, list] = {}
    for a, b in _idle_gaps([(k[0], k[1]) for k in kernels], t0, t1):
        j = bisect.bisect_left(kernel_starts, b)
        tid = launcher.get(kernels[j][2], step_tid) if j < len(kernels) else step_tid
        thread = threads.get(tid)
        chain = (thread.chain((a + b) / 2) if thread else "") or "(no host event)"
        entry = totals.setdefault(chain, [0.0, 0])
        entry[0] += (b - a) / 1000.0
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"chain": c, "idle_ms": ms, "gaps": n} for c, (ms, n) in ranked]


def kernels_by_name(kernels: list[dict], top: int = 15) -> list[dict]:
    """The kernels' names by how often they ran, most first: ``[{"name", "count", "ms"}]``, ``top`` entries at
    most (``top=0``: every name)."""
    table: dict[str, list] = {}
    for k in kernels:
        entry = table.setdefault(str(k.get("name", "")), [0, 0.0])
        entry[0] += 1
        entry[1] += float(k["dur"]) / 1000.0
    ranked = sorted(table.items(), key=lambda kv: (-kv[1][0], kv[0]))
    return [{"name": n, "count": c, "ms": ms} for n, (c, ms) in (ranked[:top] if top else ranked)]


def compare_kernels(a: dict, b: dict, top: int = 15) -> list[dict]:
    """Per kernel name, how many more times it ran in profile ``b`` than in ``a`` (two ``step_profile`` results
    made with ``top_names=0``), largest differences first: ``[{"name", "a", "b", "diff", "ms_diff"}]``."""
    ka, kb = ({k["name"]: k for k in p["top_kernels"]} for p in (a, b))
    rows = []
    for name in ka.keys() | kb.keys():
        x, y = ka.get(name, {"count": 0, "ms": 0.0}), kb.get(name, {"count": 0, "ms": 0.0})
        if x["count"] != y["count"]:
            rows.append({"name": name, "a": x["count"], "b": y["count"], "diff": y["count"] - x["count"],
                         "ms_diff": y["ms"] - x["ms"]})  # fmt: skip
    return sorted(rows, key=lambda r: (-abs(r["diff"]), r["name"]))[:top]


def step_profile(events: list[dict], top_names: int = 15) -> dict:
    """Busy share and time by category of the last profiled step of ``events`` (module docstring), and its
    ``top_names`` most frequent kernel names (0: all). Times in ms."""
    steps = [e for e in events if e.get("ph") == "X" and STEP_RE.match(str(e.get("name", "")))]
    if not steps:
        raise ValueError("the trace holds no ProfilerStep#N span: profile with torch.profiler's schedule (prof.step())")
    step = max(steps, key=lambda e: float(e["ts"]))
    t0, cpu_end = float(step["ts"]), float(step["ts"]) + float(step["dur"])
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and t0 <= float(e["ts"]) <= cpu_end]
    t1 = max([cpu_end] + [float(k["ts"]) + float(k["dur"]) for k in kernels])
    busy = _union_length([(float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels])
    by_cat = {c: {"ms": 0.0, "kernels": 0} for c in CATEGORIES}
    for k in kernels:
        c = by_cat[kernel_category(str(k.get("name", "")))]
        c["ms"] += float(k["dur"]) / 1000.0
        c["kernels"] += 1
    length = (t1 - t0) / 1000.0
    inside = [e for e in events if e.get("ph") == "X" and t0 <= float(e["ts"]) <= t1]
    return {"step": int(STEP_RE.match(step["name"]).group(1)), "step_ms": length, "busy_ms": busy / 1000.0,
            "busy_share": busy / (t1 - t0) if t1 > t0 else 0.0, "kernels": len(kernels), "by_category": by_cat,
            "idle_by_host_frame": idle_by_host_frame(inside, t0, t1, step.get("tid")),
            "top_kernels": kernels_by_name(kernels, top_names)}  # fmt: skip


def format_profile(summary: dict) -> str:
    """A few lines for a benchmark's log: busy share, then each category's ms, share of the kernel time, count."""
    total = sum(c["ms"] for c in summary["by_category"].values()) or 1.0
    lines = [f"step {summary['step']}: {summary['step_ms']:.1f} ms, GPU busy {100 * summary['busy_share']:.1f}% "
             f"({summary['busy_ms']:.1f} ms, {summary['kernels']} kernels)"]  # fmt: skip
    for name, c in sorted(summary["by_category"].items(), key=lambda kv: -kv[1]["ms"]):
        if c["kernels"]:
            lines.append(f"  {name:<13} {c['ms']:9.2f} ms  {100 * c['ms'] / total:5.1f}%  {c['kernels']:6d} kernels")
    names = (summary.get("top_kernels") or [])[:8]
    if names:
        lines.append("  most launched kernels:")
        lines += [f"  {k['count']:6d} x {k['ms']:9.2f} ms  {k['name'][:140]}" for k in names]
    idle = summary.get("idle_by_host_frame") or []
    if idle:
        lines.append(f"  GPU idle {summary['step_ms'] - summary['busy_ms']:.1f} ms; the host meanwhile (launching thread):")
        lines += [f"  {i['idle_ms']:9.2f} ms {i['gaps']:6d} gaps  {i['chain'][-150:]}" for i in idle]
    return "\n".join(lines)


def format_comparison(rows: list[dict]) -> str:
    """``compare_kernels``'s rows as lines: count in A, in B, the difference, the time difference, the name."""
    lines = ["kernels launched a different number of times (A -> B, difference, ms difference):"]
    lines += [f"  {r['a']:6d} -> {r['b']:6d} {r['diff']:+7d} {r['ms_diff']:+9.2f} ms  {r['name'][:140]}" for r in rows]
    return "\n".join(lines if rows else ["every kernel name ran as often in both steps"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print("\n".join(__doc__.strip().splitlines()[-2:]), file=sys.stderr)
        return 2
    profiles = [step_profile(load_trace(path), top_names=0) for path in argv]
    for path, profile in zip(argv, profiles):
        print(f"{path}:\n{format_profile(profile)}")
    if len(profiles) == 2:
        print(format_comparison(compare_kernels(*profiles)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
