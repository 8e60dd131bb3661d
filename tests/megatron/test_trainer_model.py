"""The trainer's model builder (training/model.py) on the CPU: MoE top-1 routing (which Megatron
builds only with the softmax before the choice) giving its router a gradient."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("megatron_world")
pytest.importorskip("hydra")


def build(*overrides, vocab=257):
    """The trainer's model (one layer) for the default configuration with ``overrides``."""
    from primus_fp8_plugin.training.model import build_model, transformer_config
    from tests.hydra_compose import compose

    cfg = compose("backend=reference", "model.num_layers=1", *overrides)
    torch.manual_seed(0)
    return build_model(cfg, transformer_config(cfg, False), vocab, torch.device("cpu"))


def test_moe_top1_routing_builds_and_trains_its_router():
    model = build("model.num_experts=4", "model.moe_router_topk=1", "model.add_bias_linear=false")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 257, (2, 128), generator=g)
    pos = torch.arange(128).unsqueeze(0).expand(2, -1)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    (router,) = [p for n, p in model.named_parameters() if n.endswith("router.weight")]
    assert torch.isfinite(loss) and router.grad is not None and router.grad.abs().sum() > 0
