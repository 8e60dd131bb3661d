"""``Fp8MoELayer``: Megatron's MoE layer whose tokens go straight from the router into the grouped FP8 layout
(``megatron/moe.py``), on the CPU (gloo, EP = TP = 1, the allgather dispatcher: Megatron's alltoall one needs CUDA
streams; tests/gpu/test_gpu_moe_sync_free.py runs it on a GPU).

* bit for bit the layer with Megatron's own dispatcher (permute, the grouped experts on the permuted copy,
  unpermute): the loss and every parameter's gradient (router, experts, attention, embeddings) of a GPT model, on
  fresh random routings with starved experts, reference and triton (interpreter) backends;
* no host read of a device value anywhere in the MoE layer's forward and backward (the plugin's code and
  Megatron's MoE code, counted by ``test_host_sync.HostReads``), where Megatron's dispatcher makes several;
* what blocks the routed path is named, and the layer then is Megatron's."""

from __future__ import annotations

import warnings
from pathlib import Path

import megatron.core.transformer.moe as megatron_moe
import pytest
import torch

from .common import build_gpt, loss_and_grads
from .test_host_sync import HostReads
from .test_moe_grouped import moe_config, moe_spec

pytestmark = pytest.mark.usefixtures("megatron_world")


def moe_layers(model):
    from primus_fp8_plugin.megatron.moe import Fp8MoELayer

    layers = [m for m in model.modules() if isinstance(m, Fp8MoELayer)]
    assert layers
    return layers


def use_megatrons_dispatcher(model) -> None:
    for layer in moe_layers(model):
        layer.token_dispatcher, layer.routed_dispatcher = layer.routed_dispatcher.megatron, None


AUX_LOSS = dict(moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss")
# DeepSeek-V3's router: sigmoid scores, an expert bias, scaled top-k, sequence aux loss, z-loss; a shared expert
DSV3_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                   moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_z_loss_coeff=1e-3,
                   moe_shared_expert_intermediate_size=256)  # fmt: skip


@pytest.mark.parametrize(
    "backend, topk, seed, router",
    [("reference", 2, 0, AUX_LOSS), ("reference", 3, 1, DSV3_ROUTER), ("triton", 2, 2, AUX_LOSS)],
    ids=["reference-top2-aux_loss", "reference-top3-dsv3_router_shared_expert", "triton-top2-aux_loss"],
)
def test_routed_layer_equals_megatrons_dispatcher_bit_for_bit(backend, topk, seed, router):
    from primus_fp8_plugin import backend_availability

    if not backend_availability(backend, "cpu"):
        pytest.skip(backend_availability(backend, "cpu").reason)
    cfg = moe_config(moe_router_topk=topk, **router, **({"num_layers": 1} if backend == "triton" else {}))  # interpreter
    model = build_gpt(moe_spec(True, backend), cfg, seed=seed)
    assert all(layer.routed_dispatch_off is None for layer in moe_layers(model))
    with torch.no_grad():  # starve an expert of the first layer's router: a group with no rows
        moe_layers(model)[0].router.weight[0].fill_(-1.0)
    routed = loss_and_grads(model, seed=seed + 1)
    use_megatrons_dispatcher(model)
    megatron = loss_and_grads(model, seed=seed + 1)
    assert routed[0] == megatron[0]
    assert routed[1].keys() == megatron[1].keys() and any(".router." in n for n in routed[1])
    assert any(".shared_experts." in n for n in routed[1]) == ("moe_shared_expert_intermediate_size" in router)
    different = [n for n in routed[1] if not torch.equal(routed[1][n], megatron[1][n])]
    assert not different, different


MEGATRON_MOE = str(Path(megatron_moe.__file__).resolve().parent)


