"""The weight cache: reused across microbatches and by backward, refreshed by every kind of weight
change, never stale, never in a state dict."""

from __future__ import annotations

import copy

import torch

from primus_fp8_plugin import Fp8BlockwiseLinear

from .conftest import make_input


def fresh_output(layer, x):
    """What a layer with the same weights and no cache computes."""
    other = Fp8BlockwiseLinear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                               dtype=layer.weight.dtype, backend=layer.backend, cache_weight=False)  # fmt: skip
    other.load_state_dict(layer.state_dict())
    with torch.no_grad():
        return other(x)


def make_layer():
    torch.manual_seed(0)
    return Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")


def run(layer, x):
    with torch.no_grad():
        return layer(x)


def test_one_quantization_per_step_reused_by_microbatches_and_backward():
    layer = make_layer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    cache = layer._weight_cache
    for step in range(3):
        for _ in range(4):  # microbatches
            x = make_input((32, 256), seed=step).requires_grad_(True)
            layer(x).float().square().mean().backward()
        assert cache.refreshes == step + 1
        opt.step()
        opt.zero_grad()
    x = make_input((8, 256), seed=9)
    assert torch.equal(run(layer, x), fresh_output(layer, x))
    assert cache.refreshes == 4


def test_every_kind_of_weight_change_refreshes():
    layer = make_layer()
    x = make_input((16, 256), seed=1)
    run(layer, x)

    def in_place_edit(lay):
        with torch.no_grad():
            lay.weight.mul_(0.5)

    def load_state(lay):
        lay.load_state_dict({"weight": torch.randn(128, 256, dtype=torch.bfloat16), "bias": lay.bias.detach().clone()})

    def optimizer_step(lay):
        lay.weight.grad = torch.ones_like(lay.weight)
        torch.optim.SGD([lay.weight], lr=0.01).step()

    def megatron_copy_after_step(lay):  # Megatron copies fp32 main params into the model after a step
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1).step()
        lay.weight.data.copy_(torch.randn(128, 256))

    def replace_parameter(lay):
        lay.weight = torch.nn.Parameter(torch.randn(128, 256, dtype=torch.bfloat16))

    def dtype_change(lay):
        lay.to(torch.float32)

    changes = [in_place_edit, load_state, optimizer_step, megatron_copy_after_step, replace_parameter, dtype_change]
    for change in changes:
        what = change.__name__
        before = run(layer, x.to(layer.weight.dtype))
        change(layer)
        xx = x.to(layer.weight.dtype)
        after = run(layer, xx)
        assert torch.equal(after, fresh_output(layer, xx)), what
        assert not torch.equal(after.float(), before.float()), f"{what}: the change had no effect, the test proves nothing"


def test_writes_through_data_need_an_explicit_refresh():
    """The one change no key can see (documented): a `.data` write outside an optimizer step.
    `invalidate_weight_cache()` and Megatron's `is_first_microbatch` both make it visible."""
    layer = make_layer()
    x = make_input((16, 256), seed=2)
    run(layer, x)
    layer.weight.data.mul_(2.0)
    layer.invalidate_weight_cache()
    assert torch.equal(run(layer, x), fresh_output(layer, x))
    layer.weight.data.mul_(0.25)
    layer.is_first_microbatch = True
    assert torch.equal(run(layer, x), fresh_output(layer, x))
    assert layer.is_first_microbatch is False  # consumed, as TE's modules do
    refreshes = layer._weight_cache.refreshes
    run(layer, x)
    assert layer._weight_cache.refreshes == refreshes  # later microbatches reuse


def test_cache_is_reported_and_never_in_state_dict():
    layer = make_layer()
    assert layer.weight_cache_nbytes == 0
    run(layer, make_input((4, 256)))
    # W and W^T (1 byte per element) + scales in TE's padded layouts: [1, pad4(2)] and [2, pad4(1)]
    assert layer.weight_cache_nbytes == 2 * 128 * 256 + 4 * (1 * 4 + 2 * 4)
    assert set(layer.state_dict()) == {"weight", "bias"}
    clone = copy.deepcopy(layer)
    assert set(clone.state_dict()) == {"weight", "bias"}
    off = Fp8BlockwiseLinear(256, 128, cache_weight=False)
    run(off, make_input((4, 256), dtype=torch.float32))
    assert off.weight_cache_nbytes == 0


def test_under_cuda_graph_capture_the_cache_always_quantizes(monkeypatch):
    # A capture that skipped quantization (cache valid at capture time) would replay a stale copy after
    # every later optimizer step. While capturing, every call quantizes; afterwards the entry made
    # inside the capture is not served by key.
    from primus_fp8_plugin import weight_cache

    layer = make_layer()
    cache = layer._weight_cache
    x = make_input((32, 256), seed=1)
    run(layer, x)
    run(layer, x)
    assert cache.refreshes == 1  # eager: cached
    monkeypatch.setattr(weight_cache, "_capturing", lambda: True)
    run(layer, x)
    run(layer, x)
    assert cache.refreshes == 3  # capturing: quantized each time although the weight did not change
    monkeypatch.setattr(weight_cache, "_capturing", lambda: False)
    with torch.no_grad():
        layer.weight.data.mul_(0.5)  # through .data: no version bump, no optimizer step
    y = run(layer, x)
    assert cache.refreshes == 4  # the capture-time entry is not trusted outside the graph
    assert torch.equal(y, fresh_output(layer, x))
