"""Bytes per parameter, by category, of the trainer's model as a training step holds them, measured on the tensors.

    python -m tools.param_memory [--arms bf16,blockwise,fp8_params] [--json out.json] [TRAINER OVERRIDES ...]
    torchrun --nproc-per-node 2 -m tools.param_memory parallel=dp parallel.use_distributed_optimizer=true

Each arm builds the model of ``python -m primus_fp8_plugin.train OVERRIDES`` (``bf16``: ``fp8=bf16``; ``blockwise``:
the plugin's linears with the weight cache; ``fp8_params``: ``fp8.params=true``) with the trainer's DDP and optimizer,
takes a training step on random tokens, and in the forward of the next step counts, on rank 0:

* weights: the bytes each parameter's data holds (a released FP8 primary weight: its two-byte placeholder);
* FP8 copies: the plugin's weight caches (W and W^T, or the held W), with their scales;
* grads: the fp32 ``main_grad`` in DDP's buffer (and any ``.grad``);
* optimizer state: the FP32 master (``main_param``: this rank's shard under the distributed optimizer) and Adam's two
  moments of it;
* activations: the storages autograd saves in that forward (one microbatch), outside the parameters.

Bytes are the mean over the data-parallel ranks (the distributed optimizer's shards split the linear and the other
parameters unevenly between ranks).

The linear layers' weights (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, experts included) and the
other parameters are counted apart; for the linear weights the table sets each category per parameter against the
formulas (Adam, ``d`` data-parallel ranks with the distributed optimizer, else ``d = 1``): BF16 ``2 + 4 + 12/d``, the
plugin's weight cache ``2 + 2 + 4 + 12/d``, FP8 primary weights ``1 + 4 + 12/d`` (plus the scales: 4 bytes per
128x128 block and copy). Pipeline parallelism is not supported here (one model chunk's direct forward).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile

import torch

ARMS = {"bf16": ["fp8=bf16"], "blockwise": ["fp8=blockwise"], "fp8_params": ["fp8=blockwise", "fp8.params=true"]}
LINEAR = re.compile(r"\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)\.weight\d*$")
CATEGORIES = ("weights", "fp8_copies", "grads", "optimizer")


def formula(arm: str, d: int) -> float:
    """The issue's bytes per linear-weight parameter (weights + FP8 copies + grads + optimizer state), scales aside."""
    return {"bf16": 2 + 4, "blockwise": 2 + 2 + 4, "fp8_params": 1 + 4}[arm] + 12 / d


def held_bytes(t: torch.Tensor) -> int:
    """Bytes ``t``'s data holds: its elements, or less where its storage is smaller (a placeholder)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def optimizer_states(optimizer) -> dict[int, int]:
    """Bytes of Adam's state per master parameter (``id`` of the master), over Megatron's chained optimizers."""
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for master, state in opt.optimizer.state.items():
            out[id(master)] = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.numel() > 1)
    return out


def measure(cfg, device, vocab: int) -> dict:
    """One arm: build, step, and count in the next forward (module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from primus_fp8_plugin.fp8_params import PRIMARY, fp8_layers, weights_of
    from primus_fp8_plugin.megatron.fp8_params import attach
    from primus_fp8_plugin.training.loop import build_ddp_and_optimizer
    from primus_fp8_plugin.training.model import build_model, transformer_config

    tconfig = transformer_config(cfg, device.type == "cuda")
    model, optimizer = build_ddp_and_optimizer(cfg, tconfig, build_model(cfg, tconfig, vocab, device))
    primary = attach(model) if cfg.fp8.params else None
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (b, s), generator=g).to(device)
    position = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    for step in range(2):  # counted in the second step's forward: caches filled, optimizer state made
        model.zero_grad_buffer()
        optimizer.zero_grad()
        if primary is not None:
            primary.release()
        with torch.autograd.graph.saved_tensors_hooks(pack if step else (lambda t: t), lambda t: t):
            loss = model(tokens, position, None, labels=tokens).float().mean()
        if step:
            break
        loss.backward()
        model.finish_grad_sync()
        if primary is not None:
            primary.restore()
        optimizer.step()
    states = optimizer_states(optimizer)
    params = dict(model.module.named_parameters())
    linear = {id(p) for n, p in params.items() if LINEAR.search(n)}
    totals = {kind: dict.fromkeys(CATEGORIES, 0) for kind in ("linear", "other")}
    counts = {"linear": 0, "other": 0}
    for p in params.values():
        kind = "linear" if id(p) in linear else "other"
        counts[kind] += p.numel()
        row = totals[kind]
        row["weights"] += held_bytes(p)
        main_grad = getattr(p, "main_grad", None)
        row["grads"] += (0 if main_grad is None else held_bytes(main_grad)) + (0 if p.grad is None else held_bytes(p.grad))
        master = getattr(p, "main_param", None)
        if master is not None:
            row["optimizer"] += held_bytes(master) + states.get(id(master), 0)
    for layer in fp8_layers(model):
        kind = "linear" if all(id(w) in linear for w in weights_of(layer)) else "other"
        totals[kind]["fp8_copies"] += layer.weight_cache.nbytes if layer.weight_cache is not None else 0
    param_storages = {p.untyped_storage().data_ptr() for p in params.values()}
    activations = sum(n for ptr, n in saved.items() if ptr not in param_storages)
    held = sum(getattr(p, PRIMARY, False) for p in params.values())
    # the mean over the data-parallel ranks: the distributed optimizer's shards split linear and other parameters
    # unevenly, their mean is each rank's share
    flat = torch.tensor([float(totals[k][c]) for k in totals for c in CATEGORIES], dtype=torch.float64)
    group = parallel_state.get_data_parallel_group()
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    mean = iter(flat.tolist())
    totals = {k: {c: next(mean) for c in CATEGORIES} for k in totals}
    return {"params": counts, "bytes": totals, "activations": activations, "tokens": b * s, "fp8_primary_weights": held}


