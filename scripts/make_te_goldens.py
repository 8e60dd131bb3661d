#!/usr/bin/env python3
"""Record Transformer Engine's own outputs as a golden directory for ``primus_fp8_plugin.validate``.

Run on a GPU machine where TE (with FP8 block scaling: Hopper or newer) is installed:

    python scripts/make_te_goldens.py --out my_goldens [--fp32-scales]

Writes ``quant.safetensors`` (TE's ``Float8BlockQuantizer`` on 6 inputs x 5 variants),
``linear.safetensors`` (``te.Linear`` forward and backward under ``Float8BlockScaling`` on 5
cases) and ``grouped.safetensors`` (``te.GroupedLinear`` forward and backward under
``Float8BlockScaling`` on 5 routings: counts 0, 1, 15, 16, 127, 128, 129, skewed, 16-aligned), in the
format of ``docs/GOLDENS.md``. Inputs are drawn on the CPU with a seeded generator, so every run
writes the same inputs. ``--only grouped`` records the grouped cases alone.

Where TE refuses a routing whose counts are not multiples of 16 (Megatron pads them so for TE), the case
is recorded from TE on the tokens padded per expert with zero rows to multiples of 16 (zero rows change no
scale and no product), the padding rows dropped again, and the metadata says ``te_padding=16``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch


def die(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


# ---- inputs (CPU, seeded) ----------------------------------------------------------------------
def quant_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cases = {
        "randn_256x512": randn(256, 512).bfloat16(),
        "scales_384x1024": (randn(384, 1024) * torch.exp2(torch.randint(-30, 30, (384, 1), generator=g))).bfloat16(),
        "ragged_200x320": randn(200, 320).bfloat16(),
        "ragged_136x272": (randn(136, 272) * 3).bfloat16(),
    }
    special = randn(256, 384)
    special[:128, 128:256] = 0  # an all-zero tile (and 128x128 block)
    special[130:132] = torch.finfo(torch.bfloat16).max / 2  # huge rows
    special[140:142] = 1e-30  # tiny rows
    special[200, 300] = 1e4  # one outlier
    cases["special_256x384"] = special.bfloat16()
    cases["fp32in_128x256"] = randn(128, 256) * 10
    return cases


def linear_inputs() -> dict[str, dict]:
    g = torch.Generator().manual_seed(4321)
    r = lambda *s, std=1.0: (torch.randn(*s, generator=g) * std).bfloat16()  # noqa: E731
    spec = [  # name, x shape, N, bias, format
        ("lin_256x512_384", (256, 512), 384, True, "E4M3"),
        ("lin_seq64x4x512_640", (64, 4, 512), 640, True, "E4M3"),
        ("lin_272x384_640", (272, 384), 640, True, "E4M3"),
        ("lin_256x512_384_hybrid", (256, 512), 384, True, "HYBRID"),
        ("lin_512x2048_512", (512, 2048), 512, False, "E4M3"),
    ]
    cases = {}
    for name, xs, n, bias, fmt in spec:
        k = xs[-1]
        c = {"x": r(*xs), "weight": r(n, k, std=1 / math.sqrt(k)), "grad_out": r(*xs[:-1], n), "fmt": fmt}
        if bias:
            c["bias"] = r(n, std=0.1)
        cases[name] = c
    return cases


def skewed_counts(experts: int, tokens: int, seed: int) -> list[int]:
    """A Zipf-like routing (exponent 1.3, permuted over the experts) with a few empty experts; sums to ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, experts + 1).double() ** 1.3
    p = p[torch.randperm(experts, generator=g)]
    counts = (p / p.sum() * tokens).floor().long()
    counts[counts < 3] = 0
    counts[int(p.argmax())] += tokens - int(counts.sum())
    return [int(c) for c in counts]


