"""The weight cache: reused across microbatches and by backward, refreshed by every kind of weight
change, never stale, never in a state dict; never serving one tensor's copy for another (a new tensor
at the freed address of the old one, a transposed view, a replaced parameter or storage); the writes
it cannot see caught by check mode."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from primus_fp8_plugin import Fp8BlockwiseLinear, WeightCache, fp8_blockwise_linear

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
    cache = layer.weight_cache
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
    refreshes = layer.weight_cache.refreshes
    run(layer, x)
    assert layer.weight_cache.refreshes == refreshes  # later microbatches reuse


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
    cache = layer.weight_cache
    x = make_input((32, 256), seed=1)
    run(layer, x)
    run(layer, x)
    assert cache.refreshes == 1  # eager: cached
    monkeypatch.setattr(weight_cache, "capturing", lambda: True)
    run(layer, x)
    run(layer, x)
    assert cache.refreshes == 3  # capturing: quantized each time although the weight did not change
    monkeypatch.setattr(weight_cache, "capturing", lambda: False)
    with torch.no_grad():
        layer.weight.data.mul_(0.5)  # through .data: no version bump, no optimizer step
    y = run(layer, x)
    assert cache.refreshes == 4  # the capture-time entry is not trusted outside the graph
    assert torch.equal(y, fresh_output(layer, x))


# ---- one tensor's copy is never served for another ------------------------------------------------


class SameAddress:
    """New tensors that all live at one address, each with a storage object of its own and version 0:
    what a caching allocator hands out when the freed block of the last weight is reused for the next
    one (as CUDA's allocator does; the CPU's seldom does it by itself, so tests make it happen)."""

    def __init__(self, shape, dtype=torch.bfloat16):
        self.shape, self.dtype = tuple(shape), dtype
        self.buf = bytearray(math.prod(shape) * dtype.itemsize)

    def new(self, values: torch.Tensor) -> torch.Tensor:
        torch.frombuffer(self.buf, dtype=self.dtype).copy_(values.detach().reshape(-1))
        return torch.frombuffer(self.buf, dtype=self.dtype).view(self.shape)


def uncached(x, w, b=None):
    with torch.no_grad():
        return fp8_blockwise_linear(x, w.detach(), None if b is None else b.detach(), backend="reference")


def random_weights(count, shape=(128, 256), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(count)]


def assert_none_stale(pairs):
    """Every (got, expected) forward equal; the expected outputs differ from each other (so a stale
    copy would show)."""
    stale = sum(not torch.equal(got, want) for got, want in pairs)
    assert stale == 0, f"stale forwards: {stale} of {len(pairs)}"
    assert len({want.float().sum().item() for _, want in pairs}) == len(pairs), "the weights did not change"


def test_a_new_weight_at_the_old_ones_address_is_not_served_its_copy():
    """The functional API with one WeightCache and a new weight per call (each at the same address,
    version 0)."""
    pool, cache, x = SameAddress((128, 256)), WeightCache(), make_input((32, 256), seed=1)
    outs = []
    for values in random_weights(8):
        w = pool.new(values)
        with torch.no_grad():
            outs.append((fp8_blockwise_linear(x, w, backend="reference", weight_cache=cache), uncached(x, values)))
        del w
    assert_none_stale(outs)
    assert cache.refreshes == 8


def test_a_transposed_view_is_not_served_the_weights_copy():
    """``functional_call(L, {"weight": L.weight.t()})`` on a square layer: same storage, same address,
    other strides."""
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(256, 256, bias=False, dtype=torch.bfloat16, backend="reference")
    x = make_input((32, 256), seed=2)
    with torch.no_grad():
        plain = layer(x)
        flipped = torch.func.functional_call(layer, {"weight": layer.weight.t()}, (x,))
        again = layer(x)
    assert torch.equal(flipped, uncached(x, layer.weight.t().contiguous()))
    assert not torch.equal(flipped, plain)
    assert torch.equal(again, plain)


@pytest.mark.parametrize("how", ["parameter", "data", "load_state_dict_assign"])
def test_a_replaced_weight_or_storage_is_not_served_the_old_copy(how):
    """``layer.weight = nn.Parameter(new)``, ``layer.weight.data = new`` and
    ``load_state_dict(sd, assign=True)``, twice between forwards, the new tensors at the old address."""
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")
    pool, x = SameAddress((128, 256)), make_input((32, 256), seed=3)
    bias = layer.bias.detach().clone()
    values = random_weights(20, seed=4)
    outs = []
    for first, second in zip(values[::2], values[1::2]):
        for v in (first, second):
            w = pool.new(v)
            if how == "parameter":
                layer.weight = nn.Parameter(w)
            elif how == "data":
                layer.weight.data = w
            else:
                layer.load_state_dict({"weight": w, "bias": bias}, assign=True)
            del w
        with torch.no_grad():
            outs.append((layer(x), uncached(x, second, layer.bias)))
    assert_none_stale(outs)


class _WeightNormInPool(nn.Module):
    """Weight normalisation ``g * v / ||v||`` (per output row) whose result lands at one address on
    every evaluation, as the allocator places torch's own weight_norm's result."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool

    def forward(self, g, v):  # torch's weight_norm's order (original0 = g, original1 = v)
        return self.pool.new(torch._weight_norm(v, g, 0))

    def right_inverse(self, w):
        return torch.norm_except_dim(w, 2, 0), w


