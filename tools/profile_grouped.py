#!/usr/bin/env python
"""Where one grouped expert linear's forward + backward goes on the GPU: host time against GPU time, and the GPU
time by kernel, for each expert weight layout (one weight per expert; one ``[E, N, K]`` weight).

    python -m tools.profile_grouped [--experts 128] [--tokens-per-expert 256] [--k 2048] [--n 1536]
                                    [--backend triton] [--top 12] [--trace-dir DIR]

The layer is ``Fp8GroupedLinear`` with an fp32 ``main_grad`` per weight (Megatron's DDP protocol), device-side
counts (balanced routing) and cached weights, as ``benchmarks/bench_grouped.py --main-grad --device-counts`` times
it. Printed per layout:

* ``wall``: ms per step over 50 steps back to back (one synchronisation at the end); ``host enqueue``: the host's
  ms per step inside them; both for the cached and the fresh (re-quantized) weight. Host time about the wall time
  means host-bound only where the GPU's work per step (below) is clearly less: a GPU-bound loop also makes the host
  wait, once the launch queue is full;
* ``cached events``: CUDA events around 20 cached steps, per step;
* ``kernels per step``: from a ``torch.profiler`` trace of two cached steps (the GPU idle at its start and end),
  each kernel name's launches and ms per step, and their sum (the GPU's work per step; the rest of the wall time
  is the GPU waiting for the host).

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from primus_fp8_plugin import Fp8GroupedLinear

ACTIVE_STEPS = 2


def kernels_per_step(trace: Path, steps: int) -> list[tuple[str, float, float]]:
    """(kernel name, launches per step, ms per step) of a chrome trace's kernels over ``steps`` steps, most time
    first."""
    events = json.loads(trace.read_text())["traceEvents"]
    table: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "kernel":
            table[str(e["name"])][0] += 1
            table[str(e["name"])][1] += float(e["dur"]) / 1000.0
    rows = [(name, n / steps, ms / steps) for name, (n, ms) in table.items()]
    return sorted(rows, key=lambda r: -r[2])


def profile_layout(args, single: bool, trace_dir: Path) -> None:
    e, t, k, n = args.experts, args.tokens_per_expert, args.k, args.n
    torch.manual_seed(0)
    x = torch.randn(e * t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(e * t, n, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((e,), t, device="cuda", dtype=torch.int32)
    layer = Fp8GroupedLinear(e, k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=args.backend,
                             single_grouped_weight=single)  # fmt: skip
    for w in layer.weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        w.grad_added_to_main_grad = False
    params = list(layer.parameters())

    def step(first: bool) -> None:
        for p in params:
            p.grad = None
        x.grad = None
        layer.is_first_microbatch = first
        layer(x, counts).backward(dy)

    step(True)
    for _ in range(5):
        step(False)
    torch.cuda.synchronize()
    for label, first in (("cached", False), ("fresh", True)):
        host, t0 = 0.0, time.perf_counter()
        for _ in range(50):
            h0 = time.perf_counter()
            step(first)
            host += time.perf_counter() - h0
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 50 * 1e3
        print(f"single={single} {label}: wall {wall:.3f} ms/step, host enqueue {host / 50 * 1e3:.3f} ms/step", flush=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step(False)
    end.record()
    torch.cuda.synchronize()
    print(f"single={single} cached events: {start.elapsed_time(end) / 20:.3f} ms/step", flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:  # synchronised at both ends: exactly these steps
        for _ in range(ACTIVE_STEPS):
            step(False)
        torch.cuda.synchronize()
    trace = trace_dir / f"grouped_single{int(single)}.json"
    prof.export_chrome_trace(str(trace))
    rows = kernels_per_step(trace, ACTIVE_STEPS)
    total_ms, launches = sum(r[2] for r in rows), sum(r[1] for r in rows)
    print(f"single={single} kernels per step (cached): {total_ms:.3f} ms in {launches:.0f} launches")
    for name, launches, ms in rows[: args.top]:
        print(f"  {launches:5.1f} x {ms:8.3f} ms  {name[:120]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens-per-expert", type=int, default=256)
    ap.add_argument("--k", type=int, default=2048, help="in_features")
    ap.add_argument("--n", type=int, default=1536, help="out_features (Qwen3-30B-A3B's fc1: 2 x 768)")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--top", type=int, default=12, help="kernel names listed per layout")
    ap.add_argument("--trace-dir", type=Path, help="keep the chrome traces here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_grouped needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or Path(tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        for single in (False, True):
            profile_layout(args, single, trace_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
