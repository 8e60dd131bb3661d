#!/usr/bin/env python
"""Check and time the Gluon blockwise FP8 GEMM (``kernels/sm90/gemm.py``) on an H100/H200.

    python -m tools.check_gluon_gemm                      # correctness + benchmark, 128x128 tiles
    python -m tools.check_gluon_gemm --configs 128x128,128x128_s4,128x64,128x128_g16
    python -m tools.check_gluon_gemm --aot                # only the sm_90 compile check (no GPU needed)
    python -m tools.check_gluon_gemm --no-bench           # correctness only
    timeout -k 10 300 python -m tools.check_gluon_gemm --configs 128x128,128x256   # a hung kernel ends as rc 124
    python -m tools.check_gluon_gemm --configs 128x256,128x128 --rounds 3   # the two tiles, interleaved

Configs that do not handle a B scale layout (``gemm_gluon.supports``) print SKIP / n/a for it.

(a) correctness against a float64 emulation of the blockwise math (pass: relative Frobenius error
    <= 2e-3 against the emulation rounded to the output dtype: a bf16 output's own rounding is up to
    2^-9 = 1.95e-3 per element, so on a 128-element output the unrounded error is a coin toss around
    the bound; both errors are printed) on ragged shapes (M = 1, 130, 200, 300, 17920; N = 56, 136, 384),
    b_block_dim 1 and 2, bias, accumulate_into, bf16 / fp16 / fp32 outputs, e5m2 A, and scale
    tensors TMA cannot read as they are (unpadded rows, unaligned base: the 128x256 kernel copies
    them); configs after the first must also give bit-identical outputs;
(b) TFLOPS of the Gluon kernel vs cuBLAS blockwise (torch.nn.functional.scaled_mm) and the plain
    Triton ``blockwise_gemm``: fwd form (128x128 B scales, bf16 out), wgrad form (1x128 B scales,
    bf16 out) and wgrad+acc (1x128 B scales, accumulate_into an fp32 main_grad; cuBLAS column: fp32
    output without the accumulation, so its ratio is a lower bound for ours).
Every case is guarded: a failure prints its exception and the script goes on.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback

import torch

from primus_fp8_plugin.kernels.sm90 import gemm as gemm_gluon
from primus_fp8_plugin.kernels.sm90.gemm import GluonGemmConfig, blockwise_gemm_gluon
from tools.gemm_variants import VARIANTS

TOL = 2e-3
CONFIGS = VARIANTS

# (17920, 136 / 56, 256): 140 tiles of 128 rows, more than the H200's 132 SMs, so some CTAs store a second
# tile after one whose N edge left 3 (N=136) or 1 (N=56) of the quarter-chain epilogue's four pieces
CORRECTNESS_SHAPES = [(1, 128, 128), (130, 256, 384), (200, 384, 640), (4096, 4096, 4096), (300, 136, 400),
                      (17920, 136, 256), (17920, 56, 256)]  # fmt: skip
# for the configs after the first (without --check-all-configs): the ragged ones
SMALL_SHAPES = [s for s in CORRECTNESS_SHAPES if s != (4096, 4096, 4096)]
BENCH_SHAPES = [
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 8192, 8192),
    (8192, 8192, 29568),
    (8192, 29568, 8192),
    (16384, 14336, 4096),
    (16384, 4096, 14336),
]


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def pad4(x: int) -> int:
    return cdiv(x, 4) * 4


def make_inputs(m, n, k, b_block_dim, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn, seed=0):
    """FP8 operands and positive scales in TE's layouts (rows padded to a multiple of 4)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, device="cuda", generator=g) * 2.0).to(a_dtype)
    b = (torch.randn(n, k, device="cuda", generator=g) * 2.0).to(b_dtype)
    kb = cdiv(k, 128)
    a_s = torch.rand(kb, pad4(m), device="cuda", generator=g) * 1.5 + 0.25
    if b_block_dim == 2:
        b_s = torch.rand(cdiv(n, 128), pad4(kb), device="cuda", generator=g) * 1.5 + 0.25
    else:
        b_s = torch.rand(kb, pad4(n), device="cuda", generator=g) * 1.5 + 0.25
    return a, a_s, b, b_s


