"""The weight cache: a weight's quantized copies (W for fprop, W^T for dgrad, with scales), made by
one pass over the weight and reused until the weight changes.

Training reads each weight once per microbatch in forward and once in backward, but changes it once
per optimizer step: quantizing it once per step instead of twice per microbatch saves a full pass
over every weight per use.

What a cache serves
-------------------
``get(weight, params, backend)`` returns the stored copy only if all of these are what they were
when the copy was made; otherwise it quantizes ``weight`` again:

* **the tensor object itself** (held by a weak reference: a new tensor never matches, even one at
  the freed address of the old one with the same version number);
* **its storage object** (a weak reference to the storage keeps the storage's identity from being
  handed to another storage while the cache holds it), data pointer, storage offset, strides,
  shape, dtype and device (``w.data = new``, ``.to()``, a transposed view);
* **its version counter**, which torch bumps on every in-place write through the tensor or a view
  sharing its counter: optimizer updates, ``load_state_dict``'s ``copy_``, ``w.mul_(...)`` under
  ``no_grad``;
* the quantization parameters and the backend;
* a process-wide **weight epoch**, advanced after every ``torch.optim.Optimizer.step`` of any
  optimizer (a global post-hook; Megatron's optimizers step such an inner optimizer and then copy
  their fp32 main params into the model's params through ``.data``, which the version counter does
  not see) and by :func:`mark_weights_changed`;

and ``refresh=True`` (a module's ``is_first_microbatch``, which Megatron sets on the first
microbatch of each step) always makes a new copy.

What it cannot see
------------------
A write to the weight's memory that bypasses the weight's version counter *outside* an optimizer
step: through ``.data`` (``w.data.add_(...)``, ``w.data.copy_(ema)``), through another tensor over
the same storage with a counter of its own (``.data`` views, ``torch.frombuffer``/``from_numpy``
aliases, parameters tied through ``.data``), or by a collective or kernel writing the memory
(``dist.broadcast(w, 0)``, ``dist.all_reduce(w.data)``). After such a write call ``invalidate()``
(``Fp8BlockwiseLinear.invalidate_weight_cache()``) or :func:`mark_weights_changed`.
``PRIMUS_FP8_CHECK_WEIGHT_CACHE=1`` (or ``WeightCache(check=True)``) re-quantizes the weight on every
use and raises :class:`StaleWeightCacheError` where the stored copy differs: a debug mode, at the
cost of a full quantization per call.

Where no key can be checked
---------------------------
* Inference tensors (made under ``torch.inference_mode()``) have no version counter: inside
  inference mode, where they can be written in place untracked, they are quantized on every call;
  outside it, where no in-place write to them is allowed, they are cached on the other keys.
* Under CUDA-graph capture the host-side key check would be frozen into the graph: a graph captured
  while the cache was valid would replay without quantizing and read the copy of the capture step
  after every later optimizer step. So while the current stream is capturing, ``get`` always
  quantizes (the graph re-quantizes on every replay, correct for any weight values), and the entry
  it makes is not trusted afterwards outside the graph.
* Under ``torch.compile`` tracing ``get`` quantizes without caching (the FP8 linear itself runs
  outside compiled graphs, ``linear.py``, so this applies only to direct calls being traced).
"""

from __future__ import annotations

import itertools
import os
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from .backends import Backend
from .recipe import QuantParams
from .tensor import BlockwiseFp8Tensor

CHECK_ENV = "PRIMUS_FP8_CHECK_WEIGHT_CACHE"
"""Set to 1 to compare every copy a cache serves with a fresh quantization (read when a cache is made)."""

_epochs = itertools.count(1)
_weight_epoch = 0


def mark_weights_changed() -> None:
    """Declare that weights may have changed in ways no version counter saw: every weight cache in
    the process re-quantizes on its next use. Runs after every ``torch.optim`` optimizer step."""
    global _weight_epoch
    _weight_epoch = next(_epochs)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    mark_weights_changed()


register_optimizer_step_post_hook(_after_optimizer_step)


def weight_epoch() -> int:
    """How many times weights were declared changed (optimizer steps and ``mark_weights_changed``)."""
    return _weight_epoch


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class StaleWeightCacheError(RuntimeError):
    """A weight cache in check mode found its stored copy different from a fresh quantization."""


def _same_bits(a: BlockwiseFp8Tensor, b: BlockwiseFp8Tensor) -> bool:
    """Whether two quantized weights hold the same bits (NaN scales compare equal to NaN)."""
    pairs = (
        (a.rowwise_data, b.rowwise_data),
        (a.rowwise_scale_inv, b.rowwise_scale_inv),
        (a.columnwise_data, b.columnwise_data),
        (a.columnwise_scale_inv, b.columnwise_scale_inv),
    )
    for x, y in pairs:
        if (x is None) != (y is None):
            return False
        if x is not None and not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return False
    return True


