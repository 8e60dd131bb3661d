"""The weight cache's staleness reproducers on the GPU (``backend="auto"``, 4096 -> 1024 bf16), where
CUDA's caching allocator really hands a freed weight's block to the next weight: every forward is
compared with one that quantizes the weight afresh. Each test prints ``stale forwards: N of M`` and
how many forwards found their weight at the previous weight's address (the hazard the cache key
must survive); all must report 0 stale. Run: ``python -m pytest -q -s tests/gpu/test_gpu_weight_cache.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from primus_fp8_plugin import Fp8BlockwiseLinear, WeightCache, fp8_blockwise_linear

from ..conftest import make_input

pytestmark = pytest.mark.gpu

K, N = 4096, 1024


def _fresh(x, w, b=None):
    with torch.no_grad():
        return fp8_blockwise_linear(x, w.detach(), None if b is None else b.detach(), backend="auto")


def _layer(**kw):
    torch.manual_seed(0)
    return Fp8BlockwiseLinear(K, N, device="cuda", dtype=torch.bfloat16, backend="auto", **kw)


class _Report:
    def __init__(self, name):
        self.name, self.stale, self.total, self.reused, self.last_ptr = name, 0, 0, 0, None

    def add(self, got, want, ptr):
        self.total += 1
        self.stale += not torch.equal(got, want)
        self.reused += ptr == self.last_ptr
        self.last_ptr = ptr

    def check(self):
        print(f"{self.name}: stale forwards: {self.stale} of {self.total} "
              f"(weight at the previous weight's address in {self.reused})")  # fmt: skip
        assert self.stale == 0


@pytest.fixture
def x():
    return make_input((512, K), seed=1, device="cuda")


def test_weight_norm_evaluating_checkpoints(x):
    layer = _layer()
    torch.nn.utils.parametrizations.weight_norm(layer)
    ckpts = []
    for seed in range(4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        ckpts.append({k: torch.randn(v.shape, generator=g, device="cuda", dtype=v.dtype) for k, v in layer.state_dict().items()})
    rep = _Report("weight norm, 4 checkpoints via load_state_dict")
    for sd in ckpts:
        layer.load_state_dict(sd)
        with torch.no_grad():
            got = layer(x)
            w = layer.weight
            rep.add(got, _fresh(x, w, layer.bias), w.data_ptr())
            del w
    rep.check()


class _Double(nn.Module):
    def forward(self, w):
        return w * 2


def test_parametrization_with_in_place_edits_of_the_original(x):
    layer = _layer()
    parametrize.register_parametrization(layer, "weight", _Double())
    rep = _Report("parametrization + in-place edit of the original")
    for step in range(8):
        with torch.no_grad():
            layer.parametrizations.weight.original.mul_(-1.0 if step % 2 else 1.25)
            got = layer(x)
            w = layer.weight
            rep.add(got, _fresh(x, w, layer.bias), w.data_ptr())
            del w
    rep.check()


@pytest.mark.parametrize("how", ["nn.Parameter(new)", ".data = new", "load_state_dict(assign=True)"])
def test_replaced_weights_twice_between_forwards(x, how):
    layer = _layer()
    rep = _Report(f"layer.weight replaced by {how}, twice between forwards")
    for _ in range(10):
        for _ in range(2):
            new = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            if how == "nn.Parameter(new)":
                layer.weight = nn.Parameter(new)
            elif how == ".data = new":
                layer.weight.data = new
            else:
                layer.load_state_dict({"weight": new, "bias": layer.bias.detach().clone()}, assign=True)
            del new
        with torch.no_grad():
            rep.add(layer(x), _fresh(x, layer.weight, layer.bias), layer.weight.data_ptr())
    rep.check()


def test_functional_form_with_one_cache_and_a_new_weight_per_call(x):
    cache = WeightCache()
    rep = _Report("fp8_blockwise_linear, one WeightCache, a new weight per call")
    for _ in range(8):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        with torch.no_grad():
            rep.add(fp8_blockwise_linear(x, w, backend="auto", weight_cache=cache), _fresh(x, w), w.data_ptr())
        del w
    rep.check()


def test_functional_call_with_the_transposed_weight():
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(K, K, bias=False, device="cuda", dtype=torch.bfloat16, backend="auto")
    x = make_input((512, K), seed=2, device="cuda")
    with torch.no_grad():
        layer(x)
        got = torch.func.functional_call(layer, {"weight": layer.weight.t()}, (x,))
        want = _fresh(x, layer.weight.t().contiguous())
    diff = (got.float() - want.float()).abs().max().item()
    print(f"functional_call with weight.t(): stale forwards: {int(diff != 0)} of 1 (max difference {diff})")
    assert diff == 0


def test_torch_compile_of_a_training_model_with_the_cache():
    def model():
        torch.manual_seed(0)
        return nn.Sequential(
            Fp8BlockwiseLinear(1024, 2048, device="cuda", dtype=torch.bfloat16), nn.ReLU(),
            Fp8BlockwiseLinear(2048, 1024, device="cuda", dtype=torch.bfloat16),
        )  # fmt: skip

    def train(m, run):
        opt, out = torch.optim.AdamW(m.parameters(), lr=1e-3), []
        for step in range(4):
            for micro in range(2):
                loss = run(make_input((256, 1024), seed=10 * step + micro, device="cuda", spread=False)).float().square().mean()
                loss.backward()
                out.append(loss.item())
            opt.step()
            opt.zero_grad()
        return out

    eager, compiled = model(), model()
    torch._dynamo.reset()
    a, b = train(eager, eager), train(compiled, torch.compile(compiled))
    stale = sum(u != v for u, v in zip(a, b))
    print(f"torch.compile training, cache on: losses differing from eager: {stale} of {len(a)}; "
          f"refreshes {[compiled[i].weight_cache.refreshes for i in (0, 2)]} (4 steps)")  # fmt: skip
    assert stale == 0 and [compiled[i].weight_cache.refreshes for i in (0, 2)] == [4, 4]


@pytest.mark.parametrize("overlap", [False, True], ids=["distributed_optimizer", "overlapped_param_gather"])
def test_megatron_distributed_optimizer_steps_refresh_every_cache(nccl_world, overlap):
    """Megatron's distributed optimizer on one GPU writes the new bf16 params into the parameter
    buffer and all-gathers them, with ``overlap_param_gather`` from the next forward's pre-hooks
    (CUDA streams: not testable on the CPU). Every cache in check mode; one batch throughout, so the
    microbatches of a step must give the same loss."""
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from primus_fp8_plugin.megatron import get_gpt_block_spec
    from primus_fp8_plugin.megatron.cpu import FUSIONS_OFF
    from primus_fp8_plugin.megatron.layers import Fp8MegatronLinear

    config = TransformerConfig(num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                               params_dtype=torch.bfloat16, bf16=True, hidden_dropout=0.0, attention_dropout=0.0,
                               **FUSIONS_OFF)  # fmt: skip
    torch.manual_seed(0)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_block_spec(2, backend="auto"), vocab_size=1024,
                   max_sequence_length=256).cuda()  # fmt: skip
    model = Float16Module(config, gpt)
    layers = [m for m in model.modules() if isinstance(m, Fp8MegatronLinear)]
    for m in layers:
        m.weight_cache.check = True
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                      overlap_grad_reduce=overlap, overlap_param_gather=overlap),
        model,
    )  # fmt: skip
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True, overlap_param_gather=overlap),
        [ddp],
    )
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 1024, (2, 256), generator=g, device="cuda")
    pos = torch.arange(256, device="cuda").unsqueeze(0).expand(2, -1)
    steps, micro, losses = 3, 3, []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for _ in range(micro):
            loss = ddp(ids, pos, None, labels=ids).float().mean()
            loss.backward()
            losses.append(loss.item())
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
    per_step = [losses[i * micro : (i + 1) * micro] for i in range(steps)]
    refreshes = [m.weight_cache.refreshes for m in layers]
    print(f"Megatron distributed optimizer (overlap_param_gather={overlap}): losses per step {per_step}; "
          f"refreshes per layer {sorted(set(refreshes))} for {steps} steps; stale forwards: 0 of "
          f"{sum(m.weight_cache.checks for m in layers)} checked cache hits")  # fmt: skip
    assert all(len(set(s)) == 1 for s in per_step), per_step
    assert len({s[0] for s in per_step}) == steps
    assert all(r == steps for r in refreshes), refreshes
