#!/usr/bin/env python3
"""Grouped (MoE) FP8 GEMMs alone, on a Hopper GPU: the Gluon grouped kernels (kernels/sm90/gemm_grouped.py) vs
the portable Triton grouped kernels (kernels/triton/gemm_grouped.py) vs a loop of dense Gluon GEMMs (one per expert) vs BF16
(``torch._grouped_mm`` where this torch has it, else a loop of BF16 matmuls), for fwd, dgrad and wgrad (into
fp32 main_grads), all contenders in one run.

    python benchmarks/bench_grouped_gemm.py [--models mixtral qwen3 dsv3] [--tokens 8192 32768]
        [--routing balanced skewed] [--ops fwd dgrad wgrad] [--sustained S] [--json out.json] [--plot out.png]
        [--wgrad-configs 128x128w4s3 64x128w4s3 ...]

Shapes (one expert linear of SwiGLU experts per row: ``fc1`` [hidden -> 2 x ffn], ``fc2`` [ffn -> hidden]):
``mixtral`` (8 experts, hidden 4096, ffn 14336), ``qwen3`` (128 experts, hidden 2048, ffn 768), ``dsv3``
(DeepSeek-V3's local experts at EP=8: 32 experts, hidden 7168, ffn 2048). ``--tokens``: routed tokens (tokens x
top-k); ``balanced``: equal counts, ``skewed``: Zipf 1.2 shares permuted over the experts (bench_grouped.routing);
counts are multiples of 16.

Columns: ``ms`` per contender; ``TF`` 2 T N K / the Gluon time; ``ceil ms`` the roofline bound of the GEMM,
``max(2 T N K / 1979 TF/s, bytes / 4.8 TB/s)`` (H200 dense FP8 peak and HBM bandwidth; bytes: FP8 operands, scales,
the output (bf16; wgrad: fp32 main_grad read and written)), and ``% ceil`` the Gluon time's share of it;
ratios ``x portable``, ``x loop``, ``x bf16`` = that contender's time / the Gluon time (above 1: Gluon faster).
Geometric means end the table. Timing: triton's do_bench (median, L2 flushed) by default, or ``--sustained S``
seconds per contender back to back (benchlib.Timing).

``--wgrad-configs``: the portable grouped wgrad (into the fp32 main_grads) also with other launch configs
(``BMxBNwWARPSsSTAGES``, optionally ``gGROUP_M``; ``parse_config``), each a contender ``portable-NAME`` with its
``x portable-NAME`` ratio and ``portable-NAME bits`` (True where it adds into main_grad the bits the default
config adds: the tile config must not change the numerics).
"""

from __future__ import annotations

import functools
import math
import re
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _d in (_HERE, _HERE.parent):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

from bench_grouped import MODELS, routing  # noqa: E402
from benchlib import Timing, bench_parser, environment, report, require_cuda, save_figure  # noqa: E402

PEAK_TFLOPS = 1979.0  # H200 / H100 SXM dense FP8
HBM_TBPS = 4.8  # H200


def linears(model: str) -> list[tuple[str, int, int, int]]:
    e, hidden, ffn = MODELS[model]
    return [(f"{model}.fc1", e, hidden, 2 * ffn), (f"{model}.fc2", e, ffn, hidden)]


