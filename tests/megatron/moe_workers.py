"""Process bodies for the multi-rank grouped-experts tests (spawned; gloo on the CPU)."""

from __future__ import annotations

import contextlib
import re
import warnings

import torch
import torch.distributed as dist


def global_expert_names(grads: dict, ep_rank: int, local_experts: int) -> dict:
    """``...linear_fc1.weight{i}`` (local expert i) -> ``...linear_fc1.weight{global index}``."""
    out = {}
    for name, g in grads.items():
        m = re.fullmatch(r"(.*\.experts\.linear_fc[12]\.weight)(\d+)", name)
        out[f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}" if m else name] = g
    return out


def per_expert_grads(grads: dict) -> dict:
    """A single grouped weight's gradient ``...linear_fc1.weight [E, out, in]`` as ``...linear_fc1.weight{i}``."""
    out = {}
    for name, g in grads.items():
        if re.fullmatch(r".*\.experts\.linear_fc[12]\.weight", name):
            out.update({f"{name}{i}": gi for i, gi in enumerate(g.unbind(0))})
        else:
            out[name] = g
    return out


def run(rank, world, port, jobs, out_dir):
    """Each job (a dict: name, ep, etp, dispatcher, grouped, single, backend, num_layers, save, load, megatron_dispatch,
    host_reads, build_only) builds the tiny MoE GPT under its parallel layout (``single``: each grouped linear's
    experts in one weight; its gradients reported under the per-expert names) (seed 0, or another seed and the weights of the
    checkpoint ``load``; ``megatron_dispatch``: Megatron's token dispatcher instead of the routed one), takes the loss
    and gradients of one batch (``host_reads``: recording the host reads of device values that the plugin's and
    Megatron's MoE code make), writes them (rank 0) to ``out_dir/<name>.pt`` with the layers' ``routed_dispatch_off``,
    and its checkpoint to ``save`` if given."""
    warnings.simplefilter("ignore")
    from megatron.core import dist_checkpointing, parallel_state

    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    from .common import build_gpt, loss_and_grads
    from .test_host_sync import HostReads
    from .test_moe_grouped import NUM_EXPERTS, moe_config, moe_spec
    from .test_moe_routed import MEGATRON_MOE

    for job in jobs:
        ep, etp = job.get("ep", 1), job.get("etp", 1)
        init_cpu_distributed(rank=rank, world_size=world, tp=1, port=port, ep=ep, etp=etp)
        config = moe_config(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                            moe_token_dispatcher_type=job.get("dispatcher", "allgather"),
                            **({"num_layers": job["num_layers"]} if "num_layers" in job else {}))  # fmt: skip
        spec = moe_spec(job.get("grouped", True), job.get("backend", "reference"), job.get("single", False))
        model = build_gpt(spec, config, seed=0 if job.get("load") is None else 123)
        if job.get("load") is not None:
            model.module.load_state_dict(dist_checkpointing.load(model.module.sharded_state_dict(), job["load"]))
        moe_layers = [m for m in model.modules() if hasattr(m, "routed_dispatch_off")]
        routed_off = [m.routed_dispatch_off for m in moe_layers]
        if job.get("megatron_dispatch"):
            for m in moe_layers:
                m.token_dispatcher, m.routed_dispatcher = m.routed_dispatcher.megatron, None
        if job.get("build_only"):  # what blocks the routed path, nothing run
            if rank == 0:
                torch.save({"routed_off": routed_off}, f"{out_dir}/{job['name']}.pt")
            dist.barrier()
            parallel_state.destroy_model_parallel()
            continue
        reads = HostReads(roots=(MEGATRON_MOE,)) if job.get("host_reads") else contextlib.nullcontext()
        with reads:
            loss, grads = loss_and_grads(model)
        grads = per_expert_grads(grads)
        if etp == 1:  # expert grads with global expert indices, from every EP rank
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            mine = {n: g for n, g in global_expert_names(grads, ep_rank, NUM_EXPERTS // ep).items() if ".experts." in n}
            parts = [None] * world
            dist.all_gather_object(parts, mine)
            for part in parts:
                grads.update(part)
        if job.get("save") is not None:
            dist_checkpointing.save(model.module.sharded_state_dict(), job["save"])
        if rank == 0:
            found = reads.found if job.get("host_reads") else None
            torch.save({"loss": loss, "grads": grads, "routed_off": routed_off, "host_reads": found},
                       f"{out_dir}/{job['name']}.pt")  # fmt: skip
        dist.barrier()
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
