"""The TE-free fast spec (``fp8_gpt_fast_layer_spec``) under Megatron-core's own per-layer CUDA graphs
(``cuda_graph_impl="local"``, ``CudaGraphManager``), driven as Megatron's schedule drives them: the first
training step runs eagerly and records, ``create_cudagraphs()`` captures every ``TransformerLayer``'s forward
and backward at its end, and every later microbatch replays. Against an eager twin with the same weights,
inputs, DDP gradient buffers and optimizer:

* every microbatch's output, input gradient, and after each step every ``main_grad`` and parameter are the
  eager model's bit for bit (SDPA's math kernel in both, so that attention's backward is deterministic), over
  optimizer steps that change every FP8 weight: a replay that read the weight's quantized copy of the capture
  step would differ from the second step on;
* the layers' Python does not run on replay (their weight caches stop counting quantizations);
* Megatron's gradient-accumulation fusion (``main_grad += dW`` inside the plugin's wgrad GEMM, captured in the
  backward graph) and the plain path (Megatron's graph adds the returned ``dW``) both;
* with SDPA's default (flash) kernels the graphed model trains like the eager one (flash's backward is not
  bit-reproducible);

and the eager layers' forward and backward make no host synchronisation (``torch.cuda.set_sync_debug_mode
("error")``): a synchronising call inside them would fail graph capture, or stall every step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")

SEQ, MBS, MICROBATCHES, STEPS = 128, 2, 2, 3
MODELS = {
    # Llama-style: RMSNorm, SwiGLU (fused with fc2's quantization), RoPE (the plugin's), GQA, no biases
    "llama": dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=768,
                  normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False),
    # GPT-style (the 125M benchmark's layer): LayerNorm, GELU, biases, no RoPE
    "gpt": dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, normalization="LayerNorm"),
    # fine-grained MoE (Qwen3-like): 8 grouped experts, top-2 with the aux loss, the routed dispatch (sync-free at
    # EP=1, so the whole layer, router and experts, is captured: Megatron's own dropless layer cannot be)
    "moe": dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=768,
                normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256, moe_grouped_gemm=True,
                moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=1e-2),
}  # fmt: skip


@pytest.fixture
def graph_world(nccl_world):
    """Megatron's cudagraph-safe RNG tracker (CudaGraphManager refuses others); afterwards every graph is deleted,
    the default stream restored (the first manager moves the process to a side stream) and the usual tracker
    put back, so that later tests see a clean process."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    tensor_parallel.model_parallel_cuda_manual_seed(0, use_cudagraphable_rng=True, force_reset_rng=True)
    yield
    torch.cuda.synchronize()
    delete_cuda_graphs()
    torch.cuda.set_stream(torch.cuda.default_stream())
    tensor_parallel.model_parallel_cuda_manual_seed(0, force_reset_rng=True)


def config(model: str, **kw):
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config

    return cpu_transformer_config(**MODELS[model], params_dtype=torch.bfloat16, bf16=True, **kw)


def build_block(cfg):
    """The fast spec's decoder block (its layers, then the final norm) on the GPU, bf16."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from primus_fp8_plugin.megatron import fp8_gpt_fast_layer_spec

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        block = TransformerBlock(cfg, fp8_gpt_fast_layer_spec(cfg)).cuda()
    return block


def wrap_ddp(cfg, block):
    """Megatron's DDP around ``block``: its gradient buffers give every parameter the ``main_grad`` that
    Megatron's backward graph accumulates into."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    # fp32 main_grad, as Megatron-LM's --bf16 runs (--accumulate-allreduce-grads-in-fp32)
    return DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), block)


def copy_params(src, dst):
    with torch.no_grad():
        for (n, p), (m, q) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
            assert n == m
            q.copy_(p)