class WeightCache:
    """Quantized copies of one weight (W and W^T), served while the weight is provably unchanged.

    Args:
        check: compare every served copy with a fresh quantization and raise
            ``StaleWeightCacheError`` on a difference (a debug mode). None (the default) reads
            ``PRIMUS_FP8_CHECK_WEIGHT_CACHE`` (``1`` turns it on) when the cache is made.

    Attributes:
        refreshes: how many times the weight was quantized through this cache.
        checks: how many served copies check mode compared.
    """

    def __init__(self, *, check: bool | None = None) -> None:
        self._value: BlockwiseFp8Tensor | None = None
        self._tensor_ref: weakref.ref | None = None
        self._storage_ref: StorageWeakRef | None = None
        self._key: tuple | None = None
        self.check = os.environ.get(CHECK_ENV, "0") == "1" if check is None else bool(check)
        self.refreshes = 0
        self.checks = 0

    @staticmethod
    def _key_of(weight: torch.Tensor, version: int, params: QuantParams, backend: Backend) -> tuple:
        return (
            version,
            _weight_epoch,
            weight.data_ptr(),
            weight.storage_offset(),
            weight.stride(),
            weight.shape,
            weight.dtype,
            weight.device,
            params,
            backend,
        )

    def _holds(self, weight: torch.Tensor, key: tuple) -> bool:
        ref = self._tensor_ref
        return (
            ref is not None
            and ref() is weight
            and key == self._key
            and weight.untyped_storage()._cdata == self._storage_ref.cdata
        )

    def get(self, weight: torch.Tensor, params: QuantParams, backend: Backend, *, refresh: bool = False) -> BlockwiseFp8Tensor:
        """The quantized copies of ``weight`` [N, K] (W and W^T), re-made unless provably unchanged."""
        untracked = False
        if weight.is_inference():
            # no version counter; inside inference mode such tensors can be written in place untracked
            untracked = torch.is_inference_mode_enabled()
            version = -1
        else:
            version = weight._version
        if untracked or _capturing() or torch.compiler.is_compiling():
            self.refreshes += 1
            value = self._quantize(weight, params, backend)
            self.invalidate()  # an entry made here is never served by key (see the module docstring)
            self._value = value
            return value
        key = self._key_of(weight, version, params, backend)
        if not refresh and self._holds(weight, key):
            if self.check:
                self._check(weight, params, backend)
            return self._value
        self._value = self._quantize(weight, params, backend)
        self._tensor_ref = weakref.ref(weight)
        self._storage_ref = StorageWeakRef(weight.untyped_storage())
        self._key = key
        self.refreshes += 1
        return self._value

    @staticmethod
    def _quantize(weight: torch.Tensor, params: QuantParams, backend: Backend) -> BlockwiseFp8Tensor:
        with torch.no_grad():
            return backend.quantize_weight(weight.detach().contiguous(), params)

    def _check(self, weight: torch.Tensor, params: QuantParams, backend: Backend) -> None:
        self.checks += 1
        if not _same_bits(self._quantize(weight, params, backend), self._value):
            raise StaleWeightCacheError(
                f"the weight cache was about to serve a stale FP8 copy of a {weight.dtype} weight "
                f"{list(weight.shape)} on {weight.device}: the weight's values changed without a version-counter "
                "bump (a write through .data, through another tensor sharing its storage, or by a collective) "
                "and outside an optimizer step. After such a write call invalidate() "
                "(Fp8BlockwiseLinear.invalidate_weight_cache()) or "
                "primus_fp8_plugin.weight_cache.mark_weights_changed(); see 'What the weight cache guarantees' "
                "in the README."
            )

    def __getstate__(self) -> dict:
        # copies (copy.copy / deepcopy of a module) and pickles start empty: a copy's weight is another
        # tensor, and the storage weak reference must never be duplicated (each one frees itself once)
        return {"check": self.check}

    def __setstate__(self, state: dict) -> None:
        self.__init__(check=state["check"])

    def invalidate(self) -> None:
        """Drop the cached copies; the next ``get`` re-quantizes."""
        self._value = self._tensor_ref = self._storage_ref = self._key = None

    @property
    def nbytes(self) -> int:
        """Device memory held by the cached copies (0 when empty)."""
        return 0 if self._value is None else self._value.nbytes
