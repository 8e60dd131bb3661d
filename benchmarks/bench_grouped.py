#!/usr/bin/env python3
"""Grouped (MoE) expert linears on the GPU: the plugin's Fp8GroupedLinear vs TE's te.GroupedLinear
(Float8BlockScaling), the plugin's SequentialMLP path (a dense Fp8BlockwiseLinear per expert) and BF16 grouped
(torch._grouped_mm where this torch has it, else a loop of BF16 linears), forward + backward, all in one run.

    python benchmarks/bench_grouped.py [--models mixtral qwen3 dsv3] [--tokens 8192 32768]
        [--routing balanced skewed] [--backends triton] [--sustained S] [--json out.json] [--plot out.png]

Fine-grained experts (128 and 256 of them, 128 to 2048 tokens each, gradients into fp32 ``main_grad`` as in
training)::

    python benchmarks/bench_grouped.py --models qwen3 e256 --tokens-per-expert 128 256 512 1024 2048 \
        --routing balanced --no-sequential --main-grad

Models (one row per expert linear, SwiGLU experts: fc1 is [hidden -> 2 x ffn], fc2 [ffn -> hidden]):
``mixtral`` (Mixtral-8x7B-like: 8 experts, top-2, hidden 4096, ffn 14336), ``qwen3`` (Qwen3-30B-A3B-like: 128
experts, top-8, hidden 2048, ffn 768), ``dsv3`` (DeepSeek-V3's local experts at EP=8: 32 experts, hidden 7168,
ffn 2048); ``moe_proxy`` (16 experts, hidden 2048, ffn 1408: the Megatron-LM MoE proxy of docs/PERFORMANCE.md,
only when asked for); ``e256`` (256 experts at Qwen3-30B-A3B's width, only when asked for). ``--tokens`` are
routed tokens (tokens x top-k) per step, or ``--tokens-per-expert`` each model's experts times that many;
``balanced`` gives every expert the same count, ``skewed`` a Zipf (exponent 1.2) share, randomly permuted over the
experts; counts are multiples of ``--align`` (16: what Megatron pads to for TE's FP8 grouped GEMM).

Columns: ``step ms`` one forward+backward with a freshly quantized weight (ours ``is_first_microbatch=True``,
TE ``is_first_microbatch=None``, the sequential path ``True`` on every expert); ``cached ms`` the same with the
quantized weights reused (ours and the sequential path ``False`` after a ``True`` call, TE ``False`` after
``True``); ``TF`` 6 x tokens x N x K / step time; ``vs TE`` / ``vs bf16`` that contender's time over this one's
(above 1: faster), for the step and the cached step; ``peak MiB`` the most memory one fresh step allocates
above what was allocated before it (``torch.cuda.max_memory_allocated``; activations, quantized copies, weight
gradients and temporaries); ``floor ms`` the shape's memory floor: the bytes a cached step must move at the least
(``memory_floor_bytes``: the bf16 activations and gradients in and out once, both FP8 weight copies read once, the
weight gradient written, or ``main_grad`` read and written in fp32) over the GPU's HBM bandwidth (``HBM_TBPS``,
``--hbm-tbps``), and ``x floor`` the cached step over it. ``--main-grad``: ours and TE accumulate the weight
gradients into fp32 ``main_grad`` (Megatron's training path; the BF16 and sequential contenders write ``.grad``).
``--single-grouped-weight`` adds ours with the experts' weights in one ``[E, N, K]`` parameter
(``ours-BACKEND-single``: one tensor for the weight cache's checks, autograd and ``main_grad``).
Geometric means over the shapes end the table.

Timing (default): each contender run back to back for ``--sustained`` seconds (0.75) after an untimed settle,
the contenders' order reversed on every other shape (benchlib.Timing: the power-limited clock of training,
docs/PERFORMANCE.md); ``--sustained 0`` uses triton's do_bench (median, L2 flushed) instead. The expected
duration is printed first (the default run: about 5 minutes on one H200).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _d in (_HERE, _HERE.parent / "scripts", _HERE.parent):  # benchlib lives in benchmarks/ (or scripts/)
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

from benchlib import SETTLE_S, Timing, environment, report, require_cuda, save_figure, step_peak_mib, try_import_te  # noqa: E402

from primus_fp8_plugin import Fp8BlockwiseLinear, Fp8GroupedLinear, backend_availability  # noqa: E402

MODELS = {  # name: (experts, hidden, ffn)
    "mixtral": (8, 4096, 14336),
    "qwen3": (128, 2048, 768),
    "dsv3": (32, 7168, 2048),
}
# not in the default run: the Megatron-LM MoE proxy's experts; 256 experts at Qwen3-30B-A3B's width
EXTRA_MODELS = {"moe_proxy": (16, 2048, 1408), "e256": (256, 2048, 768)}
# HBM bandwidth by device name (TB/s, the vendors' figures): the memory floor's denominator
HBM_TBPS = {"H200": 4.8, "H100": 3.35, "H20": 4.0, "B200": 8.0, "MI355X": 8.0, "MI300X": 5.3}


def memory_floor_bytes(tokens: int, k: int, n: int, experts: int, main_grad: bool) -> int:
    """Bytes one forward + backward of a grouped linear ``[K -> N]`` with cached FP8 weights must move at the
    least: X read, Y written, dY read, dX written (bf16, once each), the FP8 W read in fprop and W^T in dgrad
    (one byte per element; scales left out), and the weight gradient written in bf16, or with ``main_grad`` read and
    written in fp32. The quantized activation copies a real implementation writes and reads are not counted."""
    activations = 2 * tokens * (2 * k + 2 * n)
    weights = 2 * experts * n * k
    wgrad = experts * n * k * (8 if main_grad else 2)
    return activations + weights + wgrad


def hbm_tbps(device_name: str) -> float | None:
    """The HBM bandwidth of a device by its name (``HBM_TBPS``), None where unknown."""
    return next((bw for name, bw in sorted(HBM_TBPS.items(), key=lambda kv: -len(kv[0])) if name in device_name), None)


def routing(kind: str, experts: int, tokens: int, align: int, seed: int = 0) -> list[int]:
    """Tokens per expert, multiples of ``align`` summing to ``tokens`` (rounded down to ``align``)."""
    units = tokens // align
    if kind == "balanced":
        share = torch.full((experts,), 1.0 / experts)
    else:
        g = torch.Generator().manual_seed(seed)
        zipf = 1.0 / torch.arange(1, experts + 1).double() ** 1.2
        share = (zipf / zipf.sum())[torch.randperm(experts, generator=g)]
    counts = (share * units).floor().long()
    counts[torch.argsort(share * units - counts, descending=True)[: units - int(counts.sum())]] += 1
    return (counts * align).tolist()


def grouped_mm_trains() -> bool:
    """Whether this torch has ``torch._grouped_mm`` with a backward on this GPU (a small probe)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(2, 128, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([32, 64], device="cuda", dtype=torch.int32)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


class Bf16Grouped(torch.nn.Module):
    """BF16 experts: ``torch._grouped_mm`` on stacked weights [E, N, K] (offsets on the device), else a loop."""

    def __init__(self, experts, k, n, grouped: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k))
        self.grouped = grouped

    def forward(self, x, counts, offs):
        if self.grouped:
            return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)
        return torch.cat([p @ w.t() for p, w in zip(torch.split(x, counts), self.weight.unbind(0))])


