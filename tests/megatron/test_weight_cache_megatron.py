"""Megatron's optimizers and the plugin's weight caches: after every optimizer step the next forward
uses the new weights, whatever path the optimizer writes them through (Megatron's mixed-precision
optimizer copies fp32 main params into the bf16 params through ``.data``; the distributed optimizer
writes its shard into the parameter buffer and all-gathers it). The caches run in check mode, which
re-quantizes on every cache hit and raises on a stale copy."""

from __future__ import annotations

import pytest

from primus_fp8_plugin import weight_cache
from primus_fp8_plugin.megatron import get_gpt_block_spec
from primus_fp8_plugin.megatron.layers import Fp8MegatronLinear

from .common import batch, build_gpt


def _train(use_distributed_optimizer: bool, steps: int, micro: int, after_step=None):
    """``steps`` optimizer steps of ``micro`` microbatches each on a tiny plugin GPT wrapped in
    Megatron's DDP with Megatron's bf16 Adam; returns the FP8 layers and the losses."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from primus_fp8_plugin.megatron.cpu import CudaAsCpu

    model = build_gpt(get_gpt_block_spec(2, backend="reference"))
    layers = [m for m in model.modules() if isinstance(m, Fp8MegatronLinear)]
    for m in layers:
        m.weight_cache.check = True
    with CudaAsCpu():
        ddp = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer),
            model,
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=use_distributed_optimizer),
            [ddp],
        )
        losses = []
        for _ in range(steps):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            for _ in range(micro):
                ids, pos = batch(seed=1)  # one batch throughout: its loss must fall step by step
                loss = ddp(ids, pos, None, labels=ids).float().mean()
                loss.backward()
                losses.append(loss.item())
            ok, _, _ = opt.step()
            assert ok
            if after_step is not None:
                after_step()
    return layers, losses


@pytest.mark.parametrize("use_distributed_optimizer", [False, True], ids=["mixed_precision", "distributed"])
def test_megatron_optimizer_steps_refresh_every_cache(megatron_world, use_distributed_optimizer):
    steps, micro = 3, 3
    layers, losses = _train(use_distributed_optimizer, steps, micro)
    # one quantization per step (the first microbatch), the other microbatches and every backward
    # served from the cache and checked against a fresh quantization
    assert all(m.weight_cache.refreshes == steps for m in layers), [m.weight_cache.refreshes for m in layers]
    assert all(m.weight_cache.checks >= steps * (micro - 1) for m in layers)
    per_step = [losses[i * micro : (i + 1) * micro] for i in range(steps)]
    assert all(len(set(s)) == 1 for s in per_step), per_step  # same weights, same batch: same loss
    firsts = [s[0] for s in per_step]
    assert firsts[-1] < firsts[0] and len(set(firsts)) == steps, firsts  # each step changed the weights


def test_check_mode_catches_a_step_that_no_hook_saw(megatron_world, monkeypatch):
    """Were the post-step hook not to fire (an optimizer stepped outside ``torch.optim``'s hooks, such
    as a graphed step), Megatron's ``.data`` copies would leave stale copies: check mode raises, and
    ``mark_weights_changed()`` after the step (what the plugin's trainer calls) is enough."""
    mark = weight_cache.mark_weights_changed
    monkeypatch.setattr(weight_cache, "mark_weights_changed", lambda: None)  # the hook now does nothing
    with pytest.raises(weight_cache.StaleWeightCacheError, match="stale FP8 copy"):
        _train(False, steps=2, micro=1)
    layers, _ = _train(False, steps=3, micro=2, after_step=mark)
    assert all(m.weight_cache.refreshes == 3 for m in layers)
