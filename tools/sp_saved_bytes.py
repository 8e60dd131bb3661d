"""Activation bytes saved for backward per rank under sequence parallelism: the plugin's FP8 layers vs Megatron's BF16.

    python -m tools.sp_saved_bytes [--tp 2 4] [--tokens 2048] [--hidden 4096] [--ffn 14336] [--heads 32]
                                   [--groups 8] [--json out.json]

One transformer layer's four linears at TP = each ``--tp`` value with sequence parallelism, in gloo processes on
the CPU (Megatron-core with its CPU stand-ins, ``primus_fp8_plugin/megatron/cpu.py``; the reference backend):
``linear_qkv`` and ``linear_fc1`` (column-parallel, input: this rank's ``tokens / tp`` tokens of the sequence),
``linear_proj`` and ``linear_fc2`` (row-parallel, input: all tokens, ``1 / tp`` of the features). Each layer runs one
forward (and its backward) on random input under ``torch.autograd.graph.saved_tensors_hooks`` counting the unique
storages saved (parameters left out: they are the model's, and the plugin's quantized weights live in its weight
cache, not in the graph). Columns, MiB per rank (every rank saves the same; the tool checks it):

* ``megatron_bf16``: Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` (saves its bf16 input: the local
  shard for a column-parallel layer, which it all-gathers again in backward);
* ``plugin``: ``Fp8ColumnParallelLinear`` / ``Fp8RowParallelLinear`` (column-parallel: the local shard's columnwise
  FP8 copy, all-gathered in FP8; ``sequence_parallel.py``);
* ``plugin_bf16_gather``: the plugin's column-parallel layers as they were before (bf16 all-gather, then the
  gathered sequence's columnwise FP8 copy saved); row-parallel layers are unchanged, so the same as ``plugin``.

Defaults: Llama-3-8B width (hidden 4096, ffn 14336 gated, 32 heads, 8 query groups), 2048 tokens (sequence 2048,
micro batch 1).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import warnings

import torch
import torch.multiprocessing as mp

MIB = 2**20
COLUMNS = ("megatron_bf16", "plugin", "plugin_bf16_gather")


class SavedBytes:
    """Unique storages saved by autograd inside the context (``storages``: address -> bytes; ``saved_as``: address
    -> the dtype and shape of the first tensor saved from it), parameters left out, and any storage whose
    address is in ``exclude`` (e.g. views of a module's parameters) (``nbytes``: their total)."""

    def __init__(self, exclude=()):
        self.exclude = set(exclude)
        self.storages: dict[int, int] = {}
        self.saved_as: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}

    def _pack(self, t):
        s = t.untyped_storage()
        key = s.data_ptr()
        if not isinstance(t, torch.nn.Parameter) and key not in self.exclude:
            self.storages[key] = s.nbytes()
            self.saved_as.setdefault(key, (t.dtype, tuple(t.shape)))
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def linears(hidden: int, ffn: int, heads: int, groups: int) -> list[tuple[str, str, int, int]]:
    """(name, 'column' | 'row', in_features, out_features) of one GPT layer's linears (a gated fc1)."""
    qkv = hidden + 2 * groups * (hidden // heads)
    return [("linear_qkv", "column", hidden, qkv), ("linear_proj", "row", hidden, hidden),
            ("linear_fc1", "column", hidden, 2 * ffn), ("linear_fc2", "row", ffn, hidden)]  # fmt: skip


def _saved(fn, x, out_dim_tokens) -> int:
    """Bytes ``fn(x)`` saves for backward; runs the backward too (a training step's use of them)."""
    with SavedBytes() as saved:
        y = fn(x)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(torch.ones_like(y))
    assert y.shape[0] == out_dim_tokens, (tuple(y.shape), out_dim_tokens)
    return saved.nbytes


def _worker(rank: int, tp: int, port: int, shape: dict, out_path: str) -> None:
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from primus_fp8_plugin import fp8_blockwise_linear
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config, init_cpu_distributed
    from primus_fp8_plugin.megatron.layers import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    init_cpu_distributed(rank=rank, world_size=tp, tp=tp, port=port)
    h, tokens = shape["hidden"], shape["tokens"]
    config = cpu_transformer_config(num_layers=1, hidden_size=h, num_attention_heads=shape["heads"],
                                    ffn_hidden_size=shape["ffn"], tensor_model_parallel_size=tp, sequence_parallel=True,
                                    params_dtype=torch.bfloat16, bf16=True)  # fmt: skip
    group = parallel_state.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(rank)
    rows = []
    for name, kind, k, n in linears(h, shape["ffn"], shape["heads"], shape["groups"]):
        col = kind == "column"
        kw = dict(config=config, init_method=config.init_method, bias=False)
        kw.update(dict(gather_output=False) if col else dict(input_is_parallel=True, skip_bias_add=True))
        mega = (ColumnParallelLinear if col else RowParallelLinear)(k, n, **kw)
        plug = (Fp8ColumnParallelLinear if col else Fp8RowParallelLinear)(k, n, **kw, fp8_backend="reference")
        # column-parallel: this rank's tokens, all features; row-parallel: all tokens, this rank's features
        x = torch.randn((tokens // tp, 1, k) if col else (tokens, 1, k // tp), generator=g).bfloat16().requires_grad_(True)
        out_tokens = tokens if col else tokens // tp
        got = {"megatron_bf16": _saved(mega, x, out_tokens), "plugin": _saved(plug, x, out_tokens)}
        if col:

            def before(t, layer=plug):  # the plugin's column-parallel _forward_impl before the FP8 all-gather
                gathered = gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)
                return fp8_blockwise_linear(gathered, layer.weight, None, **layer.fp8_options())

            got["plugin_bf16_gather"] = _saved(before, x, out_tokens)
        else:
            got["plugin_bf16_gather"] = got["plugin"]
        counts = torch.tensor([got[c] for c in COLUMNS], dtype=torch.int64)
        everyone = [torch.empty_like(counts) for _ in range(tp)]
        dist.all_gather(everyone, counts, group=group)
        if any(not torch.equal(e, counts) for e in everyone):
            raise RuntimeError(f"{name}: ranks saved different bytes: {[e.tolist() for e in everyone]}")
        rows.append({"tp": tp, "linear": name, "kind": kind, "input_per_rank": list(x.shape[:1]) + [x.shape[-1]],
                     **{c: got[c] / MIB for c in COLUMNS}})  # fmt: skip
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def measure(tp: int, hidden: int, ffn: int, heads: int, groups: int, tokens: int, port: int) -> list[dict]:
    """One row per linear, plus a ``total`` row: MiB saved per rank (``COLUMNS``), at TP = ``tp``."""
    if tokens % tp or hidden % tp or ffn % tp:
        raise ValueError(f"tokens ({tokens}), hidden ({hidden}) and ffn ({ffn}) must be multiples of tp ({tp})")
    shape = dict(hidden=hidden, ffn=ffn, heads=heads, groups=groups, tokens=tokens)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(tp, port, shape, out), nprocs=tp, join=True)
        with open(out) as f:
            rows = json.load(f)
    total = {"tp": tp, "linear": "total", "kind": "", "input_per_rank": ""}
    total.update({c: sum(r[c] for r in rows) for c in COLUMNS})
    return rows + [total]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--tokens", type=int, default=2048, help="sequence length x micro batch (the whole sequence)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336, help="ffn hidden size (fc1 is gated: 2 x ffn outputs)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8, help="query groups (GQA)")
    ap.add_argument("--port", type=int, default=int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 60)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rows = []
    for i, tp in enumerate(args.tp):
        rows += measure(tp, args.hidden, args.ffn, args.heads, args.groups, args.tokens, args.port + i)
    print(f"saved activation MiB per rank, sequence parallel, {args.tokens} tokens, hidden {args.hidden}, "
          f"ffn {args.ffn} (gated), {args.heads} heads / {args.groups} groups")  # fmt: skip
    head = f"{'tp':>3}  {'linear':<12} {'megatron_bf16':>14} {'plugin':>9} {'vs bf16':>8} {'plugin_bf16_gather':>19}"
    print(head)
    for r in rows:
        ratio = r["plugin"] / r["megatron_bf16"] if r["megatron_bf16"] else float("nan")
        print(f"{r['tp']:>3}  {r['linear']:<12} {r['megatron_bf16']:>14.2f} {r['plugin']:>9.2f} {ratio:>7.2f}x "
              f"{r['plugin_bf16_gather']:>19.2f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