def contenders(args, experts, k, n, counts, te):
    """name -> (module, call(module, x, first_microbatch)) for one expert linear."""
    out = {}
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    bf16 = Bf16Grouped(experts, k, n, args.bf16_grouped)
    out["bf16 grouped" if bf16.grouped else "bf16 loop"] = (bf16, lambda m, x, first: m(x, counts, offs))
    counts_dev = torch.tensor(counts, device="cuda", dtype=torch.int32)
    def call(m, x, first, split=counts_dev if args.device_counts else counts):
        m.is_first_microbatch = first
        return m(x, split)

    layouts = (False, True) if args.single_grouped_weight else (False,)
    for b in args.backends:
        if not backend_availability(b, "cuda"):
            continue
        for single in layouts:  # one weight per expert (TE's layout), or one [E, N, K] weight
            layer = Fp8GroupedLinear(experts, k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=b,
                                     single_grouped_weight=single)  # fmt: skip
            if args.main_grad:
                give_main_grads(layer.weights)
            out[f"ours-{b}" + ("-single" if single else "")] = (layer, call)
    if not args.no_sequential:
        seq_backend = args.sequential_backend
        dense = torch.nn.ModuleList(
            Fp8BlockwiseLinear(k, n, bias=False, device="cuda", dtype=torch.bfloat16, backend=seq_backend) for _ in range(experts)
        )

        def seq_call(mods, x, first):
            outs = []
            for mod, part in zip(mods, torch.split(x, counts)):
                mod.is_first_microbatch = first
                outs.append(mod(part))
            return torch.cat(outs)

        out[f"sequential-{seq_backend}"] = (dense, seq_call)
    if te is not None:
        from transformer_engine.common.recipe import Float8BlockScaling

        recipe = Float8BlockScaling()
        te_layer = te.GroupedLinear(experts, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                                    fuse_wgrad_accumulation=args.main_grad)  # fmt: skip
        if args.main_grad:
            give_main_grads([getattr(te_layer, f"weight{i}") for i in range(experts)])

        def te_call(m, x, first):
            ctx = te.autocast(enabled=True, recipe=recipe) if hasattr(te, "autocast") else \
                te.fp8_autocast(enabled=True, fp8_recipe=recipe)  # fmt: skip
            with ctx:
                return m(x, counts, is_first_microbatch=first)

        out["TE"] = (te_layer, te_call)
    return out


