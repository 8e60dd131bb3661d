#!/usr/bin/env python3
"""Linear-layer step time on the GPU: ours (Fp8BlockwiseLinear) vs torch BF16 nn.Linear vs TE te.Linear
(Float8BlockScaling), forward + backward, all measured in the same run.

    python benchmarks/bench_linear.py [--json out.json] [--plot out.png] [--backends cublas triton] [--cuda-graph]

Two measurements per shape (M tokens, N out, K in; 6*M*N*K FLOPs per forward+backward):
* ``step``: one forward+backward with a freshly quantized weight (what every optimizer step costs
  once): ours with ``is_first_microbatch=True``, TE with ``is_first_microbatch=None``;
* ``4 microbatches``: four forward+backward passes sharing one weight quantization (ours: the
  weight cache; TE: ``is_first_microbatch=True`` then ``False``), reported per microbatch.

``--cuda-graph`` adds BF16 and ours (first backend given) captured with
``torch.cuda.make_graphed_callables``: forward and backward each replay one graph, so the host cost
per call disappears. Under capture our weight cache always quantizes (weight_cache.py), so a graphed
microbatch always includes the weight quantization.

``step_peak_mib``: the step's peak CUDA memory above what was allocated before it (``benchlib.step_peak_mib``:
saved activations, gradients, the weight's quantized copies, transients), not measured for graphed contenders.

``--sustained S`` runs each contender's step (and its four microbatches) back to back for S seconds
instead of ``do_bench``'s 150 ms, and records the SM clock and board power over the one-step run: the
H200 then sits at its 700 W limit, as in training (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for benchmarks.benchlib

from benchmarks.benchlib import (  # noqa: E402
    Timing,
    bench_parser,
    environment,
    report,
    require_cuda,
    save_figure,
    shapes_or,
    step_peak_mib,
    try_import_te,
)
from primus_fp8_plugin import Fp8BlockwiseLinear, backend_availability  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (8192, 8192, 29568),
          (8192, 29568, 8192), (16384, 14336, 4096), (16384, 4096, 14336)]  # fmt: skip


def step_fns(layer, x, dy, call):
    """(one step with a fresh weight, four microbatches with one weight) closures."""
    params = [p for p in layer.parameters()]

    def fwd_bwd(first):
        for p in params:
            p.grad = None
        call(layer, x, first).backward(dy)

    def four():
        for i in range(4):
            fwd_bwd(i == 0)

    return (lambda: fwd_bwd(True)), four


def clear_grads(layer, x):
    """Drop the gradients a step makes (so that ``step_peak_mib`` sees the step allocate them)."""
    for p in layer.parameters():
        p.grad = None
    x.grad = None


def main() -> int:
    ap = bench_parser(__doc__, "MxNxK")
    ap.add_argument("--backends", nargs="*", default=["cublas", "triton"])
    ap.add_argument("--cuda-graph", action="store_true", help="also BF16 and ours captured in CUDA graphs")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S",
                    help="time each contender's step over S seconds back to back (the power-limited clock of "
                         "training), with SM clock and power (nvidia-smi)")  # fmt: skip
    args = ap.parse_args()
    if not require_cuda("bench_linear"):
        return 2
    shapes = shapes_or(args, SHAPES)
    te, tex = try_import_te()
    with Timing(args.sustained) as timing:
        rows = _run(args, shapes, te, timing)
    env = environment()
    env["timing"] = timing.describe() + (" (clock and power: the one-step runs)" if args.sustained > 0 else "")
    cols = [("shape", ""), ("impl", ""), ("step ms", ".3f"), ("step TF", ".0f"), ("vs bf16", ".2f"), ("vs TE", ".2f"),
            ("4mb ms/mb", ".3f"), ("4mb vs bf16", ".2f"), ("4mb vs TE", ".2f"), ("step_peak_mib", ".1f")]  # fmt: skip
    if args.sustained > 0:
        cols += [("step MHz", ".0f"), ("step W", ".0f"), ("step throttle", "")]
    report("bench_linear", env, rows, cols, args, plot, [] if te is not None else [f"(TE not installed: {tex})"])
    return 0


def _run(args, shapes, te, timing) -> list[dict]:
    """Times every contender on every shape (one step, and four microbatches); one row per contender."""
    rows = []
    for i_shape, (m, n, k) in enumerate(shapes):
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        contenders = {
            "bf16": (torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16), lambda lay, inp, f: lay(inp))
        }
        for b in args.backends:
            if backend_availability(b, "cuda"):
                layer = Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=b)

                def call(lay, inp, first):
                    lay.is_first_microbatch = first
                    return lay(inp)

                contenders[f"ours-{b}"] = (layer, call)
        if te is not None:
            from transformer_engine.common.recipe import Float8BlockScaling

            recipe = Float8BlockScaling()
            te_layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
            autocast = te.autocast if hasattr(te, "autocast") else None

            def te_call(lay, inp, first, recipe=recipe, autocast=autocast):
                ctx = autocast(enabled=True, recipe=recipe) if autocast else te.fp8_autocast(enabled=True, fp8_recipe=recipe)
                with ctx:
                    return lay(inp, is_first_microbatch=first)

            contenders["TE"] = (te_layer, te_call)
        if args.cuda_graph:
            plain = lambda lay, inp, f: lay(inp)  # noqa: E731
            bf16_g = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            contenders["bf16 graph"] = (torch.cuda.make_graphed_callables(bf16_g, (x,)), plain)
            ours = [b for b in args.backends if backend_availability(b, "cuda")]
            if ours:
                lay = Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=ours[0])
                contenders[f"ours-{ours[0]} graph"] = (torch.cuda.make_graphed_callables(lay, (x,)), plain)
        flops = 6 * m * n * k
        shape_rows = {name: {"shape": f"{m}x{n}x{k}", "impl": name} for name in contenders}
        times = {}
        for name in timing.order(contenders, i_shape):
            layer, call = contenders[name]
            if name == "bf16" or name.endswith(" graph"):
                single, four = step_fns(layer, x, dy, lambda lay, inp, f: lay(inp))
            elif name == "TE":
                # one step: no weight caching (None); four microbatches: True, then False
                single, _ = step_fns(layer, x, dy, lambda lay, inp, f: call(lay, inp, None))
                _, four = step_fns(layer, x, dy, call)
            else:
                single, four = step_fns(layer, x, dy, call)
            times[name] = (timing.ms(single, shape_rows[name], "step"), timing.ms(four) / 4)
            if not name.endswith(" graph"):  # a graph's memory is allocated at capture
                shape_rows[name]["step_peak_mib"] = step_peak_mib(single, lambda: clear_grads(layer, x))
        bf16 = times["bf16"]
        for name, row in shape_rows.items():
            t1, t4 = times[name]
            row.update({"step ms": t1, "step TF": flops / t1 / 1e9, "vs bf16": bf16[0] / t1, "4mb ms/mb": t4,
                        "4mb vs bf16": bf16[1] / t4})  # fmt: skip
            if "TE" in times and name != "TE":
                row["vs TE"] = times["TE"][0] / t1
                row["4mb vs TE"] = times["TE"][1] / t4
            rows.append(row)
        print("  ".join(f"{nme} {times[nme][0]:.3f}/{times[nme][1]:.3f} ms" for nme in contenders), f"({m}x{n}x{k})",
              flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for j, impl in enumerate(impls):
        vals = [next((r["vs bf16"] for r in rows if r["shape"] == s and r["impl"] == impl), 0) for s in shapes]
        ax.bar([i + 0.8 / len(impls) * j for i in range(len(shapes))], vals, width=0.8 / len(impls), label=impl)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(range(len(shapes)), shapes, rotation=20, fontsize=8)
    ax.set_ylabel("speed vs torch BF16 (fwd+bwd step)")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
