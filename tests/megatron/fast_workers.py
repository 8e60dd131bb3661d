"""Process body for the fast spec's tensor-parallel test (spawned; gloo on the CPU): a 2-layer Llama-style
GPT (RMSNorm, SwiGLU, RoPE) of ``fp8_gpt_fast_layer_spec(config)`` layers (backend auto: reference on the
CPU) at TP = ``tp``, one forward/backward."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .workers import _full


def _full_gated(t, param, group):
    """``workers._full``, with the gated fc1's stride-2 layout: each rank holds ``[gate_r | up_r]``, so the
    TP=1 tensor is ``[gate_0 .. gate_n | up_0 .. up_n]``."""
    stride = getattr(param, "partition_stride", 1)
    if stride == 1 or dist.get_world_size(group) == 1:
        return _full(t, param, group)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    chunks = [p.chunk(stride, dim=param.partition_dim) for p in parts]
    return torch.cat([c[i] for i in range(stride) for c in chunks], dim=param.partition_dim)


def run(rank: int, world: int, tp: int, sp: bool, port: int, out_path: str):
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from primus_fp8_plugin.megatron import fp8_gpt_fast_layer_spec
    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    from .common import SEQ, VOCAB, loss_and_grads, tiny_config

    init_cpu_distributed(rank=rank, world_size=world, tp=tp, port=port)
    config = tiny_config(tensor_model_parallel_size=tp, sequence_parallel=sp, normalization="RMSNorm",
                         gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)  # fmt: skip
    torch.manual_seed(0)
    spec = fp8_gpt_fast_layer_spec(config)  # the callable Megatron-LM calls: a block spec with TorchNorm
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                   position_embedding_type="rope")  # fmt: skip
    model = Float16Module(config, gpt)
    loss, grads = loss_and_grads(model)
    group = parallel_state.get_tensor_model_parallel_group()
    full_grads, full_weights = {}, {}
    for name, p in model.named_parameters():
        g = grads[name]
        if sp and getattr(p, "sequence_parallel", False):
            dist.all_reduce(g, group=group)  # Megatron's finalize_model_grads does this for such parameters
        full_grads[name] = _full_gated(g, p, group)
        full_weights[name] = _full_gated(p.detach().float(), p, group)
    if rank == 0:
        torch.save({"loss": loss, "grads": full_grads, "weights": full_weights}, out_path)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
