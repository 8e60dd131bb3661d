#!/usr/bin/env python
"""Host (CPU) cost of our FP8 linear layer's step, piece by piece, on a GPU machine.

    python -m tools.profile_linear_host [--shape 4096x4096x4096] [--backend cublas] [--steps 200] [--top 25]
    python -m tools.profile_linear_host --backend triton --ab-hints 15
    python -m tools.profile_linear_host --ab-backends cublas,hopper,triton,bf16 --shape 2048x1024x1024

At 4096^3 the GPU work of a forward+backward step is about 0.5 ms; when the host needs longer to
issue it, the step is host-bound (docs/PERFORMANCE.md, issue 5). This prints
(a) the host time per call of each piece (no synchronisation inside the timed loop: the GPU queue
    absorbs the launches; batches of 20 calls, synchronised between batches),
(b) the host time of each part inside eager steps (the backend's calls and what is left around
    them, forward and backward), and
(c) a cProfile of whole eager steps (forward + backward, weight refreshed as in bench_linear's
    "step"), sorted by own time, to show which Python functions the host time goes to.
With ``--ab-hints N`` it prints only an interleaved A/B of the launch hints (launch.py) instead; with
``--ab-backends A,B,...`` only an interleaved A/B of eager steps of a layer per named backend
(``bf16``: torch's nn.Linear), ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from primus_fp8_plugin import Fp8BlockwiseLinear
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.recipe import BlockwiseRecipe, TensorRole


def _middle(values: list[float]) -> float:
    """The median (the upper middle value of an even count)."""
    return sorted(values)[len(values) // 2]


def host_us(fn, calls: int = 20, batches: int = 10) -> float:
    """Median over batches of the host time per call of ``fn`` (us)."""
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


def step_breakdown(layer, backend, x, dy, steps: int) -> dict[str, float]:
    """Host time of each part of eager steps: the layer's forward and backward calls, and inside them
    the backend's calls (timed by wrapping the backend's methods; a wrapper costs ~1 us). The steps
    run back to back, synchronised every 10 steps so that the launch queue never fills. The
    backward's own Python runs on autograd's device thread; it is timed from the calling thread as
    ``backward()``'s duration."""
    names = ("quantize_act", "quantize_weight", "gemm_fwd", "gemm_dgrad", "gemm_wgrad")
    originals = {n: getattr(backend, n) for n in names}
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

    for n in names:
        setattr(backend, n, timed(n, originals[n]))
    rows: dict[str, list[float]] = {}
    try:
        for i in range(steps + 5):
            spent.clear()
            layer.weight.grad = None
            layer.is_first_microbatch = True
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
        for n in names:
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


def ab_hints(ours, bf16, rounds: int) -> None:
    """Eager steps with and without launch hints, interleaved (batches of 20 steps, synchronised
    between batches), so that the host's drift hits both alike; BF16's step as the anchor. Wall
    time per step, host-bound at small shapes."""
    from primus_fp8_plugin.backends.triton.launch import FastLauncher

    times: dict[str, list[float]] = {"hints on": [], "hints off": [], "bf16 nn.Linear": []}
    before = FastLauncher.use_hints
    try:
        for use in (True, False):
            FastLauncher.use_hints = use
            per_step(ours, 5)
        for _ in range(rounds):
            for name, use in (("hints on", True), ("hints off", False)):
                FastLauncher.use_hints = use
                times[name].append(per_step(ours))
            times["bf16 nn.Linear"].append(per_step(bf16))
    finally:
        FastLauncher.use_hints = before
    print(f"eager step wall time (us), {rounds} interleaved rounds of 20 steps: median [min, max]")
    for name, v in times.items():
        print(f"  {name:16} {_middle(v):8.1f}  [{min(v):.1f}, {max(v):.1f}]")


def ab_backends(names: list[str], make_step, rounds: int) -> None:
    """Eager steps of one layer per backend, interleaved (batches of 20 steps, the order reversed every
    other round), so that the host's drift hits all alike. Wall time per step."""
    steps = {name: make_step(name) for name in names}
    for fn in steps.values():
        per_step(fn, 3)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(per_step(steps[name]))
    print(f"eager step wall time (us), {rounds} interleaved rounds of 20 steps: median [min, max]")
    for name, v in times.items():
        print(f"  {name:16} {_middle(v):8.1f}  [{min(v):.1f}, {max(v):.1f}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096x4096", help="MxNxK")
    ap.add_argument("--backend", default="cublas")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--ab-hints",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only an A/B of launch hints (FastLauncher.use_hints) on eager steps, ROUNDS interleaved rounds",
    )
    ap.add_argument("--ab-backends", default="", metavar="A,B,...",
                    help="only an A/B of these backends' eager steps (with --rounds interleaved rounds)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=15, help="rounds of --ab-backends")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_linear_host: needs a CUDA GPU")
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

    if args.ab_backends:  # nothing else: no --backend layer
        names = [b.strip() for b in args.ab_backends.split(",") if b.strip()]

        def make_step(name):
            if name == "bf16":
                return step(bf16)
            return step(Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=name), True)

        ab_backends(names, make_step, args.rounds)
        return 0
    backend = get_backend(args.backend, torch.device("cuda"))
    recipe = BlockwiseRecipe()
    layer = Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=args.backend)
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
    if args.ab_hints:
        ab_hints(step(layer, True), step(bf16), args.ab_hints)
        return 0
    print(f"host time per call, {m}x{n}x{k}, backend {args.backend}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name, fn in pieces.items():
        print(f"  {name:34} {host_us(fn):8.1f} us", flush=True)

    print(f"\ninside a step (fwd+bwd, weight refreshed), host us per step, median of {args.steps} steps:")
    for name, us in step_breakdown(layer, backend, x, dy, args.steps).items():
        print(f"  {name:34} {us:8.1f} us")

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
    print(f"\ncProfile of {args.steps} steps (fwd+bwd, weight refreshed), by own time:")
    print(out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
