"""The grouped weight cache keeps the dense cache's guarantees: every kind of change to any one expert's weight
(in-place edit, load_state_dict, an optimizer step, a Megatron-style copy after a step, a replaced parameter,
``.data =``, ``assign=True``, a dtype change, a new tensor at the old one's address) refreshes; later
microbatches reuse; check mode catches what no key sees; copies start empty; a refresh releases the old buffers
before making new ones; and the per-call check costs a fixed number of C-level passes, not per-expert Python."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

from primus_fp8_plugin import Fp8GroupedLinear, GroupedWeightCache
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.recipe import BlockwiseRecipe, TensorRole
from primus_fp8_plugin.weight_cache import StaleWeightCacheError, WeightCache, mark_weights_changed

from .conftest import make_input
from .host_calls import python_calls

E, K, N = 4, 128, 128
COUNTS = [40, 0, 130, 30]


def make_layer(**kw):
    torch.manual_seed(0)
    return Fp8GroupedLinear(E, K, N, bias=False, dtype=torch.bfloat16, backend="reference", **kw)


def run(layer, x):
    with torch.no_grad():
        return layer(x, COUNTS)


def fresh_output(layer, x):
    other = make_layer(cache_weight=False)
    other.to(layer.weight0.dtype)
    other.load_state_dict(layer.state_dict())
    return run(other, x)


def in_place_edit(lay):
    with torch.no_grad():
        lay.weight2.mul_(0.5)


def load_state(lay):
    sd = {k: v.clone() for k, v in lay.state_dict().items()}
    sd["weight2"] = torch.randn(N, K, dtype=torch.bfloat16)
    lay.load_state_dict(sd)


def optimizer_step(lay):
    lay.weight2.grad = torch.ones_like(lay.weight2)
    torch.optim.SGD([lay.weight2], lr=0.05).step()


def megatron_copy_after_step(lay):  # a step of another optimizer, then the model's params written through .data
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1).step()
    lay.weight2.data.copy_(torch.randn(N, K))


def replace_parameter(lay):
    lay.weight2 = nn.Parameter(torch.randn(N, K, dtype=torch.bfloat16))


def assign_data(lay):
    lay.weight2.data = torch.randn(N, K, dtype=torch.bfloat16)


def load_state_assign(lay):
    sd = {k: v.clone() for k, v in lay.state_dict().items()}
    sd["weight2"] = torch.randn(N, K, dtype=torch.bfloat16)
    lay.load_state_dict(sd, assign=True)


def narrow_view(lay):  # .data = another view of the same storage (same pointer and shape, other strides)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    lay.weight2.data = w
    run(lay, make_input((sum(COUNTS), K), seed=9))
    lay.weight2.data = w.t()


def dtype_change(lay):
    lay.to(torch.float32)


CHANGES = [in_place_edit, load_state, optimizer_step, megatron_copy_after_step, replace_parameter, assign_data,
           load_state_assign, narrow_view, dtype_change]  # fmt: skip


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_every_kind_of_change_to_one_expert_refreshes(change):
    layer = make_layer()
    x = make_input((sum(COUNTS), K), seed=1)
    before = run(layer, x)
    run(layer, x)
    assert layer.weight_cache.refreshes == 1
    change(layer)
    xx = x.to(layer.weight0.dtype)
    after = run(layer, xx)
    assert torch.equal(after, fresh_output(layer, xx)), change.__name__
    assert not torch.equal(after.float(), before.float()), f"{change.__name__}: no effect, the test proves nothing"
    refreshes = layer.weight_cache.refreshes
    run(layer, xx)
    assert layer.weight_cache.refreshes == refreshes, "an unchanged weight set is served from the cache"


def test_a_new_weight_at_the_old_ones_address_is_not_served_its_copy():
    """A new tensor per call for one expert, each in the memory the previous one freed, version 0."""
    be, p = get_backend("reference", "cpu"), BlockwiseRecipe().params(TensorRole.WEIGHT)
    cache = GroupedWeightCache()
    torch.manual_seed(3)
    fixed = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(E - 1)]
    addresses = set()
    for i in range(6):
        w = torch.empty(N, K, dtype=torch.bfloat16)
        w.copy_(torch.randn(N, K))  # version 1 for every new tensor
        addresses.add(w.data_ptr())
        got = cache.get([*fixed, w], p, be)
        want = be.quantize_weight(w, p)
        assert torch.equal(got.expert(E - 1).rowwise_data.view(torch.uint8), want.rowwise_data.view(torch.uint8)), i
        del w, got
        gc.collect()
    assert cache.refreshes == 6
    print(f"{len(addresses)} distinct addresses over 6 new weights")


def test_writes_through_data_are_caught_by_check_mode_and_need_an_explicit_refresh():
    layer = make_layer()
    layer.weight_cache.check = True
    x = make_input((sum(COUNTS), K), seed=2)
    run(layer, x)
    run(layer, x)
    assert layer.weight_cache.checks == 1
    layer.weight1.data.mul_(2.0)
    with pytest.raises(StaleWeightCacheError, match="expert 1's weight"):
        run(layer, x)
    layer.invalidate_weight_cache()
    assert torch.equal(run(layer, x), fresh_output(layer, x))
    layer.weight3.data.mul_(0.25)
    mark_weights_changed()
    assert torch.equal(run(layer, x), fresh_output(layer, x))
    layer.weight0.data.mul_(4.0)
    layer.is_first_microbatch = True
    assert torch.equal(run(layer, x), fresh_output(layer, x))


def test_copies_start_empty_and_compute_the_same():
    layer = make_layer()
    x = make_input((sum(COUNTS), K), seed=4)
    y = run(layer, x)
    twin = copy.deepcopy(layer)
    assert twin.weight_cache._value is None and twin.weight_cache_nbytes == 0
    assert torch.equal(run(twin, x), y)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "dense"])
def test_a_refresh_releases_the_old_buffers_before_making_new_ones(grouped):
    """At most one set of copies is alive while the cache re-quantizes (nothing else holds the old), in both of the
    cache's forms (the dense one is the same mechanism over one weight)."""
    import weakref

    be, p = get_backend("reference", "cpu"), BlockwiseRecipe().params(TensorRole.WEIGHT)
    cache = GroupedWeightCache() if grouped else WeightCache()
    ws = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(E)] if grouped else torch.randn(256, 128, dtype=torch.bfloat16)
    old_ref = weakref.ref(cache.get(ws, p, be))
    alive_at_quantize = []
    method = "quantize_weight_grouped" if grouped else "quantize_weight"

    def spy_quantize(self, weights, params):
        alive_at_quantize.append(old_ref() is not None)
        return getattr(be, method)(weights, params)

    spy = type("Spy", (), {"name": be.name, method: spy_quantize})()
    fresh = cache.get(ws, p, spy)  # another backend: a refresh
    assert alive_at_quantize == [False] and cache.refreshes == 2
    assert cache.get(ws, p, spy) is fresh and cache.refreshes == 2