def give_main_grads(weights) -> None:
    """An fp32 ``main_grad`` per weight, as Megatron's DDP gives them (with its hook's flag)."""
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        w.grad_added_to_main_grad = False


def step_fns(module, call, x, dy, te_style: bool):
    """(a step with a fresh weight quantization, a step with the cached quantized weights, the warm-up that
    fills the cache) for one contender."""
    params = list(module.parameters())

    def fwd_bwd(first):
        for p in params:
            p.grad = None
        x.grad = None
        call(module, x, first).backward(dy)

    # TE: a fresh step without weight caching (None); ours and the sequential path: a fresh quantization (True)
    return (lambda: fwd_bwd(None if te_style else True)), (lambda: fwd_bwd(False)), (lambda: fwd_bwd(True))


SETUP_S = 2.0  # per shape: inputs, modules, first calls (kernels compiled once per shape)


def expected_seconds(shapes: int, contenders: int, sustained: float) -> float:
    """Rough duration of a run: per contender and shape two timings (fresh and cached), each an untimed settle
    plus ``sustained`` seconds (``do_bench``: about 0.2 s), and a fixed setup per shape."""
    per_timing = SETTLE_S + sustained + 0.1 if sustained > 0 else 0.25
    return shapes * (contenders * 2 * per_timing + SETUP_S)


