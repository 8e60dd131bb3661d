#!/usr/bin/env python3
"""Fused ops on the GPU: norm + FP8 quantization and SwiGLU + FP8 quantization fused against unfused,
plus the norm, SwiGLU and RoPE backward passes, with the bytes each contender moves.

    python benchmarks/bench_fused.py [--ops norm,swiglu,bwd,rope] [--shapes 8192x4096 ...] [--sustained S]
                                     [--variants] [--json out.json]

Contenders (triton backend; on Hopper its unfused quantizer is the Gluon kernel):

* ``fused``: the one-pass kernels (norm: the row-statistics kernel, then the kernel that writes the
  rowwise 1x128 and columnwise 128x1 FP8 copies from x; SwiGLU: one kernel from fc1's output); on
  Hopper that kernel is the Gluon one, and ``fused (Triton kernel)`` times the portable one;
* ``unfused (plugin)``: the plugin's own op writing its bf16 output, then the activation quantizer: the
  composition ``fused`` is bit-exact with;
* ``unfused (torch)``: torch's ``F.layer_norm`` / ``F.rms_norm`` / ``F.silu(a) * b`` then the quantizer
  (what a Megatron layer without the fused spec runs);
* ``copy``: a device-to-device copy of the input (the bandwidth ceiling).

``--variants`` adds every launch variant of the fused kernels (``backends/triton.py``'s ``FusedVariants``;
all give the same bits): ``fused [stats=..,gluon=..]`` for the norms, ``fused [gluon=..]`` for SwiGLU,
``ours [bwd=..]`` for the norm backward, and the norm's two kernels timed apart, ``stats [..]`` (read x,
write the statistics) and ``quantize [gluon=..]`` (read x, write both FP8 copies; Hopper); the plain
``fused`` / ``ours`` rows run the default variants.

Columns: ``us`` time per call (``benchlib.Timing``: do_bench median with L2 flushed, or ``--sustained``);
``MB``: for the forward rows the bytes the contender's own kernels read and write (each kernel reading
its inputs once and writing its outputs once), for the backward and RoPE rows the task's minimum (its
inputs read once, its outputs written once), the same for every contender (``bytes_*`` below, tested);
``TB/s`` MB / us; ``% copy`` TB/s over the copy's; ``vs plugin`` / ``vs torch`` / ``vs base`` the
unfused contender's (torch autograd's, Megatron's RoPE's) time over this one's.
Default shapes: M x H with H = 4096 / 8192 (Llama-3 8B / 70B hidden) for norms, M x F with F = 14336 /
3584 for SwiGLU (8B's fc2 input, and a TP=4 shard of it), M = 8192 and 16384 tokens.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root
from benchmarks.benchlib import Timing, bench_parser, environment, report, require_cuda, shapes_or  # noqa: E402
from primus_fp8_plugin import BlockwiseRecipe, TensorRole  # noqa: E402
from primus_fp8_plugin.backends.reference_fused import rope_cos_sin  # noqa: E402
from primus_fp8_plugin.backends.triton import FusedVariants, TritonBackend  # noqa: E402
from primus_fp8_plugin.kernels.sm90.fused_act import quantize_fused_gluon  # noqa: E402
from primus_fp8_plugin.kernels.sm90.heuristics import FUSED_QUANT  # noqa: E402
from primus_fp8_plugin.kernels.sm90.target import runs_on  # noqa: E402
from primus_fp8_plugin.kernels.triton import norm as triton_norm  # noqa: E402
from primus_fp8_plugin.kernels.triton.fused_act import quantize_fused  # noqa: E402
from primus_fp8_plugin.kernels.triton.fused_math import OP_LAYERNORM, OP_RMSNORM, OP_SWIGLU  # noqa: E402
from primus_fp8_plugin.kernels.triton.heuristics import NORM_BWD, NORM_STATS  # noqa: E402
from primus_fp8_plugin.tensor import ceil_div, pad4  # noqa: E402

NORM_SHAPES = [(8192, 4096), (16384, 4096), (8192, 8192)]
SWIGLU_SHAPES = [(8192, 14336), (16384, 3584), (8192, 3584)]
ROPE_SHAPES = [(4096, 2, 32, 128), (8192, 1, 8, 128)]  # s, b, heads, head dim (Llama-3 8B q and k)


def fp8_copies_bytes(m: int, k: int) -> int:
    """Both FP8 copies of an [m, k] activation with their scales in TE's layouts (BlockwiseFp8Tensor.nbytes)."""
    return 2 * m * k + 4 * (ceil_div(k, 128) * pad4(m) + ceil_div(m, 128) * pad4(k))


