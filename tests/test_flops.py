"""MFU: the model FLOPs of a step against a hand computation, the device peak table, and how the log
line shows MFU and memory."""

from __future__ import annotations

import pytest

pytest.importorskip("hydra")

from primus_fp8_plugin.training import flops  # noqa: E402
from primus_fp8_plugin.training.metrics import console_line  # noqa: E402
from tests.hydra_compose import compose  # noqa: E402


def test_model_flops_of_the_tiny_gpt_by_hand():
    """The default tiny GPT: 2 layers, h=256, f=1024 (GeLU), 4 heads (MHA), s=128, a padded vocabulary of
    512, 8 sequences a step. Weights a token is multiplied by: per layer QKV 256*768 = 196608, projection
    65536, MLP 2*262144 = 524288, so 786432; two layers 1572864; output layer 256*512 = 131072; N = 1703936.
    Causal attention: 6*L*s*h = 6*2*128*256 = 393216. Per token 6*1703936 + 393216 = 10616832;
    per step x 1024 tokens = 10871635968."""
    cfg = compose("train.global_batch_size=8")
    assert flops.matmul_weights_per_token(cfg.model, 512) == 1703936
    assert flops.model_flops_per_step(cfg, 512) == 10871635968


def test_model_flops_count_gqa_swiglu_and_active_experts_only():
    """h=256, 4 heads of 64, 2 query groups: QKV 256*(256+2*2*64) = 131072, projection 65536; SwiGLU
    f=512: 256*1024 + 512*256 = 393216 per expert, 2 of 8 experts active: 786432, router 256*8 = 2048;
    one layer 985088, output layer 256*512; N = 1116160."""
    cfg = compose("model.num_layers=1", "model.num_query_groups=2", "model.swiglu=true", "model.ffn_hidden_size=512",
                  "model.num_experts=8", "model.moe_router_topk=2")  # fmt: skip
    assert flops.matmul_weights_per_token(cfg.model, 512) == 1116160


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA H100 80GB HBM3", 989.5), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.5),
     ("NVIDIA A100-SXM4-80GB", 312.0), ("AMD Instinct MI355X", 2516.6), ("AMD Instinct MI300X", 1307.4),
     ("NVIDIA GeForce RTX 3090", None), (None, None)],
)  # fmt: skip
def test_peak_table(name, tflops):
    assert flops.peak_flops(name) == (None if tflops is None else tflops * 1e12)


def test_mfu_is_model_flops_over_time_devices_and_peak():
    # 1e15 model FLOPs in 2 s on 2 devices of 1e15 FLOP/s peak: 1e15 / (2 * 2 * 1e15)
    assert flops.mfu(1e15, 2.0, 2, 1e15) == pytest.approx(0.25)
    assert flops.mfu(1e15, 2.0, 2, None) is None  # the CPU: no peak
    assert flops.device_peak_flops("cpu") is None


def test_the_log_line_shows_mfu_in_percent_and_memory_in_gib():
    line = console_line({"step": 3, "loss": 2.5, "mfu": 0.4215, "memory_bytes": 3 * 2**30 // 2})
    assert line == "step=3 loss=2.5 mfu=42.1% mem=1.50GiB"
    assert console_line({"step": 3, "mfu": None}) == "step=3 mfu=n/a"
    saved = {"event": "checkpoint", "step": 100, "path": "/x/iter_0000100", "bytes": int(1.2 * 2**30), "seconds": 3.44,
             "pruned": ["iter_0000050"]}  # fmt: skip
    assert console_line(saved) == "saved checkpoint iter_0000100 (1.2 GiB) in 3.4 s; removed iter_0000050"
