#!/usr/bin/env python3
"""Where a small FP8 linear step spends its time: host (Python + launch) cost of each piece, GPU
time, and a torch.profiler table. For the fixed per-call cost that dominates small layers.

    python -m tools.profile_linear [--backend cublas] [--shape 4096x4096x4096] [--trace out.json]
    python -m tools.profile_linear --op-overhead      # any machine, no GPU needed
    python -m tools.profile_linear --breakdown        # host time of each backend call inside the op

Host cost is measured on a tiny problem (256x256x256: the GPU finishes each kernel long before the
CPU launches the next one), as wall time per call without synchronising, over many calls.
``--op-overhead`` measures the autograd op's own Python (linear.py, recipe, tensor checks) on the CPU,
with a backend whose five operations return precomputed results at once.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.benchlib import require_cuda
from primus_fp8_plugin import BlockwiseRecipe, Fp8BlockwiseLinear, get_backend
from primus_fp8_plugin.recipe import TensorRole


def host_us(fn, n: int = 300, warmup: int = 20, cuda: bool = True) -> float:
    """Wall microseconds per call of ``fn``, without synchronising inside the timed loop (on a GPU
    with tiny inputs, so that the GPU is never the bottleneck)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / n * 1e6


def op_overhead_us(s: int = 128, n: int = 2000) -> dict[str, float]:
    """Microseconds per call of ``fp8_blockwise_linear`` on the CPU with an instant backend, and of
    a BF16 ``nn.Linear`` (real CPU GEMMs) for scale."""
    from primus_fp8_plugin import fp8_blockwise_linear

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

    def timed(fn) -> float:
        return host_us(fn, n, warmup=50, cuda=False)

    def ours_step():
        w.grad = None
        fp8_blockwise_linear(x, w, backend=instant).backward(dy)

    def bf16_step():
        bf16.weight.grad = None
        bf16(x).backward(dy)

    return {
        "ours forward (instant backend)": timed(lambda: fp8_blockwise_linear(x, w, backend=instant)),
        "ours forward+backward (instant backend)": timed(ours_step),
        "bf16 nn.Linear forward+backward (real CPU GEMMs)": timed(bf16_step),
    }