def bytes_norm(m: int, h: int, elem: int, how: str) -> int:
    """HBM bytes of norm + quantization of x [m, h] (elem bytes per element); how: fused / unfused, or
    one of the fused path's two kernels: stats / quantize."""
    stats = 8 * m  # mean and rstd, written once and read once (fp32), or rstd only: within 0.1%
    params = 2 * h * elem
    if how == "stats":  # the statistics kernel alone: read x, write mean and rstd
        return m * h * elem + stats // 2
    if how == "quantize":  # the fused quantizer alone: read x, the statistics and gamma/beta, write both FP8 copies
        return m * h * elem + fp8_copies_bytes(m, h) + stats // 2 + params
    if how == "fused":  # statistics: read x; fused kernel: read x, write both FP8 copies
        return 2 * m * h * elem + fp8_copies_bytes(m, h) + stats + params
    # norm: read x, write y; quantizer: read y, write both FP8 copies
    return 3 * m * h * elem + fp8_copies_bytes(m, h) + stats + params


def bytes_swiglu(m: int, f: int, elem: int, how: str) -> int:
    """HBM bytes of SwiGLU + quantization of h [m, 2f]: fused / unfused (plugin: one SwiGLU kernel) /
    torch (F.silu(a): read a, write s; s * b: read both, write y)."""
    out = fp8_copies_bytes(m, f)
    if how == "fused":
        return 2 * m * f * elem + out
    if how == "plugin":
        return (2 + 1 + 1) * m * f * elem + out
    return (2 + 3 + 1) * m * f * elem + out


def bytes_norm_bwd(m: int, h: int, elem: int) -> int:
    """The norm backward's minimum traffic: read x and dy, write dx (the gradients of gamma and beta: [h])."""
    return 3 * m * h * elem + 2 * h * elem


def bytes_swiglu_bwd(m: int, f: int, elem: int) -> int:
    """The SwiGLU backward's minimum traffic: read h [m, 2f] and dy [m, f], write dh [m, 2f]."""
    return 5 * m * f * elem


def _in_variant(**names) -> TritonBackend:
    """A triton backend whose fused ops run the launch variants ``names`` (``FusedVariants`` fields)."""
    return TritonBackend(fused=FusedVariants(**names))


def _variant_label(**names) -> str:
    return ",".join(f"{k}={v}" for k, v in names.items())


def _norm_rows(timing, be, p, shapes, rows, variants=False):
    for m, h in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, h, device="cuda", generator=g).bfloat16()
        w, b = torch.rand(h, device="cuda").bfloat16() + 0.5, torch.randn(h, device="cuda").bfloat16()
        dst = torch.empty_like(x)
        copy_us = timing.ms(lambda: dst.copy_(x)) * 1e3
        copy_bw = 4 * x.numel() / copy_us / 1e6
        rows.append({"op": "copy", "shape": f"{m}x{h}", "impl": "copy", "us": copy_us, "MB": 4 * x.numel() / 1e6,
                     "TB/s": copy_bw, "% copy": 100.0})  # fmt: skip
        for kind in ("LayerNorm", "RMSNorm"):
            beta = b if kind == "LayerNorm" else None
            tnorm = (lambda: F.layer_norm(x, (h,), w, b, 1e-5)) if beta is not None else (lambda: F.rms_norm(x, (h,), w, 1e-5))
            code = OP_LAYERNORM if kind == "LayerNorm" else OP_RMSNORM

            def triton_kernel():
                mean, rstd = triton_norm.norm_stats(x, 1e-5, kind)
                return quantize_fused(x, code, p, k=h, mean=mean, rstd=rstd, gamma=w, beta=beta, rowwise=True,
                                      columnwise=True)  # fmt: skip

            contenders = {
                "fused": (lambda: be.quantize_norm_act(x, w, beta, 1e-5, kind, p, rowwise=True, columnwise=True), "fused"),
                "unfused (plugin)": (lambda: be.quantize_act(be.norm_fwd(x, w, beta, 1e-5, kind)[0], p, rowwise=True,
                                                             columnwise=True), "unfused"),
                "unfused (torch)": (lambda: be.quantize_act(tnorm(), p, rowwise=True, columnwise=True), "unfused"),
            }  # fmt: skip
            if runs_on(x.device):
                contenders["fused (Triton kernel)"] = (triton_kernel, "fused")
            mean, rstd = triton_norm.norm_stats(x, 1e-5, kind)
            if variants:
                for sv in NORM_STATS:
                    for gv in FUSED_QUANT:
                        vb = _in_variant(stats=sv, gluon=gv)
                        contenders[f"fused [{_variant_label(stats=sv, gluon=gv)}]"] = (
                            lambda vb=vb: vb.quantize_norm_act(x, w, beta, 1e-5, kind, p, rowwise=True, columnwise=True),
                            "fused")  # fmt: skip
                for sv, cfg in NORM_STATS.items():
                    contenders[f"stats [{sv}]"] = (lambda cfg=cfg: triton_norm.norm_stats(x, 1e-5, kind, cfg), "stats")
                if runs_on(x.device):
                    for gv, cfg in FUSED_QUANT.items():
                        contenders[f"quantize [gluon={gv}]"] = (
                            lambda cfg=cfg: quantize_fused_gluon(x, code, p, k=h, config=cfg, mean=mean, rstd=rstd,
                                                                 gamma=w, beta=beta, rowwise=True, columnwise=True),
                            "quantize")  # fmt: skip
            _add(rows, timing, f"{kind}+quant", f"{m}x{h}", contenders, lambda how: bytes_norm(m, h, 2, how), copy_bw)


