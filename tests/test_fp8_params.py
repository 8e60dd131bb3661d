"""FP8 primary weights on the plugin's own modules (``Fp8BlockwiseLinear``, ``Fp8GroupedLinear``), without Megatron:
held weights compute what the weight cache computes, bit for bit, with their bf16 data gone; a shared storage is
freed and put back whole; what would lose a held weight is refused; a plain torch optimizer is refused. (Under
Megatron's DDP and optimizers: tests/megatron/test_fp8_params_megatron.py; the trainer: test_train_fp8_params.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from primus_fp8_plugin import BlockwiseRecipe, Fp8BlockwiseLinear, Fp8GroupedLinear, TensorRole, get_backend
from primus_fp8_plugin import weight_cache as wc
from primus_fp8_plugin.fp8_params import PRIMARY, Fp8Params, param_bytes
from primus_fp8_plugin.weight_cache import HeldWeightError

from .conftest import make_input

COUNTS = [50, 0, 80]


class Model(nn.Module):
    """A dense FP8 linear (rows not a multiple of 128), three grouped experts, and a bf16 parameter of its own."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.dense = Fp8BlockwiseLinear(200, 136, dtype=torch.bfloat16, backend="reference")
        self.experts = Fp8GroupedLinear(3, 136, 72, dtype=torch.bfloat16, backend="reference")
        self.scale = nn.Parameter(torch.full((72,), 0.5, dtype=torch.bfloat16))

    def forward(self, x):
        return self.experts(self.dense(x), COUNTS) * self.scale


def step(model: Model, seed: int = 1):
    """A forward and backward on a fixed batch: the output and every gradient (the FP8 weights' too)."""
    x = make_input((sum(COUNTS), 200), seed=seed).requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    y = model(x)
    y.backward(make_input(tuple(y.shape), seed=seed + 1))
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_held_weights_compute_what_the_cache_computes_without_their_bf16_data():
    y_ref, dx_ref, grads_ref = step(Model())
    model = Model()
    primary = Fp8Params(model)
    primary.release()
    assert all(getattr(w, PRIMARY) and w.untyped_storage().nbytes() == 2 for w in primary.weights)
    assert torch.isnan(model.dense.weight).all()  # any read of the released bf16 data shows
    assert not model.dense.weight_cache.keep_transpose and model.dense.weight_cache.held
    for _ in range(2):  # the held W serves every microbatch; W^T is made for each dgrad
        y, dx, grads = step(model)
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
        assert grads.keys() == grads_ref.keys() and all(torch.equal(grads[n], g) for n, g in grads_ref.items())
    assert model.scale.untyped_storage().nbytes() == 72 * 2  # not an FP8 weight: untouched


def test_released_weights_share_one_nan_that_no_write_can_reach():
    """Every released weight (more than one element) is a view of one NaN per dtype and device: no allocation or
    fill per parameter and step; writing into it is refused, so no weight's placeholder can turn plausible."""
    from primus_fp8_plugin.fp8_params import placeholder

    model = Model()
    primary = Fp8Params(model)
    primary.release()
    ptrs = {w.data_ptr() for w in primary.weights}
    assert len(primary.weights) > 1 and len(ptrs) == 1
    with pytest.raises(RuntimeError, match="single memory location"):
        model.dense.weight.data.copy_(torch.zeros_like(model.dense.weight))
    assert all(torch.isnan(w).all() for w in primary.weights)
    one = torch.zeros(1, dtype=torch.bfloat16)
    assert placeholder(one).data_ptr() not in ptrs and torch.isnan(placeholder(one)).all()  # writable: its own


def test_restore_gives_nan_storage_until_written_then_the_next_release_quantizes_it():
    model, ref = Model(), Model(seed=5)
    primary = Fp8Params(model)
    primary.release()
    primary.restore()
    assert not model.dense.weight_cache.held and model.dense.weight_cache.nbytes == 0  # the FP8 copies dropped
    assert model.dense.weight.untyped_storage().nbytes() == 200 * 136 * 2 and torch.isnan(model.dense.weight).all()
    with torch.no_grad():  # what an optimizer step writes: here another model's weights
        for mine, theirs in zip(model.parameters(), ref.parameters()):
            mine.copy_(theirs)
    primary.release()
    y, _, _ = step(model)
    assert torch.equal(y, step(ref)[0])


