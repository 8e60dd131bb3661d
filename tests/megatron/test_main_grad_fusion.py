"""Weight gradients into ``main_grad`` inside the FP8 ops under Megatron's DDP, whatever Megatron's
``gradient_accumulation_fusion`` flag says (CPU, gloo, the reference backend).

A transformer layer of the fast spec with grouped experts (the dense qkv / proj linears and the grouped fc1 / fc2)
trains two steps of two microbatches in Megatron's ``DistributedDataParallel`` with Megatron's optimizer. Every
in-place add into a ``main_grad`` is counted (Megatron's backward hook adds ``param.grad`` there unless the layer
says it already did: ``grad_added_to_main_grad``): with the flag off the plugin's weights get none, the layer filled
``main_grad`` itself; the flag changes no bit of the losses or the weights. The layers' opt-out
(``fuse_wgrad_accumulation=False``) hands ``dW`` to the hook, one add per weight per microbatch. Megatron's hook is
the same in 0.16 and 0.19 (``distributed_data_parallel._make_backward_post_hook``)."""

from __future__ import annotations

import functools
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from .common import tiny_config

pytestmark = pytest.mark.usefixtures("megatron_world")

STEPS, MICRO = 2, 2


class HookAdds:
    """Counts, per parameter name, the ``Tensor.add_`` calls into a parameter's ``main_grad`` that Megatron's DDP
    makes (its backward hook, ``distributed_data_parallel.py``): ``torch.Tensor.add_`` wrapped while the ``with``
    block runs (a ``TorchFunctionMode`` would not see the hooks, which autograd runs outside the mode)."""

    def __init__(self, targets: dict[int, str]):
        self.targets, self.adds = targets, {}

    def __enter__(self):
        self.original = original = torch.Tensor.add_

        def add_(t, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if id(t) in self.targets and caller.endswith("distributed_data_parallel.py"):
                name = self.targets[id(t)]
                self.adds[name] = self.adds.get(name, 0) + 1
            return original(t, *args, **kwargs)

        torch.Tensor.add_ = add_
        return self

    def __exit__(self, *exc):
        torch.Tensor.add_ = self.original


@functools.cache
def train(flag: bool, fuse: bool = True, single: bool = True):
    """Losses, final weights, hook adds per parameter and the plugin's weight names of a short DDP run."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    from primus_fp8_plugin.megatron import TorchNorm, set_wgrad_accumulation_fusion
    from primus_fp8_plugin.megatron.cpu import CudaAsCpu
    from primus_fp8_plugin.megatron.fast_specs import get_gpt_fast_layer_spec
    from primus_fp8_plugin.modules import HoldsWeightCache

    cfg = tiny_config(num_layers=1, num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="allgather",
                      add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, moe_ffn_hidden_size=384,
                      gradient_accumulation_fusion=flag)  # fmt: skip
    spec = get_gpt_fast_layer_spec(num_experts=4, moe_grouped_gemm=True, single_grouped_weight=single, backend="reference")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = TransformerBlock(cfg, TransformerBlockSubmodules(layer_specs=[spec], layer_norm=TorchNorm))
    # qkv, proj; fc1 and fc2 of 4 experts: one single grouped weight each, or 4 per-expert weights each
    assert set_wgrad_accumulation_fusion(block, fuse) == 2 + 2 * (1 if single else 4)
    plugin = {n for n, p in block.named_parameters() for m in block.modules()
              if isinstance(m, HoldsWeightCache) and any(p is q for q in m.parameters(recurse=False))}  # fmt: skip
    plugin = {n for n in plugin if ".weight" in n and "layer_norm" not in n}
    with CudaAsCpu():
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), block)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True), [ddp])
    params = dict(block.named_parameters())
    counter = HookAdds({id(p.main_grad): n for n, p in params.items()})
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(32, 2, cfg.hidden_size, generator=g).to(torch.bfloat16) for _ in range(MICRO)]
    losses, filled = [], []
    for _ in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for x in xs:
            with counter:
                loss = ddp(hidden_states=x, attention_mask=None).float().pow(2).mean()
                loss.backward()
            losses.append(loss.item())
        filled.append({n: bool(params[n].main_grad.abs().sum() > 0) for n in plugin})
        with CudaAsCpu():
            ok, _, _ = opt.step()
        assert ok
    flags = {n: params[n].grad_added_to_main_grad for n in plugin}
    weights = {n: p.detach().clone() for n, p in params.items()}
    return losses, weights, counter.adds, plugin, filled, flags


@pytest.mark.parametrize("single", [True, False], ids=["single_grouped_weight", "per_expert_weights"])
def test_the_layers_fill_main_grad_with_the_flag_off_and_the_hook_adds_nothing(single):
    losses_off, weights_off, adds_off, plugin, filled, flags = train(flag=False, single=single)
    assert len(plugin) == (4 if single else 10) and all(all(f.values()) for f in filled), filled
    assert all(flags.values()), flags  # the layer told Megatron's hook it already added dW
    assert not any(adds_off.get(n) for n in plugin), {n: adds_off[n] for n in plugin if adds_off.get(n)}
    # the counter sees the hook: Megatron's own parameters (router, norms) get one add per microbatch
    others = set(weights_off) - plugin
    assert others and all(adds_off.get(n) == STEPS * MICRO for n in others), adds_off

    losses_on, weights_on, adds_on, *_ = train(flag=True, single=single)
    assert losses_on == losses_off
    assert all(torch.equal(weights_on[n], weights_off[n]) for n in weights_off)
    assert adds_on == adds_off
    assert len(set(losses_off)) == STEPS * MICRO  # every step and microbatch computed something new


def test_the_opt_out_hands_dw_to_megatrons_hook():
    losses_fused, weights_fused, *_ = train(flag=False)
    losses, weights, adds, plugin, filled, flags = train(flag=False, fuse=False)
    assert all(adds.get(n) == STEPS * MICRO for n in plugin), adds  # dW in .grad (bf16), added by the hook
    assert all(all(f.values()) for f in filled) and not any(flags.values())
    assert losses[0] == losses_fused[0]  # the same first forward; then bf16 .grad vs. fp32 accumulation
    changed = [n for n in plugin if not torch.equal(weights[n], weights_fused[n])]
    assert changed  # the paths differ in rounding...
    for n in plugin:  # ...only
        assert torch.allclose(weights[n].float(), weights_fused[n].float(), rtol=0, atol=2e-2), n


def test_single_grouped_weights_train_as_per_expert_weights():
    """Megatron's DDP and optimizer over one ``[E, out, in]`` weight per grouped linear: the losses and, after every
    step, each expert's weights are the per-expert parameters' bit for bit."""
    losses_single, weights_single, *_ = train(flag=False, single=True)
    losses_experts, weights_experts, *_ = train(flag=False, single=False)
    assert losses_single == losses_experts
    for name, w in weights_experts.items():
        head, _, tail = name.rpartition(".")
        if ".experts.linear_fc" in name and tail.startswith("weight"):
            w_single = weights_single[f"{head}.weight"][int(tail.removeprefix("weight"))]
        else:
            w_single = weights_single[name]
        assert torch.equal(w_single, w), name
