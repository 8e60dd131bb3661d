"""Check the plugin against a directory of Transformer Engine golden outputs.

    python -m primus_fp8_plugin.validate --golden DIR [--backend NAME] [--device DEV] [--json FILE]

* quantization: FP8 data bit-exact and every real ``scale_inv`` entry equal, both copies, every
  variant (1x128 / 128x128, power-of-2 / fp32 scales, E4M3 / E5M2);
* linear (through the plugin's autograd op, as ``Fp8BlockwiseLinear`` runs it): ``out``,
  ``dgrad``, ``wgrad``, ``bgrad`` within a relative Frobenius error of 2e-3 of
  TE's, and the SNR of ``out`` against an fp32 linear within 0.2 dB of TE's recorded SNR.

Prints a table; exits 0 only if every check passes and there is at least one, 1 otherwise (naming
what failed), 2 for usage errors and golden files that cannot be read or break the format (naming
the file).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .backends import get_backend
from .golden import GoldenFormatError, LinearCase, QuantCase, golden_file, load_linear_cases, load_quant_cases
from .linear import fp8_blockwise_linear
from .quantize import quantize_activation, quantize_weight
from .recipe import BlockwiseRecipe, QuantParams
from .tensor import BlockwiseFp8Tensor

REL_FROB_TOL = 2e-3
SNR_TOL_DB = 0.2


@dataclass
class Check:
    kind: str  # "quant" or "linear"
    case: str
    item: str  # variant / tensor name
    passed: bool
    detail: str


def rel_frobenius(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    denom = ref.norm().item()
    err = (got - ref).norm().item()
    return err / denom if denom > 0 else (0.0 if err == 0 else math.inf)


def snr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (got.double() - ref.double()).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.double().norm().item() / noise)


def _compare_copy(ours: BlockwiseFp8Tensor, te: BlockwiseFp8Tensor, which: str) -> tuple[int, int, int, int]:
    """(data mismatches, data count, scale mismatches, scale count) for one copy."""
    d_ours = ours.to_te()[f"{which}_data"]
    d_te = te.to_te()[f"{which}_data"]
    s_ours, s_te = ours.scales(which), te.scales(which)
    d_bad = int((d_ours.cpu() != d_te.cpu()).sum())
    # NaN == NaN counts as equal (bitwise comparison of the real entries).
    s_bad = int((s_ours.cpu().view(torch.int32) != s_te.cpu().view(torch.int32)).sum())
    return d_bad, d_te.numel(), s_bad, s_te.numel()


def check_quant_case(case: QuantCase, backend: str, device: torch.device) -> list[Check]:
    x = case.x.to(device)
    checks = []
    for v in case.variants:
        params = QuantParams(v.fp8_dtype, v.block_dim, pow2_scales=v.pow2_scales)
        if v.block_dim == 1:
            ours = quantize_activation(x, params, backend=backend)
        else:
            ours = quantize_weight(x, params, backend=backend)
        te = BlockwiseFp8Tensor.from_te(
            shape=tuple(x.shape),
            block_dim=v.block_dim,
            fp8_dtype=v.fp8_dtype,
            orig_dtype=x.dtype,
            **{k: t.to(device) for k, t in v.tensors.items()},
        )
        details, ok = [], True
        for which in ("rowwise", "columnwise"):
            d_bad, d_n, s_bad, s_n = _compare_copy(ours, te, which)
            ok &= d_bad == 0 and s_bad == 0
            details.append(f"{which[:3]}: data {d_bad}/{d_n} differ, scales {s_bad}/{s_n}")
        checks.append(Check("quant", case.name, v.name, ok, "; ".join(details)))
    return checks


def run_linear(
    recipe: BlockwiseRecipe,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grad_out: torch.Tensor,
    backend: str,
) -> dict[str, torch.Tensor]:
    """Forward and backward of ``y = x W^T + b`` through the plugin's autograd op (as a user's
    ``Fp8BlockwiseLinear`` runs it): returns out, dgrad, wgrad and (with a bias) bgrad."""
    x = x.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    bias = None if bias is None else bias.detach().clone().requires_grad_(True)
    out = fp8_blockwise_linear(x, weight, bias, recipe=recipe, backend=backend)
    out.backward(grad_out)
    res = {"out": out.detach(), "dgrad": x.grad, "wgrad": weight.grad}
    if bias is not None:
        res["bgrad"] = bias.grad
    return res


def check_linear_case(case: LinearCase, backend: str, device: torch.device) -> list[Check]:
    t = {k: v.to(device) for k, v in case.tensors.items()}
    recipe = BlockwiseRecipe(fp8_format=case.fmt, pow2_scales=case.pow2_scales)
    ours = run_linear(recipe, t["x"], t["weight"], t.get("bias"), t["grad_out"], backend)
    checks = []
    for name in ("out", "dgrad", "wgrad", "bgrad"):
        if name not in t:
            continue
        err = rel_frobenius(ours[name], t[name])
        checks.append(
            Check(
                "linear",
                case.name,
                name,
                err <= REL_FROB_TOL,
                f"rel. Frobenius error {err:.2e} (tol {REL_FROB_TOL:.0e})",
            )
        )
    if case.snr_db is not None:
        x2 = t["x"].reshape(-1, t["x"].shape[-1]).double()
        ref = x2 @ t["weight"].double().t()
        if "bias" in t:
            ref = ref + t["bias"].double()
        ours_snr = snr_db(ours["out"].reshape(ref.shape), ref.float())
        gap = ours_snr - case.snr_db
        checks.append(
            Check(
                "linear",
                case.name,
                "out SNR",
                abs(gap) <= SNR_TOL_DB,
                f"{ours_snr:.2f} dB vs TE {case.snr_db:.2f} dB (gap {gap:+.2f}, tol {SNR_TOL_DB})",
            )
        )
    return checks


def validate(golden_dir: str | Path, backend: str = "auto", device: str | torch.device | None = None) -> list[Check]:
    """Run every check of a golden directory; returns one ``Check`` per row of the table."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend_name = get_backend(backend, dev).name  # fail early, with the reason, if unavailable
    quant_cases, _ = load_quant_cases(golden_dir)
    linear_cases, _ = load_linear_cases(golden_dir)
    checks = []
    for qc in quant_cases:
        checks += check_quant_case(qc, backend_name, dev)
    for lc in linear_cases:
        checks += check_linear_case(lc, backend_name, dev)
    return checks