def test_param_bytes_count_the_held_fp8_w_and_scales():
    model = Model()
    bf16 = param_bytes(model)
    assert bf16 == 2 * sum(p.numel() for p in model.parameters())
    primary = Fp8Params(model)
    primary.release()
    # dense [136, 200]: 2 x 2 blocks of scales (pad4 -> 2 x 4); experts [72, 136]: 1 x 2 blocks each (-> 1 x 4)
    fp8 = 136 * 200 + 4 * 2 * 4 + 3 * (72 * 136 + 4 * 1 * 4)
    assert primary.fp8_bytes() == fp8
    assert param_bytes(model) == bf16 - 2 * (136 * 200 + 3 * 72 * 136) + fp8


def test_a_shared_storage_is_freed_and_put_back_whole():
    """Parameters that are views of one flat buffer (as under Megatron's distributed optimizer): ``release`` frees
    the buffer, the other parameters in it keep their values in private copies, ``restore`` puts them back."""
    model = Model()
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.bfloat16)
    offset = 0
    for p in params:
        view = flat[offset : offset + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
        offset += p.numel()
    y_ref = step(Model())[0]
    with pytest.raises(ValueError, match="view of a larger storage"):
        Fp8Params(model)
    primary = Fp8Params(model, shared_storages=[(flat, params)])
    primary.release()
    assert flat.untyped_storage().nbytes() == 0
    assert torch.equal(model.scale, torch.full((72,), 0.5, dtype=torch.bfloat16))
    assert torch.equal(step(model)[0], y_ref)
    primary.restore()
    assert flat.untyped_storage().nbytes() == flat.numel() * 2
    assert params[0] is model.scale  # a module's own parameters come first
    assert model.scale.data_ptr() == flat.data_ptr() and torch.equal(flat[:72], torch.full((72,), 0.5).bfloat16())
    assert torch.isnan(model.dense.weight).all() and model.dense.weight.data_ptr() == flat[72:].data_ptr()


def test_what_would_lose_a_held_weight_is_refused():
    model = Model()
    primary = Fp8Params(model)
    primary.release()
    with pytest.raises(HeldWeightError, match="restore them first"):
        model.to(torch.float32)
    with pytest.raises(HeldWeightError, match="restore them first"):
        model.dense.invalidate_weight_cache()
    with pytest.raises(HeldWeightError, match="copy or pickle"):
        copy.deepcopy(model)
    params, backend = BlockwiseRecipe().params(TensorRole.WEIGHT), get_backend("reference")
    with pytest.raises(HeldWeightError, match="other weights"):
        model.dense.weight_cache.get(torch.zeros(136, 200, dtype=torch.bfloat16), params, backend)
    with pytest.raises(HeldWeightError, match="not .* on 'triton'"):
        model.dense.weight_cache.get(model.dense.weight, params, get_backend("triton", "cpu"))
    primary.restore()
    copy.deepcopy(model)  # fine again


def test_a_plain_torch_optimizer_is_refused():
    model = Model()
    Fp8Params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model)
    with pytest.raises(NotImplementedError, match="keeps no FP32 master"):
        opt.step()
    fine = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    fine.step()  # optimizers that hold no such parameter are left alone


def test_frozen_and_empty_weights_stay_bf16_and_layers_without_a_cache_are_refused():
    model = Model()
    model.experts.requires_grad_(False)
    primary = Fp8Params(model)
    assert primary.layers == [model.dense]
    primary.release()
    assert model.experts.weight0.untyped_storage().nbytes() == 72 * 136 * 2
    empty = nn.Sequential(Fp8BlockwiseLinear(128, 0), Fp8BlockwiseLinear(128, 128))
    assert Fp8Params(empty).layers == [empty[1]]  # a layer without outputs computes without FP8
    uncached = nn.Sequential(Fp8BlockwiseLinear(128, 128, cache_weight=False))
    with pytest.raises(ValueError, match="cache_weight=True"):
        Fp8Params(uncached)
    with pytest.raises(ValueError, match="none of the plugin's FP8 layers"):
        Fp8Params(nn.Linear(4, 4))


def test_a_held_weight_is_not_captured_into_a_cuda_graph(monkeypatch):
    model = Model()
    primary = Fp8Params(model)
    primary.release()
    monkeypatch.setattr(wc, "capturing", lambda: True)
    with pytest.raises(HeldWeightError, match="CUDA graph"):
        step(model)
