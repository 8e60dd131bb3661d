"""What the grouped expert layer keeps for backward and allocates at its peak, on the CPU, without arithmetic.

    python -m tools.moe_memory [--experts 16] [--hidden 2048] [--ffn 1408] [--topk 4] [--tokens 8192] [--skewed]

One SwiGLU expert layer (fc1 ``[hidden -> 2 ffn]``, ``silu(a) * b``, fc2 ``[ffn -> hidden]``) through
``fp8_grouped_linear`` with Megatron's setting (each weight has a ``main_grad``, gradient-accumulation fusion, a
hook dropping ``.grad``, weight caches refreshed as on a step's first microbatch), with a shape-only backend: its
grouped operations allocate their outputs exactly as the Triton grouped kernels do (``quantize_grouped.py``,
``gemm_grouped.py``) and compute nothing, so the figures are those of the autograd op and the caches, not of a
kernel's arithmetic. Prints, in MiB:

* saved for backward (``torch.autograd.graph.saved_tensors_hooks``, storages counted once, parameters left out),
  split into the grouped linears' FP8 copies and scales and the activation's bf16 tensors;
* the weight caches (every expert's W and W^T in FP8, with scales);
* the peak allocated above the start during one forward + backward, and during the forward alone (``torch.profiler``
  memory events).
"""

from __future__ import annotations

import argparse

import torch

from primus_fp8_plugin import GroupedWeightCache, fp8_grouped_linear
from primus_fp8_plugin.backends.base import Availability, Backend
from primus_fp8_plugin.grouped_tensor import GroupedFp8Tensor, GroupedFp8Weight
from primus_fp8_plugin.recipe import BLOCK
from primus_fp8_plugin.tensor import pad4, scale_inv_shape

MIB = 2**20


class ShapeOnlyBackend(Backend):
    """The grouped operations' outputs, allocated as the Triton grouped kernels allocate them, left unwritten."""

    name = "shape-only"

    def availability(self, device):
        return Availability(True, auto=False)

    def _dense(self, *args, **kwargs):
        raise NotImplementedError("the shape-only backend has grouped operations only")

    quantize_act = quantize_weight = gemm_fwd = gemm_dgrad = gemm_wgrad = _dense

    def quantize_act_grouped(self, x, layout, params, *, rowwise, columnwise, rows=None):
        t, k = (x.shape[0] if rows is None else rows.numel()), x.shape[1]
        f8, cap, parts = params.fp8_dtype, layout.capacity, {}
        if rowwise:
            parts.update(rowwise_data=torch.empty(t, k, dtype=f8), rowwise_scale_inv=torch.empty(scale_inv_shape(t, k, 1)))
        if columnwise:
            parts.update(columnwise_data=torch.empty(k, cap, dtype=f8), columnwise_scale_inv=torch.empty(cap // BLOCK, pad4(k)))
        return GroupedFp8Tensor(layout, (t, k), f8, x.dtype, **parts)

    def quantize_weight_grouped(self, weights, params, out=None):
        w0 = weights[0]
        return out if out is not None else GroupedFp8Weight.empty(len(weights), tuple(w0.shape), params.fp8_dtype, w0.dtype,
                                                                  w0.device)  # fmt: skip

    def gemm_fwd_grouped(self, x, w, bias, out_dtype):
        return torch.empty(x.shape[0], w.shape[0], dtype=out_dtype)

    def gemm_dgrad_grouped(self, dy, w, out_dtype):
        return torch.empty(dy.shape[0], w.shape[1], dtype=out_dtype)

    def gemm_wgrad_grouped(self, dy, x, out_dtype, accumulate_into):
        if accumulate_into is not None:
            return list(accumulate_into)
        return list(torch.empty(x.num_groups, dy.shape[1], x.shape[1], dtype=out_dtype).unbind(0))


def routing(experts: int, tokens: int, skewed: bool) -> list[int]:
    if not skewed:
        base = [tokens // experts] * experts
        base[0] += tokens - sum(base)
        return base
    share = [1.0 / (i + 1) ** 1.2 for i in range(experts)]
    counts = [int(tokens * s / sum(share)) for s in share]
    counts[0] += tokens - sum(counts)
    return counts


def _megatron_weights(experts: int, n: int, k: int) -> list[torch.nn.Parameter]:
    ws = [torch.nn.Parameter(torch.empty(n, k, dtype=torch.bfloat16)) for _ in range(experts)]
    for w in ws:
        w.main_grad = torch.zeros(n, k)
        w.grad_added_to_main_grad = False
        w.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    return ws


def measure(experts: int, hidden: int, ffn: int, topk: int, tokens: int, skewed: bool = False) -> dict[str, float]:
    """Bytes (as MiB) of one expert layer: ``saved_fp8`` (the grouped linears' FP8 copies and fp32 scales),
    ``saved_other`` (the rest of what autograd keeps: the activation's bf16 tensors), ``cache``, ``peak`` and
    ``forward_peak`` (the peak before backward starts)."""
    counts = routing(experts, tokens * topk, skewed)
    t = sum(counts)
    be = ShapeOnlyBackend()
    w1, w2 = _megatron_weights(experts, 2 * ffn, hidden), _megatron_weights(experts, hidden, ffn)
    c1, c2 = GroupedWeightCache(), GroupedWeightCache()
    x = torch.randn(t, hidden, dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(t, hidden, dtype=torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in w1 + w2}

    def step(seen):
        def pack(s):
            st = s.untyped_storage()
            if st.data_ptr() not in params:
                seen[st.data_ptr()] = (st.nbytes(), s.dtype)
            return s

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            h = fp8_grouped_linear(x, counts, w1, weight_cache=c1, refresh_weight_cache=True, backend=be)
            a, b = h.chunk(2, -1)
            y = fp8_grouped_linear(torch.nn.functional.silu(a) * b, counts, w2, weight_cache=c2, refresh_weight_cache=True,
                                   backend=be)  # fmt: skip
        with torch.profiler.record_function("moe_memory.backward"):
            y.backward(dy)
        x.grad = None

    step({})  # fills the caches: the measured step refreshes them as a step's first microbatch does
    from torch.profiler import ProfilerActivity, profile

    seen: dict = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(seen)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    bwd_start = next(e.time_range.start for e in events if e.name == "moe_memory.backward")
    cur = peak = fwd_peak = 0
    for e in events:
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
        if e.time_range.start < bwd_start:
            fwd_peak = max(fwd_peak, cur)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float32)
    return {
        "routed_tokens": t,
        "saved_fp8": sum(n for n, d in seen.values() if d in fp8) / MIB,
        "saved_other": sum(n for n, d in seen.values() if d not in fp8) / MIB,
        "cache": (c1.nbytes + c2.nbytes) / MIB,
        "peak": peak / MIB,
        "forward_peak": fwd_peak / MIB,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--skewed", action="store_true", help="a Zipf (1.2) routing instead of a balanced one")
    args = ap.parse_args(argv)
    r = measure(args.experts, args.hidden, args.ffn, args.topk, args.tokens, args.skewed)
    print(f"expert layer: {args.experts} experts, hidden {args.hidden}, ffn {args.ffn}, {r['routed_tokens']} routed tokens")
    print(f"saved for backward: {r['saved_fp8'] + r['saved_other']:.1f} MiB (grouped linears' FP8 copies and scales "
          f"{r['saved_fp8']:.1f}, activation {r['saved_other']:.1f})")  # fmt: skip
    print(f"weight caches: {r['cache']:.1f} MiB; peak above the start: {r['peak']:.1f} MiB during one fwd+bwd, "
          f"{r['forward_peak']:.1f} MiB during the forward")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
