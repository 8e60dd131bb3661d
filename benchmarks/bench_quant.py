#!/usr/bin/env python3
"""Quantization bandwidth on the GPU: ours vs a device copy, TE's quantizer and torch eager.

    python benchmarks/bench_quant.py [--json out.json] [--plot out.png] [--graph]

"ours" is what the triton backend runs (the Gluon kernels on Hopper, else the Triton kernels, which
are also timed on their own as "ours (Triton kernel)").

For each M x K: the dual 1x128 activation quantization (bf16 X -> rowwise + columnwise FP8 with
scales), the 128x128 weight quantization (W -> W and W^T) and W^T made from W's FP8 blocks (FP8 primary
weights' dgrad operand: a byte transpose, ``transpose_weight.py``). Bandwidth counts bytes read plus
bytes written; "copy" is a device-to-device copy of X measured in the same run (the ceiling).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for benchmarks.benchlib

from benchmarks.benchlib import (  # noqa: E402
    bench_ms,
    bench_parser,
    environment,
    graph_ms,
    report,
    require_cuda,
    save_figure,
    shapes_or,
    try_import_te,
)
from primus_fp8_plugin import BlockwiseRecipe, TensorRole  # noqa: E402
from primus_fp8_plugin.backends.reference import ReferenceBackend  # noqa: E402
from primus_fp8_plugin.backends.triton import hopper_or_portable_act_quant, hopper_or_portable_weight_quant  # noqa: E402
from primus_fp8_plugin.kernels.triton.heuristics import QuantizeConfig  # noqa: E402
from primus_fp8_plugin.kernels.triton.quantize_act import quantize_1x128_dual  # noqa: E402
from primus_fp8_plugin.kernels.triton.quantize_weight import quantize_128x128  # noqa: E402
from primus_fp8_plugin.kernels.triton.transpose_weight import transpose_128x128  # noqa: E402
from primus_fp8_plugin.tensor import ceil_div  # noqa: E402

SHAPES = [(8192, 8192), (16384, 4096), (8192, 29568), (4096, 14336)]


def main() -> int:
    ap = bench_parser(__doc__, "MxK, e.g. 8192x8192")
    ap.add_argument("--variants", action="store_true", help="first sweep our kernels' (SUB_M, num_warps) on 8192x8192")
    ap.add_argument("--graph", action="store_true",
                    help="time each contender as 20 calls in a CUDA graph (benchlib.graph_ms: no host time, no L2 "
                         "flush) instead of do_bench; a contender that cannot be captured is timed with do_bench")  # fmt: skip
    args = ap.parse_args()
    if not require_cuda("bench_quant"):
        return 2
    shapes = shapes_or(args, SHAPES)
    recipe = BlockwiseRecipe()
    p_act, p_w = recipe.params(TensorRole.INPUT), recipe.params(TensorRole.WEIGHT)
    te, tex = try_import_te()
    ref = ReferenceBackend()
    if args.variants:
        sweep_variants(p_act, p_w)
    rows = []
    for m, k in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
        copy_dst = torch.empty_like(x)
        hp = x.numel() * 2
        act_bytes = hp + 2 * x.numel() + 4 * (m * ceil_div(k, 128) + k * ceil_div(m, 128))
        w_bytes = hp + 2 * x.numel() + 8 * ceil_div(m, 128) * ceil_div(k, 128)
        both = {"rowwise": True, "columnwise": True}
        held = quantize_128x128(x, p_w)  # W^T on demand reads W's FP8 blocks and scales, writes W^T's
        t_bytes = 2 * x.numel() + 8 * ceil_div(m, 128) * ceil_div(k, 128)
        contenders = {
            ("copy", "-"): (lambda: copy_dst.copy_(x), 2 * hp),
            ("ours", "act 1x128 row+col"): (lambda: hopper_or_portable_act_quant(x, p_act, **both), act_bytes),
            ("ours (Triton kernel)", "act 1x128 row+col"): (lambda: quantize_1x128_dual(x, p_act, **both), act_bytes),
            ("ours", "weight 128x128 W+W^T"): (lambda: hopper_or_portable_weight_quant(x, p_w), w_bytes),
            ("ours (Triton kernel)", "weight 128x128 W+W^T"): (lambda: quantize_128x128(x, p_w), w_bytes),
            ("ours", "W^T from W (on demand)"): (lambda: transpose_128x128(held.rowwise_data, held.rowwise_scale_inv), t_bytes),
            ("torch eager", "act 1x128 row+col"): (lambda: ref.quantize_act(x, p_act, rowwise=True, columnwise=True), act_bytes),
            ("torch eager", "weight 128x128 W+W^T"): (lambda: ref.quantize_weight(x, p_w), w_bytes),
        }
        if te is not None:
            q1 = te.Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1)
            q2 = te.Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)
            contenders[("TE", "act 1x128 row+col")] = (lambda: q1(x), act_bytes)
            contenders[("TE", "weight 128x128 W+W^T")] = (lambda: q2(x), w_bytes)
        # torch eager (50x slower, many small kernels) always with do_bench
        times = {key: timed(fn, args.graph and key[0] != "torch eager") for key, (fn, _) in contenders.items()}
        copy_bw = 2 * hp / times[("copy", "-")] / 1e9
        for (who, what), (_, nbytes) in contenders.items():
            t = times[(who, what)]
            bw = nbytes / t / 1e9  # bytes/ms -> TB/s
            te_t = times.get(("TE", what))
            rows.append({
                "shape": f"{m}x{k}", "op": what, "impl": who, "us": t * 1e3, "TB/s": bw,
                "% copy": 100 * bw / copy_bw, "vs TE": (te_t / t) if te_t and who != "TE" else None,
            })  # fmt: skip
        torch.cuda.empty_cache()
    env = environment()
    env["timing"] = "CUDA graph, 20 calls (no host time, no L2 flush)" if args.graph else "triton do_bench (L2 flushed)"
    cols = [("shape", ""), ("op", ""), ("impl", ""), ("us", ".1f"), ("TB/s", ".2f"), ("% copy", ".0f"), ("vs TE", ".2f")]
    report("bench_quant", env, rows, cols, args, plot, [] if te is not None else [f"(TE not installed: {tex})"])
    return 0


def timed(fn, graph: bool) -> float:
    """ms per call: ``graph_ms`` if asked and capturable, else ``bench_ms``."""
    if graph:
        try:
            return graph_ms(fn)
        except Exception as err:  # noqa: BLE001 - e.g. a quantizer that synchronises cannot be captured
            print(f"(CUDA graph capture failed: {type(err).__name__}: {str(err)[:120]}; timed with do_bench)")
            torch.cuda.synchronize()
    return bench_ms(fn)


def sweep_variants(p_act, p_w, m: int = 8192, k: int = 8192) -> None:
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    copy_dst = torch.empty_like(x)
    copy_bw = 4 * x.numel() / bench_ms(lambda: copy_dst.copy_(x)) / 1e9
    nbytes = 4 * x.numel()  # read bf16 + two FP8 copies (scales: < 1%)
    print(f"variants on {m}x{k} (copy {copy_bw:.2f} TB/s): sub_m, num_warps -> % of copy (act dual, weight)")
    for sub_m in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            cfg = QuantizeConfig(sub_m, warps)
            t_a = bench_ms(lambda: quantize_1x128_dual(x, p_act, rowwise=True, columnwise=True, config=cfg))
            t_w = bench_ms(lambda: quantize_128x128(x, p_w, config=cfg))
            pa, pw = (100 * nbytes / t / 1e9 / copy_bw for t in (t_a, t_w))
            print(f"  {sub_m:4} {warps:2} -> {pa:5.1f}%  {pw:5.1f}%", flush=True)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ["act 1x128 row+col", "weight 128x128 W+W^T"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, op in zip(axes, ops):
        shapes = sorted({r["shape"] for r in rows}, key=lambda s: [int(v) for v in s.split("x")])
        known = ("ours", "ours (Triton kernel)", "TE", "torch eager")
        impls = [i for i in known if any(r["impl"] == i and r["op"] == op for r in rows)]
        for j, impl in enumerate(impls):
            vals = [
                next((r["% copy"] for r in rows if r["shape"] == s and r["op"] == op and r["impl"] == impl), 0) for s in shapes
            ]
            ax.bar([i + 0.2 * j for i in range(len(shapes))], vals, width=0.2, label=impl)
        ax.axhline(85, color="gray", ls="--", lw=1, label="85% of copy (goal)")
        ax.set_xticks([i + 0.1 * (len(impls) - 1) for i in range(len(shapes))], shapes)  # under each group
        ax.set_title(op)
        ax.set_ylabel("% of device-copy bandwidth")
        ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
