#!/usr/bin/env python3
"""Blockwise FP8 GEMM throughput on the GPU: ours vs cuBLAS blockwise, BF16 cuBLAS and TE.

    python benchmarks/bench_gemm.py [--json out.json] [--plot out.png] [--gluon-configs 128x64 ...]
    python benchmarks/bench_gemm.py --sustained 0      # do_bench's short timing instead of 1 s sustained runs

``ours`` is what the ``triton`` backend runs: on Hopper the warp-specialised Gluon kernel
(kernels/sm90/gemm.py), elsewhere the portable Triton kernel; ``portable`` is the portable
Triton kernel (kernels/triton/gemm.py) on every GPU. ``--gluon-configs`` adds Gluon launch configs
(names from ``tools.gemm_variants.VARIANTS``) as further columns, where they support the GEMM.

For each layer shape (M, N, K) and each GEMM of a linear layer (fwd Y=XW^T, dgrad dX=dYW,
wgrad dW=dY^T X; 2*M*N*K FLOPs each), every contender is timed in the same run on the same
quantized operands. By default (``--sustained 1``) each contender runs back to back for 1 second after
an untimed settle run, and the SM clock and board power over each run are recorded (nvidia-smi): on the
H200 every FP8 GEMM then runs at the 700 W power limit (fwd/dgrad at 1.3-1.5 GHz, wgrad at 1.5-1.75),
as in training. ``--sustained 0`` times with ``do_bench`` (150 ms) instead: that catches part of the
boost clock and the power controller's transients, and our kernels' ratios to cuBLAS then moved by up
to 10% between shapes and runs (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks, tools

from benchmarks.benchlib import (  # noqa: E402
    Timing,
    bench_parser,
    environment,
    report,
    require_cuda,
    save_figure,
    shapes_or,
    try_import_te,
)
from primus_fp8_plugin import BlockwiseRecipe, TensorRole  # noqa: E402
from primus_fp8_plugin.backends.cublas import CublasBackend  # noqa: E402
from primus_fp8_plugin.backends.triton import hopper_or_portable_gemm  # noqa: E402
from primus_fp8_plugin.kernels.sm90.gemm import blockwise_gemm_gluon, supports  # noqa: E402
from primus_fp8_plugin.kernels.triton.gemm import blockwise_gemm  # noqa: E402
from primus_fp8_plugin.kernels.triton.quantize_act import quantize_1x128_dual  # noqa: E402
from primus_fp8_plugin.kernels.triton.quantize_weight import quantize_128x128  # noqa: E402
from tools.gemm_variants import VARIANTS  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 8192, 29568),
          (8192, 29568, 8192), (16384, 14336, 4096), (16384, 4096, 14336)]  # fmt: skip


def operands(m, n, k, direction, recipe):
    """Quantized A, B (K-major), their TE-layout scales, B's block dim, and the GEMM's (M, N, K)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    xq = quantize_1x128_dual(x, recipe.params(TensorRole.INPUT), rowwise=True, columnwise=True)
    wq = quantize_128x128(w, recipe.params(TensorRole.WEIGHT))
    dyq = quantize_1x128_dual(dy, recipe.params(TensorRole.GRAD_OUTPUT), rowwise=True, columnwise=True)
    if direction == "fwd":
        meta = dict(a=xq, b=wq, dims=(m, n, k), hp=(x, w))
        return meta, (xq.rowwise_data, xq.rowwise_scale_inv, wq.rowwise_data, wq.rowwise_scale_inv, 2)
    if direction == "dgrad":
        meta = dict(a=dyq, b=wq, dims=(m, k, n), hp=(dy, w.t().contiguous()))
        return meta, (dyq.rowwise_data, dyq.rowwise_scale_inv, wq.columnwise_data, wq.columnwise_scale_inv, 2)
    meta = dict(a=dyq, b=xq, dims=(n, k, m), hp=(dy.t().contiguous(), x.t().contiguous()))
    return meta, (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, 1)


def te_gemm_fn(te, tex, direction, m, n, k, recipe_fmt="E4M3"):
    """TE's own blockwise GEMM on TE-quantized operands, or None with the reason."""
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm

        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
        q1 = lambda: te.Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1)  # noqa: E731
        q2 = te.Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)
        xq, wq, dyq = q1()(x), q2(w), q1()(dy)
        kwargs = dict(out_dtype=torch.bfloat16, use_split_accumulator=True)
        if "workspace" in inspect.signature(general_gemm).parameters:
            from transformer_engine.pytorch.module.base import get_workspace

            kwargs["workspace"] = get_workspace()
        if direction == "fwd":
            return (lambda: general_gemm(wq, xq, layout="TN", **kwargs)), ""
        if direction == "dgrad":
            return (lambda: general_gemm(wq, dyq, layout="NN", **kwargs)), ""
        return (lambda: general_gemm(xq, dyq, layout="NT", **kwargs)), ""
    except Exception as err:  # noqa: BLE001 - TE's internal API varies by version
        return None, f"{type(err).__name__}: {err}"


