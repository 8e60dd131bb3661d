#!/usr/bin/env python
"""Host (CPU) cost of an FP8 linear layer's step, piece by piece: where the fixed per-call cost of
small and medium layers goes, and whether a step is host-bound.

    python -m tools.profile_linear [--backend cublas] [--shape 4096x4096x4096] [--steps 200] [--top 25]
    python -m tools.profile_linear --probes            # + what a piece costs in autograd's thread, plain launches
    python -m tools.profile_linear --breakdown [--cached-weight]   # only (b)
    python -m tools.profile_linear --torch-profiler [--trace out.json]
    python -m tools.profile_linear --ab-hints 15       # launch hints on / off, interleaved
    python -m tools.profile_linear --ab-backends cublas,hopper,triton,bf16 --shape 2048x1024x1024
    python -m tools.profile_linear --op-overhead       # any machine, no GPU: the op's own Python

On a GPU, by default:
(a) the host time per call of each piece (median over 10 batches of 20 calls; no synchronisation
    inside a batch, so the GPU queue absorbs the launches);
(b) the host time of each part inside eager steps: the layer's forward and backward calls and, inside
    them, each backend operation (timed by wrapping the backend's methods, ~1 us each) and what is
    left around them (the op's Python, autograd, thread hand-offs); the weight is refreshed every
    step as in bench_linear's "step", or cached with ``--cached-weight``;
(c) a cProfile of whole eager steps sorted by own time: which Python functions the host time goes to.
``--probes`` adds pieces that isolate costs: the same call inside an autograd backward (autograd's
device thread, as the real backward runs), and a quantizer launched through ``kernel[grid]`` instead
of the compiled handle (launch.py). ``--torch-profiler``: torch.profiler tables of 5 steps by self CPU
and device time, and with ``--trace`` a chrome trace (with Python stacks) of three steps.
``--ab-hints N`` / ``--ab-backends A,B,..`` print only an interleaved A/B of eager steps (launch
hints on and off; one layer per backend, ``bf16`` = torch's nn.Linear), with BF16 as the anchor.
``--op-overhead`` measures the autograd op's own Python on the CPU (linear.py, recipe, tensor
checks), with a backend whose five operations return precomputed results at once.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from primus_fp8_plugin import BlockwiseRecipe, Fp8BlockwiseLinear, fp8_blockwise_linear, get_backend
from primus_fp8_plugin.recipe import TensorRole

OPS = ("quantize_act", "quantize_weight", "gemm_fwd", "gemm_dgrad", "gemm_wgrad")


def _middle(values: list[float]) -> float:
    """The median (the upper middle value of an even count)."""
    return sorted(values)[len(values) // 2]


def host_us(fn, calls: int = 20, batches: int = 10) -> float:
    """Median over batches of the host time per call of ``fn`` (us); the GPU is synchronised
    between batches, never inside one."""
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return _middle(per)


def cpu_us(fn, n: int, warmup: int) -> float:
    """Wall microseconds per call of ``fn`` on the CPU, over ``n`` calls."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def op_overhead_us(s: int = 128, n: int = 2000) -> dict[str, float]:
    """Microseconds per call of ``fp8_blockwise_linear`` on the CPU with an instant backend, and of
    a BF16 ``nn.Linear`` (real CPU GEMMs) for scale."""
    ref = get_backend("reference", torch.device("cpu"))
    recipe = BlockwiseRecipe()
    x = torch.randn(s, s, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(s, s, dtype=torch.bfloat16))
    dy = torch.randn(s, s, dtype=torch.bfloat16)
    xq = ref.quantize_act(x.detach(), recipe.params(TensorRole.INPUT), rowwise=True, columnwise=True)
    wq = ref.quantize_weight(w.detach(), recipe.params(TensorRole.WEIGHT))
    y = ref.gemm_fwd(xq, wq, None, torch.bfloat16)

    class Instant(type(ref)):
        name = "instant"

        def quantize_act(self, x, params, *, rowwise, columnwise):
            return xq

        def quantize_weight(self, w, params):
            return wq

        def gemm_fwd(self, *args):
            return y.clone()

        def gemm_dgrad(self, *args):
            return y.clone()

        def gemm_wgrad(self, *args):
            return y.clone()

    instant, bf16 = Instant(), torch.nn.Linear(s, s, bias=False, dtype=torch.bfloat16)

    def ours_step():
        w.grad = None
        fp8_blockwise_linear(x, w, backend=instant).backward(dy)

    def bf16_step():
        bf16.weight.grad = None
        bf16(x).backward(dy)

    return {
        "ours forward (instant backend)": cpu_us(lambda: fp8_blockwise_linear(x, w, backend=instant), n, 50),
        "ours forward+backward (instant backend)": cpu_us(ours_step, n, 50),
        "bf16 nn.Linear forward+backward (real CPU GEMMs)": cpu_us(bf16_step, n, 50),
    }


