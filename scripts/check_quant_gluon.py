#!/usr/bin/env python
"""Check and time the Gluon 1x128 dual quantization kernel (``backends/triton/quantize_act_gluon.py``)
against the Triton kernel (``quantize_act.quantize_1x128_dual``) on an H100/H200.

    timeout -k 10 120 .venv/bin/python scripts/check_quant_gluon.py        # a hung kernel ends as rc 124
    timeout -k 10 120 .venv/bin/python scripts/check_quant_gluon.py --no-bench
    timeout -k 10 120 .venv/bin/python scripts/check_quant_gluon.py --no-check --configs all
    .venv/bin/python scripts/check_quant_gluon.py --aot                   # sm_90 compile check only (no GPU)

(a) bit-exactness vs the Triton kernel (data bytes and scale_inv bits, NaN == NaN) for every mode
    (rowwise+columnwise, rowwise, columnwise) on ragged shapes with NaN/Inf tiles, zero rows, tiny
    values, fp16/fp32 inputs, E5M2, pow2=False and amax_epsilon; shapes the Gluon kernel must refuse
    (TMA rules) are checked to raise NotImplementedError;
(b) time (triton.testing.do_bench, median) of Gluon (several launch configs) vs Triton vs a device
    copy (x.clone-style copy_ of the same bytes), bf16 input, both copies, printed in us and % of
    copy speed where bytes = 2 read + 2 written per element + 2 x 4 B of scales per 128 elements.
Every case is guarded: a failure prints its exception and the script goes on. Exit code 1 if any
bit-exactness check failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from primus_fp8_plugin.backends.triton import quantize_act, quantize_act_gluon  # noqa: E402
from primus_fp8_plugin.backends.triton.quantize_act_gluon import GluonQuantConfig  # noqa: E402
from primus_fp8_plugin.recipe import QuantParams  # noqa: E402

MODES = {"both": (True, True), "row": (True, False), "col": (False, True)}

# name -> config timed in (b) ("default" is what the wrapper uses without options)
BENCH_CONFIGS = {
    "default": GluonQuantConfig(),
    "s2": GluonQuantConfig(num_stages=2),
    "s4": GluonQuantConfig(num_stages=4, out_bufs=1),
    "s3o1": GluonQuantConfig(num_stages=3, out_bufs=1),
    "s2o1x2": GluonQuantConfig(num_stages=2, out_bufs=1, ctas_per_sm=2, maxnreg=128),
    "w4": GluonQuantConfig(num_warps=4, maxnreg=0),
    "w4s2o1x2": GluonQuantConfig(num_warps=4, num_stages=2, out_bufs=1, ctas_per_sm=2, maxnreg=0),
    "nomaxnreg": GluonQuantConfig(maxnreg=0),
}


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[bool, str]:
    if a is None or b is None:
        return (a is None and b is None), "presence differs"
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    ia = a.view(torch.uint8) if a.element_size() == 1 else a.view(torch.int32)
    ib = b.view(torch.uint8) if b.element_size() == 1 else b.view(torch.int32)
    diff = ia != ib
    if a.dtype == torch.float32:  # any NaN equals any NaN
        diff &= ~(torch.isnan(a) & torch.isnan(b))
    n = int(diff.sum())
    if n == 0:
        return True, ""
    idx = diff.nonzero()[:3].tolist()
    ex = ", ".join(f"{tuple(i)}: {a[tuple(i)].item()} vs {b[tuple(i)].item()}" for i in idx)
    return False, f"{n} differing entries, e.g. {ex}"


def _make_input(m: int, k: int, dtype: torch.dtype, special: bool, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.float32)
    # rows of widely different magnitude (exercise pow2 scales / saturation)
    x *= torch.exp2(torch.randint(-20, 20, (m, 1), device="cuda", generator=g).float())
    if special and m > 2 and k > 2:
        x[0, :] = 0.0  # zero row -> scale 1
        x[1, : min(k, 128)] = 1e-30  # tiny values (overflow -> in_max scale, or flush)
        x[m // 2, k // 2] = float("nan")
        x[m - 1, k - 1] = float("inf")
        x[m // 3, 0] = float("-inf")
        if m > 200 and k > 200:
            x[130:140, 140:150] = 0.0
    return x.to(dtype)


def check_bits(verbose: bool) -> int:
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    all3, both = ("both", "row", "col"), ("both",)
    cases = [
        # (M, K, in dtype, fp8, pow2, eps, special inputs, modes); one compile per distinct variant,
        # so the variety is spread over few (dtype, fp8, pow2, mode) combinations
        (16, 128, torch.bfloat16, e4, True, 0.0, False, all3),
        (144, 384, torch.bfloat16, e4, True, 0.0, True, all3),
        (4096, 4096, torch.bfloat16, e4, True, 0.0, True, all3),
        (2048, 8192, torch.bfloat16, e4, True, 0.0, True, both),
        (272, 400, torch.bfloat16, e4, True, 0.0, True, all3),  # ragged K (400 = 3 x 128 + 16)
        (1, 128, torch.bfloat16, e4, True, 0.0, False, all3),  # columnwise refused (M % 16)
        (130, 272, torch.bfloat16, e4, True, 0.0, True, all3),  # columnwise refused; rowwise pads row scales
        (1000, 1536, torch.bfloat16, e4, True, 0.0, True, all3),  # columnwise refused
        (1008, 1544, torch.bfloat16, e4, True, 0.0, True, all3),  # rowwise refused (K % 16)
        (130, 136, torch.bfloat16, e4, True, 0.0, True, both),  # refused
        (208, 144, torch.float16, e4, True, 0.0, True, both),
        (144, 384, torch.float32, e4, True, 0.0, True, all3),
        (1008, 1540, torch.float32, e4, True, 0.0, True, all3),  # rowwise refused (K % 16)
        (1024, 1536, torch.float32, e4, False, 0.0, True, both),
        (144, 384, torch.bfloat16, e5, True, 0.0, True, both),
        (1024, 1024, torch.bfloat16, e5, False, 0.0, True, both),
        (144, 384, torch.bfloat16, e4, False, 1e-4, True, both),
        (400, 640, torch.bfloat16, e4, False, 1e-4, False, both),
        (512, 640, torch.float16, e5, True, 1e-12, True, both),
    ]
    failures = 0
    t0 = time.time()
    for seed, (m, k, dt, f8, pow2, eps, special, modes) in enumerate(cases):
        params = QuantParams(f8, 1, pow2, eps)
        x = _make_input(m, k, dt, special, seed)
        for mode in modes:
            row, col = MODES[mode]
            name = f"{m}x{k} {str(dt)[6:]}->{str(f8)[6:]} pow2={int(pow2)} eps={eps:g} {mode}"
            reason = quantize_act_gluon.unsupported_reason(x, params, row, col)
            try:
                if reason is not None:
                    try:
                        quantize_act_gluon.quantize_1x128_dual_gluon(x, params, rowwise=row, columnwise=col)
                    except NotImplementedError:
                        if verbose:
                            print(f"  refused (ok)  {name}: {reason}")
                        continue
                    print(f"  FAIL {name}: expected NotImplementedError ({reason})")
                    failures += 1
                    continue
                ref = quantize_act.quantize_1x128_dual(x, params, rowwise=row, columnwise=col)
                out = quantize_act_gluon.quantize_1x128_dual_gluon(x, params, rowwise=row, columnwise=col)
                torch.cuda.synchronize()
                bad = []
                for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
                    ok, why = _bits_equal(getattr(out, field), getattr(ref, field))
                    if not ok:
                        bad.append(f"{field}: {why}")
                if bad:
                    failures += 1
                    print(f"  FAIL {name}: " + "; ".join(bad))
                elif verbose:
                    print(f"  ok   {name}")
            except Exception:  # noqa: BLE001
                failures += 1
                print(f"  FAIL {name}: exception")
                traceback.print_exc()
    # launch configs must give the same bits
    x = _make_input(1024, 2048, torch.bfloat16, True, 99)
    params = QuantParams(e4, 1, True, 0.0)
    ref = quantize_act.quantize_1x128_dual(x, params, rowwise=True, columnwise=True)
    for cname, cfg in BENCH_CONFIGS.items():
        try:
            out = quantize_act_gluon.quantize_1x128_dual_gluon(x, params, rowwise=True, columnwise=True, config=cfg)
            oks = [_bits_equal(getattr(out, f), getattr(ref, f))[0] for f in
                   ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")]  # fmt: skip
            if not all(oks):
                failures += 1
                print(f"  FAIL config {cname}: {oks}")
            elif verbose:
                print(f"  ok   config {cname}")
        except Exception as e:  # noqa: BLE001
            print(f"  config {cname}: {type(e).__name__}: {e}")
            if not isinstance(e, ValueError):  # ValueError: does not fit in shared memory (not a bug)
                failures += 1
    print(f"bit-exactness: {'PASS' if failures == 0 else f'{failures} FAILURES'} ({time.time() - t0:.1f} s)")
    return failures


def bench(config_names: list[str]) -> None:
    import triton.testing

    shapes = [(8192, 8192), (16384, 4096), (8192, 29568), (4096, 14336)]
    params = QuantParams(torch.float8_e4m3fn, 1, True, 0.0)
    names = ["triton"] + [f"gluon:{c}" for c in config_names]
    print(f"\n{'M x K':>12} {'copy us':>8} " + " ".join(f"{n:>18}" for n in names) + "   (us / % of copy)")
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        # a device copy of the same bytes: read 2 B/elem, write 2 B/elem
        src = x.view(-1)
        dst = torch.empty_like(src)
        t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=40, return_mode="median")
        bytes_q = m * k * 4 + 2 * (m * k // 128) * 4
        bw_copy = 4 * m * k / t_copy
        cells = []
        fns = {"triton": lambda: quantize_act.quantize_1x128_dual(x, params, rowwise=True, columnwise=True)}
        for c in config_names:
            cfg = BENCH_CONFIGS[c]
            fns[f"gluon:{c}"] = (lambda cfg=cfg: quantize_act_gluon.quantize_1x128_dual_gluon(
                x, params, rowwise=True, columnwise=True, config=cfg))  # fmt: skip
        for n in names:
            try:
                fns[n]()
                torch.cuda.synchronize()
                t = triton.testing.do_bench(fns[n], warmup=5, rep=40, return_mode="median")
                pct = 100 * (bytes_q / t) / bw_copy
                cells.append(f"{t * 1e3:9.1f} / {pct:3.0f}%")
            except Exception as e:  # noqa: BLE001
                cells.append(f"{type(e).__name__[:18]:>18}")
        print(f"{m:>6}x{k:<6} {t_copy * 1e3:8.1f} " + " ".join(f"{c:>18}" for c in cells), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aot", action="store_true", help="only the sm_90 compile check (no GPU needed)")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exactness checks")
    ap.add_argument("--no-bench", action="store_true", help="skip the timing")
    ap.add_argument("--configs", default="default,s2,s3o1,s2o1x2,w4",
                    help=f"comma-separated launch configs to time, or 'all' ({', '.join(BENCH_CONFIGS)})")  # fmt: skip
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if args.aot:
        return 0 if quantize_act_gluon.aot_check() else 1
    if not torch.cuda.is_available():
        print("no GPU")
        return 1
    print(f"device: {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()}")
    failures = 0
    if not args.no_check:
        failures = check_bits(args.verbose)
    if not args.no_bench:
        configs = list(BENCH_CONFIGS) if args.configs == "all" else [c for c in args.configs.split(",") if c]
        bench(configs)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
