#!/usr/bin/env python
"""Host (CPU) cost of one Megatron MoE layer's forward + backward, the plugin's routed dispatch against
Megatron's dispatcher (allgather type: Megatron's alltoall one needs CUDA streams), on the CPU.

    python -m tools.moe_host_cost [--experts 128] [--topk 8] [--tokens 256] [--hidden 256] [--iters 30]
                                  [--top 20] [--json out.json]

The layer is the fast spec's MoE layer (router, ``Fp8GroupedMLP`` with SwiGLU fused, the plugin's grouped
linears). The FP8 operations run on an *instant* backend: the reference backend's result for each operation's k-th
call in a step is computed once, then handed back at once (tensors cloned), so that what is measured is what a GPU run
spends on the host per layer: Python, autograd, torch's dispatch of the aten operations (each of which is one
kernel launch or more on a GPU), none of the FP8 arithmetic. The sizes are small, so the aten operations' CPU
arithmetic is small too (``--tokens``/``--hidden`` scale it).

Printed per dispatch (the routed one, Megatron's) and expert weight layout (one ``[E, out, in]`` parameter per
grouped linear, ``single_grouped_weight``; one per expert, the default and TE's): ms per layer forward+backward
(median of ``--iters``), aten operations per layer (a ``TorchDispatchMode`` count: autograd runs backward in the
calling thread on the CPU, so both directions count) and how many of them compute (not a view:
``METADATA_OPS``), Python calls; with ``--top N`` also the aten operations by count and a cProfile of the functions
by own time. Per layout also the layer's optimizer step (``optimizer/...``: Megatron's Adam with fp32 masters, the
gradient norm, clipping, the zeroing of the gradient buffers), which a training step runs once: on the CPU torch's
Adam runs its per-parameter loop (on a GPU its ``foreach`` form launches kernels for many parameters at once), and
its ms include the CPU's Adam arithmetic over the layer's weights; Megatron's own per-parameter Python loops (the
gradient and master copies, the norm) are what a GPU run does on the host as well.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import sys
import time
import warnings
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from primus_fp8_plugin.backends import Backend, get_backend

ALL = -1


@dataclasses.dataclass(frozen=True)
class ArgPosition:
    """Where an input tensor stands in a call's arguments: ``args[i]``, ``args[i][j]``, or (``j == ALL``) the list
    ``args[i]`` itself."""

    i: int
    j: int | None


def instant_backend(inner: Backend) -> Backend:
    """A backend answering the ``k``-th call of each FP8 operation within a step (``new_step()`` starts one) with
    ``inner``'s result for the ``k``-th call of the first step that made it (with the same shape of the first tensor
    argument and the same plain keyword arguments), its tensors cloned (module docstring). A training step calls
    the same operations in the same order every time, so this costs a dictionary look-up per call. For host-cost
    measurements only: the results of later calls are not computed from their inputs."""
    memo: dict = {}
    calls: Counter = Counter()

    def template(value, inputs: dict):
        """The result with each of the call's own input tensors (an output written in place, such as the main_grad
        tensors a wgrad accumulates into) replaced by its position among the arguments."""
        if isinstance(value, torch.Tensor):
            return inputs.get(id(value), value)
        if isinstance(value, (tuple, list)):
            items = type(value)(template(v, inputs) for v in value)
            whole = [v.i if isinstance(v, ArgPosition) and v.j == j else None for j, v in enumerate(items)]
            if isinstance(value, list) and items and None not in whole and len(set(whole)) == 1:
                return ArgPosition(whole[0], ALL)  # a list argument handed back whole (``list(accumulate_into)``)
            return items
        return value

    def build(value, args):
        """A fresh result from a template: input positions resolved in this call's ``args``, tensors cloned."""
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, ArgPosition):
            return args[value.i] if value.j is None else list(args[value.i]) if value.j == ALL else args[value.i][value.j]
        if isinstance(value, (tuple, list)):
            return type(value)(build(v, args) for v in value)
        return value

    def memoized(name, method):
        def call(self, *args, **kwargs):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            options = tuple((k, v) for k, v in sorted(kwargs.items()) if isinstance(v, (bool, int, float, str, type(None))))
            key = (name, calls[name], None if first is None else tuple(first.shape), options)
            calls[name] += 1
            if key not in memo:
                inputs = {}
                for i, a in enumerate(args):
                    items = [(None, a)] if isinstance(a, torch.Tensor) else enumerate(a) if isinstance(a, (list, tuple)) else ()
                    inputs.update((id(b), ArgPosition(i, j)) for j, b in items if isinstance(b, torch.Tensor))
                memo[key] = template(method(*args, **kwargs), inputs)
            return build(memo[key], args)

        return call

    ops = [n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_") and n != "availability"]
    methods = {n: memoized(n, getattr(inner, n)) for n in ops}
    methods["new_step"] = lambda self: calls.clear()
    return type("InstantBackend", (type(inner),), {"name": "instant", **methods})()


# aten operations that only make a new view of existing memory: no kernel on a GPU
METADATA_OPS = frozenset({"view", "_unsafe_view", "detach", "alias", "t", "permute", "transpose", "slice", "select",
                          "expand", "as_strided", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind"})  # fmt: skip


class AtenCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def build_layer(experts: int, topk: int, hidden: int, ffn: int, single_grouped_weight: bool = True):
    """The fast spec's MoE layer (one transformer layer's ``mlp``) on the CPU, gloo world of one, under Megatron's
    DDP; its grouped linears with one ``[E, out, in]`` weight each (``single_grouped_weight``) or one weight per
    expert. Returns the layer and its optimizer step: Megatron's Adam over the layer (bf16 weights, fp32 masters,
    the gradient norm and clipping at 1.0), then the zeroing of the gradient buffers, as a training step ends."""
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from primus_fp8_plugin.megatron import TorchNorm
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config, init_cpu_distributed
    from primus_fp8_plugin.megatron.fast_specs import get_gpt_fast_layer_spec

    init_cpu_distributed()
    cfg = cpu_transformer_config(num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=ffn,
                                 params_dtype=torch.bfloat16, bf16=True, num_moe_experts=experts,
                                 moe_router_topk=topk, moe_token_dispatcher_type="allgather", add_bias_linear=False,
                                 gated_linear_unit=True, activation_func=F.silu, moe_ffn_hidden_size=ffn,
                                 moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss")  # fmt: skip
    spec = get_gpt_fast_layer_spec(num_experts=experts, moe_grouped_gemm=True, single_grouped_weight=single_grouped_weight,
                                   backend="reference")  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = TransformerBlock(cfg, TransformerBlockSubmodules(layer_specs=[spec], layer_norm=TorchNorm))
    layer = block.layers[0].mlp
    if layer.routed_dispatch_off is not None:
        raise RuntimeError(f"the routed dispatch is off: {layer.routed_dispatch_off}")
    use_instant_backend(layer)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from primus_fp8_plugin.megatron.cpu import CudaAsCpu

    with CudaAsCpu():  # Megatron's gradient buffers: main_grad and its backward hooks, as in training
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), layer)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, clip_grad=1.0), [ddp])

    def optimizer_step():
        with CudaAsCpu():
            ok, _, _ = optimizer.step()
        if not ok:
            raise RuntimeError("Megatron's optimizer skipped the step (gradients not finite)")
        ddp.zero_grad_buffer()
        optimizer.zero_grad()

    return layer, optimizer_step


