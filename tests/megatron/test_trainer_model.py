"""The trainer's model builder (training/model.py) on the CPU: the embedding sized by the run's
vocabulary, padded as Megatron pads, and MoE top-1 routing (which Megatron builds only with the
softmax before the choice) giving its router a gradient."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("megatron_world")
pytest.importorskip("hydra")


@pytest.mark.parametrize(
    "vocab, divisible_by, tp, padded",
    [(257, 128, 1, 384), (257, 128, 2, 512), (257, 256, 1, 512), (32000, 128, 1, 32000), (32000, 128, 8, 32768),
     (128256, 128, 1, 128256), (128256, 128, 8, 129024), (50257, 128, 1, 50304)],
)  # fmt: skip
def test_vocabulary_is_padded_as_megatron_pads(vocab, divisible_by, tp, padded):
    # Megatron-LM's --make-vocab-size-divisible-by x TP: GPT-2's 50257 -> 50304, Llama-3's 128256 at TP=8 -> 129024
    from primus_fp8_plugin.training.model import padded_vocab

    assert padded_vocab(vocab, divisible_by, tp) == padded


def build(*overrides, vocab=257):
    """The trainer's model (one layer) for the default configuration with ``overrides``."""
    from primus_fp8_plugin.training.model import build_model, transformer_config
    from tests.hydra_compose import compose

    cfg = compose("backend=reference", "model.num_layers=1", *overrides)
    torch.manual_seed(0)
    return build_model(cfg, transformer_config(cfg, False), vocab, torch.device("cpu"))


def test_embedding_has_the_padded_vocabulary():
    rows = {n: p.shape[0] for n, p in build(vocab=32000).named_parameters() if "word_embeddings" in n or "output_layer" in n}
    assert set(rows.values()) == {32000} and len(rows) == 2
    rows = {n: p.shape[0] for n, p in build("model.make_vocab_size_divisible_by=100").named_parameters() if "embeddings" in n}
    assert rows["module.embedding.word_embeddings.weight"] == 300


def test_moe_top1_routing_builds_and_trains_its_router():
    model = build("model.num_experts=4", "model.moe_router_topk=1", "model.add_bias_linear=false")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 257, (2, 128), generator=g)
    pos = torch.arange(128).unsqueeze(0).expand(2, -1)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    (router,) = [p for n, p in model.named_parameters() if n.endswith("router.weight")]
    assert torch.isfinite(loss) and router.grad is not None and router.grad.abs().sum() > 0
