#!/usr/bin/env python3
"""Record Transformer Engine's own outputs as a golden directory for ``primus_fp8_plugin.validate``.

Run on a GPU machine where TE (with FP8 block scaling: Hopper or newer) is installed:

    python scripts/make_te_goldens.py --out my_goldens [--fp32-scales]

Writes ``quant.safetensors`` (TE's ``Float8BlockQuantizer`` on 6 inputs x 5 variants) and
``linear.safetensors`` (``te.Linear`` forward and backward under ``Float8BlockScaling`` on 5
cases), in the format of ``docs/GOLDENS.md``. Inputs are drawn on the CPU with a seeded
generator, so every run writes the same inputs.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory to write (created)")
    ap.add_argument("--fp32-scales", action="store_true", help="linear cases with fp32 (not power-of-2) scales")
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
    print(f"wrote {args.out} (TE {meta['te_version']}, {meta['device']}) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
