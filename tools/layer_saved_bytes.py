"""What one Megatron transformer layer keeps for backward, storage by storage, per spec: the plugin's TE-free fast
spec against TE's spec under Float8BlockScaling (and the TE-free BF16 local spec), same shapes, one process.

    python -m tools.layer_saved_bytes [--specs fast te local] [--hidden 4096] [--ffn 14336] [--heads 32]
                                      [--groups 8] [--seq 2048] [--batch 2] [--device cuda] [--json out.json]

One Llama-style ``TransformerLayer`` (RMSNorm, gated SwiGLU MLP, RoPE, GQA, no biases; the width of the 8B-proxy of
docs/PERFORMANCE.md by default) runs one forward on random hidden states under
``torch.autograd.graph.saved_tensors_hooks``; each distinct storage saved (parameters left out: the model's, and
the quantized weights live in weight caches) is listed with its bytes, dtype, the shape it was saved as, and the
autograd nodes that hold it (found by walking the graph from the output: a custom Function's ``saved_tensors``, a
built-in node's ``_saved_*`` attributes). A storage larger than the tensor saved from it is a view keeping a
bigger buffer alive. Then the backward runs (the saved tensors are what it uses).

Specs: ``fast`` (``fp8_gpt_fast_layer_spec``: fused norm / SwiGLU + quantization, the plugin's RoPE, SDPA; the
reference backend on a CPU), ``te`` (TE's ``get_gpt_layer_with_transformer_engine_spec`` under
``--fp8-format e4m3 --fp8-recipe blockwise``: needs TE and a GPU), ``local`` (Megatron's local spec in BF16: its
unfused attention, no TE). Per spec the table ends with the total in MiB and bytes per token per hidden unit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import warnings

import torch
import torch.nn.functional as F

from tools.sp_saved_bytes import SavedBytes

MIB = 2**20


def _nodes(root):
    """Every autograd node reachable from ``root``."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))


def _node_tensors(node):
    """The tensors ``node`` saved for its backward (those it can still give back)."""
    out = []
    try:
        out.extend(t for t in node.saved_tensors if isinstance(t, torch.Tensor))  # custom autograd.Function
    except (AttributeError, RuntimeError):
        pass
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                v = getattr(node, name)
            except RuntimeError:
                continue
            vals = v if isinstance(v, (tuple, list)) else [v]
            out.extend(t for t in vals if isinstance(t, torch.Tensor))
    return out


def inventory(layer, x, *, context=None, **call) -> dict:
    """Saved storages of one ``layer(x, **call)`` forward (under ``context`` when given), then its backward."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    with context or contextlib.nullcontext(), SavedBytes(exclude=params) as saved:
        out = layer(x, **call)
    out = out[0] if isinstance(out, tuple) else out
    held = {key: set() for key in saved.storages}
    for node in _nodes(out.grad_fn):
        for t in _node_tensors(node):
            key = t.untyped_storage().data_ptr()
            if key in held:
                held[key].add(type(node).__name__)
    out.backward(torch.randn_like(out))
    rows = [{"bytes": nbytes, "dtype": str(saved.saved_as[key][0]).replace("torch.", ""),
             "saved_as": list(saved.saved_as[key][1]), "held_by": sorted(held[key]) or ["?"]}
            for key, nbytes in saved.storages.items() if nbytes > 0]  # fmt: skip
    rows.sort(key=lambda r: -r["bytes"])
    return {"rows": rows, "total_bytes": sum(r["bytes"] for r in rows)}


def _config(args, spec: str):
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config

    kw = dict(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, num_query_groups=args.groups,
              ffn_hidden_size=args.ffn, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False, params_dtype=torch.bfloat16, bf16=True,
              use_cpu_initialization=args.device == "cpu")  # fmt: skip
    if spec == "te":
        kw.update(fp8="e4m3", fp8_recipe="blockwise")
    return cpu_transformer_config(**kw)


def _layer_spec(spec: str, config):
    if spec == "fast":
        from primus_fp8_plugin.megatron import fp8_gpt_fast_layer_spec

        return fp8_gpt_fast_layer_spec(config)
    from megatron.core.models.gpt import gpt_layer_specs as g

    if spec == "te":
        return g.get_gpt_layer_with_transformer_engine_spec()
    if spec == "local":
        return g.get_gpt_layer_local_spec(normalization="RMSNorm")
    raise ValueError(f"unknown spec {spec!r} (fast, te, local)")


def measure(args, spec: str) -> dict:
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.models.gpt import GPTModel

    config = _config(args, spec)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = GPTModel(config=config, transformer_layer_spec=_layer_spec(spec, config), vocab_size=1024,
                       max_sequence_length=args.seq, position_embedding_type="rope")  # fmt: skip
    gpt = gpt.to(args.device, torch.bfloat16)
    layer = gpt.decoder.layers[0]
    x = torch.randn(args.seq, args.batch, args.hidden, device=args.device, dtype=torch.bfloat16, requires_grad=True)
    rope = gpt.rotary_pos_emb(args.seq)
    res = inventory(layer, x, context=get_fp8_context(config), attention_mask=None, rotary_pos_emb=rope)
    tokens = args.seq * args.batch
    res.update(spec=spec, tokens=tokens, bytes_per_token_hidden=res["total_bytes"] / tokens / args.hidden)
    return res


def _print(res: dict) -> None:
    print(f"\n{res['spec']}: {res['total_bytes'] / MIB:.1f} MiB saved, {res['bytes_per_token_hidden']:.2f} bytes per "
          f"token per hidden unit ({res['tokens']} tokens)")  # fmt: skip
    print(f"{'MiB':>9}  {'dtype':<14} {'saved as':<22} held by")
    for r in res["rows"]:
        print(f"{r['bytes'] / MIB:9.2f}  {r['dtype']:<14} {str(r['saved_as']):<22} {', '.join(r['held_by'])}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", nargs="*", default=["fast", "te"], choices=["fast", "te", "local"])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if "te" in args.specs and args.device == "cpu":
        ap.error("the te spec needs a GPU (TE's Float8BlockScaling): --device cuda, or leave te out of --specs")
    _init(args.device)
    results = []
    for spec in args.specs:
        results.append(measure(args, spec))
        _print(results[-1])
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            d = (base["total_bytes"] - r["total_bytes"]) / MIB
            print(f"{base['spec']} - {r['spec']}: {d:+.1f} MiB per layer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


def _init(device: str) -> None:
    """One-process model-parallel groups (gloo on a CPU, NCCL on a GPU)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if device == "cpu":
        from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

        init_cpu_distributed()
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


if __name__ == "__main__":
    raise SystemExit(main())