class TimedBackend:
    """Delegates to a backend and adds up the wall time of each of its five operations, in whichever
    thread calls them (forward: the caller's; backward: autograd's device thread)."""

    OPS = ("quantize_act", "quantize_weight", "gemm_fwd", "gemm_dgrad", "gemm_wgrad")

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.totals = dict.fromkeys(self.OPS, 0.0)
        for op in self.OPS:
            setattr(self, op, self._timed(op, getattr(inner, op)))

    def _timed(self, op, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.totals[op] += time.perf_counter() - t0
            return out

        return call


def breakdown_us(backend: str, s: int = 256, n: int = 300) -> dict[str, float]:
    """Host microseconds per fwd+bwd step of the real op (cached weight) split into: the forward call,
    the backward call, and inside them each backend operation; the rest is the op's Python, autograd
    and thread hand-offs. Tiny problem, so the GPU never holds the host back."""
    from primus_fp8_plugin import fp8_blockwise_linear
    from primus_fp8_plugin.backends import Backend
    from primus_fp8_plugin.weight_cache import WeightCache

    timed = TimedBackend(get_backend(backend, torch.device("cuda")))
    Backend.register(type(timed))  # a virtual subclass: fp8_blockwise_linear takes it as a backend
    x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(s, s, device="cuda", dtype=torch.bfloat16))
    dy = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    cache = WeightCache()
    fwd_t = bwd_t = 0.0
    for i in range(n + 20):
        if i == 20:
            torch.cuda.synchronize()
            timed.totals = dict.fromkeys(timed.OPS, 0.0)
            fwd_t = bwd_t = 0.0
        w.grad = None
        t0 = time.perf_counter()
        y = fp8_blockwise_linear(x, w, backend=timed, weight_cache=cache)
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        fwd_t, bwd_t = fwd_t + t1 - t0, bwd_t + t2 - t1
    torch.cuda.synchronize()
    out = {"forward call": fwd_t, "backward call": bwd_t}
    out.update({f"  in them: {op}": t for op, t in timed.totals.items()})
    out["  in them: everything else"] = fwd_t + bwd_t - sum(timed.totals.values())
    return {k: v / n * 1e6 for k, v in out.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="cublas")
    ap.add_argument("--shape", default="4096x4096x4096", help="MxNxK for the profiler table")
    ap.add_argument("--trace", help="write a chrome trace (with Python stacks) of three tiny fwd+bwd steps")
    ap.add_argument("--op-overhead", action="store_true", help="the op's own Python on the CPU (no GPU needed)")
    ap.add_argument("--breakdown", action="store_true", help="host time of each backend call inside the op (GPU)")
    args = ap.parse_args()
    if args.op_overhead:
        print("host cost per call of the autograd op with an instant backend, 128x128x128, CPU:")
        for name, us in op_overhead_us().items():
            print(f"  {name:50s} {us:8.1f} us")
        return 0
    if not require_cuda("profile_linear"):
        return 2
    if args.breakdown:
        print(f"host time per fwd+bwd step of the op, {args.backend} backend, 256^3, cached weight:")
        for name, us in breakdown_us(args.backend).items():
            print(f"  {name:40s} {us:8.1f} us")
        return 0
    be = get_backend(args.backend, torch.device("cuda"))
    recipe = BlockwiseRecipe()
    p_in, p_w, p_dy = (recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))

    s = 256
    x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    xq = be.quantize_act(x.detach(), p_in, rowwise=True, columnwise=True)
    wq = be.quantize_weight(w, p_w)
    dyq = be.quantize_act(dy, p_dy, rowwise=True, columnwise=True)
    ours = Fp8BlockwiseLinear(s, s, bias=False, device="cuda", dtype=torch.bfloat16, backend=args.backend)
    bf16 = torch.nn.Linear(s, s, bias=False, device="cuda", dtype=torch.bfloat16)

    def step(layer, first):
        def f():
            layer.weight.grad = None
            if first is not None:
                layer.is_first_microbatch = first
            layer(x).backward(dy)

        return f

    pieces = {
        "torch.empty x4": lambda: [torch.empty(s, s, device="cuda") for _ in range(4)],
        "recipe.params x3": lambda: [recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT)],
        "quantize_act (dual)": lambda: be.quantize_act(x.detach(), p_in, rowwise=True, columnwise=True),
        "quantize_weight": lambda: be.quantize_weight(w, p_w),
        "gemm_fwd": lambda: be.gemm_fwd(xq, wq, None, torch.bfloat16),
        "gemm_dgrad": lambda: be.gemm_dgrad(dyq, wq, torch.bfloat16),
        "gemm_wgrad": lambda: be.gemm_wgrad(dyq, xq, torch.bfloat16, None),
        "ours fwd (cached w)": lambda: ours(x),
        "ours fwd+bwd (cached w)": step(ours, False),
        "ours fwd+bwd (fresh w)": step(ours, True),
        "bf16 nn.Linear fwd+bwd": step(bf16, None),
    }

    def in_backward(work):
        """fwd+bwd of an identity autograd op whose backward runs ``work``: the cost of a piece when
        it runs in autograd's device thread, as the real backward does."""

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.view_as(t)

            @staticmethod
            def backward(ctx, g):
                work()
                return g

        return lambda: Probe.apply(x).backward(dy)

    from primus_fp8_plugin.backends.triton.launch import FastLauncher

    def plain_launch(work):
        def f():
            FastLauncher.enabled = False
            try:
                work()
            finally:
                FastLauncher.enabled = True

        return f

    pieces["quantize_act, plain kernel[grid]"] = plain_launch(pieces["quantize_act (dual)"])
    pieces.update(
        {
            "autograd probe: nothing": in_backward(lambda: None),
            "autograd probe: quantize_act, plain": in_backward(plain_launch(pieces["quantize_act (dual)"])),
            "autograd probe: quantize_act": in_backward(pieces["quantize_act (dual)"]),
            "autograd probe: gemm_dgrad": in_backward(pieces["gemm_dgrad"]),
            "autograd probe: gemm_wgrad": in_backward(pieces["gemm_wgrad"]),
            "autograd probe: torch.empty x4": in_backward(pieces["torch.empty x4"]),
        }
    )
    print(f"host cost per call, {args.backend} backend, {s}x{s}x{s} ({torch.cuda.get_device_name()}):")
    for name, fn in pieces.items():
        print(f"  {name:28s} {host_us(fn):8.1f} us")

    if args.trace:  # Python-level trace of a few tiny steps: where the host time goes
        from torch.profiler import ProfilerActivity, profile

        f = step(ours, False)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(3):
                f()
            torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)

    m, n, k = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    big = Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=args.backend)
    f = step(big, True)
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            f()
        torch.cuda.synchronize()
    print(f"\ntorch.profiler, 5 steps of {m}x{n}x{k} (fresh weight), by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print("by device time:")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
