"""No host synchronisation in the plugin's MoE experts at EP=1 (``torch.cuda.set_sync_debug_mode("error")``).

* ``Fp8GroupedMLP`` (Megatron's ``TEGroupedMLP`` with the plugin's grouped linears, SwiGLU and the routing
  probabilities fused into fc2, the token counts a device tensor) forward and backward, with the weight cache
  refreshing and serving, into Megatron's ``main_grad`` (shared placeholder gradients) and into ``.grad``;
* ``Fp8GroupedLinear`` with biases (their gradients a segment sum on the device) and device counts;
* a whole MoE transformer layer of the fast spec (router, ``Fp8MoELayer`` replacing Megatron's alltoall
  dispatcher at EP=1 by the routed path: the permutation from the routing map, fc1 reading the tokens through
  it, the fused combine), and the same layer against Megatron's own dispatcher (close: Megatron's GPU combine
  adds with bf16 atomics in no fixed order).

Each runs one warm-up step first (kernel compilation and the first pointer tables may synchronise)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")

E, HIDDEN, FFN, TOKENS = 8, 1024, 512, 1536


def config(**kw):
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config

    base = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, ffn_hidden_size=4 * HIDDEN,
                params_dtype=torch.bfloat16, bf16=True, normalization="RMSNorm", gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, num_moe_experts=E, moe_router_topk=2,
                moe_ffn_hidden_size=FFN, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall")  # fmt: skip
    base.update(kw)
    return cpu_transformer_config(**base)


def without_host_sync(step) -> None:
    """``step()`` twice, the first outside the check (warm-up), the second under ``set_sync_debug_mode("error")``."""
    step(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(True)  # the weight caches re-quantize (first microbatch)
        step(False)  # and serve their copies
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("single", [False, True], ids=["per_expert_weights", "single_grouped_weight"])
@pytest.mark.parametrize("main_grad", [True, False], ids=["main_grad", "grad"])
def test_grouped_experts_make_no_host_sync(nccl_world, main_grad, single):
    from megatron.core.process_groups_config import ProcessGroupCollection

    from primus_fp8_plugin.megatron.grouped import Fp8GroupedMLP, grouped_mlp

    torch.manual_seed(0)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    experts = grouped_mlp(single_grouped_weight=single)(E, config(), pg_collection=pgs).cuda()
    assert isinstance(experts, Fp8GroupedMLP) and experts.fused_swiglu
    if main_grad:
        for p in experts.parameters():
            p.main_grad, p.grad_added_to_main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda"), False
    counts = torch.tensor([400, 0, 129, 1, 300, 200, 250, 256], device="cuda")
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(TOKENS, device="cuda")
    dy = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step(first: bool):
        experts.linear_fc1.is_first_microbatch = experts.linear_fc2.is_first_microbatch = first
        xin, p = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out, _ = experts(xin, counts, p)
        out.backward(dy)
        for q in experts.parameters():
            q.grad = None  # Megatron's hook drops the placeholder

    without_host_sync(step)
    if main_grad:
        assert all(bool(p.grad_added_to_main_grad) for p in experts.parameters())


def test_grouped_linear_with_biases_makes_no_host_sync():
    from primus_fp8_plugin import Fp8GroupedLinear

    layer = Fp8GroupedLinear(E, HIDDEN, FFN, bias=True, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([400, 0, 129, 1, 300, 200, 250, 256], device="cuda")
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, FFN, device="cuda", dtype=torch.bfloat16)

    def step(first: bool):
        layer.is_first_microbatch = first
        layer(x, counts).backward(dy)

    without_host_sync(step)
    assert layer.bias1.grad is not None and not layer.bias1.grad.any()  # the expert without tokens


def fast_moe_block():
    """One MoE transformer layer of the fast spec (Megatron's alltoall config at EP=1: the routed layer), bf16."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from primus_fp8_plugin.megatron import fp8_gpt_fast_layer_spec

    cfg = config()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerBlock(cfg, fp8_gpt_fast_layer_spec(cfg)).cuda()


def test_moe_layer_at_ep1_makes_no_host_sync(nccl_world):
    block = fast_moe_block()
    assert block.layers[0].mlp.routed_dispatch_off is None
    x = torch.randn(256, 2, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def step(first: bool):
        xin = x.clone().requires_grad_(True)
        block(hidden_states=xin, attention_mask=None).backward(dy)

    without_host_sync(step)


def test_routed_moe_layer_agrees_with_megatrons_alltoall_dispatcher(nccl_world):
    block = fast_moe_block()
    moe = block.layers[0].mlp
    x = torch.randn(256, 2, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def run():
        xin = x.clone().requires_grad_(True)
        block.zero_grad(set_to_none=True)
        y = block(hidden_states=xin, attention_mask=None)
        y.backward(dy)
        return [y.detach(), xin.grad] + [p.grad.clone() for p in block.parameters() if p.grad is not None]

    routed = run()
    moe.token_dispatcher, moe.routed_dispatcher = moe.routed_dispatcher.megatron, None
    megatron = run()
    assert len(routed) == len(megatron)
    for a, b in zip(routed, megatron):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())