def grouped_inputs() -> dict[str, dict]:
    """Grouped-linear cases: ``x [T, K]`` (permuted tokens), ``m_splits``, ``weight [E, N, K]``, optional
    ``bias [E, N]``, ``grad_out [T, N]``, ``fmt``."""
    g = torch.Generator().manual_seed(2468)
    r = lambda *s, std=1.0: (torch.randn(*s, generator=g) * std).bfloat16()  # noqa: E731
    edges = [0, 1, 15, 16, 127, 128, 129, 200]
    spec = [  # name, counts, K, N, bias, format
        ("grp_edges_e8_256_384", edges, 256, 384, True, "E4M3"),
        ("grp_edges_e8_384_256_hybrid", edges, 384, 256, False, "HYBRID"),
        ("grp_skewed_e16_512_256", skewed_counts(16, 1000, 0), 512, 256, False, "E4M3"),
        ("grp_aligned16_e4_256_640", [0, 16, 144, 256], 256, 640, True, "E4M3"),
        ("grp_one_expert_e1_384_384", [300], 384, 384, True, "E4M3"),
    ]
    cases = {}
    for name, counts, k, n, bias, fmt in spec:
        t, e = sum(counts), len(counts)
        c = {"x": r(t, k), "m_splits": torch.tensor(counts, dtype=torch.int64), "weight": r(e, n, k, std=1 / math.sqrt(k)),
             "grad_out": r(t, n), "fmt": fmt}  # fmt: skip
        if bias:
            c["bias"] = r(e, n, std=0.1)
        cases[name] = c
    return cases


# ---- TE ----------------------------------------------------------------------------------------
def import_te():
    try:
        import transformer_engine.pytorch as te
        import transformer_engine_torch as tex
        from transformer_engine.common.recipe import Float8BlockScaling, Format
    except ImportError as err:
        die(f"Transformer Engine is not importable ({err}); install it (pip install transformer-engine[pytorch])")
    ok, reason = te.is_fp8_block_scaling_available(return_reason=True)
    if not ok:
        die(f"TE cannot run FP8 block scaling here: {reason}")
    quantizer_cls = getattr(te, "Float8BlockQuantizer", None)
    if quantizer_cls is None:
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer as quantizer_cls
    return te, tex, Float8BlockScaling, Format, quantizer_cls


def _te_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer_engine", "transformer-engine-cu13", "transformer-engine-cu12"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import transformer_engine

    return str(getattr(transformer_engine, "__version__", "unknown"))


def te_autocast(te, recipe):
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def snr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (got.double() - ref.double()).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.double().norm().item() / noise)


def _pad_rows(t: torch.Tensor, counts: list[int], align: int) -> torch.Tensor:
    parts = []
    for p, c in zip(torch.split(t, counts), counts):
        parts += [p, t.new_zeros((-c) % align, t.shape[1])]
    return torch.cat(parts)


def _unpad_rows(t: torch.Tensor, counts: list[int], align: int) -> torch.Tensor:
    padded = [c + (-c) % align for c in counts]
    return torch.cat([p[:c] for p, c in zip(torch.split(t, padded), counts)])