def step_breakdown(layer, backend, x, dy, steps: int, refresh: bool = True) -> dict[str, float]:
    """Host time of each part of eager steps (median over ``steps``, us): the layer's forward and
    backward calls, and inside them the backend's calls. The steps run back to back, synchronised
    every 10 steps so that the launch queue never fills. The backward's own Python runs on
    autograd's device thread; it is timed from the calling thread as ``backward()``'s duration."""
    originals = {n: getattr(backend, n) for n in OPS}
    phase = ["forward"]
    spent: dict[str, float] = {}

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                key = f"{phase[0]}: {name}"
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

        return call

    for n in OPS:
        setattr(backend, n, timed(n, originals[n]))
    rows: dict[str, list[float]] = {}
    try:
        for i in range(steps + 5):
            spent.clear()
            layer.weight.grad = None
            layer.is_first_microbatch = refresh
            phase[0] = "forward"
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            phase[0] = "backward"
            y.backward(dy)
            t2 = time.perf_counter()
            if i % 10 == 0:
                torch.cuda.synchronize()
            if i < 5:
                continue
            sample = {"step": t2 - t0, "forward": t1 - t0}
            sample.update({k: v for k, v in spent.items() if k.startswith("forward")})
            sample["forward: the rest"] = (t1 - t0) - sum(v for k, v in spent.items() if k.startswith("forward"))
            sample["backward"] = t2 - t1
            sample.update({k: v for k, v in spent.items() if k.startswith("backward")})
            sample["backward: the rest"] = (t2 - t1) - sum(v for k, v in spent.items() if k.startswith("backward"))
            for k, v in sample.items():
                rows.setdefault(k, []).append(v)
    finally:
        for n in OPS:
            delattr(backend, n)  # back to the class's methods
    return {k: _middle(v) * 1e6 for k, v in rows.items()}


def per_step(fn, calls=20) -> float:
    """Wall time per call (us) of ``calls`` calls issued back to back, synchronised before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def ab(steps: dict, rounds: int) -> None:
    """Eager steps of each contender, interleaved (batches of 20 steps, the order reversed every other
    round), so that the host's drift hits all alike. Wall time per step, host-bound at small shapes."""
    for fn in steps.values():
        per_step(fn, 3)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(per_step(steps[name]))
    print(f"eager step wall time (us), {rounds} interleaved rounds of 20 steps: median [min, max]")
    for name, v in times.items():
        print(f"  {name:16} {_middle(v):8.1f}  [{min(v):.1f}, {max(v):.1f}]")


def with_hints(use: bool, fn):
    """``fn`` run with the launch hints (launch.py) on or off."""
    from primus_fp8_plugin.kernels.triton.launch import launch_settings

    def run():
        with launch_settings(hints=use):
            fn()

    return run


def plain_launch(fn):
    """``fn`` with every kernel launched through ``kernel[grid]`` (JITFunction.run) instead of the
    compiled handle (launch.py)."""
    from primus_fp8_plugin.kernels.triton.launch import launch_settings

    def run():
        with launch_settings(fast=False):
            fn()

    return run