def test_a_weight_normed_layer_evaluating_checkpoints_uses_each_checkpoint():
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")
    parametrize.register_parametrization(layer, "weight", _WeightNormInPool(SameAddress((128, 256))), unsafe=True)
    ref = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference", cache_weight=False)
    torch.nn.utils.parametrizations.weight_norm(ref)
    x = make_input((32, 256), seed=5)
    outs = []
    for seed in range(4):
        g = torch.Generator().manual_seed(100 + seed)
        sd = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in layer.state_dict().items()}
        layer.load_state_dict(sd)
        ref.load_state_dict(sd)
        with torch.no_grad():
            outs.append((layer(x), ref(x)))
    assert_none_stale(outs)


def test_a_parametrized_weight_sees_in_place_edits_of_the_original():
    torch.manual_seed(0)
    layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")
    parametrize.register_parametrization(layer, "weight", _WeightNormInPool(SameAddress((128, 256))), unsafe=True)
    x = make_input((32, 256), seed=6)
    outs = []
    for step in range(8):
        with torch.no_grad():
            layer.parametrizations.weight.original0.mul_(1.5 if step % 2 else -0.75)
            layer.parametrizations.weight.original1.add_(0.25)
            outs.append((layer(x), uncached(x, layer.weight, layer.bias)))
    assert_none_stale(outs)


def test_copies_and_pickles_of_a_cached_layer_start_empty_and_compute_the_same():
    import gc
    import pickle

    layer = make_layer()
    x = make_input((16, 256), seed=7)
    y = run(layer, x)
    copies = [copy.deepcopy(layer), copy.copy(layer), pickle.loads(pickle.dumps(layer))]
    for other in copies:
        assert other.weight_cache_nbytes == 0 or other.weight_cache is layer.weight_cache
        assert torch.equal(run(other, x), y)
    del copies, other
    gc.collect()  # each cache's storage weak reference is released once
    assert torch.equal(run(layer, x), y)


def test_mark_weights_changed_refreshes_every_cache():
    from primus_fp8_plugin.weight_cache import mark_weights_changed

    layers = [make_layer(), make_layer()]
    x = make_input((16, 256), seed=9)
    for lay in layers:
        run(lay, x)
        lay.weight.data.mul_(-1.0)  # unseen
    mark_weights_changed()
    for lay in layers:
        assert torch.equal(run(lay, x), fresh_output(lay, x))


# ---- writes no key can see: documented, and caught by check mode ---------------------------------


def _alias(t: torch.Tensor) -> torch.Tensor:
    """Another tensor over ``t``'s storage, with a version counter of its own."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


UNSEEN_WRITES = {
    "data_add": lambda w: w.data.add_(torch.randn_like(w)),  # the textbook SGD loop's update
    "ema_swap": lambda w: w.data.copy_(torch.randn_like(w)),  # evaluating EMA weights
    "shared_storage": lambda w: _alias(w).mul_(-2.0),  # parameters tied through .data, buffers, views
}


@pytest.mark.parametrize("write", list(UNSEEN_WRITES))
def test_writes_that_bypass_the_version_counter_are_caught_by_check_mode(write):
    from primus_fp8_plugin.weight_cache import StaleWeightCacheError

    x = make_input((16, 256), seed=8)
    for check in (False, True):
        torch.manual_seed(0)
        layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")
        layer.weight_cache.check = check
        run(layer, x)
        UNSEEN_WRITES[write](layer.weight)
        if not check:  # the documented limit: served stale
            assert not torch.equal(run(layer, x), fresh_output(layer, x))
            continue
        with pytest.raises(StaleWeightCacheError, match=r"stale FP8 copy of a torch.bfloat16 weight \[128, 256\]"):
            run(layer, x)
        layer.invalidate_weight_cache()  # what the message says to do
        assert torch.equal(run(layer, x), fresh_output(layer, x))
        assert torch.equal(run(layer, x), fresh_output(layer, x))  # a checked hit
        assert layer.weight_cache.checks == 2


def test_check_mode_follows_the_environment(monkeypatch):
    from primus_fp8_plugin.weight_cache import CHECK_ENV

    monkeypatch.delenv(CHECK_ENV, raising=False)
    assert WeightCache().check is False and WeightCache(check=True).check is True
    monkeypatch.setenv(CHECK_ENV, "1")
    assert WeightCache().check is True and WeightCache(check=False).check is False
    assert make_layer().weight_cache.check is True
    monkeypatch.setenv(CHECK_ENV, "0")
    assert WeightCache().check is False


def _broadcast_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank 1's layer, cached, receives rank 0's weight by ``dist.broadcast``, which bumps no version
    counter: served stale without check mode, caught with it."""
    import os

    import torch.distributed as dist

    from primus_fp8_plugin.weight_cache import StaleWeightCacheError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(rank)  # different weights on the two ranks
    x = make_input((16, 256), seed=11)
    result = {}
    for check in (False, True):
        layer = Fp8BlockwiseLinear(256, 128, dtype=torch.bfloat16, backend="reference")
        layer.weight_cache.check = check
        run(layer, x)
        with torch.no_grad():
            dist.broadcast(layer.weight, 0)
        try:
            result[check] = "fresh" if torch.equal(run(layer, x), fresh_output(layer, x)) else "stale"
        except StaleWeightCacheError:
            result[check] = "raised"
            layer.invalidate_weight_cache()
            result["after_invalidate"] = "fresh" if torch.equal(run(layer, x), fresh_output(layer, x)) else "stale"
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_collective_writing_the_weight_is_caught_by_check_mode(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_broadcast_worker, args=(port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    on_rank1 = torch.load(tmp_path / "rank1.pt")
    assert on_rank1 == {False: "stale", True: "raised", "after_invalidate": "fresh"}, on_rank1
    assert torch.load(tmp_path / "rank0.pt") == {False: "fresh", True: "fresh"}  # the sender's weight is unchanged