@pytest.mark.parametrize("routed", [True, False], ids=["routed", "megatrons_dispatcher"])
def test_moe_layer_reads_no_device_value_on_the_host(routed):
    """The routed layer makes no host read of a device value (the plugin's code and Megatron's MoE code); with
    Megatron's dispatcher the same check finds its ``masked_select``, ``.cpu()`` and ``.item()``."""
    from primus_fp8_plugin import backend_availability

    if not backend_availability("triton", "cpu"):
        pytest.skip(backend_availability("triton", "cpu").reason)
    model = build_gpt(moe_spec(True, "triton"), moe_config(num_layers=1), seed=3)
    if not routed:
        use_megatrons_dispatcher(model)
    layer = moe_layers(model)[0]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 2, model.module.config.hidden_size, generator=g).to(torch.bfloat16)
    for _ in range(2):  # the weight cache's refresh, then its copy
        xin = x.clone().requires_grad_(True)
        reads = HostReads(roots=(MEGATRON_MOE,))
        with reads:
            out, _ = layer(xin)
            out.float().square().sum().backward()
    assert reads.plugin_calls > 20
    if routed:
        assert not reads.found, f"host reads in the MoE layer: {sorted(set(reads.found))}"
    else:
        assert {"masked_select", "cpu", "item"} <= {name for name, _ in reads.found}, reads.found


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(moe_expert_capacity_factor=1.5), "token dropping"),
        (dict(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True), "moe_apply_probs_on_input"),
        (dict(activation_func=torch.nn.functional.gelu), "SwiGLU fused"),
    ],
)
def test_what_blocks_the_routed_path_is_named_and_the_layer_is_megatrons(overrides, reason):
    cfg = moe_config(**overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt(moe_spec(True), cfg)
    for layer in moe_layers(model):
        assert reason in layer.routed_dispatch_off and layer.routed_dispatcher is None
        assert type(layer.token_dispatcher).__module__.startswith("megatron.")
    loss, grads = loss_and_grads(model)
    assert torch.isfinite(torch.tensor(loss)) and all(torch.isfinite(g).all() for g in grads.values())


def test_the_environment_switch_keeps_megatrons_dispatcher_and_says_so(monkeypatch):
    """``PRIMUS_FP8_MOE_ROUTED=0`` (benchmarks/megatron_lm.py's ``plugin_fast_mdisp`` arm): Megatron's dispatcher, the
    same loss and gradients (the routed layer's bits), the reason named."""
    from primus_fp8_plugin import env

    routed = build_gpt(moe_spec(True), moe_config(num_layers=1), seed=7)
    monkeypatch.setenv(env.MOE_ROUTED, "0")
    megatron = build_gpt(moe_spec(True), moe_config(num_layers=1), seed=7)
    assert all("PRIMUS_FP8_MOE_ROUTED=0" in layer.routed_dispatch_off for layer in moe_layers(megatron))
    assert all(layer.routed_dispatch_off is None for layer in moe_layers(routed))
    (loss_r, grads_r), (loss_m, grads_m) = loss_and_grads(routed), loss_and_grads(megatron)
    assert loss_r == loss_m and all(torch.equal(grads_r[n], grads_m[n]) for n in grads_r)


def test_sequential_experts_keep_megatrons_dispatcher():
    """The module-level spec decides the experts by ``config.moe_grouped_gemm``: SequentialMLP experts (no grouped
    layout) keep Megatron's dispatcher, and the layer says why."""
    from primus_fp8_plugin.megatron import fp8_gpt_moe_layer_spec

    model = build_gpt(fp8_gpt_moe_layer_spec, moe_config(moe_grouped_gemm=False, num_moe_experts=8))
    assert all("Fp8GroupedMLP" in layer.routed_dispatch_off for layer in moe_layers(model))
    grouped = build_gpt(fp8_gpt_moe_layer_spec, moe_config(moe_grouped_gemm=True, num_moe_experts=8))
    assert all(layer.routed_dispatch_off is None for layer in moe_layers(grouped))


def test_a_forward_with_a_padding_mask_runs_megatrons_dispatcher():
    """Padded tokens are routed nowhere, so the routed rows are not ``T * topk``: that forward goes through Megatron's
    dispatcher (the same output as the routed path where the mask pads nothing), the next one routes again."""
    import inspect

    from megatron.core.transformer.moe.moe_layer import MoELayer

    if "padding_mask" not in inspect.signature(MoELayer.forward).parameters:
        pytest.skip("this megatron-core's MoELayer takes no padding_mask")
    model = build_gpt(moe_spec(True), moe_config(num_layers=1), seed=5)
    layer = moe_layers(model)[0]
    seen = []
    dispatch = layer.routed_dispatcher.megatron.dispatch_postprocess

    def megatrons(*args):
        seen.append(layer.routed_dispatcher.active)
        return dispatch(*args)

    layer.routed_dispatcher.megatron.dispatch_postprocess = megatrons
    x = torch.randn(32, 2, model.module.config.hidden_size, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    nothing_padded = torch.zeros(2, 32, dtype=torch.bool)  # [b, s], True = padding
    with torch.no_grad():
        masked, _ = layer(x, padding_mask=nothing_padded)
        routed, _ = layer(x)
    assert seen == [False] and layer.routed_dispatcher.active
    assert torch.equal(masked, routed)