def _swiglu_rows(timing, be, p, shapes, rows, variants=False):
    for m, f in shapes:
        hh = torch.randn(m, 2 * f, device="cuda").bfloat16()
        a, b = hh.chunk(2, -1)
        dst = torch.empty_like(hh)
        copy_us = timing.ms(lambda: dst.copy_(hh)) * 1e3
        copy_bw = 4 * hh.numel() / copy_us / 1e6
        contenders = {
            "fused": (lambda: be.quantize_swiglu_act(hh, p, rowwise=True, columnwise=True), "fused"),
            "unfused (plugin)": (lambda: be.quantize_act(be.swiglu_fwd(hh), p, rowwise=True, columnwise=True), "plugin"),
            "unfused (torch)": (lambda: be.quantize_act(F.silu(a) * b, p, rowwise=True, columnwise=True), "torch"),
        }
        if runs_on(hh.device):
            contenders["fused (Triton kernel)"] = (
                lambda: quantize_fused(hh, OP_SWIGLU, p, k=f, up_offset=f, rowwise=True, columnwise=True),
                "fused",
            )
        if variants:
            for gv in FUSED_QUANT:
                vb = _in_variant(gluon=gv)
                contenders[f"fused [gluon={gv}]"] = (
                    lambda vb=vb: vb.quantize_swiglu_act(hh, p, rowwise=True, columnwise=True), "fused")  # fmt: skip
        _add(rows, timing, "SwiGLU+quant", f"{m}x{f}", contenders, lambda how: bytes_swiglu(m, f, 2, how), copy_bw)


def _bwd_rows(timing, be, norm_shapes, swiglu_shapes, rows, variants=False):
    for m, h in norm_shapes:
        x = torch.randn(m, h, device="cuda").bfloat16()
        dy = torch.randn_like(x)
        w, b = torch.rand(h, device="cuda").bfloat16() + 0.5, torch.randn(h, device="cuda").bfloat16()
        for kind in ("LayerNorm", "RMSNorm"):
            beta = b if kind == "LayerNorm" else None
            _, mean, rstd = be.norm_fwd(x, w, beta, 1e-5, kind)
            xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            bs = beta.clone().requires_grad_(True) if beta is not None else None
            y = F.layer_norm(xs, (h,), ws, bs, 1e-5) if bs is not None else F.rms_norm(xs, (h,), ws, 1e-5)
            params = (xs, ws) + ((bs,) if bs is not None else ())
            contenders = {
                "ours": (lambda: be.norm_bwd(dy, x, w, mean, rstd, need_dgamma=True, need_dbeta=beta is not None), None),
                "torch autograd": (lambda: torch.autograd.grad(y, params, dy, retain_graph=True), None),
            }
            if variants:
                for bv in NORM_BWD:
                    vb = _in_variant(bwd=bv)
                    contenders[f"ours [bwd={bv}]"] = (
                        lambda vb=vb: vb.norm_bwd(dy, x, w, mean, rstd, need_dgamma=True, need_dbeta=beta is not None),
                        None)  # fmt: skip
            nbytes = bytes_norm_bwd(m, h, 2)
            _add(rows, timing, f"{kind} bwd", f"{m}x{h}", contenders, lambda how: nbytes, None, base="torch autograd")
    for m, f in swiglu_shapes:
        hh = torch.randn(m, 2 * f, device="cuda").bfloat16()
        dy = torch.randn(m, f, device="cuda").bfloat16()
        hs = hh.clone().requires_grad_(True)
        a, b = hs.chunk(2, -1)
        y = F.silu(a) * b
        contenders = {
            "ours": (lambda: be.swiglu_bwd(dy, hh), None),
            "torch autograd": (lambda: torch.autograd.grad(y, (hs,), dy, retain_graph=True), None),
        }
        _add(rows, timing, "SwiGLU bwd", f"{m}x{f}", contenders, lambda how: bytes_swiglu_bwd(m, f, 2), None,
             base="torch autograd")  # fmt: skip


