"""The start-up memory check's estimate against the models the trainer builds: the parameter count is
exact, and the activation-side lower bound is at most what one forward really keeps for the backward."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin.config.resources import memory_lower_bound, parameter_count
from tests.hydra_compose import compose

pytestmark = pytest.mark.usefixtures("megatron_world")


def build(cfg):
    from primus_fp8_plugin.training.model import build_model, padded_vocab, transformer_config

    vocab = padded_vocab(257, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp)
    return build_model(cfg, transformer_config(cfg, on_cuda=False), 257, torch.device("cpu")), vocab


@pytest.mark.parametrize(
    "overrides",
    [
        ["backend=reference"],
        ["fp8=bf16", "model.swiglu=true", "model.normalization=RMSNorm", "model.position_embedding_type=rope",
         "model.num_query_groups=2", "model.add_bias_linear=false", "model.num_layers=3"],
        ["fp8=bf16", "model.num_experts=4", "model.add_bias_linear=false", "model.ffn_hidden_size=256"],
    ],
)  # fmt: skip
def test_parameter_count_is_the_built_models(overrides):
    cfg = compose(*overrides)
    model, vocab = build(cfg)
    assert parameter_count(cfg, vocab) == sum(p.numel() for p in model.parameters())


def test_activation_bound_is_below_what_a_forward_keeps():
    """Bytes of the distinct tensors autograd saves in one forward of the trainer's model (local
    attention, so the seq^2 probabilities dominate) against the estimate's activation-side parts."""
    cfg = compose("fp8=bf16", "model.seq_length=256", "train.micro_batch_size=2")
    model, vocab = build(cfg)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (b, s), generator=g)
    position = torch.arange(s).unsqueeze(0).expand(b, -1)
    saved: dict[int, int] = {}

    def pack(t):
        if t.layout == torch.strided and t.device.type == "cpu":
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position, None, labels=tokens).float().mean()
    parts = memory_lower_bound(cfg, 1, vocab)
    bound = parts["attention probabilities"] + parts["activations"] + parts["logits"]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = sum(n for ptr, n in saved.items() if ptr not in params)
    assert parts["attention probabilities"] > parts["activations"]  # the case that matters at long sequences
    assert bound <= kept, (bound, kept)
    loss.backward()