def reference(a, a_s, b, b_s, b_block_dim, bias=None, acc=None):
    """float64 emulation: sum_kb (A[:, kb] @ B[:, kb]^T) * a_s[kb, m] * b_scale(n, kb) (+ bias) (+ acc)."""
    m, k = a.shape
    n = b.shape[0]
    a64 = a.double()
    b64 = b.double()
    out = torch.zeros(m, n, dtype=torch.float64, device=a.device)
    for kb in range(cdiv(k, 128)):
        ks = slice(kb * 128, min(k, kb * 128 + 128))
        part = a64[:, ks] @ b64[:, ks].T
        sa = a_s[kb, :m].double()[:, None]
        if b_block_dim == 2:
            sb = b_s[:, kb].double().repeat_interleave(128)[:n][None, :]
        else:
            sb = b_s[kb, :n].double()[None, :]
        out += part * sa * sb
    if bias is not None:
        out += bias.double()[None, :]
    if acc is not None:
        out += acc.double()
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check_case(tag: str, case, first_outputs: dict | None = None) -> int:
    """Run one correctness case (``case()`` returns the output, the float64 reference and a problem
    message or None); print PASS / FAIL / ERROR; return the number of failures (0 or 1).

    Pass: relative Frobenius error <= TOL against the reference rounded to the output's dtype (the
    rounding the caller asked for is not the kernel's error); the unrounded error is printed too.
    ``first_outputs``: outputs of the first config by tag; a later config whose output is not
    bit-identical to it fails (every config promotes in the same per-element order)."""
    try:
        out, ref, problem = case()
        torch.cuda.synchronize()
        err = rel_err(out, ref.to(out.dtype).double())
        raw = rel_err(out, ref)
        ok = err <= TOL and torch.isfinite(out).all().item() and problem is None
        if problem is not None:
            print(f"    {problem}")
        same = ""
        if first_outputs is not None:
            if tag in first_outputs:
                identical = torch.equal(first_outputs[tag], out)
                ok = ok and identical  # every config promotes in the same per-element order
                same = f"  {'identical to' if identical else 'DIFFERS from'} the first config"
            else:
                first_outputs[tag] = out.clone()
        print(f"  {'PASS' if ok else 'FAIL'} {tag} rel_err={err:.2e} (unrounded {raw:.2e}){same}")
        return int(not ok)
    except Exception as e:  # noqa: BLE001
        print(f"  ERROR {tag}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=3)
        return 1


def correctness(cfg_name: str, cfg: GluonGemmConfig, shapes, first_outputs: dict | None = None) -> int:
    fails = 0
    print(f"\n=== correctness [{cfg_name}] {cfg}")
    cases = []
    for m, n, k in shapes:
        for bdim in (2, 1):
            cases.append((m, n, k, bdim, torch.bfloat16, False, False, torch.float8_e4m3fn))
            cases.append((m, n, k, bdim, torch.float32, True, False, torch.float8_e4m3fn))
            cases.append((m, n, k, bdim, torch.bfloat16, True, False, torch.float8_e4m3fn))
            cases.append((m, n, k, bdim, torch.float32, False, True, torch.float8_e4m3fn))
        cases.append((m, n, k, 1, torch.float16, False, False, torch.float8_e4m3fn))
        cases.append((m, n, k, 1, torch.float32, True, True, torch.float8_e4m3fn))
        cases.append((m, n, k, 1, torch.bfloat16, False, False, torch.float8_e5m2))  # HYBRID wgrad: dY e5m2
        cases.append((m, n, k, 1, torch.float32, False, True, torch.float8_e5m2))  # ... into main_grad
    skipped = set()
    for m, n, k, bdim, od, has_bias, accumulate, a_dtype in cases:
        tag = (f"M={m:5} N={n:5} K={k:5} b{bdim}d out={str(od).split('.')[-1]:8} bias={int(has_bias)} "
               f"acc={int(accumulate)} a={str(a_dtype).split('.')[-1]}")  # fmt: skip
        why = gemm_gluon.supports(cfg, bdim, od, accumulate, has_bias)
        if why is not None:  # the config does not handle this case (the wrapper raises NotImplementedError)
            if why not in skipped:
                print(f"  SKIP (b{bdim}d out={str(od).split('.')[-1]} acc={int(accumulate)} bias={int(has_bias)} "
                      f"and alike): {why}")  # fmt: skip
                skipped.add(why)
            continue

        def case(m=m, n=n, k=k, bdim=bdim, od=od, has_bias=has_bias, accumulate=accumulate, a_dtype=a_dtype):
            a, a_s, b, b_s = make_inputs(m, n, k, bdim, a_dtype=a_dtype, seed=m * 7 + n * 3 + k + bdim)
            g = torch.Generator(device="cuda").manual_seed(m + n + k)  # the same bias / acc for every config
            bias = (torch.randn(n, device="cuda", generator=g) * 10).to(od) if has_bias else None
            acc0 = torch.randn(m, n, device="cuda", generator=g) * 10 if accumulate else None
            acc_in = acc0.clone() if accumulate else None
            out = blockwise_gemm_gluon(a, a_s, b, b_s, b_block_dim=bdim, out_dtype=od, bias=bias,
                                       accumulate_into=acc_in, config=cfg)  # fmt: skip
            in_place = not accumulate or out.data_ptr() == acc_in.data_ptr()
            problem = None if in_place else "accumulate_into was not updated in place"
            return out, reference(a, a_s, b, b_s, bdim, bias, acc0), problem

        fails += check_case(tag, case, first_outputs)
    # scale tensors TMA cannot read in place (rows not padded to 4, base not 16-byte aligned)
    for bdim, od, accumulate in ((1, torch.bfloat16, False), (1, torch.float32, True), (2, torch.bfloat16, False)):
        if gemm_gluon.supports(cfg, bdim, od, accumulate) is not None:
            continue
        m, n, k = 130, 136, 400 if bdim == 1 else 656  # b2d: K/128 = 6 scale columns, 24-byte rows
        tag = (f"M={m:5} N={n:5} K={k:5} b{bdim}d out={str(od).split('.')[-1]:8} acc={int(accumulate)} "
               "unpadded/unaligned scales")  # fmt: skip

        def case(m=m, n=n, k=k, bdim=bdim, od=od, accumulate=accumulate):
            a, a_s, b, b_s = make_inputs(m, n, k, bdim, seed=11)
            a_s = a_s[:, :m].contiguous()  # row stride 130 * 4 bytes
            if bdim == 1:
                b_s = torch.cat([torch.ones(b_s.shape[0], 1, device="cuda"), b_s[:, :n]], 1)[:, 1:]  # base + 4 bytes
            else:
                b_s = b_s[:, : cdiv(k, 128)].contiguous()
            acc0 = torch.randn(m, n, device="cuda") if accumulate else None
            acc_in = acc0.clone() if accumulate else None
            out = blockwise_gemm_gluon(a, a_s, b, b_s, b_block_dim=bdim, out_dtype=od, accumulate_into=acc_in, config=cfg)
            return out, reference(a, a_s, b, b_s, bdim, None, acc0), None

        fails += check_case(tag, case)
    # unsupported inputs must raise cleanly
    try:
        a, a_s, b, b_s = make_inputs(64, 128, 136, 1)
        a2 = torch.empty(64, 136, dtype=torch.float8_e4m3fn, device="cuda")[:, :130]
        blockwise_gemm_gluon(a2, a_s, b[:, :130].contiguous(), b_s, b_block_dim=1, out_dtype=torch.bfloat16,
                             config=CONFIGS["128x128"])  # fmt: skip
        print("  FAIL unsupported input (non-contiguous, K=130) did not raise")
        fails += 1
    except (ValueError, NotImplementedError) as e:
        print(f"  PASS unsupported input raises {type(e).__name__}: {e}")
    return fails


def cublas_fn(a, a_s, b, b_s, b_block_dim, out_dtype):
    F = torch.nn.functional
    m = a.shape[0]
    n = b.shape[0]
    a_view = a_s[:, :m].t() if a_s.shape[1] != m else a_s.t()
    if b_block_dim == 2:
        b_view, recipe = b_s.t(), F.ScalingType.BlockWise128x128
    else:
        b_view, recipe = (b_s[:, :n].t() if b_s.shape[1] != n else b_s.t()), F.ScalingType.BlockWise1x128
    return lambda: F.scaled_mm(a, b.t(), a_view, F.ScalingType.BlockWise1x128, b_view, recipe, output_dtype=out_dtype)


def bench(configs: dict[str, GluonGemmConfig], shapes, with_triton: bool, rounds: int = 1) -> None:
    """TFLOPS per form and shape; with ``rounds`` > 1 every contender is timed once per round, the
    rounds interleaved (clock and power drift hit all alike), and the median is printed with the range."""
    import statistics

    import triton

    from primus_fp8_plugin.kernels.triton.gemm import blockwise_gemm

    print(f"\n=== benchmark (TFLOPS{f', median of {rounds} interleaved rounds (min-max)' if rounds > 1 else ''}; "
          "ratio = gluon / cuBLAS; wgrad+acc: cuBLAS writes fp32 without accumulating)")  # fmt: skip
    header = f"{'form':6} {'M':>6} {'N':>6} {'K':>6} {'cuBLAS':>8} {'triton':>8}"
    for name in configs:
        header += f" {name:>10} {'ratio':>6}"
    print(header + "  check(gluon vs cuBLAS rel err)")
    for m, n, k in shapes:
        forms = (("fwd", 2, torch.bfloat16, False), ("wgrad", 1, torch.bfloat16, False), ("w+acc", 1, torch.float32, True))
        for form, bdim, od, accumulate in forms:
            line = f"{form:6} {m:6} {n:6} {k:6}"
            flops = 2.0 * m * n * k
            try:
                a, a_s, b, b_s = make_inputs(m, n, k, bdim)
            except Exception as e:  # noqa: BLE001
                print(f"{line} inputs failed: {e}")
                continue

            def tflops(fn):
                ms = triton.testing.do_bench(fn, warmup=10, rep=60)
                return flops / ms * 1e-9

            # what runs, by label (a contender that failed is absent: printed as err); configs that do
            # not take this form are printed as n/a
            contenders = {}
            not_applicable = set()
            ref_out = None
            try:
                fn = cublas_fn(a, a_s, b, b_s, bdim, od)
                ref_out = fn()
                contenders["cuBLAS"] = fn
            except Exception as e:  # noqa: BLE001
                print(f"    cuBLAS failed: {type(e).__name__}: {str(e)[:300]}")
            acc_buf = torch.zeros(m, n, device="cuda", dtype=torch.float32) if accumulate else None
            if with_triton:
                contenders["triton"] = functools.partial(blockwise_gemm, a, a_s, b, b_s, b_block_dim=bdim, out_dtype=od,
                                                         accumulate_into=acc_buf)  # fmt: skip
            checks = []
            for name, cfg in configs.items():
                if gemm_gluon.supports(cfg, bdim, od, accumulate) is not None:
                    not_applicable.add(name)
                    continue
                fn = functools.partial(blockwise_gemm_gluon, a, a_s, b, b_s, b_block_dim=bdim, out_dtype=od,
                                       accumulate_into=acc_buf, config=cfg)  # fmt: skip
                try:
                    if acc_buf is not None:
                        acc_buf.zero_()  # the check compares one product (the timing then accumulates on)
                    out = fn()
                    if ref_out is not None:
                        checks.append(f"{name}:{rel_err(out.float(), ref_out.double()):.1e}")
                    contenders[name] = fn
                except Exception as e:  # noqa: BLE001
                    print(f"    gluon[{name}] failed: {type(e).__name__}: {str(e)[:500]}")
            times: dict[str, list[float]] = {label: [] for label in contenders}
            for _ in range(rounds):
                for label, fn in contenders.items():
                    try:
                        times[label].append(tflops(fn))
                    except Exception as e:  # noqa: BLE001
                        print(f"    {label} failed: {type(e).__name__}: {str(e)[:300]}")

            def fmt(label):
                ts = times.get(label) or []
                if not ts:
                    return float("nan"), f" {'err':>8}"
                med = statistics.median(ts)
                spread = f" ({min(ts):.0f}-{max(ts):.0f})" if rounds > 1 else ""
                return med, f" {med:8.1f}{spread}"

            t_cublas, text = fmt("cuBLAS")
            line += text
            line += fmt("triton")[1] if with_triton else f" {'-':>8}"
            for name in configs:
                if name in not_applicable:
                    line += f" {'n/a':>10} {'-':>6}"
                    continue
                t, text = fmt(name)
                line += f"{text} {t / t_cublas:6.2f}"
            print(line + "  " + " ".join(checks), flush=True)
            del a, b, a_s, b_s, ref_out, acc_buf
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--configs", default="128x128", help=f"comma list of configs to check and time, from: {', '.join(CONFIGS)} (or 'all')"
    )
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--no-bench", action="store_true", help="skip the benchmark")
    ap.add_argument("--no-triton", action="store_true", help="do not time the plain Triton kernel")
    ap.add_argument("--check-all-configs", action="store_true",
                    help="run the full correctness check for every config (default: only the first config; "
                         "the others get the ragged shapes, without 4096^3)")  # fmt: skip
    ap.add_argument("--shapes", default="", help="benchmark only these shapes, e.g. 4096x4096x4096,8192x8192x8192")
    ap.add_argument("--aot", action="store_true", help="only run the sm_90 AOT compile check (no GPU needed)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds per shape (median reported)")
    args = ap.parse_args(argv)

    names = list(CONFIGS) if args.configs == "all" else [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        print(f"unknown configs {unknown}; known: {list(CONFIGS)}")
        return 2
    configs = {c: CONFIGS[c] for c in names}

    if args.aot:
        from tools.aot_triton import check_gemm

        return 0 if check_gemm(configs=configs) else 1

    if not torch.cuda.is_available():
        print("no CUDA device: run with --aot for the compile-only check")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    import triton

    print(f"triton {triton.__version__}")
    t0 = time.time()
    fails = 0
    if not args.no_check:
        first_outputs: dict = {}
        for i, (name, cfg) in enumerate(configs.items()):
            shapes = CORRECTNESS_SHAPES if (i == 0 or args.check_all_configs) else SMALL_SHAPES
            fails += correctness(name, cfg, shapes, first_outputs)
        print(f"\ncorrectness: {'ALL PASS' if fails == 0 else f'{fails} FAILED'}  ({time.time() - t0:.0f} s)", flush=True)
    if not args.no_bench:
        shapes = BENCH_SHAPES
        if args.shapes:
            shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
        bench(configs, shapes, not args.no_triton, args.rounds)
    print(f"\ntotal {time.time() - t0:.0f} s")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
