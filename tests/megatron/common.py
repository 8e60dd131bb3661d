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