def use_instant_backend(layer) -> None:
    """A fresh instant backend (its own memo) for every FP8 operation of ``layer``."""
    instant = instant_backend(get_backend("reference", "cpu"))
    for m in layer.modules():
        if hasattr(m, "fp8_backend"):
            m.fp8_backend = instant
    layer.routed_dispatcher.backend = instant


def layer_step(layer, x, dy):
    """One forward and backward (Megatron's DDP hooks leave every parameter's ``.grad`` None after it)."""
    layer.routed_dispatcher.backend.new_step()
    out, _ = layer(x)
    out.backward(dy)
    x.grad = None


def python_calls(fn) -> int:
    """Python-level function calls ``fn()`` makes, ``fn`` itself included (``sys.setprofile``'s "call" events; C
    functions report "c_call" and are not counted)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def measure(step, iters: int, top: int) -> dict:
    """``step()``'s host cost: median ms over ``iters`` runs after three warm-up runs (the instant backend computes
    each operation's result once), aten operations (computing ones), Python calls; ``top``: the aten operations by
    count and a cProfile."""
    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with AtenCounter() as counter:
        step()
    calls = python_calls(step)
    kernels = sum(n for op, n in counter.counts.items() if op not in METADATA_OPS)
    result = {"ms": sorted(times)[len(times) // 2] * 1e3, "aten_ops": sum(counter.counts.values()), "aten_kernel_ops": kernels,
              "python_calls": calls, "aten_by_name": dict(counter.counts.most_common(top))}  # fmt: skip
    if top:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        result["cprofile"] = text.getvalue()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256, help="tokens per layer call (sequence x batch)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=128, help="each expert's FFN width")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--top", type=int, default=0, help="print the N most frequent aten ops and a cProfile top N")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if torch.cuda.is_available():
        p.error("a CPU measurement: run it where no GPU is visible (CUDA_VISIBLE_DEVICES=)")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, 1, args.hidden, generator=g).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(args.tokens, 1, args.hidden, generator=g).to(torch.bfloat16)
    results = {}
    for weights in ("single", "per_expert"):  # one [E, out, in] weight per grouped linear, or one per expert
        layer, optimizer_step = build_layer(args.experts, args.topk, args.hidden, args.ffn,
                                            single_grouped_weight=weights == "single")  # fmt: skip
        routed = layer.routed_dispatcher
        results[f"routed/{weights}"] = measure(lambda: layer_step(layer, x, dy), args.iters, args.top)
        layer.token_dispatcher = routed.megatron  # Megatron's allgather dispatcher, the same experts
        use_instant_backend(layer)  # its own memo: another sequence of calls
        results[f"megatron/{weights}"] = measure(lambda: layer_step(layer, x, dy), args.iters, args.top)
        results[f"optimizer/{weights}"] = measure(optimizer_step, args.iters, args.top)
    print(f"MoE layer fwd+bwd on the host: {args.experts} experts, top-{args.topk}, {args.tokens} tokens, "
          f"hidden {args.hidden}, expert FFN {args.ffn}; instant FP8 backend, one CPU thread")  # fmt: skip
    print("  dispatch/expert weights (optimizer: the layer's optimizer step, once per training step, not per layer call)")
    for name, r in sorted(results.items(), key=lambda kv: kv[0].startswith("optimizer")):
        print(f"  {name:<20} {r['ms']:7.2f} ms  {r['aten_ops']:5d} aten ops, {r['aten_kernel_ops']:5d} of them computing "
              f"(a GPU kernel or more each)  {r['python_calls']:6d} Python calls")  # fmt: skip
    if args.top:
        for name, r in results.items():
            print(f"\n{name}: aten ops by count\n" + "\n".join(f"  {n:6d} {op}" for op, n in r["aten_by_name"].items()))
            print(f"\n{name}: cProfile, by own time\n{r['cprofile']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": {k: {n: v for n, v in r.items() if n != "cprofile"}
                                                        for k, r in results.items()}}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
