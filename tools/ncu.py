"""Nsight Compute for our kernels: run one kernel under an NVTX range (``run``), and summarise the
reports (``summary``). ``tools/gpu/gpu_ncu.sh`` runs both on the GPU machine.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --set full --import-source yes \\
        -o report python -m tools.ncu run gemm-fwd --impl ours --shape 8192x8192x8192
    ncu -i report.ncu-rep --page details            # throughput, occupancy, stall reasons
    ncu -i report.ncu-rep --page source --csv --print-source sass   # per-instruction stall samples
    python -m tools.ncu summary OUTDIR/NAME [OUTDIR/NAME2 ...] [--top 8]

``run`` targets: ``gemm-fwd``, ``gemm-dgrad``, ``gemm-wgrad`` (``--impl ours`` = what the triton
backend runs, ``cublas`` = torch's blockwise scaled_mm, ``gluon:<config>`` = a
``tools.gemm_variants.VARIANTS`` entry; ``--shape MxNxK`` of the linear layer, as in
benchmarks/bench_gemm.py), ``quant-act``, ``quant-weight`` (``--shape MxK``; ``--impl ours``: the
Triton kernel, ``gluon``: the Hopper Gluon kernel) and ``copy`` (a device-to-device copy of an
``MxK`` bf16 tensor, the bandwidth ceiling). The operands are prepared and the kernel is run twice
outside the range (compilation, caches), so the range holds exactly the launches of one call.

``summary``, for each report prefix NAME (as ``gpu_ncu.sh`` writes them): a few lines of
``NAME_details.txt`` (clock, duration, throughputs, the busiest pipe), the warp-stall samples of
``NAME_sass.csv`` summed by reason over the kernel and by instruction kind (FMUL, LDS, QGMMA, ...),
and the instructions with the most samples (address, SASS, samples by reason).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter
from pathlib import Path

DETAIL_KEYS = ("SM Frequency", "Duration", "DRAM Throughput", "L2 Cache Throughput", "Compute (SM) Throughput",
               "Issue Slots Busy", "Registers Per Thread", "Achieved Occupancy", "highest-utilized pipeline")  # fmt: skip


def details(path: Path) -> list[str]:
    if not path.exists():
        return [f"(no {path.name})"]
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if any(key in line for key in DETAIL_KEYS) and line.strip() not in out:
            out.append(re.sub(r"\s{2,}", " ", line.strip())[:120])
    return out


def instruction_kind(sass: str) -> str:
    """The mnemonic of a SASS line without predicate or modifiers (``@!P0 FMUL.FTZ R1, ...`` -> FMUL)."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def by_kind(per_inst: list) -> dict[str, Counter]:
    """Stall samples summed over the instructions of each kind (rows as ``stalls`` collects them)."""
    kinds: dict[str, Counter] = {}
    for _, _, src, counts in per_inst:
        kinds.setdefault(instruction_kind(src.strip()), Counter()).update(counts)
    return kinds


def stalls(path: Path, top: int) -> list[str]:
    if not path.exists():
        return [f"(no {path.name})"]
    rows = list(csv.reader(path.read_text(errors="replace").splitlines()))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[header_at]
    reasons = [c for c in header if c.startswith("stall_") and "(Not Issued)" not in c]
    idx = {c: header.index(c) for c in reasons}
    total: Counter = Counter()
    per_inst = []
    for r in rows[header_at + 1 :]:
        if len(r) < len(header):
            continue
        counts = Counter()
        for c in reasons:
            try:
                counts[c] = int(float(r[idx[c]] or 0))
            except ValueError:
                pass
        total.update(counts)
        per_inst.append((sum(counts.values()), r[0], r[1], counts))
    n = sum(total.values()) or 1
    out = [f"total samples {n}"]
    out += [f"  {c:30} {v:8d} {100 * v / n:5.1f}%" for c, v in total.most_common() if v]
    out.append("by instruction kind (share of all samples; top reasons):")
    for kind, counts in sorted(by_kind(per_inst).items(), key=lambda t: -sum(t[1].values()))[:top]:
        why = " ".join(f"{c[6:]}:{100 * v / n:.1f}" for c, v in counts.most_common(3) if v)
        out.append(f"  {kind:10} {100 * sum(counts.values()) / n:5.1f}%  {why}")
    for s, addr, src, counts in sorted(per_inst, key=lambda t: -t[0])[:top]:
        why = " ".join(f"{c[6:]}:{v}" for c, v in counts.most_common(3) if v)
        out.append(f"  {s:6d} {100 * s / n:5.1f}% {addr[-5:]:>5} {src.strip()[:58]:58} {why}")
    return out


TARGETS = ("gemm-fwd", "gemm-dgrad", "gemm-wgrad", "quant-act", "quant-weight", "copy")


def gemm_call(direction: str, impl: str, m: int, n: int, k: int):
    import torch

    from benchmarks.bench_gemm import operands
    from primus_fp8_plugin import BlockwiseRecipe
    from primus_fp8_plugin.backends.cublas import CublasBackend
    from primus_fp8_plugin.backends.triton import hopper_or_portable_gemm
    from primus_fp8_plugin.kernels.sm90.gemm import blockwise_gemm_gluon
    from tools.gemm_variants import VARIANTS

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
    if impl.startswith("gluon:") and impl[6:] in VARIANTS:
        cfg = VARIANTS[impl[6:]]
        return lambda: blockwise_gemm_gluon(a, sa, b, sb, b_block_dim=bdim, out_dtype=torch.bfloat16, config=cfg)
    raise SystemExit(f"--impl must be ours, cublas or gluon:<one of {sorted(VARIANTS)}>, got {impl!r}")


def quant_call(target: str, impl: str, m: int, k: int):
    import torch

    from primus_fp8_plugin import BlockwiseRecipe, TensorRole
    from primus_fp8_plugin.kernels.sm90.quantize_act import quantize_1x128_dual_gluon
    from primus_fp8_plugin.kernels.sm90.quantize_weight import quantize_128x128_gluon
    from primus_fp8_plugin.kernels.triton.quantize_act import quantize_1x128_dual
    from primus_fp8_plugin.kernels.triton.quantize_weight import quantize_128x128

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


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("tools.ncu run needs a CUDA GPU")
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


def summary(args) -> int:
    for prefix in args.reports:
        p = Path(prefix)
        print(f"== {p.name}")
        for line in details(p.parent / f"{p.name}_details.txt") + stalls(p.parent / f"{p.name}_sass.csv", args.top):
            print(" " + line)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run one kernel under the NVTX range 'profile' (inside ncu)")
    r.add_argument("target", choices=TARGETS)
    r.add_argument("--impl", default="ours", help="GEMMs: ours | cublas | gluon:<config>; quant: ours (Triton) | gluon")
    r.add_argument("--shape", default="", help="MxNxK (GEMMs, default 8192x8192x8192) or MxK (default 8192x8192)")
    s = sub.add_parser("summary", help="key metrics and warp stalls of reports written by gpu_ncu.sh")
    s.add_argument("reports", nargs="+", help="OUTDIR/NAME prefixes (as given to gpu_ncu.sh)")
    s.add_argument("--top", type=int, default=8, help="instructions to list")
    args = ap.parse_args(argv)
    return run(args) if args.command == "run" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