def format_table(checks: list[Check]) -> str:
    w_case = max([len(c.case) for c in checks] + [4])
    w_item = max([len(c.item) for c in checks] + [4])
    lines = [f"{'kind':6}  {'case':{w_case}}  {'item':{w_item}}  result  detail"]
    lines.append("-" * len(lines[0]) + "-" * 40)
    for c in checks:
        lines.append(f"{c.kind:6}  {c.case:{w_case}}  {c.item:{w_item}}  {'PASS' if c.passed else 'FAIL':6}  {c.detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m primus_fp8_plugin.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--golden", required=True, help="directory with quant.safetensors and linear.safetensors (or .xz)")
    ap.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    ap.add_argument("--device", default=None, help="device to run on (default: cuda if present, else cpu)")
    ap.add_argument("--json", default=None, help="also write every check as JSON to this file")
    args = ap.parse_args(argv)
    if not Path(args.golden).is_dir():
        print(f"error: --golden {args.golden!r} is not a directory", file=sys.stderr)
        return 2
    dev = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        name = get_backend(args.backend, dev).name
        checks = validate(args.golden, name, dev)
    except GoldenFormatError as err:
        print(f"error: bad golden file {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"primus_fp8_plugin.validate: golden={args.golden} backend={name} device={dev}")
    print(format_table(checks))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in checks], indent=1))
    if not checks:
        print(f"\nFAILED: {args.golden} yields no checks (its golden files hold no cases): nothing was validated")
        return 1
    for kind, stem in (("quant", "quant"), ("linear", "linear")):
        if not any(c.kind == kind for c in checks):
            print(f"\nnote: {golden_file(Path(args.golden), stem)} holds no cases: no {kind} checks ran")
    failed = [c for c in checks if not c.passed]
    if failed:
        print(f"\nFAILED {len(failed)} of {len(checks)} checks:")
        for c in failed:
            print(f"  {c.kind} {c.case} {c.item}: {c.detail}")
        return 1
    print(f"\nall {len(checks)} checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
