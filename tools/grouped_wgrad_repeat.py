"""Repeat the Gluon grouped wgrad into main_grad and count the experts whose result differs from a loop of the
portable dense kernel, per register split and epilogue (H200 only).

    python -m tools.grouped_wgrad_repeat [--reps 10] [--splits 24:240 40:232 56:224] [--output main_grad|bf16]

Why: at the default 240 / 24 consumer / producer registers the Gluon kernel gave wrong tiles in a few experts per
call, differing from run to run (so main_grad takes the portable kernel: kernels/sm90/heuristics.grouped_wgrad;
issue 39). The routing is tests/gpu/test_gpu_grouped.py's ``qwen-like-128`` (128 experts, skewed counts, K 2048,
N 1536) with device-side counts. The main_grads are views of one buffer, as Megatron's gradient buffer holds them:
the TMA-stored epilogue (the wrapper refuses to accumulate through stores from registers, which failed at every
split tried). ``--output bf16``: new bf16 dW instead (no accumulation), as the backend's grouped wgrad runs it at
240 / 24 (``GROUPED_WGRAD_256x128``), compared with the portable grouped kernel's bf16 dW."""

from __future__ import annotations

import argparse

import torch

import primus_fp8_plugin.kernels.sm90.gemm_grouped as gg
from primus_fp8_plugin.grouped import group_layout, quantize_activation_grouped
from primus_fp8_plugin.kernels.sm90.target import runs_on
from primus_fp8_plugin.kernels.triton.gemm import blockwise_gemm
from primus_fp8_plugin.kernels.triton.gemm_grouped import grouped_wgrad as portable_grouped_wgrad
from tests.gpu.test_gpu_grouped import ROUTINGS, _case, same


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--splits", nargs="*", default=["24:240", "40:232", "56:224"], help="PRODUCER:CONSUMER registers")
    ap.add_argument("--output", choices=["main_grad", "bf16"], default="main_grad")
    args = ap.parse_args(argv)
    if not (torch.cuda.is_available() and runs_on(torch.device("cuda"))):
        raise SystemExit("grouped_wgrad_repeat runs the Gluon grouped kernel: it needs an NVIDIA sm_90 GPU")
    _, counts, k, n = ROUTINGS[2]
    _, x, dy, _, _, p = _case(counts, k, n, "E4M3")
    layout = group_layout(torch.tensor(counts, device="cuda"), x.shape[0], "cuda")
    xq = quantize_activation_grouped(x, layout, p[0], backend="triton")
    dyq = quantize_activation_grouped(dy, layout, p[2], backend="triton")
    ops = (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, layout)
    xs, dys = xq.split(), dyq.split()
    num = len(counts)
    buf = torch.randn(num * n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    start = list(buf.view(num, n, k).unbind(0))
    if args.output == "bf16":
        ref = portable_grouped_wgrad(*ops, out_dtype=torch.bfloat16)
    else:
        ref = []
        for e in range(num):
            w = (dys[e].columnwise_data, dys[e].columnwise_scale_inv, xs[e].columnwise_data, xs[e].columnwise_scale_inv)
            ref.append(blockwise_gemm(*w, b_block_dim=1, out_dtype=torch.float32, accumulate_into=start[e].clone()))

    def run(cfg) -> int:
        if args.output == "bf16":
            dw = gg.grouped_wgrad_gluon(*ops, out_dtype=torch.bfloat16, config=cfg)
            return sum(not same(a, b) for a, b in zip(dw, ref))
        mg = list(buf.clone().view(num, n, k).unbind(0))
        assert gg.output_span(mg, n, k) is not None, "views of one buffer lie in one span"
        gg.grouped_wgrad_gluon(*ops, out_dtype=torch.float32, accumulate_into=mg, config=cfg)
        return sum(not same(a, b) for a, b in zip(mg, ref))

    print(f"qwen-like-128: {num} experts, K {k}, N {n}, device counts, {args.output} output; experts differing per call")
    for split in args.splits:
        pr, cr = (int(v) for v in split.split(":"))
        cfg = gg.GroupedConfig(block_m=256, block_n=128, producer_regs=pr, consumer_regs=cr)
        print(f"  producer {pr:3d} / consumer {cr:3d}: {[run(cfg) for _ in range(args.reps)]}", flush=True)


if __name__ == "__main__":
    main()
