#!/usr/bin/env python
"""Host (CPU) cost of our FP8 linear layer's step, piece by piece, on a GPU machine.

    python scripts/profile_linear_host.py [--shape 4096x4096x4096] [--backend cublas] [--steps 200] [--top 25]

At 4096^3 the GPU work of a forward+backward step is about 0.5 ms; when the host needs longer to
issue it, the step is host-bound (docs/PERFORMANCE.md, issue 5). This prints
(a) the host time per call of each piece (no synchronisation inside the timed loop: the GPU queue
    absorbs the launches; batches of 20 calls, synchronised between batches), and
(b) a cProfile of whole eager steps (forward + backward, weight refreshed as in bench_linear's
    "step"), sorted by own time, to show which Python functions the host time goes to.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from primus_fp8_plugin import Fp8BlockwiseLinear  # noqa: E402
from primus_fp8_plugin.backends import get_backend  # noqa: E402
from primus_fp8_plugin.recipe import BlockwiseRecipe, TensorRole  # noqa: E402


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
    per.sort()
    return per[len(per) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4096x4096x4096", help="MxNxK")
    ap.add_argument("--backend", default="cublas")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_linear_host: needs a CUDA GPU")
        return 2
    m, n, k = (int(v) for v in args.shape.split("x"))
    backend = get_backend(args.backend, torch.device("cuda"))
    recipe = BlockwiseRecipe()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    layer = Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=args.backend)
    bf16 = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    p_in, p_w, p_g = (recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))
    xd = x.detach()
    xq = backend.quantize_act(xd, p_in, rowwise=True, columnwise=True)
    wq = backend.quantize_weight(layer.weight.detach(), p_w)
    dyq = backend.quantize_act(dy, p_g, rowwise=True, columnwise=True)

    def step(lay, first=True):
        def run():
            for p in lay.parameters():
                p.grad = None
            if hasattr(lay, "is_first_microbatch"):
                lay.is_first_microbatch = first
            lay(x).backward(dy)

        return run

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
    print(f"host time per call, {m}x{n}x{k}, backend {args.backend}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name, fn in pieces.items():
        print(f"  {name:34} {host_us(fn):8.1f} us", flush=True)

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
