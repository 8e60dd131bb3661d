"""Shared helpers for the Megatron-core tests: a tiny GPT on the CPU, built from a given spec."""

from __future__ import annotations

import warnings
from functools import partial

import torch

SEQ, BATCH, VOCAB = 64, 2, 512
# hidden/ffn/qkv widths whose TP=2 shards are multiples of 128, so FP8 tiles align across TP sizes
DIMS = dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512)


def submodules_of(spec):
    """A spec's submodules: a ``ModuleSpec``'s, or a ``partial``'s keyword (MLP specs from megatron-core 0.17 on)."""
    return spec.keywords["submodules"] if isinstance(spec, partial) else spec.submodules


def tiny_config(**overrides):
    from primus_fp8_plugin.megatron.cpu import cpu_transformer_config

    kw = dict(DIMS, params_dtype=torch.bfloat16, bf16=True)
    kw.update(overrides)
    return cpu_transformer_config(**kw)


def build_gpt(spec, config=None, seed=0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    config = config or tiny_config()
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    return Float16Module(config, gpt)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    return ids, pos


def loss_and_grads(model, seed=1):
    """Mean LM loss of one batch and the gradients of every parameter (fp32 copies, by name)."""
    ids, pos = batch(seed)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def unfused_reference(config, backend):
    """The unfused plugin spec (separate norms, Megatron's RoPE and MLP activation) with the same attention kernel
    (SDPA) and the same q/k norm class."""
    import dataclasses

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from primus_fp8_plugin.megatron import TorchNorm, get_gpt_layer_spec

    spec = get_gpt_layer_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm, core_attention="sdpa",
                              fused_norm=False, backend=backend)  # fmt: skip
    attn = spec.submodules.self_attention
    qk = {f: TorchNorm for f in ("q_layernorm", "k_layernorm") if getattr(attn.submodules, f) is not IdentityOp}
    attn = ModuleSpec(module=attn.module, params=attn.params, submodules=dataclasses.replace(attn.submodules, **qk))
    return ModuleSpec(module=spec.module, params=spec.params,
                      submodules=dataclasses.replace(spec.submodules, self_attention=attn))  # fmt: skip


def fused_norm_names(state: dict) -> dict:
    """An unfused layer's state dict under the fused-norm layer's names (the norms live in linear_qkv / linear_fc1)."""
    renamed = {}
    for k, v in state.items():
        k = k.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
        renamed[k.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")] = v
    return renamed
