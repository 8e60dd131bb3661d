"""Repeat the Gluon grouped wgrad into main_grad and count the experts whose result differs from a loop of the
portable dense kernel, per register split and epilogue (Hopper only).

    python -m tools.grouped_wgrad_repeat [--reps 10] [--splits 24:240 40:232 56:224] [--output main_grad|bf16]
                                         [--diagnose 8]

Why: before its pipeline stages were released behind a proxy fence (kernels/sm90/gemm_library.release_stage), the
Gluon kernel gave wrong tiles in a few experts in about one call in five at 240 / 24 consumer / producer registers
(a column-scale load still in flight when the producer's TMA overwrote the stage; issue 39): this repeats the call
to show it does not recur. The routing is tests/gpu/test_gpu_grouped.py's ``qwen-like-128`` (128 experts, skewed counts, K 2048,
N 1536) with device-side counts. The main_grads are views of one buffer, as Megatron's gradient buffer holds them:
the TMA-stored epilogue (the wrapper refuses to accumulate through stores from registers, which failed at every
split tried). ``--output bf16``: new bf16 dW instead (no accumulation), as the backend's grouped wgrad runs it at
240 / 24 (``GROUPED_WGRAD_256x128``), compared with the portable grouped kernel's bf16 dW.
``--diagnose N`` (main_grad output): for up to N wrong 256 x 128 tiles of each call, what the error looks like
(``explain_tile``): the tile left as it was, dW added without the old value, dW added twice, one 128-token block of
the expert's dW missing or added twice, or another tile's dW in its place; and how well one token block's share
with a factor per row or per column fits it (``scale_fit``: a wrong row or column scale of that block)."""

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
    ap.add_argument("--diagnose", type=int, default=0, metavar="N", help="explain up to N wrong tiles per call")
    args = ap.parse_args(argv)
    if args.diagnose and args.output != "main_grad":
        ap.error("--diagnose explains wrong main_grad tiles: use it with --output main_grad")
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

    def run(cfg, call: int) -> int:
        if args.output == "bf16":
            dw = gg.grouped_wgrad_gluon(*ops, out_dtype=torch.bfloat16, config=cfg)
            return sum(not same(a, b) for a, b in zip(dw, ref))
        mg = list(buf.clone().view(num, n, k).unbind(0))
        assert gg.output_span(mg, n, k) is not None, "views of one buffer lie in one span"
        gg.grouped_wgrad_gluon(*ops, out_dtype=torch.float32, accumulate_into=mg, config=cfg)
        wrong = [e for e, (a, b) in enumerate(zip(mg, ref)) if not same(a, b)]
        if args.diagnose:  # (GPU work between calls: the counts of such a run are not a plain run's)
            for line in diagnose(mg, ref, start, xs, dys, wrong, args.diagnose):
                print(f"    call {call}: {line}")
        return len(wrong)

    print(f"qwen-like-128: {num} experts, K {k}, N {n}, device counts, {args.output} output; experts differing per call")
    for split in args.splits:
        pr, cr = (int(v) for v in split.split(":"))
        cfg = gg.GroupedConfig(block_m=256, block_n=128, producer_regs=pr, consumer_regs=cr)
        print(f"  producer {pr:3d} / consumer {cr:3d}: {[run(cfg, i) for i in range(args.reps)]}", flush=True)


TILE_M, TILE_N, BLOCK_T = 256, 128, 128  # the kernel's output tile (rows of dW x columns) and its token block


def block_contributions(dy_e: torch.Tensor, x_e: torch.Tensor) -> list[torch.Tensor]:
    """Each 128-token block's share of ``dW_e = dY_e^T X_e`` (dequantized operands, fp32): what one K block of
    the kernel adds."""
    return [dy_e[t : t + BLOCK_T].T @ x_e[t : t + BLOCK_T] for t in range(0, dy_e.shape[0], BLOCK_T)]


FITS = 0.5  # a candidate whose relative distance to the residual is above this explains nothing


