"""Process body of tests/megatron/test_sequence_parallel_layers.py (spawned; gloo on the CPU, TP = world): the plugin's
column-parallel Megatron layers under sequence parallelism (the FP8 all-gather) against the bf16 all-gather the
layers used before (Megatron's ``gather_from_sequence_parallel_region``, then the FP8 linear), bit for bit."""

from __future__ import annotations

import warnings

import torch


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def check_same(a, b, what):
    assert (a is None) == (b is None), f"{what}: one side is None"
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(bits(a), bits(b)), f"{what}: bits differ (max |diff| {(a.float() - b.float()).abs().max()})"


def _input(rank, s, b, h, seed):
    g = torch.Generator().manual_seed(seed + rank)
    rows = torch.exp2(torch.randint(-8, 8, (s, b, 1), generator=g).float())
    return (torch.randn(s, b, h, generator=g) * rows).bfloat16().requires_grad_(True)


def _grads(layer, x, dy, run):
    """``run(layer, x) -> y``; backward with ``dy``; returns y, dx and the parameters' gradients (main_grad for the
    weight when it has one)."""
    for p in layer.parameters():
        p.grad = None
    if hasattr(layer.weight, "main_grad"):
        layer.weight.main_grad.zero_()
    x = x.detach().clone().requires_grad_(True)
    y = run(layer, x)
    y.backward(dy)
    grads = {n: (p.main_grad.clone() if hasattr(p, "main_grad") else p.grad) for n, p in layer.named_parameters()}
    return y.detach(), x.grad, grads


def _compare(new, old, what):
    check_same(new[0], old[0], f"{what} y")
    check_same(new[1], old[1], f"{what} dx")
    assert new[2].keys() == old[2].keys()
    for n in new[2]:
        check_same(new[2][n], old[2][n], f"{what} {n}")


def check_column(rank, world, config, s, b, main_grad, seed):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from primus_fp8_plugin.megatron.layers import Fp8ColumnParallelLinear

    torch.manual_seed(seed)
    h, n = 256, 96 * world
    layer = Fp8ColumnParallelLinear(h, n, config=config, init_method=config.init_method, bias=True, gather_output=False)
    if main_grad:
        layer.weight.main_grad = torch.zeros(layer.weight.shape)
        layer.weight.grad_added_to_main_grad = False
    group = parallel_state.get_tensor_model_parallel_group()

    def before(layer, x):  # the layer's _forward_impl before the FP8 all-gather
        gathered = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
        return layer._fp8_linear(gathered, layer.weight, layer.bias)

    x = _input(rank, s, b, h, seed)
    dy = _input(rank + 1000, world * s, b, n // world, seed).detach()
    new = _grads(layer, x, dy, lambda m, t: m(t)[0])
    old = _grads(layer, x, dy, before)
    if main_grad:
        assert new[2]["weight"].abs().sum() > 0
    _compare(new, old, f"column s={s} b={b} main_grad={main_grad}")


def check_norm(rank, world, config, s, b, seed):
    """The fused norm layer against the unfused one (norm of the shard, then the FP8 linear) with the bf16 gather."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from primus_fp8_plugin import fp8_blockwise_linear
    from primus_fp8_plugin.megatron.layers import Fp8LayerNormColumnParallelLinear
    from primus_fp8_plugin.megatron.norm import apply_norm

    torch.manual_seed(seed)
    h, n = 256, 64 * world
    fused = Fp8LayerNormColumnParallelLinear(h, n, config=config, init_method=config.init_method, bias=False,
                                             gather_output=False)  # fmt: skip
    with torch.no_grad():
        fused.layer_norm_weight.copy_(torch.rand(h) + 0.5)
        if fused.layer_norm_bias is not None:
            fused.layer_norm_bias.copy_(torch.randn(h))
    group = parallel_state.get_tensor_model_parallel_group()

    def before(layer, x):
        normed = apply_norm(x, layer.normalization, layer.layer_norm_weight, layer.layer_norm_bias, layer.eps,
                            layer.zero_centered_gamma)  # fmt: skip
        gathered = gather_from_sequence_parallel_region(normed, tensor_parallel_output_grad=True, group=group)
        return fp8_blockwise_linear(gathered, layer.weight, None, **layer.fp8_options())

    x = _input(rank, s, b, h, seed)
    dy = _input(rank + 1000, world * s, b, n // world, seed).detach()
    new = _grads(fused, x, dy, lambda m, t: m(t)[0])
    old = _grads(fused, x, dy, before)
    _compare(new, old, f"fused norm {config.normalization} s={s} b={b}")


def run(rank: int, world: int, port: int, seed: int):
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from primus_fp8_plugin.megatron.cpu import init_cpu_distributed

    from .common import tiny_config

    torch.set_num_threads(1)
    init_cpu_distributed(rank=rank, world_size=world, tp=world, port=port)
    try:
        for gaf in (False, True):
            config = tiny_config(tensor_model_parallel_size=world, sequence_parallel=True, gradient_accumulation_fusion=gaf)
            check_column(rank, world, config, 64, 2, gaf, seed)  # 128 rows per rank: the FP8 gather
            check_column(rank, world, config, 40, 2, gaf, seed)  # 80 rows: the bf16 gather
        for normalization, s, b in (("LayerNorm", 128, 1), ("RMSNorm", 32, 4), ("RMSNorm", 24, 3)):
            config = tiny_config(tensor_model_parallel_size=world, sequence_parallel=True, normalization=normalization)
            check_norm(rank, world, config, s, b, seed)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
