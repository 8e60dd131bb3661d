#!/usr/bin/env python3
"""Run one kernel under an NVTX range named ``profile``, for Nsight Compute (hardware counters).

    ncu --clock-control none --nvtx --nvtx-include "profile/" --set full --import-source yes \\
        -o report python -m tools.ncu_targets gemm-fwd --impl ours --shape 8192x8192x8192
    ncu -i report.ncu-rep --page details            # throughput, occupancy, stall reasons
    ncu -i report.ncu-rep --page source --csv --print-source sass   # per-instruction stall samples

Targets: ``gemm-fwd``, ``gemm-dgrad``, ``gemm-wgrad`` (``--impl ours`` = what the triton backend runs,
``cublas`` = torch's blockwise scaled_mm, ``gluon:<config>`` = a ``gemm_gluon.BENCH_CONFIGS`` entry;
``--shape MxNxK`` of the linear layer, as in bench_gemm.py), ``quant-act``, ``quant-weight``
(``--shape MxK``; ``--impl ours``: the Triton kernel, ``gluon``: the Hopper Gluon kernel) and
``copy`` (a device-to-device copy of an ``MxK`` bf16 tensor, the bandwidth ceiling). The operands are prepared and the kernel is
run twice outside the range (compilation, caches), so the range holds exactly the launches of one call.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_gemm import operands
from primus_fp8_plugin import BlockwiseRecipe, TensorRole
from primus_fp8_plugin.backends.cublas import CublasBackend
from primus_fp8_plugin.backends.triton import hopper_or_portable_gemm
from primus_fp8_plugin.backends.triton.gemm_gluon import BENCH_CONFIGS, blockwise_gemm_gluon
from primus_fp8_plugin.backends.triton.quantize_act import quantize_1x128_dual
from primus_fp8_plugin.backends.triton.quantize_act_gluon import quantize_1x128_dual_gluon
from primus_fp8_plugin.backends.triton.quantize_weight import quantize_128x128
from primus_fp8_plugin.backends.triton.quantize_weight_gluon import quantize_128x128_gluon

TARGETS = ("gemm-fwd", "gemm-dgrad", "gemm-wgrad", "quant-act", "quant-weight", "copy")


def gemm_call(direction: str, impl: str, m: int, n: int, k: int):
    recipe = BlockwiseRecipe()
    meta, (a, sa, b, sb, bdim) = operands(m, n, k, direction, recipe)
    if impl == "ours":
        return lambda: hopper_or_portable_gemm(a, sa, b, sb, b_block_dim=bdim, out_dtype=torch.bfloat16)
    if impl == "cublas":
        cublas = CublasBackend()
        return {
            "fwd": lambda: cublas.gemm_fwd(meta["a"], meta["b"], None, torch.bfloat16),
            "dgrad": lambda: cublas.gemm_dgrad(meta["a"], meta["b"], torch.bfloat16),
            "wgrad": lambda: cublas.gemm_wgrad(meta["a"], meta["b"], torch.bfloat16, None),
        }[direction]
    if impl.startswith("gluon:") and impl[6:] in BENCH_CONFIGS:
        cfg = BENCH_CONFIGS[impl[6:]]
        return lambda: blockwise_gemm_gluon(a, sa, b, sb, b_block_dim=bdim, out_dtype=torch.bfloat16, config=cfg)
    raise SystemExit(f"--impl must be ours, cublas or gluon:<one of {sorted(BENCH_CONFIGS)}>, got {impl!r}")


def quant_call(target: str, impl: str, m: int, k: int):
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    recipe = BlockwiseRecipe()
    if target == "quant-act":
        params = recipe.params(TensorRole.INPUT)
        if impl == "gluon":
            return lambda: quantize_1x128_dual_gluon(x, params, rowwise=True, columnwise=True)
        return lambda: quantize_1x128_dual(x, params, rowwise=True, columnwise=True)
    if target == "quant-weight":
        params = recipe.params(TensorRole.WEIGHT)
        if impl == "gluon":
            return lambda: quantize_128x128_gluon(x, params)
        return lambda: quantize_128x128(x, params)
    dst = torch.empty_like(x)
    return lambda: dst.copy_(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", choices=TARGETS)
    ap.add_argument("--impl", default="ours", help="GEMMs: ours | cublas | gluon:<config>; quant: ours (Triton) | gluon")
    ap.add_argument("--shape", default="", help="MxNxK (GEMMs, default 8192x8192x8192) or MxK (default 8192x8192)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_targets needs a CUDA GPU")
        return 2
    dims = [int(d) for d in args.shape.split("x")] if args.shape else []
    if args.target.startswith("gemm-"):
        m, n, k = dims or (8192, 8192, 8192)
        fn = gemm_call(args.target[5:], args.impl, m, n, k)
    else:
        m, k = dims or (8192, 8192)
        fn = quant_call(args.target, args.impl, m, k)
    fn()
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"ran {args.target} {args.impl if args.target.startswith('gemm-') else ''} {dims or 'default shape'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
