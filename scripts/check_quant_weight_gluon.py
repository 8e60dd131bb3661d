#!/usr/bin/env python
"""Check and time the Gluon 128x128 weight quantizer (``backends/triton/quantize_weight_gluon.py``)
against the Triton kernel (``quantize_weight.quantize_128x128``) and the reference backend, on an
H100/H200.

    timeout -k 10 300 python scripts/check_quant_weight_gluon.py [--no-check] [--no-bench] [--rounds 3]

(a) bit-exactness (data bytes of W and W^T, scale_inv bits, NaN == NaN) against the Triton kernel
    and the reference backend: bf16/fp16/fp32 inputs, E4M3/E5M2, pow2 on/off, amax_epsilon, NaN/Inf/
    zero/tiny blocks, N and K multiples of 16 with partial 128-blocks; shapes the kernel must refuse
    raise ``GluonWeightUnsupported``;
(b) time (median of do_bench) of Gluon vs Triton vs a device copy of the same bytes, interleaved
    over ``--rounds`` rounds, in us and % of copy speed (bytes: 2 read + 2 written per element).
Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_quant_gluon import _bits_equal, _make_input  # noqa: E402

from primus_fp8_plugin.backends.reference import ReferenceBackend  # noqa: E402
from primus_fp8_plugin.backends.triton import quantize_weight, quantize_weight_gluon  # noqa: E402
from primus_fp8_plugin.recipe import QuantParams  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


def check_bits() -> int:
    cases = [
        # (N, K, dtype, fp8, pow2, eps, special)
        (128, 128, torch.bfloat16, E4, True, 0.0, False),
        (144, 400, torch.bfloat16, E4, True, 0.0, True),
        (4096, 4096, torch.bfloat16, E4, True, 0.0, True),
        (8192, 2048, torch.bfloat16, E4, True, 0.0, True),
        (1008, 1552, torch.bfloat16, E4, True, 0.0, True),
        (16, 16, torch.bfloat16, E4, True, 0.0, False),
        (208, 144, torch.float16, E4, True, 0.0, True),
        (512, 640, torch.float16, E5, True, 1e-12, True),
        (144, 384, torch.float32, E4, True, 0.0, True),
        (1024, 1536, torch.float32, E4, False, 0.0, True),
        (2064, 1040, torch.float32, E5, False, 1e-4, True),
        (1024, 1024, torch.bfloat16, E5, False, 0.0, True),
        (400, 640, torch.bfloat16, E4, False, 1e-4, False),
    ]
    ref = ReferenceBackend()
    bad = 0
    for i, (n, k, dt, f8, pow2, eps, special) in enumerate(cases):
        params = QuantParams(f8, 2, pow2_scales=pow2, amax_epsilon=eps)
        w = _make_input(n, k, dt, special, seed=i)
        if special and n >= 256 and k >= 256:
            w[128:256, 128:256] = 1e-30  # a tiny block: scale = the input dtype's max
        ours = quantize_weight_gluon.quantize_128x128_gluon(w, params)
        torch.cuda.synchronize()
        others = {"triton": quantize_weight.quantize_128x128(w, params), "reference": ref.quantize_weight(w, params)}
        for who, other in others.items():
            for part in PARTS:
                ok, why = _bits_equal(getattr(ours, part), getattr(other, part))
                if not ok:
                    bad += 1
                    print(f"MISMATCH {n}x{k} {dt} {f8} pow2={pow2} eps={eps}: {part} vs {who}: {why}")
    for n, k in ((130, 256), (256, 136), (1, 16)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        try:
            quantize_weight_gluon.quantize_128x128_gluon(w, QuantParams(E4, 2))
            bad += 1
            print(f"NOT REFUSED: {n}x{k}")
        except quantize_weight_gluon.GluonWeightUnsupported:
            pass
    print(f"bit-exactness: {len(cases)} cases x 2 references x 4 parts, refusals: {'all OK' if bad == 0 else f'{bad} FAILED'}")
    return bad


def bench(shapes, rounds: int, orders: list[int], graph: bool) -> None:
    from benchlib import bench_ms, graph_ms

    timer = graph_ms if graph else bench_ms

    params = QuantParams(E4, 2)
    gluon_quantize = quantize_weight_gluon.quantize_128x128_gluon
    print(f"median % of copy over {rounds} interleaved rounds [min-max]; us of the median round")
    for m, k in shapes:
        w = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(w)
        fns = {
            **{f"gluon_G{g}": (lambda g=g: gluon_quantize(w, params, group_rows=g)) for g in orders},
            "triton": lambda: quantize_weight.quantize_128x128(w, params),
        }
        pct = {name: [] for name in fns}
        us = {name: [] for name in fns}
        for _ in range(rounds):
            copy_t = timer(lambda: dst.copy_(w))
            for name, fn in fns.items():
                t = timer(fn)
                pct[name].append(100 * copy_t / t)
                us[name].append(1e3 * t)
        cells = "  ".join(
            f"{name}: {statistics.median(p):5.1f}% [{min(p):.1f}-{max(p):.1f}] {statistics.median(us[name]):6.1f} us"
            for name, p in pct.items()
        )
        print(f"  {m}x{k}: {cells}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true", help="time 20 calls captured in a CUDA graph instead of do_bench")
    ap.add_argument("--orders", type=int, nargs="*", default=[0], help="block orders to time (tile_order.py group_rows)")
    ap.add_argument("--shapes", nargs="*", default=["8192x8192", "16384x4096", "8192x29568", "4096x14336"])
    args = ap.parse_args()
    bad = 0 if args.no_check else check_bits()
    if not args.no_bench:
        bench([tuple(int(v) for v in s.split("x")) for s in args.shapes], args.rounds, args.orders, args.graph)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