def te_grouped_step(te, recipe, c: dict, dev, align: int = 0) -> dict[str, torch.Tensor]:
    """TE ``GroupedLinear`` forward and backward on case ``c`` (tokens padded per expert to multiples of
    ``align`` when ``align`` > 0, the padding rows dropped from out and dgrad). m_splits as a list of ints
    (what Megatron passes), else as a CUDA int64 tensor where this TE wants one."""
    counts = [int(v) for v in c["m_splits"].tolist()]
    e, n, k = c["weight"].shape
    layer = te.GroupedLinear(e, k, n, bias="bias" in c, params_dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        for i in range(e):
            getattr(layer, f"weight{i}").copy_(c["weight"][i])
            if "bias" in c:
                getattr(layer, f"bias{i}").copy_(c["bias"][i])
    x, dy, splits = c["x"], c["grad_out"], counts
    if align:
        x, dy, splits = _pad_rows(x, counts, align), _pad_rows(dy, counts, align), [v + (-v) % align for v in counts]
    x = x.detach().to(dev).requires_grad_(True)
    with te_autocast(te, recipe):
        try:
            out = layer(x, splits)
        except (AttributeError, TypeError):  # a TE whose GroupedLinear takes m_splits only as a tensor
            out = layer(x, torch.tensor(splits, dtype=torch.int64, device=dev))
    out.backward(dy.to(dev))
    grads = [getattr(layer, f"weight{i}").grad for i in range(e)]
    res = {
        "out": out.detach(), "dgrad": x.grad,
        "wgrad": torch.stack([torch.zeros(n, k, device=dev) if g is None else g for g in grads]),
    }  # fmt: skip
    if "bias" in c:
        bg = [getattr(layer, f"bias{i}").grad for i in range(e)]
        res["bgrad"] = torch.stack([torch.zeros(n, device=dev) if g is None else g for g in bg])
    if align:
        res["out"], res["dgrad"] = _unpad_rows(res["out"], counts, align), _unpad_rows(res["dgrad"], counts, align)
    return res


def record_grouped(te, Float8BlockScaling, Format, out_dir: Path, meta: dict, fp32_scales: bool) -> None:
    from safetensors.torch import save_file

    dev = torch.device("cuda")
    tensors, gmeta = {}, dict(meta, pow2_scales="0" if fp32_scales else "1")
    for case, c in grouped_inputs().items():
        recipe = Float8BlockScaling(fp8_format=getattr(Format, c["fmt"]))
        counts = [int(v) for v in c["m_splits"].tolist()]
        align = 0
        try:
            res = te_grouped_step(te, recipe, c, dev)
        except (RuntimeError, AssertionError, ValueError) as err:
            if all(v % 16 == 0 for v in counts):
                die(f"TE's GroupedLinear failed on the 16-aligned case {case}: {type(err).__name__}: {err}")
            align = 16
            print(f"[grouped] {case}: TE refused the unpadded counts ({type(err).__name__}: {str(err)[:200]}); "
                  "recording on tokens padded per expert to multiples of 16", flush=True)  # fmt: skip
            res = te_grouped_step(te, recipe, c, dev, align=16)
        parts = torch.split(c["x"].double(), counts)
        ref = torch.cat([p @ w.double().t() for p, w in zip(parts, c["weight"].unbind(0))])
        if "bias" in c:
            ref = ref + torch.repeat_interleave(c["bias"].double(), torch.tensor(counts), dim=0)
        snr = snr_db(res["out"].cpu().double(), ref)
        saved = {k: c[k] for k in ("x", "weight", "grad_out", "bias") if k in c}
        saved.update(res)
        for key, t in saved.items():
            tensors[f"cases/{case}/{key}"] = t.detach().to(torch.bfloat16).contiguous().cpu()
        tensors[f"cases/{case}/m_splits"] = c["m_splits"].clone()
        gmeta[f"cases/{case}/fmt"] = c["fmt"]
        gmeta[f"cases/{case}/snr_db_vs_fp32"] = repr(snr)
        if align:
            gmeta[f"cases/{case}/te_padding"] = str(align)
        print(f"[grouped] {case}: {len(counts)} experts, {sum(counts)} tokens, {c['fmt']}, out SNR vs fp32 {snr:.2f} dB"
              + (" (TE on 16-padded tokens)" if align else ""), flush=True)  # fmt: skip
    save_file(tensors, str(out_dir / "grouped.safetensors"), metadata=gmeta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    ap.add_argument("--fp32-scales", action="store_true", help="linear cases with fp32 (not power-of-2) scales")
    ap.add_argument("--only", choices=["all", "grouped"], default="all",
                    help="'grouped': write grouped.safetensors alone (into an existing directory, say)")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        die("no CUDA device: TE goldens must be recorded on the GPU")
    # TE reads this when its recipe module is imported: set it first, as a TE user would.
    os.environ["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1" if args.fp32_scales else "0"
    te, tex, Float8BlockScaling, Format, Quantizer = import_te()
    from safetensors.torch import save_file

    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    meta = {"te_version": _te_version(), "torch_version": torch.__version__}
    meta["device"] = torch.cuda.get_device_name()
    t0 = time.time()
    if args.only == "grouped":
        record_grouped(te, Float8BlockScaling, Format, args.out, meta, args.fp32_scales)
        print(f"wrote {args.out / 'grouped.safetensors'} (TE {meta['te_version']}, {meta['device']}) in {time.time() - t0:.1f}s")
        return

    # quantization
    tensors = {}
    variants = [("dim1_pow21", 1, True, False), ("dim1_pow20", 1, False, False), ("dim2_pow21", 2, True, False),
                ("dim2_pow20", 2, False, False), ("dim1_pow21_e5m2", 1, True, True)]  # fmt: skip
    for case, x in quant_inputs().items():
        tensors[f"cases/{case}/x"] = x
        for vname, dim, pow2, e5m2 in variants:
            q = Quantizer(
                fp8_dtype=tex.DType.kFloat8E5M2 if e5m2 else tex.DType.kFloat8E4M3,
                rowwise=True,
                columnwise=True,
                amax_epsilon=0.0,
                force_pow_2_scales=pow2,
                block_scaling_dim=dim,
            )(x.to(dev))
            for part in ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"):
                tensors[f"cases/{case}/{vname}/{part}"] = (
                    getattr(q, f"_{part}").view(torch.uint8 if "data" in part else torch.float32).contiguous().cpu()
                )
        print(f"[quant] {case}: {len(variants)} variants", flush=True)
    save_file(tensors, str(args.out / "quant.safetensors"), metadata=meta)

    # linear
    tensors, lmeta = {}, dict(meta, pow2_scales="0" if args.fp32_scales else "1")
    for case, c in linear_inputs().items():
        x = c["x"].to(dev).requires_grad_(True)
        k, n = c["x"].shape[-1], c["weight"].shape[0]
        layer = te.Linear(k, n, bias="bias" in c, params_dtype=torch.bfloat16, device=dev)
        with torch.no_grad():
            layer.weight.copy_(c["weight"])
            if "bias" in c:
                layer.bias.copy_(c["bias"])
        recipe = Float8BlockScaling(fp8_format=getattr(Format, c["fmt"]))
        with te_autocast(te, recipe):
            out = layer(x)
        out.backward(c["grad_out"].to(dev))
        ref = x.detach().float().reshape(-1, k) @ layer.weight.detach().float().t()
        if "bias" in c:
            ref = ref + layer.bias.detach().float()
        snr = snr_db(out.detach().reshape(-1, n).float(), ref)
        saved = {"x": c["x"], "weight": c["weight"], "grad_out": c["grad_out"], "out": out.detach(),
                 "dgrad": x.grad, "wgrad": layer.weight.grad}  # fmt: skip
        if "bias" in c:
            saved.update(bias=c["bias"], bgrad=layer.bias.grad)
        for key, t in saved.items():
            tensors[f"cases/{case}/{key}"] = t.detach().to(torch.bfloat16).contiguous().cpu()
        lmeta[f"cases/{case}/fmt"] = c["fmt"]
        lmeta[f"cases/{case}/snr_db_vs_fp32"] = repr(snr)
        print(f"[linear] {case}: {c['fmt']}, out SNR vs fp32 {snr:.2f} dB", flush=True)
    save_file(tensors, str(args.out / "linear.safetensors"), metadata=lmeta)
    record_grouped(te, Float8BlockScaling, Format, args.out, meta, args.fp32_scales)
    print(f"wrote {args.out} (TE {meta['te_version']}, {meta['device']}) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