def explain_tile(r: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str:
    """The candidate that best matches the residual ``r`` (result minus expected, one tile, finite), by relative
    distance (``candidates`` in order of preference); "no candidate fits" where even the best is farther than
    ``FITS`` (a residual unlike every candidate, e.g. garbage, is as far from a near-zero candidate as from
    nothing: distance 1)."""
    norm = r.norm().item() or 1.0
    # ties (e.g. an expert without tokens, whose dW is 0, against "store skipped") go to the earlier candidate
    rel, _, name = min((torch.dist(r, c).item() / norm, i, name) for i, (name, c) in enumerate(candidates.items()))
    verdict = f"best match {name}" if rel <= FITS else f"no candidate fits (nearest: {name})"
    return f"max |err| {r.abs().max().item():.3e}; {verdict} (relative distance {rel:.2e})"


def scale_fit(r: torch.Tensor, blocks: list[torch.Tensor], per_row: bool) -> str:
    """How well one token block's contribution times one factor per row (``per_row``) or per column explains the
    residual ``r``: what a wrong row scale (1x128 of dY) or column scale (of X) of that block would leave. The
    best block, its relative distance and where its factors are not 0."""
    kind = "row" if per_row else "column"
    if not blocks:
        return f"{kind} factors: no token blocks (an expert without tokens)"
    dim = 1 if per_row else 0
    best = None
    for b, c in enumerate(blocks):
        f = (r * c).sum(dim) / (c * c).sum(dim).clamp_min(1e-30)
        rel = torch.dist(r, f.unsqueeze(dim) * c).item() / (r.norm().item() or 1.0)
        if best is None or rel < best[0]:
            best = (rel, b, f)
    rel, b, f = best
    hit = (f.abs() > 1e-6).nonzero().flatten()
    where = "none"
    if len(hit):
        where = f"{int(hit.min())}-{int(hit.max())}, factors {f[hit].min().item():.3g}..{f[hit].max().item():.3g}"
    return f"{kind} factors on token block {b}: relative distance {rel:.2e} ({where})"


def _span(idx: torch.Tensor) -> str:
    return f"{len(idx)} ({int(idx.min())}-{int(idx.max())})" if len(idx) else "0"


def diagnose(out, ref, start, xs, dys, wrong, most: int) -> list[str]:
    """Lines explaining up to ``most`` wrong tiles of the experts ``wrong`` (a value is wrong where its bits differ
    from ``ref``'s, NaN and Inf included): where the wrong values lie, how many are not finite, and, for a tile
    whose wrong values are finite, its residual against what a skipped store, a lost old value, a doubled dW, one
    missing or doubled token block, or another tile's or expert's dW would leave (``explain_tile``), and the best
    per-row and per-column scale fits (``scale_fit``)."""
    lines, seen = [], 0
    for e in wrong:
        x_e = xs[e].dequantize(torch.float32, copy="columnwise")
        dy_e = dys[e].dequantize(torch.float32, copy="columnwise")
        blocks = block_contributions(dy_e, x_e)
        bad = out[e].view(torch.int32) != ref[e].view(torch.int32)
        for tm in range(0, bad.shape[0], TILE_M):
            for tn in range(0, bad.shape[1], TILE_N):
                sl = (slice(tm, tm + TILE_M), slice(tn, tn + TILE_N))
                if seen >= most or not bool(bad[sl].any()):
                    continue
                seen += 1
                tile_bad, r = bad[sl], out[e][sl] - ref[e][sl]
                nonfinite = int((~torch.isfinite(out[e][sl]) & tile_bad).sum())
                where = (f"expert {e} tile ({tm},{tn}): {int(tile_bad.sum())} wrong values ({nonfinite} NaN or Inf) in "
                         f"rows {_span(tile_bad.any(1).nonzero().flatten())}, columns "
                         f"{_span(tile_bad.any(0).nonzero().flatten())}")  # fmt: skip
                if nonfinite or not bool(torch.isfinite(r).all()):
                    lines.append(where + "; not fitted (values not finite)")
                    continue
                dw = ref[e][sl] - start[e][sl]
                cands = {"store skipped (-dW)": -dw, "old value lost (-C)": -start[e][sl], "dW twice (+dW)": dw}
                for b, c in enumerate(blocks):
                    cands[f"token block {b} missing"] = -c[sl]
                    cands[f"token block {b} twice"] = c[sl]
                for e2 in range(len(ref)):  # another expert's tile at the same place
                    if e2 != e:
                        cands[f"expert {e2}'s dW instead"] = (ref[e2][sl] - start[e2][sl]) - dw
                for tm2 in range(0, bad.shape[0], TILE_M):  # another tile of the same expert (of the same shape)
                    for tn2 in range(0, bad.shape[1], TILE_N):
                        o = (slice(tm2, tm2 + TILE_M), slice(tn2, tn2 + TILE_N))
                        other = ref[e][o] - start[e][o]
                        if (tm2, tn2) != (tm, tn) and other.shape == dw.shape:
                            cands[f"tile ({tm2},{tn2})'s dW instead"] = other - dw
                tile_blocks = [c[sl] for c in blocks]
                lines.append(f"{where}; {explain_tile(r, cands)}; {scale_fit(r, tile_blocks, True)}; "
                             f"{scale_fit(r, tile_blocks, False)}")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
