"""Model FLOPs utilisation (MFU) of a training run: the FLOPs the model needs per step, over the step
time and the devices' peak.

Model FLOPs of one step (``tokens = train.global_batch_size x model.seq_length``)::

    tokens x (6 N + 6 L s d)

* ``N``: the weights that multiply each token (2 FLOPs per multiply-add forward, twice that backward):
  per layer the QKV projection ``h (h + 2 g d_h)`` (``g`` query groups of ``d_h = h / heads``), the
  output projection ``h h``, and the MLP ``h f (2 with SwiGLU, else 1) + f h`` (MoE: ``topk`` experts'
  MLPs plus the router's ``h E``); and the output layer ``h V`` (``V`` the padded vocabulary). Not the
  input and position embeddings (lookups), norms or biases.
* ``6 L s d``: attention's scores and weighted sum (``d = h``) over the causal half of the sequence
  (``s / 2`` keys per query on average), forward and backward.

MFU = model FLOPs per step / (step time x devices x the device's dense BF16 peak). The peak is BF16's
for every precision, as torchtitan does, so that FP8 and BF16 arms are on one scale (an FP8 run can
pass 50%). Peaks are the vendors' datasheet figures without sparsity (``PEAK_BF16_TFLOPS``); a device
not in the table (any CPU) has no MFU (None, shown as ``n/a``).
"""

from __future__ import annotations

# Dense BF16 TFLOP/s per device, by a substring of torch.cuda.get_device_name() (first match wins:
# more specific names first). NVIDIA and AMD datasheets, without sparsity.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("GH200", 989.5),
    ("H100", 989.5),  # SXM (HBM3)
    ("H200", 989.5),  # SXM
    ("H800", 989.5),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("MI300X", 1307.4),
    ("MI325X", 1307.4),
    ("MI350X", 2306.9),
    ("MI355X", 2516.6),
)


def peak_flops(device_name: str | None) -> float | None:
    """Dense BF16 peak FLOP/s of the device called ``device_name``; None when it is not in the table."""
    if not device_name:
        return None
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def device_peak_flops(device) -> float | None:
    """``peak_flops`` of a torch device (None on the CPU)."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return peak_flops(torch.cuda.get_device_name(device))


def matmul_weights_per_token(model_cfg, padded_vocab: int) -> int:
    """``N`` of the module docstring: weights each token is multiplied by (all ranks together)."""
    m = model_cfg
    h, f = m.hidden_size, m.ffn_hidden_size
    head = h // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    attention = h * (h + 2 * groups * head) + h * h
    mlp = h * f * (2 if m.swiglu else 1) + f * h
    if m.num_experts:
        mlp = m.moe_router_topk * mlp + h * m.num_experts
    return m.num_layers * (attention + mlp) + h * padded_vocab


def model_flops_per_step(cfg, padded_vocab: int) -> float:
    """Model FLOPs of one training step (the module docstring's formula)."""
    m = cfg.model
    tokens = cfg.train.global_batch_size * m.seq_length
    per_token = 6 * matmul_weights_per_token(m, padded_vocab) + 6 * m.num_layers * m.seq_length * m.hidden_size
    return float(tokens * per_token)


def mfu(flops_per_step: float, step_time_s: float, devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation (0..1) of a step taking ``step_time_s`` on ``devices`` devices of peak
    ``peak`` FLOP/s; None when the peak is unknown."""
    if peak is None or step_time_s <= 0:
        return None
    return flops_per_step / (step_time_s * devices * peak)
