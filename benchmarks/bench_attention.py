#!/usr/bin/env python3
"""Causal self-attention forward + backward on the GPU: PyTorch SDPA's kernels against TE's fused attention.

    python benchmarks/bench_attention.py [--shapes 2x2048x32x8x128 ...] [--sustained S] [--json out.json]

Shapes are ``B x S x H x G x D``: batch, sequence, query heads, key/value groups, head dim, bf16, causal,
no mask, in the ``[s, b, heads, d]`` layout Megatron hands to core attention (permuted views, as
``SdpaAttention`` passes them). Contenders:

* ``sdpa flash`` / ``sdpa cudnn`` / ``sdpa efficient``: ``F.scaled_dot_product_attention`` restricted to one
  kernel (``torch.nn.attention.sdpa_kernel``, entered once around the contender's timing);
  grouped-query attention through ``enable_gqa`` (no copy);
* ``sdpa default``: no restriction: PyTorch's own priority order (``PRIMUS_FP8_SDPA_KERNELS=torch``;
  ``SdpaAttention`` itself puts cuDNN's kernel first on Hopper);
* ``te``: Transformer Engine's ``DotProductAttention`` (``qkv_format="sbhd"``, causal), when TE imports;
  which backend TE picked is in its own log (``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2``).

Columns: ``ms`` forward + backward per call; ``TFLOP/s`` from the causal FLOPs (forward ``2 B H S^2 D``,
backward 2.5x that: half the score matrix of ``4 B H S^2 D``, times 3.5 in all); ``vs default`` the default
SDPA's time over this one's; ``vs te`` TE's over this one's. A contender that raises prints its error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root
from benchmarks.benchlib import Timing, bench_parser, environment, report, require_cuda, shapes_or, try_import_te  # noqa: E402
from primus_fp8_plugin.megatron.attention import kernel_context  # noqa: E402

# Llama-3-8B width at micro batch 2 (the pretrain_gpt proxy), seq 4096 (the trainer's), GPT-125M
SHAPES = [(2, 2048, 32, 8, 128), (1, 4096, 32, 8, 128), (8, 1024, 12, 12, 64)]


def causal_flops(b: int, s: int, h: int, d: int) -> float:
    """Forward + backward FLOPs of causal attention (the kept half of the scores)."""
    fwd = 4 * b * h * s * s * d / 2
    return 3.5 * fwd


def sdpa_step(q, k, v, grad):
    """One SDPA forward + backward; the kernel restriction is entered once around the timing (main), so
    that no contender's row carries the context manager's host cost per call."""
    gqa = {"enable_gqa": True} if q.size(2) != k.size(2) else {}

    def step():
        qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, **gqa).backward(grad)

    return step


def te_step(te, q, k, v, grad):
    h, g, d = q.size(2), k.size(2), q.size(3)
    attn = te.DotProductAttention(h, d, num_gqa_groups=g, attention_dropout=0.0, qkv_format="sbhd",
                                  attn_mask_type="causal")  # fmt: skip

    def step():
        attn(q, k, v).backward(grad.permute(2, 0, 1, 3).reshape(q.size(0), q.size(1), -1))

    return step


def main() -> int:
    ap = bench_parser(__doc__, "B x S x H x G x D shapes, e.g. 2x2048x32x8x128")
    ap.add_argument("--sustained", type=float, default=0.0, help="seconds of back-to-back calls per contender")
    args = ap.parse_args()
    if not require_cuda("bench_attention"):
        return 1
    from torch.nn.attention import SDPBackend

    te, _ = try_import_te()
    contenders = {"sdpa default": None, "sdpa flash": SDPBackend.FLASH_ATTENTION,
                  "sdpa cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    names = list(contenders) + (["te"] if te is not None else [])
    env, rows = environment(), []
    torch.manual_seed(0)
    with Timing(args.sustained) as timing:
        for i, (b, s, h, g, d) in enumerate(shapes_or(args, SHAPES)):
            q = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(s, b, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(s, b, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
            flops = causal_flops(b, s, h, d)
            times = {}
            for name in timing.order(names, i):
                row = {"shape": f"{b}x{s}x{h}x{g}x{d}", "contender": name}
                step = te_step(te, q, k, v, grad) if name == "te" else sdpa_step(q, k, v, grad)
                kernel = contenders.get(name)
                try:
                    with kernel_context(None if kernel is None else [kernel], q.device):
                        times[name] = timing.ms(step, row, "run")
                except RuntimeError as err:
                    print(f"{row['shape']} {name}: {str(err).splitlines()[0]}", file=sys.stderr)
                    continue
                row.update(ms=times[name], tflops=flops / times[name] / 1e9)
                rows.append(row)
            for row in rows[-len(times) :]:
                row["vs default"] = times.get("sdpa default", float("nan")) / row["ms"]
                if "te" in times:
                    row["vs te"] = times["te"] / row["ms"]
    cols = [("shape", ""), ("contender", ""), ("ms", ".3f"), ("tflops", ".0f"), ("vs default", ".2f"),
            ("vs te", ".2f"), ("run MHz", ".0f"), ("run W", ".0f")]  # fmt: skip
    report("bench_attention", env, rows, cols, args, notes=[timing.describe()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