def geomean_notes(rows: list[dict]) -> list[str]:
    """One line per contender and ratio column: the geometric mean over the shapes, its minimum and count."""
    notes = []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        for key in ("vs TE", "vs bf16", "cached vs TE", "cached vs bf16"):
            vals = [r[key] for r in rows if r["impl"] == impl and r.get(key)]
            if vals:
                geo = math.exp(sum(math.log(v) for v in vals) / len(vals))
                notes.append(f"{impl}: {key} geomean {geo:.3f} (min {min(vals):.3f}, {len(vals)} shapes)")
    return notes


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows and the environment as JSON")
    ap.add_argument("--plot", help="write a PNG")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=[*MODELS, *EXTRA_MODELS])
    ap.add_argument("--linears", nargs="*", default=["fc1", "fc2"], choices=["fc1", "fc2"])
    ap.add_argument("--tokens", nargs="*", type=int, default=[8192, 32768], help="routed tokens per step")
    ap.add_argument("--tokens-per-expert", nargs="*", type=int, metavar="T",
                    help="instead of --tokens: each model's experts times T routed tokens")  # fmt: skip
    ap.add_argument("--main-grad", action="store_true",
                    help="ours and TE accumulate the weight gradients into fp32 main_grad (training's path)")
    ap.add_argument("--hbm-tbps", type=float, help="HBM bandwidth for the memory floor (default: by the GPU's name)")
    ap.add_argument("--routing", nargs="*", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    ap.add_argument("--align", type=int, default=16, help="counts are multiples of this")
    ap.add_argument("--backends", nargs="*", default=["triton"], help="the plugin's backends for the grouped layer")
    ap.add_argument("--sequential-backend", default="auto", help="backend of the SequentialMLP contender")
    ap.add_argument("--no-sequential", action="store_true", help="leave out the SequentialMLP path (slow at 128 experts)")
    ap.add_argument("--device-counts", action="store_true", help="pass ours the counts as a device tensor")
    ap.add_argument("--single-grouped-weight", action="store_true",
                    help="also ours with the experts' weights in one [E, N, K] parameter (ours-BACKEND-single)")  # fmt: skip
    ap.add_argument("--sustained", type=float, default=0.75, metavar="S",
                    help="time each contender over S seconds back to back, with SM clock and power (nvidia-smi); "
                         "0: triton do_bench instead (default 0.75)")  # fmt: skip
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not require_cuda("bench_grouped"):
        return 2
    te, why = try_import_te()
    args.bf16_grouped = grouped_mm_trains()
    if args.hbm_tbps is None:
        args.hbm_tbps = hbm_tbps(torch.cuda.get_device_name())
    shapes = len(args.models) * len(args.linears) * len(args.tokens_per_expert or args.tokens) * len(args.routing)
    ours = len([b for b in args.backends if backend_availability(b, "cuda")]) * (2 if args.single_grouped_weight else 1)
    n_contenders = 1 + ours + (not args.no_sequential) + (te is not None)
    print(f"bench_grouped: {shapes} shapes x {n_contenders} contenders, expected about "
          f"{expected_seconds(shapes, n_contenders, args.sustained) / 60:.1f} min", flush=True)  # fmt: skip
    with Timing(args.sustained) as timing:
        rows = _run(args, te, timing)
    env = environment()
    env["timing"] = timing.describe()
    env["bf16"] = "torch._grouped_mm" if args.bf16_grouped else "loop of BF16 matmuls (no torch._grouped_mm backward here)"
    cols = [("model", ""), ("linear", ""), ("tokens", "d"), ("routing", ""), ("impl", ""), ("step ms", ".3f"), ("TF", ".0f"),
            ("vs TE", ".2f"), ("vs bf16", ".2f"), ("cached ms", ".3f"), ("cached vs TE", ".2f"), ("cached vs bf16", ".2f"),
            ("peak MiB", ".0f"), ("floor ms", ".3f"), ("x floor", ".2f")]  # fmt: skip
    if args.sustained > 0:
        cols += [("step MHz", ".0f"), ("step W", ".0f")]
    notes = ([] if te is not None else [f"(TE not installed: {why})"]) + geomean_notes(rows)
    if args.hbm_tbps is None:
        notes.append("(memory floor: this GPU's HBM bandwidth is unknown; give --hbm-tbps)")
    else:
        notes.append(f"(memory floor at {args.hbm_tbps} TB/s HBM, {'main_grad' if args.main_grad else 'bf16 dW'})")
    report("bench_grouped", env, rows, cols, args, plot, notes)
    return 0


def _run(args, te, timing) -> list[dict]:
    rows = []
    i_shape = 0
    for model in args.models:
        experts, hidden, ffn = {**MODELS, **EXTRA_MODELS}[model]
        for linear in args.linears:
            k, n = (hidden, 2 * ffn) if linear == "fc1" else (ffn, hidden)
            for tokens in [experts * t for t in args.tokens_per_expert] if args.tokens_per_expert else args.tokens:
                for kind in args.routing:
                    counts = routing(kind, experts, tokens, args.align)
                    t = sum(counts)
                    torch.manual_seed(0)
                    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    dy = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
                    impls = contenders(args, experts, k, n, counts, te)
                    shape_rows = {name: {"model": model, "linear": linear, "tokens": t, "routing": kind, "impl": name}
                                  for name in impls}  # fmt: skip
                    times, peaks = {}, {}
                    for name in timing.order(impls, i_shape):
                        module, call = impls[name]
                        fresh, cached, warm = step_fns(module, call, x, dy, te_style=name == "TE")
                        t_fresh = timing.ms(fresh, shape_rows[name], "step")
                        warm()  # quantize once, then time the steps that reuse it
                        times[name] = (t_fresh, timing.ms(cached, shape_rows[name], "cached"))
                        for p in module.parameters():  # the peak then includes the new weight gradients
                            p.grad = None
                        x.grad = None
                        peaks[name] = step_peak_mib(fresh)
                    i_shape += 1
                    flops = 6 * t * n * k
                    floor = memory_floor_bytes(t, k, n, experts, args.main_grad)
                    floor_ms = floor / (args.hbm_tbps * 1e9) if args.hbm_tbps else None
                    bf16 = next(v for key, v in times.items() if key.startswith("bf16"))
                    for name, row in shape_rows.items():
                        t1, tc = times[name]
                        row.update({"step ms": t1, "TF": flops / t1 / 1e9, "vs bf16": bf16[0] / t1, "cached ms": tc,
                                    "cached vs bf16": bf16[1] / tc, "peak MiB": peaks[name], "floor MB": floor / 1e6,
                                    "floor ms": floor_ms, "x floor": tc / floor_ms if floor_ms else None})  # fmt: skip
                        if "TE" in times and name != "TE":
                            row.update({"vs TE": times["TE"][0] / t1, "cached vs TE": times["TE"][1] / tc})
                        rows.append(row)
                    line = "  ".join(f"{nm} {v[0]:.3f}/{v[1]:.3f} ms" for nm, v in times.items())
                    print(f"{model} {linear} {t} {kind}: {line}", flush=True)
                    del impls
                    torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(f"{r['model']} {r['linear']}\n{r['tokens']} {r['routing']}" for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(12, len(shapes) * 0.9), 4.5))
    for j, impl in enumerate(impls):
        vals = [next((r["vs bf16"] for r in rows if f"{r['model']} {r['linear']}\n{r['tokens']} {r['routing']}" == s
                      and r["impl"] == impl), 0) for s in shapes]  # fmt: skip
        ax.bar([i + 0.8 / len(impls) * j for i in range(len(shapes))], vals, width=0.8 / len(impls), label=impl)
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(range(len(shapes)), shapes, fontsize=7)
    ax.set_ylabel("speed vs BF16 (fwd+bwd step)")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