class Trainer:
    """Megatron's training step on one model: zero the grad buffers, forward+backward per microbatch
    (``create_cudagraphs()`` after the last, as ``forward_backward_no_pipelining`` calls it), the gradient
    sync, then Adam on fp32 master copies written back through ``.data`` (as Megatron's mixed-precision
    optimizer copies its main params: no version-counter bump)."""

    def __init__(self, ddp, graphed: bool):
        self.ddp, self.graphed = ddp, graphed
        self.params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.Adam(self.masters, lr=2e-3)

    def step(self, batches, rope):
        from megatron.core.transformer.cuda_graphs import create_cudagraphs

        self.ddp.zero_grad_buffer()
        outs = []
        for x, dy in batches:
            xin = x.clone().requires_grad_(True)
            y = self.ddp(hidden_states=xin, attention_mask=None, rotary_pos_emb=rope)
            y.backward(dy)
            outs.append((y.detach().clone(), xin.grad.clone()))
        if self.graphed:
            create_cudagraphs()  # a no-op once the graphs exist
        self.ddp.finish_grad_sync()
        grads = [p.main_grad.clone() for p in self.params]
        for m, p in zip(self.masters, self.params):
            m.grad = p.main_grad.float()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                p.data.copy_(m)
        return outs, grads


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def batches(step: int, cfg):
    g = torch.Generator().manual_seed(1000 + step)
    shape = (SEQ, MBS, cfg.hidden_size)
    return [(torch.randn(shape, generator=g).to("cuda", torch.bfloat16),
             (torch.randn(shape, generator=g) * 0.1).to("cuda", torch.bfloat16)) for _ in range(MICROBATCHES)]  # fmt: skip


def rope_for(model: str, cfg):
    if model != "llama":
        return None
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)(SEQ)


def fp8_layers(module):
    """The FP8 layers (dense and grouped): each holds a weight cache."""
    from primus_fp8_plugin.modules import HoldsWeightCache

    return [m for m in module.modules() if isinstance(m, HoldsWeightCache) and m.weight_cache is not None]


def first_weight(layer) -> torch.Tensor:
    weights = layer.fp8_weight_source()[0]
    return weights[0] if isinstance(weights, list) else weights


def run_pair(model: str, fusion: bool):
    """(eager trainer, graphed trainer, per-step results of each, the graphed block's layers)."""
    g_cfg = config(model, cuda_graph_impl="local", gradient_accumulation_fusion=fusion)
    e_cfg = config(model, gradient_accumulation_fusion=fusion)
    g_block, e_block = build_block(g_cfg), build_block(e_cfg)
    copy_params(g_block, e_block)
    assert all(hasattr(layer, "cudagraph_manager") for layer in g_block.layers)
    assert not any(hasattr(layer, "cudagraph_manager") for layer in e_block.layers)
    graphed, eager = Trainer(wrap_ddp(g_cfg, g_block), True), Trainer(wrap_ddp(e_cfg, e_block), False)
    rope = rope_for(model, g_cfg)
    return graphed, eager, g_block, rope


