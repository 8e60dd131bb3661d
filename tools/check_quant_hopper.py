#!/usr/bin/env python
"""Check and time the Hopper Gluon quantizers (``kernels/sm90/quantize_weight.py``,
``quantize_act.py``) against the Triton kernels and the reference backend, on an H100/H200.

    timeout -k 10 300 python -m tools.check_quant_hopper [--no-check] [--no-bench] [--rounds 3] [--graph]

(a) bit-exactness (data bytes of both copies, scale_inv bits incl. the padding entries, NaN == NaN)
    against the Triton kernel and the reference backend: bf16/fp16/fp32 inputs, E4M3/E5M2, pow2
    on/off, amax_epsilon, NaN/Inf/zero/tiny tiles, dims multiples of 16 with partial 128-tiles, and
    for activations the three row/column modes; shapes the kernels must refuse raise their
    ``Gluon*Unsupported``;
(b) time (median of do_bench, or of CUDA-graph replays with ``--graph``) of Gluon vs Triton vs a
    device copy of the same bytes, interleaved over ``--rounds`` rounds, in us and % of copy speed
    (bytes: 2 read + 2 written per element).
Exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from primus_fp8_plugin.backends.reference import ReferenceBackend
from primus_fp8_plugin.kernels.sm90 import quantize_act as quantize_act_gluon
from primus_fp8_plugin.kernels.sm90 import quantize_weight as quantize_weight_gluon
from primus_fp8_plugin.kernels.sm90.target import GluonUnsupported
from primus_fp8_plugin.kernels.triton import quantize_act, quantize_weight
from primus_fp8_plugin.recipe import QuantParams

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[bool, str]:
    if a is None or b is None:
        return (a is None and b is None), "presence differs"
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    ia = a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32)
    ib = b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32)
    diff = ia != ib
    if a.dtype == torch.float32:  # any NaN equals any NaN
        diff &= ~(torch.isnan(a) & torch.isnan(b))
    n = int(diff.sum())
    if n == 0:
        return True, ""
    idx = diff.nonzero()[:3].tolist()
    ex = ", ".join(f"{tuple(i)}: {a[tuple(i)].item()} vs {b[tuple(i)].item()}" for i in idx)
    return False, f"{n} differing entries, e.g. {ex}"


def _make_input(m: int, k: int, dtype: torch.dtype, special: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float32)
    # rows of widely different magnitude (exercise pow2 scales / saturation)
    x *= torch.exp2(torch.randint(-20, 20, (m, 1), device="cuda", generator=g).float())
    if special and m > 2 and k > 2:
        x[0, :] = 0.0  # zero row -> scale 1
        x[1, : min(k, 128)] = 1e-30  # tiny values (overflow -> in_max scale, or flush)
        x[m // 2, k // 2] = float("nan")
        x[m - 1, k - 1] = float("inf")
        x[m // 3, 0] = float("-inf")
        if m > 200 and k > 200:
            x[130:140, 140:150] = 0.0
    return x.to(dtype)


PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


CASES = [
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


REFUSED_SHAPES = ((130, 256), (256, 136), (1, 16))  # a dim not a multiple of 16


def _mismatches(ours, others: dict, label: str) -> int:
    """Parts of ``ours`` whose bits differ from each of ``others`` ({who: tensor}); each printed."""
    bad = 0
    for who, other in others.items():
        for part in PARTS:
            ok, why = _bits_equal(getattr(ours, part), getattr(other, part))
            if not ok:
                bad += 1
                print(f"MISMATCH {label}: {part} vs {who}: {why}")
    return bad


def _not_refused(quantize, unsupported: type, label: str) -> int:
    """Shapes of REFUSED_SHAPES that ``quantize(x)`` accepted instead of raising ``unsupported``."""
    bad = 0
    for m, k in REFUSED_SHAPES:
        try:
            quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            bad += 1
            print(f"NOT REFUSED: {label} {m}x{k}")
        except unsupported:
            pass
    return bad


def check_bits() -> int:
    ref = ReferenceBackend()
    bad = 0
    for i, (n, k, dt, f8, pow2, eps, special) in enumerate(CASES):
        params = QuantParams(f8, 2, pow2_scales=pow2, amax_epsilon=eps)
        w = _make_input(n, k, dt, special, seed=i)
        if special and n >= 256 and k >= 256:
            w[128:256, 128:256] = 1e-30  # a tiny block: scale = the input dtype's max
        ours = quantize_weight_gluon.quantize_128x128_gluon(w, params)
        others = {"triton": quantize_weight.quantize_128x128(w, params), "reference": ref.quantize_weight(w, params)}
        bad += _mismatches(ours, others, f"weight {n}x{k} {dt} {f8} pow2={pow2} eps={eps}")
    bad += _not_refused(
        lambda w: quantize_weight_gluon.quantize_128x128_gluon(w, QuantParams(E4, 2)),
        GluonUnsupported, "weight",
    )  # fmt: skip
    print(f"weights: {len(CASES)} cases x 2 references x 4 parts, refusals: {'all OK' if bad == 0 else f'{bad} FAILED'}")
    return bad


def check_act_bits() -> int:
    ref = ReferenceBackend()
    bad = 0
    modes = ((True, True), (True, False), (False, True))
    for i, (m, k, dt, f8, pow2, eps, special) in enumerate(CASES):
        params = QuantParams(f8, 1, pow2_scales=pow2, amax_epsilon=eps)
        x = _make_input(m, k, dt, special, seed=100 + i)
        for row, col in modes if i % 3 == 0 else modes[:1]:
            ours = quantize_act_gluon.quantize_1x128_dual_gluon(x, params, rowwise=row, columnwise=col)
            others = {
                "triton": quantize_act.quantize_1x128_dual(x, params, rowwise=row, columnwise=col),
                "reference": ref.quantize_act(x, params, rowwise=row, columnwise=col),
            }
            bad += _mismatches(ours, others, f"act {m}x{k} {dt} {f8} pow2={pow2} eps={eps} row={row} col={col}")
    bad += _not_refused(
        lambda x: quantize_act_gluon.quantize_1x128_dual_gluon(x, QuantParams(E4, 1), rowwise=True, columnwise=True),
        GluonUnsupported, "act",
    )  # fmt: skip
    verdict = "all OK" if bad == 0 else f"{bad} FAILED"
    print(f"activations: {len(CASES)} cases (modes cycled) x 2 references x 4 parts, refusals: {verdict}")
    return bad


def bench(shapes, rounds: int, graph: bool) -> None:
    from benchmarks.benchlib import bench_ms, graph_ms

    timer = graph_ms if graph else bench_ms

    params = QuantParams(E4, 2)
    print(f"median % of copy over {rounds} interleaved rounds [min-max]; us of the median round")
    for m, k in shapes:
        w = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(w)
        act_params = QuantParams(E4, 1)
        fns = {
            "act_gluon": lambda: quantize_act_gluon.quantize_1x128_dual_gluon(w, act_params, rowwise=True, columnwise=True),
            "act_triton": lambda: quantize_act.quantize_1x128_dual(w, act_params, rowwise=True, columnwise=True),
            "weight_gluon": lambda: quantize_weight_gluon.quantize_128x128_gluon(w, params),
            "weight_triton": lambda: quantize_weight.quantize_128x128(w, params),
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
    ap.add_argument("--shapes", nargs="*", default=["8192x8192", "16384x4096", "8192x29568", "4096x14336"])
    args = ap.parse_args()
    bad = 0 if args.no_check else check_bits() + check_act_bits()
    if not args.no_bench:
        bench([tuple(int(v) for v in s.split("x")) for s in args.shapes], args.rounds, args.graph)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
