"""Where one profiled training step spends the GPU's time: the share of the step in which a kernel runs, and the
kernel time by category, from a PyTorch profiler chrome trace (``torch.profiler``'s ``export_chrome_trace``;
Megatron-LM's ``--profile --use-pytorch-profiler`` writes one).

* the step: the last ``ProfilerStep#N`` span of the trace (the CPU's view of the iteration), extended to the end of
  the last kernel that starts inside it (the GPU finishes after the CPU has queued everything);
* busy: the union of the kernels' intervals inside the step (overlapping kernels, e.g. on two streams, count once),
  over the step's length;
* categories (``kernel_category``, first matching rule wins): GEMM, attention, quantization, permutation,
  elementwise, optimizer, communication, other; each with its kernels' summed durations (overlaps counted in each)
  and count.

    python benchmarks/kernel_profile.py TRACE.json[.gz]
"""

from __future__ import annotations

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


def step_profile(events: list[dict]) -> dict:
    """Busy share and time by category of the last profiled step of ``events`` (module docstring). Times in ms."""
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
    return {"step": int(STEP_RE.match(step["name"]).group(1)), "step_ms": length, "busy_ms": busy / 1000.0,
            "busy_share": busy / (t1 - t0) if t1 > t0 else 0.0, "kernels": len(kernels), "by_category": by_cat}  # fmt: skip


def format_profile(summary: dict) -> str:
    """A few lines for a benchmark's log: busy share, then each category's ms, share of the kernel time, count."""
    total = sum(c["ms"] for c in summary["by_category"].values()) or 1.0
    lines = [f"step {summary['step']}: {summary['step_ms']:.1f} ms, GPU busy {100 * summary['busy_share']:.1f}% "
             f"({summary['busy_ms']:.1f} ms, {summary['kernels']} kernels)"]  # fmt: skip
    for name, c in sorted(summary["by_category"].items(), key=lambda kv: -kv[1]["ms"]):
        if c["kernels"]:
            lines.append(f"  {name:<13} {c['ms']:9.2f} ms  {100 * c['ms'] / total:5.1f}%  {c['kernels']:6d} kernels")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    print(format_profile(step_profile(load_trace(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