def main() -> int:
    ap = bench_parser(__doc__, "MxNxK, e.g. 8192x8192x8192")
    ap.add_argument("--gluon-configs", nargs="*", default=[], choices=sorted(VARIANTS), help="extra Gluon configs")
    ap.add_argument("--sustained", type=float, default=1.0, metavar="S",
                    help="time each contender over S seconds back to back, with SM clock and power (nvidia-smi); "
                         "0: do_bench's short timing")  # fmt: skip
    args = ap.parse_args()
    if not require_cuda("bench_gemm"):
        return 2
    shapes = shapes_or(args, SHAPES)
    recipe = BlockwiseRecipe()
    te, tex = try_import_te()
    cublas = CublasBackend()
    have_cublas = bool(cublas.availability(torch.device("cuda")))
    with Timing(args.sustained) as timing:
        rows, te_reason = _run(args, shapes, recipe, te, tex, cublas, have_cublas, timing)
    env = environment()
    env["timing"] = timing.describe()
    cols = [("shape", ""), ("gemm", ""), ("ours TF", ".0f"), ("portable TF", ".0f"), ("cublas TF", ".0f"), ("TE TF", ".0f"),
            ("bf16 TF", ".0f"), ("ours/cublas", ".2f"), ("ours/TE", ".2f"), ("ours/bf16", ".2f")]  # fmt: skip
    for name in args.gluon_configs:
        cols += [(f"gluon {name} TF", ".0f"), (f"gluon {name}/cublas", ".2f")]
    if args.sustained > 0:
        cols += [("ours MHz", ".0f"), ("cublas MHz", ".0f"), ("bf16 MHz", ".0f"), ("ours W", ".0f"), ("cublas W", ".0f"),
                 ("ours throttle", ""), ("cublas throttle", "")]  # fmt: skip
    summary, notes = {}, []
    for direction in ("fwd", "dgrad", "wgrad"):
        ratios = [r["ours/cublas"] for r in rows if r["gemm"] == direction and "ours/cublas" in r]
        if ratios:
            geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
            summary[direction] = {"geomean_vs_cublas": geomean, "min_vs_cublas": min(ratios)}
            notes.append(f"{direction}: geomean ours/cublas {geomean:.2f}, min {min(ratios):.2f}")
    if te is not None and te_reason:
        notes.append(f"(TE GEMM not measured: {te_reason})")
    report("bench_gemm", env, rows, cols, args, plot, notes, summary=summary)
    return 0


def _run(args, shapes, recipe, te, tex, cublas, have_cublas, timing) -> tuple[list[dict], str]:
    """Times every contender on every (shape, GEMM); returns the rows and why TE's GEMM was not
    measured ("" if it was, or TE is absent)."""
    rows, te_reason = [], ""
    for m, n, k in shapes:
        for direction in ("fwd", "dgrad", "wgrad"):
            meta, (a, sa, b, sb, bdim) = operands(m, n, k, direction, recipe)
            gm, gn, gk = meta["dims"]
            flops = 2 * gm * gn * gk
            hp_a, hp_b = meta["hp"]
            fns = {
                "ours": lambda: hopper_or_portable_gemm(a, sa, b, sb, b_block_dim=bdim, out_dtype=torch.bfloat16),
                "portable": lambda: blockwise_gemm(a, sa, b, sb, b_block_dim=bdim, out_dtype=torch.bfloat16),
                "bf16": lambda: torch.matmul(hp_a, hp_b.t()),
            }
            for name in args.gluon_configs:
                cfg = VARIANTS[name]
                if supports(cfg, bdim, torch.bfloat16) is None:
                    fns[f"gluon {name}"] = lambda cfg=cfg: blockwise_gemm_gluon(
                        a, sa, b, sb, b_block_dim=bdim, out_dtype=torch.bfloat16, config=cfg
                    )
            if have_cublas:
                fns["cublas"] = {
                    "fwd": lambda: cublas.gemm_fwd(meta["a"], meta["b"], None, torch.bfloat16),
                    "dgrad": lambda: cublas.gemm_dgrad(meta["a"], meta["b"], torch.bfloat16),
                    "wgrad": lambda: cublas.gemm_wgrad(meta["a"], meta["b"], torch.bfloat16, None),
                }[direction]
            if te is not None:
                fn, why = te_gemm_fn(te, tex, direction, m, n, k)
                te_reason = te_reason or why
                if fn is not None:
                    fns["TE"] = fn
            row = {"shape": f"{m}x{n}x{k}", "gemm": direction}
            tflops = {name: flops / timing.ms(fns[name], row, name) / 1e9 for name in timing.order(fns, len(rows))}
            row.update({f"{kk} TF": tflops[kk] for kk in fns})
            if "cublas" in tflops:
                row["ours/cublas"] = tflops["ours"] / tflops["cublas"]
                for name in args.gluon_configs:
                    if f"gluon {name}" in tflops:
                        row[f"gluon {name}/cublas"] = tflops[f"gluon {name}"] / tflops["cublas"]
            row["ours/bf16"] = tflops["ours"] / tflops["bf16"]
            if "TE" in tflops:
                row["ours/TE"] = tflops["ours"] / tflops["TE"]
            rows.append(row)
            print(f"{direction:5} {gm}x{gn}x{gk}: " + "  ".join(f"{kk} {tflops[kk]:.0f}" for kk in fns), flush=True)
            torch.cuda.empty_cache()
    return rows, te_reason


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    for ax, direction in zip(axes, ("fwd", "dgrad", "wgrad")):
        rs = [r for r in rows if r["gemm"] == direction]
        names = [n for n in ("ours", "portable", "cublas", "TE", "bf16") if any(f"{n} TF" in r for r in rs)]
        for j, name in enumerate(names):
            ax.bar([i + 0.16 * j for i in range(len(rs))], [r.get(f"{name} TF", 0) for r in rs], width=0.16, label=name)
        ax.set_xticks([i + 0.32 for i in range(len(rs))], [r["shape"] for r in rs], rotation=30, fontsize=7)
        ax.set_title(direction)
        ax.set_ylabel("TFLOPS")
        ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