def ceiling_ms(op: str, t: int, k: int, n: int, e: int) -> float:
    flops = 2.0 * t * n * k
    kb = -(-k // 128)
    if op == "wgrad":  # dY^T [N, T], X^T [K, T] fp8 + 1x128 scales; E fp32 [N, K] read + written
        nbytes = t * (n + k) + 4 * (t // 128 + e) * (n + k) + 8 * e * n * k
    else:  # A [T, K] fp8 + scales, W [E, N, K] fp8, C [T, N] bf16
        out_n = n
        nbytes = t * k + 4 * kb * t + e * n * k + 2 * t * out_n
    return max(flops / (PEAK_TFLOPS * 1e12), nbytes / (HBM_TBPS * 1e12)) * 1e3


def _bf16_fns(x, dy, w, counts, offs, grouped: bool):
    if grouped:
        return {
            "fwd": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
            "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
            "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
        }
    xs, dys = torch.split(x, counts), torch.split(dy, counts)
    return {
        "fwd": lambda: [a @ b.t() for a, b in zip(xs, w.unbind(0))],
        "dgrad": lambda: [a @ b for a, b in zip(dys, w.unbind(0))],
        "wgrad": lambda: [a.t() @ b for a, b in zip(dys, xs)],
    }


def grouped_mm_works() -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2, 128, 128, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor([32, 64], device="cuda", dtype=torch.int32)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        torch._grouped_mm(x.t(), x, offs=offs)
        return True
    except (RuntimeError, NotImplementedError):
        return False


CONFIG_NAME = re.compile(r"^(\d+)x(\d+)w(\d+)s(\d+)(?:g(\d+))?$")


def parse_config(name: str):
    """``BMxBNwWARPSsSTAGES[gGROUP_M]`` (e.g. ``128x128w8s3``, ``64x128w4s3g4``) as the portable kernels'
    ``GemmConfig`` (group_m 8 unless given)."""
    from primus_fp8_plugin.kernels.triton.heuristics import GemmConfig

    m = CONFIG_NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a config name: BMxBNwWARPSsSTAGES[gGROUP_M], e.g. 128x128w8s3 or 64x128w4s3g4")
    bm, bn, warps, stages, group_m = (int(v) if v else None for v in m.groups())
    for what, v in (("block_m", bm), ("block_n", bn)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name!r}: {what} {v} is not a power of 2 of at least 16")
    if warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"{name!r}: {warps} warps, {stages} stages (warps: 1, 2, 4, 8 or 16; stages >= 1)")
    if group_m is not None and group_m < 1:
        raise ValueError(f"{name!r}: group_m {group_m} (at least 1)")
    return GemmConfig(block_m=bm, block_n=bn, group_m=8 if group_m is None else group_m, num_warps=warps, num_stages=stages)


def config_bits(wgrad_args: tuple, names) -> dict[str, bool | None]:
    """``{portable-NAME: whether the portable grouped wgrad with config NAME adds into fp32 main_grads the bits the
    default config adds}`` for the operands ``wgrad_args`` (``grouped_wgrad``'s positional arguments); None where the
    config fails (it is reported, and its contender fails alone)."""
    from primus_fp8_plugin.kernels.triton.gemm_grouped import grouped_wgrad

    if not names:
        return {}
    layout = wgrad_args[-1]
    e, m, n = layout.num_groups, wgrad_args[0].shape[0], wgrad_args[2].shape[0]
    start = torch.randn(e, m, n, device=wgrad_args[0].device, generator=torch.Generator(wgrad_args[0].device).manual_seed(0))
    want = start.clone()
    grouped_wgrad(*wgrad_args, out_dtype=torch.float32, accumulate_into=list(want.unbind(0)))
    same = {}
    for name in names:
        got = start.clone()
        try:
            grouped_wgrad(*wgrad_args, out_dtype=torch.float32, accumulate_into=list(got.unbind(0)), config=parse_config(name))
        except Exception as err:  # noqa: BLE001 - one config's failure ends no run
            print(f"wgrad config {name}: {type(err).__name__}: {str(err)[:300]}", flush=True)
            same[f"portable-{name}"] = None
            continue
        same[f"portable-{name}"] = torch.equal(got.view(torch.int32), want.view(torch.int32))
    return same


def contenders(e, k, n, counts, bf16_grouped, wgrad_configs=()):
    """op -> {name: fn} for one expert linear and routing, and {``portable-NAME``: whether that wgrad config adds
    the default config's bits} for ``wgrad_configs`` (names, ``parse_config``)."""
    from primus_fp8_plugin import BlockwiseRecipe, TensorRole
    from primus_fp8_plugin.grouped import group_layout, quantize_activation_grouped, quantize_weight_grouped
    from primus_fp8_plugin.kernels.sm90 import heuristics as H
    from primus_fp8_plugin.kernels.sm90.gemm import blockwise_gemm_gluon
    from primus_fp8_plugin.kernels.sm90.gemm_grouped import grouped_gemm_gluon, grouped_wgrad_gluon
    from primus_fp8_plugin.kernels.triton.gemm_grouped import grouped_gemm, grouped_wgrad

    t = sum(counts)
    recipe = BlockwiseRecipe()
    p_in, p_w, p_g = (recipe.params(r) for r in (TensorRole.INPUT, TensorRole.WEIGHT, TensorRole.GRAD_OUTPUT))
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
    layout = group_layout(torch.tensor(counts, device="cuda", dtype=torch.int32), t, "cuda")
    xq = quantize_activation_grouped(x, layout, p_in, backend="triton")
    dyq = quantize_activation_grouped(dy, layout, p_g, backend="triton")
    wq = quantize_weight_grouped(w, p_w, backend="triton")
    # main_grads as views of one buffer, as Megatron's gradient buffer holds them
    mg = list(torch.zeros(e, n, k, device="cuda").unbind(0))
    fwd = (xq.rowwise_data, xq.rowwise_scale_inv, wq.rowwise_data, wq.rowwise_scale_inv, layout)
    dgrad = (dyq.rowwise_data, dyq.rowwise_scale_inv, wq.columnwise_data, wq.columnwise_scale_inv, layout)
    wgrad = (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, layout)
    xs, dys = xq.split(), dyq.split()
    ws = [wq.expert(i) for i in range(e)]
    live = [i for i, c in enumerate(counts) if c]

    fwd_dense, wgrad_dense = H.gemm_config(2, torch.bfloat16, False), H.gemm_config(1, torch.float32, True)
    fwd_cfg, wgrad_cfg = H.grouped_fwd_config(n), H.grouped_wgrad_config(accumulate=True)

    def loop(op):
        if op == "fwd":
            return lambda: [blockwise_gemm_gluon(xs[i].rowwise_data, xs[i].rowwise_scale_inv, ws[i].rowwise_data,
                                                 ws[i].rowwise_scale_inv, b_block_dim=2, out_dtype=torch.bfloat16,
                                                 config=fwd_dense) for i in live]  # fmt: skip
        if op == "dgrad":
            return lambda: [blockwise_gemm_gluon(dys[i].rowwise_data, dys[i].rowwise_scale_inv, ws[i].columnwise_data,
                                                 ws[i].columnwise_scale_inv, b_block_dim=2, out_dtype=torch.bfloat16,
                                                 config=fwd_dense) for i in live]  # fmt: skip
        return lambda: [blockwise_gemm_gluon(dys[i].columnwise_data, dys[i].columnwise_scale_inv, xs[i].columnwise_data,
                                             xs[i].columnwise_scale_inv, b_block_dim=1, out_dtype=torch.float32,
                                             config=wgrad_dense, accumulate_into=mg[i]) for i in live]  # fmt: skip

    offs = layout.offsets[1:].contiguous()
    bf = _bf16_fns(x, dy, w, counts, offs, bf16_grouped)
    same_bits = config_bits(wgrad, wgrad_configs)
    variants = {f"portable-{name}": functools.partial(grouped_wgrad, *wgrad, out_dtype=torch.float32, accumulate_into=mg,
                                                      config=parse_config(name))
                for name in wgrad_configs}  # fmt: skip
    return {
        "fwd": {"gluon": lambda: grouped_gemm_gluon(*fwd, out_dtype=torch.bfloat16, config=fwd_cfg),
                "portable": lambda: grouped_gemm(*fwd, out_dtype=torch.bfloat16), "loop": loop("fwd"), "bf16": bf["fwd"]},
        "dgrad": {"gluon": lambda: grouped_gemm_gluon(*dgrad, out_dtype=torch.bfloat16, config=H.grouped_fwd_config(k)),
                  "portable": lambda: grouped_gemm(*dgrad, out_dtype=torch.bfloat16), "loop": loop("dgrad"),
                  "bf16": bf["dgrad"]},
        "wgrad": {"gluon": lambda: grouped_wgrad_gluon(*wgrad, out_dtype=torch.float32, config=wgrad_cfg,
                                                       accumulate_into=mg),
                  "portable": lambda: grouped_wgrad(*wgrad, out_dtype=torch.float32, accumulate_into=mg),
                  "loop": loop("wgrad"), "bf16": bf["wgrad"], **variants},
    }, same_bits  # fmt: skip


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.35), 4))
    labels = [f"{r['shape']} {r['op']} {r['tokens']} {r['routing'][:4]}" for r in rows]
    for i, key in enumerate(("x portable", "x loop", "x bf16")):
        ax.bar([j + i * 0.27 for j in range(len(rows))], [r.get(key) or 0 for r in rows], 0.27, label=key)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("contender time / Gluon grouped time")
    ax.legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--tokens", nargs="*", type=int, default=[8192, 32768])
    ap.add_argument("--routing", nargs="*", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    ap.add_argument("--ops", nargs="*", default=["fwd", "dgrad", "wgrad"], choices=["fwd", "dgrad", "wgrad"])
    ap.add_argument("--no-loop", action="store_true", help="skip the dense per-expert loop")
    ap.add_argument("--sustained", type=float, default=0.0, help="seconds per contender (0: do_bench)")
    ap.add_argument("--wgrad-configs", nargs="*", default=[], metavar="NAME",
                    help="also the portable wgrad with these launch configs (BMxBNwWARPSsSTAGES[gGROUP_M])")  # fmt: skip
    args = ap.parse_args(argv)
    for name in args.wgrad_configs:
        try:
            parse_config(name)
        except ValueError as err:
            ap.error(str(err))
    if len(set(args.wgrad_configs)) != len(args.wgrad_configs):
        ap.error(f"--wgrad-configs names a config twice: {args.wgrad_configs}")
    if args.wgrad_configs and "wgrad" not in args.ops:
        ap.error("--wgrad-configs times the wgrad: add wgrad to --ops")
    if not require_cuda("bench_grouped_gemm"):
        return 1
    variant_names = [f"portable-{name}" for name in args.wgrad_configs]
    bf16_grouped = grouped_mm_works()
    rows = []
    with Timing(args.sustained) as timing:
        for model in args.models:
            for name, e, k, n in linears(model):
                for tokens in args.tokens:
                    for kind in args.routing:
                        counts = routing(kind, e, tokens, 16)
                        fns, same_bits = contenders(e, k, n, counts, bf16_grouped, args.wgrad_configs)
                        t = sum(counts)
                        for op in args.ops:
                            # dgrad: [T, N] x [N, K] (the same FLOPs, K and N swapped)
                            kk, nn = (n, k) if op == "dgrad" else (k, n)
                            row = {"shape": name, "op": op, "tokens": t, "routing": kind, "E": e, "K": kk, "N": nn,
                                   "max count": max(counts)}  # fmt: skip
                            for i, c in enumerate(timing.order(fns[op], len(rows))):
                                if c == "loop" and args.no_loop:
                                    continue
                                try:
                                    row[f"{c} ms"] = timing.ms(fns[op][c], row, c)
                                except Exception as err:  # noqa: BLE001 - one contender's failure ends no run
                                    print(f"{name} {op} {c}: {type(err).__name__}: {str(err)[:300]}", flush=True)
                                del i
                            g = row.get("gluon ms")
                            if g is None:
                                continue
                            row["TF"] = 2.0 * t * kk * nn / g / 1e9
                            row["ceil ms"] = ceiling_ms(op, t, kk, nn, e)
                            row["% ceil"] = 100.0 * row["ceil ms"] / g
                            for c in ("portable", "loop", "bf16", *variant_names):
                                if f"{c} ms" in row:
                                    row[f"x {c}"] = row[f"{c} ms"] / g
                            if op == "wgrad":
                                row.update({f"{c} bits": same for c, same in same_bits.items()})
                            rows.append(row)
                            print({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in row.items()
                                   if "MHz" not in k_ and " W" not in k_ and "throttle" not in k_}, flush=True)  # fmt: skip
                        del fns
                        torch.cuda.empty_cache()
    geo = {"shape": "geomean", "op": "", "tokens": None, "routing": ""}
    for key in ("x portable", "x loop", "x bf16", "% ceil", *(f"x {c}" for c in variant_names)):
        vals = [r[key] for r in rows if r.get(key)]
        if vals:
            geo[key] = math.exp(sum(math.log(v) for v in vals) / len(vals))
    columns = [("shape", ""), ("op", ""), ("tokens", ""), ("routing", ""), ("E", ""), ("K", ""), ("N", ""),
               ("max count", ""), ("gluon ms", ".3f"),
               ("portable ms", ".3f"), ("loop ms", ".3f"), ("bf16 ms", ".3f"),
               ("TF", ".0f"), ("ceil ms", ".3f"), ("% ceil", ".0f"), ("x portable", ".2f"), ("x loop", ".2f"),
               ("x bf16", ".2f")]  # fmt: skip
    for c in variant_names:
        columns += [(f"{c} ms", ".3f"), (f"x {c}", ".2f"), (f"{c} bits", "")]
    notes = [f"timing: {timing.describe()}; bf16: {'torch._grouped_mm' if bf16_grouped else 'a loop of matmuls'}",
             f"ceiling: max(FLOPs / {PEAK_TFLOPS:g} TF/s, bytes / {HBM_TBPS:g} TB/s)"]  # fmt: skip
    report("bench_grouped_gemm", environment(), rows + [geo], columns, args, plot, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
