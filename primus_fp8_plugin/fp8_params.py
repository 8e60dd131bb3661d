"""FP8 primary weights: while a model runs forward and backward it holds each FP8 linear's weight as its 128x128
FP8 W only (data and scales: about 1 byte per element), with no BF16 copy and no W^T (made for each dgrad from W's
blocks, ``Backend.transpose_weight``, and freed after it).

Who holds what
--------------
* The optimizer's FP32 masters are the weights' source of truth. Supported: Megatron-core's optimizers, which keep
  them and write bf16(master) into the model's parameters at every step (the mixed-precision optimizer and the
  distributed optimizer). A plain ``torch.optim`` optimizer updates the parameter it holds and has no master: it is
  refused (NotImplementedError at its first step on such a parameter).
* Each FP8 layer's weight cache holds the FP8 W as the weight's primary form (``WeightCache.own``). The
  ``nn.Parameter`` stays the autograd leaf and the optimizer's handle (shape, dtype, ``main_grad``, hooks,
  checkpoint keys); between ``release()`` and ``restore()`` its data is a two-byte NaN placeholder.

A training step (``Fp8Params``, called by the training loop)
------------------------------------------------------------
::

    release()            FP8 W = Q(bf16 weight) for every layer (the bits the weight cache of a BF16-weight run
                         makes), then the bf16 storage is freed
    forward, backward    on the FP8 weights (W^T made per dgrad)
    restore()            the bf16 storage back, NaN until written; the held FP8 copies dropped
    optimizer.step()     writes bf16(master) into it (the distributed optimizer: its shard, then its all-gather)
    [evaluate, save]     the bf16 weights are there: bf16(master), what a BF16-weight run evaluates and saves

Every rank quantizes the complete bf16(master) weight (after the distributed optimizer's all-gather), so each
128x128 block's amax is the block's whole amax on every data-parallel rank: TE's rule, Q(bf16(master)) with the
amax agreed across the group, and the run is bit-identical to the same run with BF16 weights and the weight cache.
Checkpoints are that run's (FP32 masters in the optimizer state, bf16(master) as the model's weights) and move
between the two modes both ways.

Storage
-------
A weight with a storage of its own (Megatron's mixed-precision optimizer) gets the placeholder as its data. Under
Megatron's distributed optimizer every parameter is a view of a data-parallel param buffer (``shared_storages``;
``megatron/fp8_params.py`` finds them): ``release()`` frees the whole buffer (``storage.resize_(0)``, as Megatron's
own offloading does), the other parameters in it (norms, biases, embeddings) keeping private copies, which
``restore()`` puts back.

Not done: the parameter all-gather of the distributed optimizer stays Megatron's, in bf16 (2 bytes a parameter,
not 1). Megatron-core's DDP sizes its param buffer by ``param.dtype`` for every parameter that is not a Transformer
Engine ``QuantizedTensor``, and its distributed optimizer quantizes master shards (``quantize_param_shard``) only
for those; no hook lets another parameter type be gathered as FP8 without patching Megatron.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .modules import HoldsWeightCache

PRIMARY = "fp8_primary_weight"
"""Attribute set (True) on a parameter whose FP8 W a weight cache holds as its primary form under ``Fp8Params``."""

_marked = 0  # parameters ever marked PRIMARY in this process: the optimizer guard looks only when there are some


def _refuse_torch_optimizers(optimizer, args, kwargs) -> None:
    if not _marked:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, PRIMARY, False):
                raise NotImplementedError(
                    f"{type(optimizer).__name__} steps a parameter whose FP8 W is its primary form (fp8_params.Fp8Params): "
                    "a torch.optim optimizer updates the parameter it holds and keeps no FP32 master, so it would "
                    "update values that are not there. FP8 primary weights need an optimizer with FP32 masters that "
                    "writes bf16(master) into the parameters (Megatron-core's mixed-precision or distributed "
                    "optimizer); without Fp8Params the plugin's layers train with BF16 weights and the weight cache"
                )


register_optimizer_step_pre_hook(_refuse_torch_optimizers)


_NAN: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(p: torch.Tensor) -> torch.Tensor:
    """A parameter's data while its FP8 W is its primary form: its shape and dtype over one NaN element (any read
    of it gives NaN, not plausible values). Parameters of more than one element share one NaN per dtype and device
    (no allocation or fill kernel per parameter and step; a write into an expanded view is refused by torch)."""
    if p.numel() <= 1:  # a view of one element is writable: its own NaN
        return torch.full((), float("nan"), dtype=p.dtype, device=p.device).expand(p.shape)
    key = (p.dtype, p.device)
    nan = _NAN.get(key)
    if nan is None:
        nan = _NAN[key] = torch.full((), float("nan"), dtype=p.dtype, device=p.device)
    return nan.expand(p.shape)


def fp8_layers(model: nn.Module) -> list[HoldsWeightCache]:
    """The plugin's FP8 layers of ``model`` (their weight caches hold the FP8 weights)."""
    return [m for m in model.modules() if isinstance(m, HoldsWeightCache)]