def in_backward(work, x, dy):
    """fwd+bwd of an identity autograd op whose backward runs ``work``: the cost of a piece when it
    runs in autograd's device thread, as the real backward does."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            work()
            return g

    return lambda: Probe.apply(x).backward(dy)


def torch_profiler_tables(run, trace: str | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    if trace:  # Python-level trace of a few steps: where the host time goes
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        prof.export_chrome_trace(trace)
        print(f"wrote {trace}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print("torch.profiler, 5 steps (weight refreshed), by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print("by device time:")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="4096x4096x4096", help="MxNxK")
    ap.add_argument("--backend", default="cublas")
    ap.add_argument("--steps", type=int, default=200, help="steps of the breakdown and the cProfile")
    ap.add_argument("--top", type=int, default=25, help="functions the cProfile lists")
    ap.add_argument("--probes", action="store_true", help="add the autograd-thread and plain-launch pieces to (a)")
    ap.add_argument("--breakdown", action="store_true", help="only (b), the host time inside steps")
    ap.add_argument("--cached-weight", action="store_true", help="(b) with the weight cached instead of refreshed")
    ap.add_argument("--torch-profiler", action="store_true", help="only torch.profiler tables of 5 steps")
    ap.add_argument("--trace", help="with --torch-profiler: write a chrome trace (with Python stacks) of 3 steps")
    ap.add_argument("--ab-hints", type=int, default=0, metavar="ROUNDS",
                    help="only an A/B of launch hints (LaunchSettings.hints) on eager steps, ROUNDS rounds")  # fmt: skip
    ap.add_argument("--ab-backends", default="", metavar="A,B,...",
                    help="only an A/B of these backends' eager steps (bf16: torch's nn.Linear), --rounds rounds")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=15, help="rounds of --ab-backends")
    ap.add_argument("--op-overhead", action="store_true", help="the op's own Python on the CPU (no GPU needed)")
    args = ap.parse_args(argv)
    if args.op_overhead:
        print("host cost per call of the autograd op with an instant backend, 128x128x128, CPU:")
        for name, us in op_overhead_us().items():
            print(f"  {name:50s} {us:8.1f} us")
        return 0
    if not torch.cuda.is_available():
        print("tools.profile_linear needs a CUDA GPU (or --op-overhead)")
        return 2
    m, n, k = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)

    def step(lay, first=True):
        def run():
            for p in lay.parameters():
                p.grad = None
            if hasattr(lay, "is_first_microbatch"):
                lay.is_first_microbatch = first
            lay(x).backward(dy)

        return run

    def fp8_layer(name):
        return Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=name)

    if args.ab_backends:  # nothing else: no --backend layer
        names = [b.strip() for b in args.ab_backends.split(",") if b.strip()]
        ab({name: step(bf16) if name == "bf16" else step(fp8_layer(name)) for name in names}, args.rounds)
        return 0
    layer = fp8_layer(args.backend)
    if args.ab_hints:
        ours = step(layer)
        ab({"hints on": with_hints(True, ours), "hints off": with_hints(False, ours), "bf16 nn.Linear": step(bf16)},
           args.ab_hints)  # fmt: skip
        return 0
    if args.torch_profiler:
        print(f"{m}x{n}x{k}, backend {args.backend}, {torch.cuda.get_device_name()}")
        torch_profiler_tables(step(layer), args.trace)
        return 0
    backend = get_backend(args.backend, torch.device("cuda"))
    what = "cached weight" if args.cached_weight else "weight refreshed"
    if not args.breakdown:
        recipe = BlockwiseRecipe()
        p_in, p_w, p_g = (recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))
        xd = x.detach()
        xq = backend.quantize_act(xd, p_in, rowwise=True, columnwise=True)
        wq = backend.quantize_weight(layer.weight.detach(), p_w)
        dyq = backend.quantize_act(dy, p_g, rowwise=True, columnwise=True)
        pieces = {
            "quantize_act (x, row+col)": lambda: backend.quantize_act(xd, p_in, rowwise=True, columnwise=True),
            "quantize_weight": lambda: backend.quantize_weight(layer.weight.detach(), p_w),
            "gemm_fwd": lambda: backend.gemm_fwd(xq, wq, None, torch.bfloat16),
            "gemm_dgrad": lambda: backend.gemm_dgrad(dyq, wq, torch.bfloat16),
            "gemm_wgrad": lambda: backend.gemm_wgrad(dyq, xq, torch.bfloat16, None),
            "layer forward (cached weight)": lambda: layer(x),
            "step: fwd+bwd, weight refreshed": step(layer, True),
            "step: fwd+bwd, cached weight": step(layer, False),
            "bf16 nn.Linear step": step(bf16),
        }
        if args.probes:
            pieces.update({
                "torch.empty x4": lambda: [torch.empty(m, k, device="cuda") for _ in range(4)],
                "recipe.params x3": lambda: [recipe.params(r) for r in TensorRole],
                "quantize_act, plain kernel[grid]": plain_launch(pieces["quantize_act (x, row+col)"]),
                "autograd probe: nothing": in_backward(lambda: None, x, dy),
                "autograd probe: quantize_act": in_backward(pieces["quantize_act (x, row+col)"], x, dy),
                "autograd probe: quantize_act, plain": in_backward(plain_launch(pieces["quantize_act (x, row+col)"]), x, dy),
                "autograd probe: gemm_dgrad": in_backward(pieces["gemm_dgrad"], x, dy),
                "autograd probe: gemm_wgrad": in_backward(pieces["gemm_wgrad"], x, dy),
            })  # fmt: skip
        print(f"(a) host time per call, {m}x{n}x{k}, backend {args.backend}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name()}")  # fmt: skip
        for name, fn in pieces.items():
            print(f"  {name:38} {host_us(fn):8.1f} us", flush=True)
        print()

    print(f"(b) inside a step (fwd+bwd, {what}), host us per step, median of {args.steps} steps:")
    for name, us in step_breakdown(layer, backend, x, dy, args.steps, refresh=not args.cached_weight).items():
        print(f"  {name:38} {us:8.1f} us")
    if args.breakdown:
        return 0

    run = step(layer, True)
    run()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        run()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"\n(c) cProfile of {args.steps} steps (fwd+bwd, weight refreshed), by own time:")
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