def test_the_check_runs_no_per_expert_python():
    """A served ``get`` makes as many Python calls at 128 experts as at 2 (its passes over the experts are C-level
    ``map``s), where checking each expert with a dense ``WeightCache`` makes Python calls per expert. Counted,
    not timed: the count does not depend on the machine's load."""
    be, p = get_backend("reference", "cpu"), BlockwiseRecipe().params(TensorRole.WEIGHT)
    served = {}
    for e in (2, 128):
        ws = [nn.Parameter(torch.randn(8, 128, dtype=torch.bfloat16)) for _ in range(e)]
        cache = GroupedWeightCache()
        cache.get(ws, p, be)
        served[e] = python_calls(lambda: cache.get(ws, p, be))  # noqa: B023 - called within the iteration
        assert cache.refreshes == 1
        dense = [WeightCache() for _ in ws]
        for c, w in zip(dense, ws):
            c.get(w, p, be)
        per_expert = python_calls(lambda: [c.get(w, p, be) for c, w in zip(dense, ws)])  # noqa: B023
        assert per_expert >= e, (e, per_expert)  # the alternative: at least one Python call per expert
    assert served[2] == served[128], served


def test_a_weight_of_another_shape_is_refused_with_or_without_a_cache():
    """With a cache the per-expert shape and device checks run when it re-quantizes (a served copy implies the
    checked shapes, dtypes and storages); a weight reshaped through ``.data`` is a miss, so it is refused too."""
    from primus_fp8_plugin import fp8_grouped_linear

    torch.manual_seed(7)
    ws = [torch.randn(N, K, dtype=torch.bfloat16) for _ in range(E)]
    x = make_input((sum(COUNTS), K), seed=8)
    bad = [*ws[:2], torch.randn(N + 1, K, dtype=torch.bfloat16), ws[3]]
    for cache in (None, GroupedWeightCache()):
        with pytest.raises(ValueError, match=r"weight 2 is \(129, 128\) on cpu: each expert needs a \[128, 128\] weight"):
            fp8_grouped_linear(x, COUNTS, bad, backend="reference", weight_cache=cache)
    layer = make_layer()
    run(layer, x)
    layer.weight3.data = torch.randn(N, K + 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight 3 is \(128, 256\)"):
        run(layer, x)


def test_stacked_weights_are_one_tracked_tensor():
    """Experts stacked in one ``[E, N, K]`` tensor: served while it is unchanged (the copies of the same weights as
    a list of ``E``), re-made after an in-place write to one expert's slice, and a tensor that is not 3-D is refused."""
    cache, params, ref = GroupedWeightCache(), BlockwiseRecipe().params(TensorRole.WEIGHT), get_backend("reference", "cpu")
    stacked = make_input((E, N, K), seed=9)
    first = cache.get(stacked, params, ref)
    assert cache.get(stacked, params, ref) is first and cache.refreshes == 1
    listed = GroupedWeightCache().get(list(stacked.unbind(0)), params, ref)
    assert torch.equal(first.rowwise_data.view(torch.uint8), listed.rowwise_data.view(torch.uint8))
    with torch.no_grad():
        stacked[2].mul_(0.3)  # not a power of 2: the FP8 data change, not only the scales
    again = cache.get(stacked, params, ref)
    assert again is not first and cache.refreshes == 2
    assert not torch.equal(again.expert(2).rowwise_data.view(torch.uint8), first.expert(2).rowwise_data.view(torch.uint8))
    with pytest.raises(ValueError, match=r"must be one \[E, N, K\] tensor \(E >= 1\) on cpu, got \(128, 128\)"):
        GroupedWeightCache().get(stacked[0], params, ref)


def test_a_grouped_cache_pickles_as_its_own_kind():
    """``GroupedWeightCache`` is the grouped form of ``WeightCache`` and stays one through copies and pickles (layers
    saved whole with ``torch.save`` hold it); a dense form is refused by name."""
    import pickle

    from primus_fp8_plugin import WeightCache

    cache = GroupedWeightCache(keep_transpose=False)
    back = pickle.loads(pickle.dumps(cache))
    assert type(back) is GroupedWeightCache and back.grouped and not back.keep_transpose
    assert isinstance(back, WeightCache) and not WeightCache().grouped
    state = {"check": False, "keep_transpose": True}  # a pickle's state from before the two were one class
    old = GroupedWeightCache.__new__(GroupedWeightCache)
    old.__setstate__(state)
    assert old.grouped
    with pytest.raises(ValueError, match="use WeightCache for one weight"):
        GroupedWeightCache(grouped=False)
