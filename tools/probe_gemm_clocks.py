#!/usr/bin/env python
"""Sustained GEMM throughput with the SM clock and board power seen while it runs (H100/H200).

    python -m tools.probe_gemm_clocks                                  # ours vs cuBLAS, 3 shapes
    python -m tools.probe_gemm_clocks --configs 128x256 --seconds 3 --rounds 3 --json out.json

Why: a short ``do_bench`` (60 ms in check_gluon_gemm.py, 150 ms in bench_gemm.py) of an FP8 GEMM on
the H200 can run at a clock the card does not hold under sustained load (the power limit pulls the SM
clock down from ~1.98 GHz to 1.3-1.75 GHz), and our kernel's throughput moved by ~10% between runs
where cuBLAS's moved 2-4% (docs/PERFORMANCE.md). Here each contender runs
back to back for ``--seconds`` per round (after an untimed settle run), the rounds interleaved, on
operands drawn afresh each round (so that their placement in memory varies too), while
``nvidia-smi`` samples the SM clock and power every 50 ms. Printed per contender: TFLOPS, median SM
clock and power over its timed run, TFLOPS per GHz (work per clock: how good the kernel's schedule
is, apart from the clock) and TFLOPS per kW (energy per FLOP: what the clock follows once the card is
at its power limit).

Contenders: cuBLAS blockwise (``torch.nn.functional.scaled_mm``), the Gluon kernel in each of
``--configs`` (``tools.gemm_variants.VARIANTS``) that takes the form, and for the fwd form two ceilings:
cuBLAS FP8 with per-tensor scales (no promotion) and BF16; forms: fwd (128x128 B scales, bf16
out, also what dgrad runs), wgrad (1x128 B scales, bf16 out) and wgrad_acc (1x128 B scales, added
into an fp32 ``main_grad``: ours in the epilogue, cuBLAS as an fp32 product plus an ``add_`` pass,
as the ``cublas`` backend does).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.benchlib import PowerLog, sustained_ms
from primus_fp8_plugin.kernels.sm90 import gemm as gemm_gluon
from tools.check_gluon_gemm import cublas_fn, make_inputs
from tools.gemm_variants import VARIANTS

SHAPES = [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 8192, 29568)]
# form: (B scale layout, output dtype, accumulate into an fp32 tensor)
FORMS = {"fwd": (2, torch.bfloat16, False), "wgrad": (1, torch.bfloat16, False), "wgrad_acc": (1, torch.float32, True)}


def ceiling_fns(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The same GEMM without blockwise scaling: FP8 with one scale per tensor (cuBLAS, no promotion:
    the best an FP8 GEMM did here) and BF16 (cuBLAS)."""
    one = torch.ones((), device=a.device)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return {
        "FP8-tensor": lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16),
        "BF16": lambda: a16 @ b16.t(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="128x256,256x128", help="comma list of tools.gemm_variants names (default: the picked)")
    ap.add_argument("--shapes", nargs="*", default=None, help="MxNxK GEMM shapes (default: 3 of bench_gemm's)")
    ap.add_argument("--forms", default="fwd,wgrad")
    ap.add_argument("--seconds", type=float, default=2.0, help="sustained run per contender and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                    help="leave out the FP8 tensorwise and BF16 cuBLAS GEMMs (fwd form)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    names, forms = args.configs.split(","), args.forms.split(",")
    unknown = [c for c in names if c not in VARIANTS] + [f for f in forms if f not in FORMS]
    if unknown:
        ap.error(f"unknown {unknown}; configs: {sorted(VARIANTS)}, forms: {sorted(FORMS)}")
    if not torch.cuda.is_available():
        print("probe_gemm_clocks needs an NVIDIA GPU", file=sys.stderr)
        return 2
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    configs = {c: VARIANTS[c] for c in names}
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  {now}")
    runs = []  # (shape, form, label, round, ms, t0, t1)
    with PowerLog() as smi:
        for m, n, k in shapes:
            for form in forms:
                bdim, od, accumulate = FORMS[form]
                for r in range(args.rounds):
                    a, a_s, b, b_s = make_inputs(m, n, k, bdim, seed=1000 + r)  # fresh operands each round
                    acc = torch.zeros(m, n, device="cuda") if accumulate else None
                    cublas = cublas_fn(a, a_s, b, b_s, bdim, od)
                    if accumulate:  # cuBLAS writes the fp32 product, a second pass adds it (backends/cublas.py)
                        contenders = {"cuBLAS": lambda cublas=cublas, acc=acc: acc.add_(cublas())}
                    else:
                        contenders = {"cuBLAS": cublas}
                    if form == "fwd" and args.ceilings:
                        contenders.update(ceiling_fns(a, b))
                    for name, cfg in configs.items():
                        if gemm_gluon.supports(cfg, bdim, od, accumulate) is None:
                            contenders[name] = functools.partial(gemm_gluon.blockwise_gemm_gluon, a, a_s, b, b_s,
                                                                 b_block_dim=bdim, out_dtype=od, config=cfg,
                                                                 accumulate_into=acc)  # fmt: skip
                    order = list(contenders)
                    if r % 2:  # alternate who goes first (a first-in-round bias was seen before)
                        order.reverse()
                    for label in order:
                        ms, t0, t1 = sustained_ms(contenders[label], args.seconds)
                        runs.append(((m, n, k), form, label, r, ms, t0, t1))
                    del a, a_s, b, b_s, contenders, acc
                    torch.cuda.empty_cache()
    rows = []
    for shape, form, label, r, ms, t0, t1 in runs:
        tf = 2.0 * shape[0] * shape[1] * shape[2] / ms * 1e-9
        w = smi.window(t0, t1)
        rows.append({"shape": list(shape), "form": form, "contender": label, "round": r, "ms": ms, "tflops": tf, **w})
    print(
        f"\nsustained {args.seconds:g} s per contender and round, {args.rounds} rounds interleaved; median (min-max) over rounds"
    )
    print(f"{'form':6} {'M':>6} {'N':>6} {'K':>6} {'contender':>11} {'TFLOPS':>18} {'ratio':>6} {'SM MHz':>7} {'W':>6}"
          f" {'TF/GHz':>7} {'TF/kW':>7} {'maxC':>5} throttle")  # fmt: skip
    for shape in shapes:
        for form in args.forms.split(","):
            sel = [x for x in rows if tuple(x["shape"]) == shape and x["form"] == form]
            base = statistics.median(x["tflops"] for x in sel if x["contender"] == "cuBLAS") if sel else float("nan")
            for label in dict.fromkeys(x["contender"] for x in sel):
                mine = [x for x in sel if x["contender"] == label]
                tfs = [x["tflops"] for x in mine]
                tf = statistics.median(tfs)
                mhz = statistics.median(x["sm_mhz"] for x in mine)
                pw = statistics.median(x["power_w"] for x in mine)
                thr = ",".join(sorted({x["throttle"] for x in mine}))
                print(f"{form:6} {shape[0]:6} {shape[1]:6} {shape[2]:6} {label:>11} {tf:7.0f} ({min(tfs):4.0f}-{max(tfs):4.0f})"
                      f" {tf / base:6.3f} {mhz:7.0f} {pw:6.0f} {tf / (mhz / 1000):7.0f} {tf / (pw / 1000):7.0f}"
                      f" {max(x['temp_c'] for x in mine):5.0f} {thr}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "seconds": args.seconds, "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