def _rope_rows(timing, be, shapes, rows):
    try:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    except ImportError:
        _apply_rotary_pos_emb_bshd = None
    for s, b, nh, d in shapes:
        t = torch.randn(s, b, nh, d, device="cuda").bfloat16()
        freqs = torch.rand(s, 1, 1, d, device="cuda") * 100
        cos, sin = rope_cos_sin(freqs, t.dtype)
        contenders = {
            "ours fwd": (lambda: be.rope(t, cos, sin, interleaved=False, backward=False), None),
            "ours bwd": (lambda: be.rope(t, cos, sin, interleaved=False, backward=True), None),
        }
        if _apply_rotary_pos_emb_bshd is not None:
            contenders["Megatron unfused fwd"] = (lambda: _apply_rotary_pos_emb_bshd(t, freqs), None)
        base = "Megatron unfused fwd" if _apply_rotary_pos_emb_bshd is not None else None
        _add(rows, timing, "RoPE", f"{s}x{b}x{nh}x{d}", contenders, lambda how: 2 * t.numel() * t.element_size(), None,
             base=base)  # fmt: skip


def _add(rows, timing, op, shape, contenders, nbytes_of, copy_bw, base="unfused (plugin)"):
    times = {}
    group = []
    for name in timing.order(contenders, len(rows)):
        fn, how = contenders[name]
        row = {"op": op, "shape": shape, "impl": name}
        times[name] = timing.ms(fn, row, "run") * 1e3
        nbytes = nbytes_of(how)
        row.update({"us": times[name], "MB": nbytes / 1e6, "TB/s": nbytes / times[name] / 1e6})
        if copy_bw:
            row["% copy"] = 100 * row["TB/s"] / copy_bw
        group.append(row)
    for row in group:
        if base in times:
            row["vs plugin" if base == "unfused (plugin)" else "vs base"] = times[base] / row["us"]
        if "unfused (torch)" in times:
            row["vs torch"] = times["unfused (torch)"] / row["us"]
    rows.extend(sorted(group, key=lambda r: list(contenders).index(r["impl"])))
    torch.cuda.empty_cache()


def main() -> int:
    ap = bench_parser(__doc__, "MxH (norms), MxF (SwiGLU) or SxBxHxD (RoPE), for the ops asked")
    ap.add_argument("--ops", default="norm,swiglu,bwd,rope", help="comma-separated: norm, swiglu, bwd, rope")
    ap.add_argument("--backend", default="triton", help="the backend whose fused ops are timed (default triton)")
    ap.add_argument("--variants", action="store_true",
                    help="also time every launch variant of the fused kernels (FusedVariants), and the norm's "
                         "two kernels apart")  # fmt: skip
    ap.add_argument("--sustained", type=float, default=0.0, metavar="S",
                    help="time each contender back to back for S seconds (benchlib.Timing) instead of do_bench")  # fmt: skip
    args = ap.parse_args()
    if not require_cuda("bench_fused"):
        return 2
    from primus_fp8_plugin.backends import get_backend

    be = get_backend(args.backend, "cuda")
    p = BlockwiseRecipe().params(TensorRole.INPUT)
    ops = set(args.ops.split(","))
    given = shapes_or(args, [])
    rows: list[dict] = []
    with Timing(args.sustained) as timing:
        if "norm" in ops:
            _norm_rows(timing, be, p, [s for s in given if len(s) == 2] or NORM_SHAPES, rows, args.variants)
        if "swiglu" in ops:
            _swiglu_rows(timing, be, p, [s for s in given if len(s) == 2] or SWIGLU_SHAPES, rows, args.variants)
        if "bwd" in ops:
            _bwd_rows(timing, be, [s for s in given if len(s) == 2] or NORM_SHAPES[:2],
                      [s for s in given if len(s) == 2] or SWIGLU_SHAPES[:2], rows, args.variants)  # fmt: skip
        if "rope" in ops:
            _rope_rows(timing, be, [s for s in given if len(s) == 4] or ROPE_SHAPES, rows)
    env = environment()
    env["timing"] = timing.describe()
    env["backend"] = args.backend
    env["fused variants (default)"] = _variant_label(**dataclasses.asdict(FusedVariants()))
    cols = [("op", ""), ("shape", ""), ("impl", ""), ("us", ".1f"), ("MB", ".1f"), ("TB/s", ".2f"), ("% copy", ".0f"),
            ("vs plugin", ".2f"), ("vs torch", ".2f"), ("vs base", ".2f")]  # fmt: skip
    report("bench_fused", env, rows, cols, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