@pytest.mark.parametrize("fusion", [False, True], ids=["plain_wgrad", "main_grad_fusion"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_megatron_local_graphs_replay_the_fast_spec_bit_for_bit(graph_world, model, fusion):
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord
    from torch.nn.attention import SDPBackend, sdpa_kernel

    graphed, eager, g_block, rope = run_pair(model, fusion)
    cfg = g_block.config
    layers = fp8_layers(g_block)
    assert layers, "the fast spec built no FP8 layer"
    if model == "moe":  # the routed dispatch runs in every MoE layer (it is what makes the layer capturable)
        moe = [layer.mlp for layer in g_block.layers]
        assert all(m.routed_dispatch_off is None for m in moe), [m.routed_dispatch_off for m in moe]
    refreshes = None
    with sdpa_kernel([SDPBackend.MATH]):
        for step in range(STEPS):
            data = batches(step, cfg)
            before = {id(p): p.detach().clone() for p in graphed.params}
            (g_outs, g_grads), (e_outs, e_grads) = graphed.step(data, rope), eager.step(data, rope)
            if step == 0:
                assert _CudagraphGlobalRecord.cudagraph_created, "create_cudagraphs() captured nothing"
                assert all(r.fwd_graph is not None and r.bwd_graph is not None
                           for layer in g_block.layers for r in layer.cudagraph_manager.cudagraph_runners)  # fmt: skip
                refreshes = [m.weight_cache.refreshes for m in layers]
            else:  # replays run no layer Python: no weight-cache call at all
                assert [m.weight_cache.refreshes for m in layers] == refreshes, "a graphed step ran the layers eagerly"
            what = f"{model} fusion={fusion} step {step}"
            for mb, ((gy, gdx), (ey, edx)) in enumerate(zip(g_outs, e_outs)):
                assert same(gy, ey), f"{what} microbatch {mb}: output differs from eager"
                assert same(gdx, edx), f"{what} microbatch {mb}: input gradient differs from eager"
            names = [n for n, p in graphed.ddp.module.named_parameters() if p.requires_grad]
            bad = [n for n, a, b in zip(names, g_grads, e_grads) if not same(a, b)]
            assert not bad, f"{what}: main_grad of {bad[:4]} differs from eager"
            bad = [n for n, a, b in zip(names, graphed.params, eager.params) if not same(a, b)]
            assert not bad, f"{what}: parameters {bad[:4]} differ from eager after the optimizer step"
            for m in layers:  # the test sees a stale quantized weight only if the weights move
                w = first_weight(m)
                changed = (bits(w) != bits(before[id(w)])).float().mean().item()
                assert changed > 0.5, f"{what}: the optimizer changed only {changed:.0%} of a weight"
    print(f"{model} fusion={fusion}: {STEPS} steps x {MICROBATCHES} microbatches graphed = eager bit for bit "
          f"({len(layers)} FP8 layers, {sum(refreshes)} weight quantizations outside replays)")  # fmt: skip


def test_megatron_local_graphs_with_fused_attention_train_like_eager(graph_world):
    """SdpaAttention's default kernels (cuDNN's first on Hopper, else flash; neither backward is
    bit-reproducible): captured and replayed, the losses
    follow the eager model's within bf16/FP8 noise over the steps."""
    graphed, eager, g_block, rope = run_pair("llama", False)
    cfg = g_block.config
    for step in range(STEPS):
        data = batches(step, cfg)
        (g_outs, _), (e_outs, _) = graphed.step(data, rope), eager.step(data, rope)
        for (gy, _), (ey, _) in zip(g_outs, e_outs):
            assert torch.isfinite(gy).all()
            err = ((gy.float() - ey.float()).norm() / ey.float().norm()).item()
            assert err < 2e-2, f"fused attention step {step}: graphed output off eager by {err:.2e} (relative Frobenius)"
    print(f"fused attention: graphed output within {err:.2e} of eager after {STEPS} steps")


@pytest.mark.parametrize("fusion", [False, True], ids=["plain_wgrad", "main_grad_fusion"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_fast_spec_layers_make_no_host_sync(nccl_world, model, fusion):
    """Forward and backward of the fast spec's block (every plugin kernel, the weight cache refreshing and
    serving, the fused main_grad accumulation) under ``set_sync_debug_mode("error")``, after one warm-up step
    (kernel compilation may synchronise)."""
    cfg = config(model, gradient_accumulation_fusion=fusion)
    block = build_block(cfg)
    if fusion:
        for p in block.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
    rope = rope_for(model, cfg)
    x, dy = batches(0, cfg)[0]

    def fwd_bwd(refresh: bool):
        if refresh:
            for m in fp8_layers(block):
                m.is_first_microbatch = True
        xin = x.clone().requires_grad_(True)
        block(hidden_states=xin, attention_mask=None, rotary_pos_emb=rope).backward(dy)

    fwd_bwd(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(True)  # the weight cache re-quantizes (first microbatch)
        fwd_bwd(False)  # and serves its copy
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
