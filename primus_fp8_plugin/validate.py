"""Check the plugin against a directory of Transformer Engine golden outputs.

    python -m primus_fp8_plugin.validate --golden DIR [--backend NAME] [--device DEV] [--json FILE]

* quantization: FP8 data bit-exact and every real ``scale_inv`` entry equal, both copies, every
  variant (1x128 / 128x128, power-of-2 / fp32 scales, E4M3 / E5M2);
* linear (through the plugin's autograd op, as ``Fp8BlockwiseLinear`` runs it): ``out``,
  ``dgrad``, ``wgrad``, ``bgrad`` within a relative Frobenius error of 2e-3 of
  TE's, and the SNR of ``out`` against an fp32 linear within 0.2 dB of TE's recorded SNR;
* grouped linear (through ``fp8_grouped_linear``, as ``Fp8GroupedLinear`` runs it, against
  ``te.GroupedLinear``): the same checks on all experts' ``out``, ``dgrad``, ``wgrad`` (stacked
  ``[E, N, K]``) and ``bgrad``, and the worst expert's ``wgrad``; each row also says how many values
  differ from TE's bits.

A golden directory holds any of ``quant.safetensors``, ``linear.safetensors`` and
``grouped.safetensors`` (each possibly ``.xz``); the checks of an absent file are skipped with a note.
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
from .golden import (
    GoldenFormatError,
    GroupedCase,
    LinearCase,
    QuantCase,
    load_grouped_cases,
    load_linear_cases,
    load_quant_cases,
    optional_golden_file,
)
from .ops import fp8_blockwise_linear, fp8_grouped_linear
from .quantize import quantize_activation, quantize_weight
from .recipe import BlockwiseRecipe, QuantParams
from .tensor import BlockwiseFp8Tensor

GOLDEN_STEMS = ("quant", "linear", "grouped")  # a directory holds any of these (at least one)
REL_FROB_TOL = 2e-3
SNR_TOL_DB = 0.2


@dataclass
class Check:
    kind: str  # "quant", "linear" or "grouped"
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


def run_grouped_linear(
    recipe: BlockwiseRecipe,
    x: torch.Tensor,
    counts: list[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    grad_out: torch.Tensor,
    backend: str,
) -> dict[str, torch.Tensor]:
    """Forward and backward of ``E`` experts' ``y_e = x_e W_e^T + b_e`` (``weight [E, N, K]``, ``bias [E, N]``)
    through the plugin's grouped autograd op (as ``Fp8GroupedLinear`` runs it, one parameter per expert):
    returns out, dgrad, wgrad ``[E, N, K]`` and (with a bias) bgrad ``[E, N]``."""
    x = x.detach().clone().requires_grad_(True)
    ws = [w.detach().clone().requires_grad_(True) for w in weight.unbind(0)]
    bs = None if bias is None else [b.detach().clone().requires_grad_(True) for b in bias.unbind(0)]
    out = fp8_grouped_linear(x, counts, ws, bs, recipe=recipe, backend=backend)
    out.backward(grad_out)
    res = {"out": out.detach(), "dgrad": x.grad, "wgrad": torch.stack([w.grad for w in ws])}
    if bs is not None:
        res["bgrad"] = torch.stack([b.grad for b in bs])
    return res


def _differ(got: torch.Tensor, ref: torch.Tensor) -> str:
    got, ref = got.cpu().to(ref.dtype), ref.cpu()
    bad = int((got.view(-1) != ref.view(-1)).sum()) - int((got.isnan() & ref.isnan()).sum())
    return "bits equal" if bad == 0 else f"{bad}/{ref.numel()} values differ"


def _tolerance_checks(kind: str, case: str, ours: dict, te: dict, names) -> list[Check]:
    checks = []
    for name in names:
        if name not in te:
            continue
        err = rel_frobenius(ours[name], te[name])
        detail = f"rel. Frobenius error {err:.2e} (tol {REL_FROB_TOL:.0e})"
        if kind == "grouped":
            detail += f"; {_differ(ours[name], te[name])}"
        checks.append(Check(kind, case, name, err <= REL_FROB_TOL, detail))
    return checks


def _snr_check(kind: str, case: str, ours_out: torch.Tensor, ref: torch.Tensor, te_snr: float) -> Check:
    ours_snr = snr_db(ours_out.reshape(ref.shape), ref.float())
    gap = ours_snr - te_snr
    return Check(kind, case, "out SNR", abs(gap) <= SNR_TOL_DB,
                 f"{ours_snr:.2f} dB vs TE {te_snr:.2f} dB (gap {gap:+.2f}, tol {SNR_TOL_DB})")  # fmt: skip


def check_grouped_case(case: GroupedCase, backend: str, device: torch.device) -> list[Check]:
    t = {k: v.to(device) for k, v in case.tensors.items() if k != "m_splits"}
    recipe = BlockwiseRecipe(fp8_format=case.fmt, pow2_scales=case.pow2_scales)
    ours = run_grouped_linear(recipe, t["x"], case.counts, t["weight"], t.get("bias"), t["grad_out"], backend)
    checks = _tolerance_checks("grouped", case.name, ours, t, ("out", "dgrad", "wgrad", "bgrad"))
    per_expert = [(rel_frobenius(ours["wgrad"][e], t["wgrad"][e]), e) for e in range(len(case.counts))]
    worst, e = max(per_expert)
    detail = f"expert {e} ({case.counts[e]} tokens): rel. Frobenius error {worst:.2e} (tol {REL_FROB_TOL:.0e})"
    checks.append(Check("grouped", case.name, "wgrad worst expert", worst <= REL_FROB_TOL, detail))
    if case.snr_db is not None:
        parts = torch.split(t["x"].double(), case.counts)
        ref = torch.cat([p @ w.double().t() for p, w in zip(parts, t["weight"].unbind(0))])
        if "bias" in t:
            ref = ref + torch.repeat_interleave(t["bias"].double(), torch.tensor(case.counts, device=device), dim=0)
        checks.append(_snr_check("grouped", case.name, ours["out"], ref, case.snr_db))
    return checks


def check_linear_case(case: LinearCase, backend: str, device: torch.device) -> list[Check]:
    t = {k: v.to(device) for k, v in case.tensors.items()}
    recipe = BlockwiseRecipe(fp8_format=case.fmt, pow2_scales=case.pow2_scales)
    ours = run_linear(recipe, t["x"], t["weight"], t.get("bias"), t["grad_out"], backend)
    checks = _tolerance_checks("linear", case.name, ours, t, ("out", "dgrad", "wgrad", "bgrad"))
    if case.snr_db is not None:
        x2 = t["x"].reshape(-1, t["x"].shape[-1]).double()
        ref = x2 @ t["weight"].double().t()
        if "bias" in t:
            ref = ref + t["bias"].double()
        checks.append(_snr_check("linear", case.name, ours["out"], ref, case.snr_db))
    return checks


def validate(golden_dir: str | Path, backend: str = "auto", device: str | torch.device | None = None) -> list[Check]:
    """Run every check of a golden directory; returns one ``Check`` per row of the table."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend_name = get_backend(backend, dev).name  # fail early, with the reason, if unavailable
    present = {stem: optional_golden_file(Path(golden_dir), stem) is not None for stem in GOLDEN_STEMS}
    if not any(present.values()):
        raise FileNotFoundError(f"{golden_dir} holds no golden file ({', '.join(s + '.safetensors' for s in GOLDEN_STEMS)}, "
                                "each possibly .xz)")  # fmt: skip
    quant_cases = load_quant_cases(golden_dir)[0] if present["quant"] else []
    linear_cases = load_linear_cases(golden_dir)[0] if present["linear"] else []
    grouped_cases, _ = load_grouped_cases(golden_dir)
    checks = []
    for qc in quant_cases:
        checks += check_quant_case(qc, backend_name, dev)
    for lc in linear_cases:
        checks += check_linear_case(lc, backend_name, dev)
    for gc in grouped_cases:
        checks += check_grouped_case(gc, backend_name, dev)
    return checks


def format_table(checks: list[Check]) -> str:
    w_case = max([len(c.case) for c in checks] + [4])
    w_item = max([len(c.item) for c in checks] + [4])
    w_kind = max([len(c.kind) for c in checks] + [6])
    lines = [f"{'kind':{w_kind}}  {'case':{w_case}}  {'item':{w_item}}  result  detail"]
    lines.append("-" * len(lines[0]) + "-" * 40)
    for c in checks:
        lines.append(f"{c.kind:{w_kind}}  {c.case:{w_case}}  {c.item:{w_item}}  {'PASS' if c.passed else 'FAIL':6}  {c.detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m primus_fp8_plugin.validate", description=__doc__.split("\n\n")[0])
    files = "quant.safetensors, linear.safetensors and/or grouped.safetensors (or .xz)"
    ap.add_argument("--golden", required=True, help=f"directory with {files}")
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
    for kind, stem in (("quant", "quant"), ("linear", "linear"), ("grouped", "grouped")):
        if not any(c.kind == kind for c in checks):
            file = optional_golden_file(Path(args.golden), stem)
            where = f"{file} holds no cases" if file else f"{args.golden} has no {stem}.safetensors"
            print(f"\nnote: {where}: no {kind} checks ran")
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
