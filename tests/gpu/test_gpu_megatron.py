"""A Megatron-core GPTModel with the plugin's spec on one GPU (NCCL, TP=1): agrees with the same
model built from Megatron's BF16 local spec within FP8 tolerance, for each GPU backend."""

from __future__ import annotations

import warnings

import pytest
import torch

from primus_fp8_plugin import backend_availability
from primus_fp8_plugin.validate import rel_frobenius

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")

SEQ, BATCH, VOCAB = 256, 4, 1024


def build(spec):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048,
                            params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
                            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False)  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    return Float16Module(cfg, gpt).cuda()


def loss_and_grads(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).cuda()
    pos = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_gpt_on_gpu_matches_bf16(nccl_world, backend):
    if not backend_availability(backend, "cuda"):
        pytest.skip(backend_availability(backend, "cuda").reason)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from primus_fp8_plugin.megatron import get_gpt_block_spec, is_fp8_linear

    loss_bf16, g_bf16 = loss_and_grads(build(get_gpt_layer_local_spec()))
    fp8_model = build(get_gpt_block_spec(2, backend=backend))
    assert sum(is_fp8_linear(m) for m in fp8_model.modules()) == 8
    loss_fp8, g_fp8 = loss_and_grads(fp8_model)
    g_fp8 = {n.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
              .replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."): g for n, g in g_fp8.items()}  # fmt: skip
    assert g_fp8.keys() == g_bf16.keys()
    errs = {n: rel_frobenius(g_fp8[n], g_bf16[n]) for n in g_bf16}
    worst = max(errs.items(), key=lambda kv: kv[1])
    print(f"{backend}: loss bf16 {loss_bf16:.5f} fp8 {loss_fp8:.5f}; worst grad error {worst}")
    assert abs(loss_fp8 - loss_bf16) / loss_bf16 < 5e-3
    assert worst[1] < 0.15


@pytest.mark.parametrize("backend", ["triton", "cublas"])
def test_gpt_plugin_spec_matches_te_spec(nccl_world, backend):
    """TE's spec under Float8BlockScaling and the plugin's spec, same weights and inputs: the same
    quantization, so the plugin sits much closer to TE than either sits to BF16 (what remains comes
    from TE's fused attention and norm kernels, whose bf16 roundings flip a few FP8 roundings)."""
    pytest.importorskip("transformer_engine.pytorch")
    if not backend_availability(backend, "cuda"):
        pytest.skip(backend_availability(backend, "cuda").reason)
    from primus_fp8_plugin.megatron.te_compare import GptShape, batch, build_gpt, copy_weights, loss_and_grads

    shape = GptShape(num_layers=2, hidden_size=512, num_attention_heads=8, ffn_hidden_size=2048, seq_length=256,
                     micro_batch_size=4)  # fmt: skip
    ids, pos = batch(shape)
    te_model = build_gpt(shape, "te")
    results = {"te": loss_and_grads(te_model, ids, pos)}
    for kind in ("plugin", "bf16"):
        model = build_gpt(shape, kind, backend=backend)
        copy_weights(te_model, model)
        results[kind] = loss_and_grads(model, ids, pos)

    def worst(a, b):
        ga, gb = results[a][1], results[b][1]
        assert ga.keys() == gb.keys()
        return max((rel_frobenius(ga[n], gb[n]), n) for n in gb)

    (l_te, _), (l_p, _), (l_b, _) = results["te"], results["plugin"], results["bf16"]
    p_te, te_bf16, p_bf16 = worst("plugin", "te"), worst("te", "bf16"), worst("plugin", "bf16")
    print(f"{backend}: loss te {l_te:.5f} plugin {l_p:.5f} bf16 {l_b:.5f}; worst grad error plugin-vs-TE {p_te}, "
          f"TE-vs-bf16 {te_bf16}, plugin-vs-bf16 {p_bf16}")  # fmt: skip
    assert abs(l_p - l_te) / l_te < 1e-3
    assert p_te[0] < te_bf16[0], "the plugin should agree with TE better than TE agrees with BF16"