def table(results: dict, d: int) -> str:
    lines = [f"bytes per parameter, mean over the data-parallel ranks (d = {d}); activations: one microbatch's saved tensors",
             f"{'arm':<11} {'params':<7} {'count':>11} " + " ".join(f"{c:>10}" for c in CATEGORIES)
             + f" {'total':>8} {'formula':>8} {'activ. MiB':>10}"]  # fmt: skip
    for arm, r in results.items():
        for kind in ("linear", "other"):
            n = max(r["params"][kind], 1)
            per = {c: r["bytes"][kind][c] / n for c in CATEGORIES}
            total = sum(per.values())
            expect = f"{formula(arm, d):8.3f}" if kind == "linear" else f"{'':8}"
            act = f"{r['activations'] / 2**20:10.2f}" if kind == "linear" else ""
            lines.append(f"{arm:<11} {kind:<7} {r['params'][kind]:>11} " + " ".join(f"{per[c]:10.4f}" for c in CATEGORIES)
                         + f" {total:8.3f} {expect} {act}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="bf16,blockwise,fp8_params", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--json", help="write the measurements (rank 0) to this file")
    ap.add_argument("overrides", nargs="*", help="trainer overrides (Hydra syntax), for every arm")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := [a for a in arms if a not in ARMS]:
        ap.error(f"unknown arm(s) {unknown}: choose from {list(ARMS)}")
    import warnings

    warnings.simplefilter("ignore")  # Megatron's notices (absent apex/TE, GPTModel's deprecation) are not the table's
    logging.getLogger("megatron").setLevel(logging.ERROR)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from primus_fp8_plugin.train import compose
    from primus_fp8_plugin.training.loop import init_runtime
    from primus_fp8_plugin.training.tokenizer import run_tokenizer

    scratch = tempfile.mkdtemp(prefix="param_memory_")
    base = [f"logging.dir={scratch}/run", f"data.cache_dir={scratch}/data", *args.overrides]
    cfg = compose(*ARMS[arms[0]], *base)
    if cfg.parallel.pp != 1:
        ap.error("parallel.pp must be 1 here (the tool runs one model chunk's forward directly)")
    device, stack = init_runtime(cfg)
    with stack:
        vocab = run_tokenizer(cfg).vocab_size
        d = parallel_state.get_data_parallel_world_size() if cfg.parallel.use_distributed_optimizer else 1
        results = {arm: measure(compose(*ARMS[arm], *base), device, vocab) for arm in arms}
        if dist.get_rank() == 0:
            print(table(results, d), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"d": d, "arms": results}, f, indent=1)
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
