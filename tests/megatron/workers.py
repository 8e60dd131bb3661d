"""Process bodies for the multi-process Megatron tests (spawned; gloo on the CPU)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def _full(t: torch.Tensor, param, tp_group) -> torch.Tensor:
    """The TP=1 equivalent of a parameter-shaped tensor: TP shards are gathered along their
    partition dim; sequence-parallel (partial) gradients are summed, as Megatron's
    finalize_model_grads does."""
    world = dist.get_world_size(tp_group)
    if world == 1:
        return t
    if getattr(param, "tensor_model_parallel", False):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        return torch.cat(parts, dim=param.partition_dim)
    return t


def run(rank: int, world: int, tp: int, sp: bool, port: int, out_path: str, save_dir: str | None, load_dir: str | None):
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing, parallel_state

    from primus_fp8_plugin.megatron import get_gpt_block_spec
    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    from .common import build_gpt, loss_and_grads, tiny_config

    init_cpu_distributed(rank=rank, world_size=world, tp=tp, port=port)
    config = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=sp)
    model = build_gpt(get_gpt_block_spec(config.num_layers, backend="reference"), config, seed=0 if load_dir is None else 123)
    if load_dir is not None:
        state = dist_checkpointing.load(model.module.sharded_state_dict(), load_dir)
        model.module.load_state_dict(state)
    loss, grads = loss_and_grads(model)
    group = parallel_state.get_tensor_model_parallel_group()
    params = dict(model.named_parameters())
    full_grads, full_weights = {}, {}
    for name, p in params.items():
        g = grads[name]
        if sp and getattr(p, "sequence_parallel", False):
            dist.all_reduce(g, group=group)  # each rank saw only its share of the sequence
        full_grads[name] = _full(g, p, group)
        full_weights[name] = _full(p.detach().float(), p, group)
    if save_dir is not None:
        dist_checkpointing.save(model.module.sharded_state_dict(), save_dir)
    if rank == 0:
        torch.save({"loss": loss, "grads": full_grads, "weights": full_weights}, out_path)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
