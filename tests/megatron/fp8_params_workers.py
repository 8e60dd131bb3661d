"""Process bodies of the FP8 primary weight tests: a tiny plugin GPT (dense or grouped MoE) trained a few steps under
Megatron's DDP and optimizer, once with BF16 weights and the weight cache and once with ``Fp8Params``, in the same
process from the same initial weights and data (gloo on the CPU; spawned for more than one rank)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

STEPS, MICRO = 3, 2


def build(job: dict):
    from primus_fp8_plugin.megatron import get_gpt_block_spec

    from .common import build_gpt, tiny_config

    kw = dict(tensor_model_parallel_size=job.get("tp", 1), sequence_parallel=job.get("sp", False))
    spec = {}
    if job.get("moe"):
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather", add_bias_linear=False,
                  gated_linear_unit=True, activation_func=F.silu, moe_ffn_hidden_size=384, moe_grouped_gemm=True,
                  expert_model_parallel_size=job.get("ep", 1))  # fmt: skip
        spec = dict(num_experts=4, moe_grouped_gemm=True, single_grouped_weight=job.get("single", False))
    config = tiny_config(**kw)
    return build_gpt(get_gpt_block_spec(config.num_layers, backend="reference", **spec), config, seed=0)


def train(job: dict, fp8_params: bool) -> dict:
    """``STEPS`` steps of ``MICRO`` microbatches; the losses, gradient norms, every parameter after the last step
    (bf16(master): what the optimizer wrote) and what the model held while it ran forward and backward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from primus_fp8_plugin import env
    from primus_fp8_plugin.fp8_params import param_bytes
    from primus_fp8_plugin.megatron.cpu import CudaAsCpu
    from primus_fp8_plugin.megatron.fp8_params import ATTACHED, attach, ddp_param_buffers

    from .common import batch

    dist_opt, hooks = job.get("dist_opt", False), fp8_params and job.get("hooks", False)
    if hooks:  # as Megatron-LM's pretrain_gpt.py runs: no call of the plugin's in the loop (last job of a process)
        os.environ[env.FP8_PARAMS] = "1"
    model = build(job)
    out = {"losses": [], "norms": []}
    with CudaAsCpu():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt), model)  # fmt: skip
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                                                     use_distributed_optimizer=dist_opt), [ddp])  # fmt: skip
        primary = attach(ddp) if fp8_params and not hooks else None
        out["param_bytes_before"] = param_bytes(ddp)
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            if primary is not None:
                primary.release()
            for micro in range(MICRO):
                ids, pos = batch(seed=100 * step + micro + dist.get_rank() * 7)
                loss = ddp(ids, pos, None, labels=ids).float().mean() / MICRO
                loss.backward()
                out["losses"].append(loss.item())
                if micro == 0:  # the param buffers while each step runs (freed in every step, hooks or loop)
                    out.setdefault("buffers_each_step", []).append(
                        [flat.untyped_storage().nbytes() for flat, _ in ddp_param_buffers(ddp)])
                if step == 0 and micro == 0:  # what the model holds while it runs
                    held = getattr(ddp, ATTACHED, None)
                    out["held"] = {
                        "param_bytes": param_bytes(ddp),
                        "fp8_bytes": 0 if held is None else held.fp8_bytes(),
                        "weight_storage": sorted({w.untyped_storage().nbytes() for w in (held.weights if held else [])}),
                        "buffers": [flat.untyped_storage().nbytes() for flat, _ in ddp_param_buffers(ddp)],
                    }
            ddp.finish_grad_sync()
            if primary is not None:
                primary.restore()
            ok, norm, _ = opt.step()
            assert ok
            if hooks and step == 0:  # the first step moved the release hook onto the model
                from primus_fp8_plugin.megatron import fp8_params as megatron_fp8_params

                out["global_hook_after_first_step"] = bool(megatron_fp8_params._global_hook)
            out["norms"].append(float(norm))
        out["weights"] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return out


def run(rank: int, world: int, port: int, jobs: list[dict], out_dir: str) -> None:
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state

    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    first = jobs[0]
    init_cpu_distributed(rank=rank, world_size=world, tp=first.get("tp", 1), port=port, ep=first.get("ep", 1))
    for job in jobs:
        result = {"bf16": train(job, fp8_params=False), "fp8": train(job, fp8_params=True)}
        if rank == 0:
            torch.save(result, f"{out_dir}/{job['name']}.pt")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
