#!/usr/bin/env python3
"""Megatron GPT layers, same weights and inputs: TE's spec under Float8BlockScaling vs the plugin's
spec (per GPU backend) vs Megatron's local BF16 spec, and TE's spec without FP8 (te_bf16). Loss,
gradient agreement and step time.

    python benchmarks/bench_gpt_layer.py [--json out.json] [--backends cublas triton] [--attention local sdpa]

With TE installed, the plugin's linears also run inside TE's spec (attention column "te": TE's fused
attention and norms around them), which differs from TE's model only in the linears. TE's spec always
runs TE's fused attention; ``--attention`` picks the core attention of the plugin and
BF16 models: ``local`` (Megatron's unfused DotProductAttention) or ``sdpa`` (the plugin's SdpaAttention,
fused), so that the linears are compared with the same kind of attention around them.

Each shape is a 2-layer GPT (the layers are what differ; embedding and output layer are BF16 in all).
Each model is compared with the BF16 model of the same attention (TE's with te_bf16): loss, speed, and
gradient agreement (relative Frobenius error of each parameter's gradient; the table gives the worst
parameter); the plugin's and the BF16 models are also compared with TE. Step time: one forward+backward,
median of 10 (CUDA events); ``step_peak_mib``: that step's peak CUDA memory above what was allocated
before it (``benchlib.step_peak_mib``: activations, gradients, weight caches, transients).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks, tools

from benchmarks.benchlib import (  # noqa: E402
    bench_parser,
    environment,
    print_table,
    require_cuda,
    save_figure,
    save_json,
    step_peak_mib,
    try_import_te,
)
from primus_fp8_plugin import backend_availability  # noqa: E402

SHAPES = {  # name: (hidden, heads, ffn, seq, micro batch)
    "h1024": (1024, 16, 4096, 1024, 4),
    "h4096": (4096, 32, 14336, 2048, 2),
}


def main() -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--backends", nargs="*", default=["cublas", "triton"])
    ap.add_argument("--only", nargs="*", choices=sorted(SHAPES), help="shapes to run (default: all)")
    ap.add_argument("--attention", nargs="*", choices=["local", "sdpa"], default=["local", "sdpa"],
                    help="core attention of the plugin and BF16 models (each value is a set of rows)")  # fmt: skip
    args = ap.parse_args()
    if not require_cuda("bench_gpt_layer"):
        return 2
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from tools import te_compare as tc

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29813")
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    te, _ = try_import_te()
    rows = []
    for name in args.only or SHAPES:
        h, heads, ffn, seq, mb = SHAPES[name]
        shape = tc.GptShape(num_layers=2, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn,
                         seq_length=seq, micro_batch_size=mb)  # fmt: skip
        ids, pos = tc.batch(shape)
        # (label, kind, backend, attention); TE's spec brings its own fused attention
        backends = [b for b in args.backends if backend_availability(b, "cuda")]
        models = [("te", "te", None, "te"), ("te_bf16", "te_bf16", None, "te")] if te is not None else []
        if te is not None:  # the plugin's linears inside TE's spec (TE's attention and norms)
            models += [(f"plugin-{b}", "plugin_te_norms", b, "te") for b in backends]
        for attention in args.attention:
            models += [(f"plugin-{b}", "plugin", b, attention) for b in backends]
            models.append(("bf16", "bf16", None, attention))
        # the first model's weights go to the others (fused-norm names map onto the local spec's, not back)
        source = None
        results = {}
        for label, kind, backend, attention in models:
            model = tc.build_gpt(shape, kind, backend=backend or "auto", attention="local" if attention == "te" else attention)
            if source is None:
                source = model
            else:
                tc.copy_weights(source, model)
            loss, grads = tc.loss_and_grads(model, ids, pos)
            ms = tc.step_ms(model, ids, pos)
            peak = step_peak_mib(lambda m=model: m(ids, pos, None, labels=ids).float().mean().backward(),
                                 lambda m=model: m.zero_grad(set_to_none=True))  # fmt: skip
            results[label, attention] = (loss, grads, ms, peak)
            if model is not source:
                del model
            torch.cuda.empty_cache()
        tokens = shape.micro_batch_size * shape.seq_length
        for (label, attention), (loss, grads, ms, peak) in results.items():
            # each model against the BF16 model with the same attention (TE's against te_bf16)
            base_loss, base_grads, base_ms, _ = results[("te_bf16", "te") if attention == "te" else ("bf16", attention)]
            row = {"shape": name, "attention": attention, "model": label, "loss": loss,
                   "loss_vs_bf16_pct": 100 * (loss - base_loss) / base_loss, "step_ms": ms,
                   "tokens_per_s": tokens / ms * 1e3, "speed_vs_bf16": base_ms / ms, "step_peak_mib": peak}  # fmt: skip
            if label not in ("bf16", "te_bf16"):
                row["worst_grad_vs_bf16"] = "{} {:.4f}".format(*tc.worst_grad_error(grads, base_grads))
            if ("te", "te") in results and label != "te":
                te_loss, te_grads, te_ms, _ = results["te", "te"]
                row["worst_grad_vs_te"] = "{} {:.4f}".format(*tc.worst_grad_error(grads, te_grads))
                row["speed_vs_te"] = te_ms / ms
            rows.append(row)
    print_table(rows, [("shape", "s"), ("attention", "s"), ("model", "s"), ("loss", ".5f"), ("loss_vs_bf16_pct", "+.3f"),
                       ("step_ms", ".2f"), ("step_peak_mib", ".0f"),
                       ("tokens_per_s", ".0f"), ("speed_vs_bf16", ".2f"), ("speed_vs_te", ".2f"),
                       ("worst_grad_vs_bf16", "s"), ("worst_grad_vs_te", "s")])  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['shape']}\n{r['attention']}\n{r['model']}" for r in rows]
        ax.bar(
            range(len(rows)),
            [r["step_ms"] for r in rows],
            color=[{"bf16": "#888", "te": "#c44", "te_bf16": "#e99"}.get(r["model"], "#48c") for r in rows],
        )
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("forward+backward ms (2-layer GPT)")
        save_figure(fig, args.plot)
    if args.json:
        save_json(args.json, {"env": environment(), "rows": rows})
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