def weights_of(layer: HoldsWeightCache) -> list[torch.Tensor]:
    weights = layer.fp8_weight_source()[0]
    return list(weights) if isinstance(weights, list) else [weights]


def owns_storage(p: torch.Tensor) -> bool:
    """Whether ``p``'s data is its storage's only content (so replacing the data frees it)."""
    return p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size()


class SharedStorage:
    """A flat buffer whose views are parameters (Megatron's param buffer): freed and re-made as a whole."""

    def __init__(self, flat: torch.Tensor, params: Sequence[nn.Parameter], primary: set[int]) -> None:
        self.storage = flat.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.views = [(p, p.data) for p in params]  # each parameter with its view of the buffer
        self.primary = primary  # ids of the parameters whose FP8 W is their primary form
        self.private: dict[int, torch.Tensor] = {}

    def release(self) -> None:
        for p, _ in self.views:
            if id(p) in self.primary:
                p.data = placeholder(p)
            else:
                self.private[id(p)] = p.data = p.data.clone()
        self.storage.resize_(0)

    def restore(self) -> None:
        self.storage.resize_(self.nbytes)
        for p, view in self.views:
            if id(p) in self.primary:
                view.fill_(float("nan"))  # written by the optimizer step
            else:
                view.copy_(self.private.pop(id(p)))
            p.data = view


class Fp8Params:
    """FP8 primary weights for every trainable FP8 layer weight of ``model`` (module docstring).

    Args:
        model: the model (a Megatron DDP wrapper or its module); its layers' weight caches are switched to W only.
        shared_storages: ``(flat buffer, its parameters)`` pairs where parameters are views of a shared buffer
            (``megatron.fp8_params.ddp_param_buffers``); every other FP8 weight must own its storage.

    Raises:
        ValueError: no FP8 layer with a weight cache; an FP8 weight that is a view of a storage not given.
    """

    def __init__(self, model: nn.Module, *, shared_storages: Sequence[tuple[torch.Tensor, Sequence[nn.Parameter]]] = ()):
        global _marked
        layers = fp8_layers(model)
        if not layers:
            raise ValueError("FP8 primary weights: the model holds none of the plugin's FP8 layers")
        if any(layer.weight_cache is None for layer in layers):
            raise ValueError("FP8 primary weights live in the layers' weight caches: build every FP8 layer with its "
                             "weight cache (cache_weight=True)")  # fmt: skip
        # frozen weights stay bf16 (no optimizer writes them); empty ones compute without FP8 (ops/api.py)
        self.layers = [layer for layer in layers if all(w.requires_grad and w.numel() for w in weights_of(layer))]
        self.weights = [w for layer in self.layers for w in weights_of(layer)]
        primary = {id(w) for w in self.weights}
        self.shared = [SharedStorage(flat, params, primary) for flat, params in shared_storages]
        in_shared = {id(p) for group in self.shared for p, _ in group.views}
        self.own = [w for w in self.weights if id(w) not in in_shared]
        for w in self.own:
            if not owns_storage(w):
                raise ValueError(f"an FP8 weight {tuple(w.shape)} is a view of a larger storage: pass that storage's "
                                 "buffer as shared_storages (megatron.fp8_params.attach does for Megatron's DDP)")  # fmt: skip
        for layer in self.layers:
            layer.weight_cache.keep_transpose = False
            layer.weight_cache.invalidate()
        for w in self.weights:
            setattr(w, PRIMARY, True)
        _marked += len(self.weights)
        self.released = False

    def release(self) -> None:
        """Hold every FP8 weight as its FP8 W (quantized from the bf16 weight now) and free the bf16 storage."""
        if self.released:
            return
        for layer in self.layers:
            layer.hold_weights()
        for w in self.own:
            w.data = placeholder(w)
        for group in self.shared:
            group.release()
        self.released = True

    def restore(self) -> None:
        """Give the weights bf16 storage again (NaN until the optimizer writes bf16(master)) and drop the FP8 copies."""
        if not self.released:
            return
        for layer in self.layers:
            layer.weight_cache.disown()
        for w in self.own:
            w.data = torch.full(w.shape, float("nan"), dtype=w.dtype, device=w.device)
        for group in self.shared:
            group.restore()
        self.released = False

    def fp8_bytes(self) -> int:
        """Bytes of the FP8 weights held now (W and scales; 0 before ``release``)."""
        return sum(layer.weight_cache.nbytes for layer in self.layers) if self.released else 0


def param_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters hold now: each parameter's elements in its dtype, but the weights a layer's cache
    holds as their FP8 primary form count the bytes of that FP8 W and its scales instead."""
    held, fp8 = set(), 0
    for layer in fp8_layers(model):
        if layer.weight_cache is not None and layer.weight_cache.held:
            held.update(map(id, weights_of(layer)))
            fp8 += layer.weight_cache.nbytes
    return fp8 + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in held)
