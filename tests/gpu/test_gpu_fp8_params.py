"""FP8 primary weights on a CUDA GPU: W^T on demand is each backend's own quantizer W^T bit for bit (ragged and
large shapes, dense and stacked experts); a stack of FP8 linears with held weights computes what the weight cache
computes and peaks lower by what it no longer holds; the trainer with ``fp8.params=true`` gives the losses of
``false`` bit for bit in less memory. Run: ``python -m pytest -q -s tests/gpu/test_gpu_fp8_params.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from primus_fp8_plugin import Fp8BlockwiseLinear, QuantParams, get_backend
from primus_fp8_plugin.fp8_params import Fp8Params

from ..conftest import make_input

pytestmark = pytest.mark.gpu


def same(a, b) -> bool:
    view = torch.uint8 if a.element_size() == 1 else torch.int32
    return a.shape == b.shape and torch.equal(a.view(view), b.view(view))


@pytest.mark.parametrize("shape", [(200, 72), (130, 4097), (4096, 14336), (28672, 8192), (1, 1)])
def test_w_t_on_demand_is_the_quantizers_own(gpu_backend, shape):
    impl = get_backend(gpu_backend, "cuda")
    params = QuantParams(torch.float8_e4m3fn, 2)
    w = make_input(shape, seed=shape[0], device="cuda")
    full = impl.quantize_weight(w, params).k_major()  # FlyDSL's preshuffled W^T compared K-major
    made = impl.transpose_weight(impl.quantize_weight(w, params).rowwise_only()).k_major()
    assert same(made.columnwise_data, full.columnwise_data) and same(made.columnwise_scale_inv, full.columnwise_scale_inv)


def test_grouped_w_t_on_demand_is_the_quantizers_own(gpu_backend):
    impl = get_backend(gpu_backend, "cuda")
    params = QuantParams(torch.float8_e4m3fn, 2)
    weights = [make_input((1408, 2048), seed=e, device="cuda") for e in range(16)]
    full = impl.quantize_weight_grouped(weights, params)
    made = impl.transpose_weight_grouped(full.rowwise_only())
    assert same(made.columnwise_data, full.columnwise_data) and same(made.columnwise_scale_inv, full.columnwise_scale_inv)


def stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Fp8BlockwiseLinear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
                           for _ in range(8)])  # fmt: skip


def fwd_bwd(model, x):
    """Output, input gradient and weight gradients (on the host, so that they hold no device memory during the
    next measurement), the peak allocated above the start and the start (bytes; gradients cleared before it)."""
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    x = x.detach().requires_grad_(True)
    y = model(x)
    y.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    grads = [p.grad.cpu() for p in model.parameters()]
    return y.detach().cpu(), x.grad.cpu(), grads, torch.cuda.max_memory_allocated() - start, start


def test_held_weights_compute_the_caches_bits_in_less_memory():
    """8 layers 4096 x 4096 (16.8 M weights each): held, each weight costs its FP8 W (1 byte + scales) instead of
    bf16 + W + W^T (4 bytes); dgrad makes one W^T at a time (16.8 MB, freed after it)."""
    x = make_input((4096, 4096), seed=3, device="cuda")
    ref = stack()
    fwd_bwd(ref, x)  # the caches filled
    y_ref, dx_ref, g_ref, peak_ref, base_ref = fwd_bwd(ref, x)
    del ref
    torch.cuda.empty_cache()
    model = stack()
    primary = Fp8Params(model)
    primary.release()
    y, dx, g, peak, base = fwd_bwd(model, x)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref) and all(torch.equal(a, b) for a, b in zip(g, g_ref))
    n = 8 * 4096 * 4096
    held_ref, held = base_ref + peak_ref, base + peak
    print(f"8 x [4096, 4096]: holding {base_ref / 2**20:.0f} -> {base / 2**20:.0f} MiB, peak {held_ref / 2**20:.0f} -> "
          f"{held / 2**20:.0f} MiB")  # fmt: skip
    assert base_ref - base >= 2.9 * n  # bf16 (2) + W^T (1) gone
    assert held_ref - held >= 2.9 * n - 4096 * 4096  # at the peak: one W^T made on demand


def test_trainer_fp8_params_same_losses_less_memory(tmp_path):
    from ..test_train import losses, train

    out = {}
    for params in ("false", "true"):
        proc, out[params] = train(tmp_path, "device=cuda", "backend=auto", "model=gpt_125m", "train.steps=20",
                                  "logging.log_interval=1", "data.split='100,0,0'", f"fp8.params={params}",
                                  name=f"params_{params}")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = out["false"], out["true"]
    assert losses(a) == losses(b), (losses(a), losses(b))
    start = {k: next(r for r in v if r.get("event") == "start") for k, v in out.items()}
    peak = {k: max(r["memory_bytes"] for r in v if "memory_bytes" in r) for k, v in out.items()}
    print(f"gpt_125m: param_bytes {start['false']['param_bytes']} -> {start['true']['param_bytes']}, "
          f"peak {peak['false'] / 2**20:.0f} -> {peak['true'] / 2**20:.0f} MiB")  # fmt: skip
    assert start["true"]["param_bytes"] < start["false"]["param_bytes"]
    assert peak["true"] < peak["false"]
