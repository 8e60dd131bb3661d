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

W only, and the FP8 primary form of a weight
--------------------------------------------
``keep_transpose=False`` keeps W only: dgrad's W^T is then made on demand from W's blocks (an exact transpose,
``Backend.transpose_weight``) and freed after it, which saves a byte per weight element. ``own()`` makes the cache's
W the weight's primary form (``fp8_params.py``): the weight is quantized once more, W^T dropped, and the copy is
served for that weight, whatever its data then holds, without a key check, until ``disown()``; meanwhile
``invalidate()``, copying or pickling the cache refuse (the copy is the only form of the weight).

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
  outside compiled graphs, ``ops/api.py``, so this applies only to direct calls being traced).
"""

from __future__ import annotations

import itertools
import operator
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import env
from .backends import Backend
from .grouped_tensor import GroupedFp8Weight, capturing
from .recipe import QuantParams
from .tensor import BlockwiseFp8Tensor

CHECK_ENV = env.CHECK_WEIGHT_CACHE
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


class StaleWeightCacheError(RuntimeError):
    """A weight cache in check mode found its stored copy different from a fresh quantization."""


class HeldWeightError(RuntimeError):
    """An operation that would lose the FP8 primary form of a weight a cache holds (``own``)."""


def check_held(weights, refs, held_key: tuple, params: QuantParams, backend: Backend) -> None:
    """A held copy is served only for the weights it was made of, with the parameters and backend it was made with,
    and never into a CUDA graph (each step holds new buffers, which a graph captured before would not read)."""
    if capturing():
        raise HeldWeightError("FP8 primary weights cannot be captured into a CUDA graph: every step holds them in new "
                              "buffers; train with BF16 weights (the weight cache) under CUDA graphs")  # fmt: skip
    if len(refs) != len(weights) or not all(map(operator.is_, map(_deref, refs), weights)):
        raise HeldWeightError("this weight cache holds the FP8 primary form of other weights than the ones passed")
    if (params, backend) != held_key:
        raise HeldWeightError(f"the held FP8 weight was quantized with {held_key[0]} on backend {held_key[1].name!r}, "
                              f"not {params} on {backend.name!r}")  # fmt: skip


def held_error(action: str) -> HeldWeightError:
    return HeldWeightError(
        f"cannot {action}: the weight cache holds the FP8 primary form of its weight, whose high-precision values were "
        "released (fp8_params.Fp8Params); restore them first (Fp8Params.restore(), then the optimizer step writes them)"
    )


def same_bits(a: BlockwiseFp8Tensor, b: BlockwiseFp8Tensor) -> bool:
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


_deref = weakref.ref.__call__
_version_of = operator.attrgetter("_version")
_storage_of = operator.methodcaller("untyped_storage")
_cdata_of = operator.attrgetter("_cdata")
_ptr_of = operator.methodcaller("data_ptr")
_stride_of = operator.methodcaller("stride")
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")


class WeightCache:
    """Quantized copies of a weight (W and W^T), served while the weight is provably unchanged (module docstring).

    One cache serves one dense weight ``[N, K]`` (``get(weight, ...)``); with ``grouped=True`` (``GroupedWeightCache``)
    it serves ``E`` expert weights, ``E`` ``[N, K]`` tensors or one ``[E, N, K]`` tensor, whose copies are stacked
    and re-made together by one batched quantization. The key is checked for every tensor by a fixed number of
    C-level passes (``map`` with ``operator`` getters: about 0.3 us per expert on a CPU), with no per-expert Python.
    A refresh releases the old copies before making the new ones, so that it never holds two.

    Args:
        check: compare every served copy with a fresh quantization and raise
            ``StaleWeightCacheError`` on a difference (a debug mode). None (the default) reads
            ``PRIMUS_FP8_CHECK_WEIGHT_CACHE`` (``1`` turns it on) when the cache is made.
        keep_transpose: keep W^T beside W (default); False keeps W only (W^T made for each dgrad).
        grouped: serve ``E`` expert weights (``GroupedFp8Weight``) instead of one (``BlockwiseFp8Tensor``).

    Attributes:
        refreshes: how many times the weight was quantized through this cache.
        checks: how many served copies check mode compared.
        held: whether the cache holds its weight's FP8 primary form (``own``).
    """

    def __init__(self, *, check: bool | None = None, keep_transpose: bool = True, grouped: bool = False) -> None:
        self._value: BlockwiseFp8Tensor | GroupedFp8Weight | None = None
        self._refs: list | None = None
        self._storage_refs: list | None = None
        self._key: tuple | None = None
        self.check = env.check_weight_cache() if check is None else bool(check)
        self.keep_transpose = bool(keep_transpose)
        self.grouped = bool(grouped)
        self.held = False
        self._held_key: tuple | None = None
        self.refreshes = 0
        self.checks = 0

    def _tracked(self, weights) -> list[torch.Tensor]:
        """The tensors the key covers: the dense weight; the ``E`` expert weights or the one stacked tensor."""
        return [weights] if not self.grouped or isinstance(weights, torch.Tensor) else weights

    @staticmethod
    def _key_of(tracked: list[torch.Tensor], params: QuantParams, backend: Backend) -> tuple[tuple, list]:
        """(the key, the tensors' storages); each part of the key is one C-level pass over the tensors (one tensor,
        the dense weight's case: the same key read directly, half the host time)."""
        if len(tracked) == 1:
            (w,) = tracked
            storage = w.untyped_storage()
            try:
                version = w._version
            except RuntimeError:  # an inference tensor (no version counter)
                version = -1
            return ((version,), _weight_epoch, params, backend, (storage._cdata,), (w.data_ptr(),), (w.stride(),),
                    (w.shape,), (w.dtype,)), [storage]  # fmt: skip
        storages = list(map(_storage_of, tracked))
        try:
            versions = tuple(map(_version_of, tracked))
        except RuntimeError:  # inference tensors have no version counter (none changes outside inference mode)
            versions = tuple(-1 if w.is_inference() else w._version for w in tracked)
        return (
            versions,
            _weight_epoch,
            params,
            backend,
            tuple(map(_cdata_of, storages)),
            tuple(map(_ptr_of, tracked)),  # with the storage and the dtype, this fixes the storage offset
            tuple(map(_stride_of, tracked)),
            tuple(map(_shape_of, tracked)),
            tuple(map(_dtype_of, tracked)),
        ), storages

    def _holds(self, tracked: list[torch.Tensor], key: tuple) -> bool:
        refs = self._refs
        if refs is None or len(refs) != len(tracked) or key != self._key:
            return False
        return refs[0]() is tracked[0] if len(refs) == 1 else all(map(operator.is_, map(_deref, refs), tracked))

    def get(self, weights, params: QuantParams, backend: Backend, *, refresh: bool = False):
        """The quantized copies (W and W^T, or W only) of the weight ``[N, K]`` (a ``BlockwiseFp8Tensor``), or of
        the ``E`` expert weights (grouped: a ``GroupedFp8Weight``), re-made unless every tensor is provably
        unchanged; the held copy while the cache holds the weights' primary form."""
        tracked = self._tracked(weights)
        if self.held:
            check_held(tracked, self._refs, self._held_key, params, backend)
            return self._value
        untracked = torch.is_inference_mode_enabled() and any(w.is_inference() for w in tracked)
        if untracked or capturing() or torch.compiler.is_compiling():
            self._check_shapes(weights, tracked)
            self.invalidate()  # an entry made here is never served by key (see the module docstring)
            self.refreshes += 1
            self._value = self._quantize(weights, params, backend)
            return self._value
        key, storages = self._key_of(tracked, params, backend)
        if not refresh and self._holds(tracked, key):
            if self.check:
                self._check(weights, params, backend)
            return self._value
        self._check_shapes(weights, tracked)
        self.invalidate()  # release the old copies before allocating the new ones
        self._value = self._quantize(weights, params, backend)
        self._refs = [weakref.ref(w) for w in tracked]
        self._storage_refs = [StorageWeakRef(s) for s in storages]
        self._key = key
        self.refreshes += 1
        return self._value

    def _check_shapes(self, weights, tracked) -> None:
        if self.grouped:
            _check_expert_weights(weights, tracked[0].device)

    def _quantize(self, weights, params: QuantParams, backend: Backend):
        with torch.no_grad():
            if not self.grouped:
                value = backend.quantize_weight(weights.detach().contiguous(), params)
            elif isinstance(weights, torch.Tensor):
                value = backend.quantize_weight_grouped(weights.detach().contiguous(), params)
            else:
                value = backend.quantize_weight_grouped([w.detach().contiguous() for w in weights], params)
        return value if self.keep_transpose else value.rowwise_only()

    def own(self, weights, params: QuantParams, backend: Backend):
        """Quantize the weights now and hold W (W^T dropped) as their primary form: served for them until
        ``disown``, whatever their data then hold (the caller may release them). Returns the held copy."""
        self.disown()
        tracked = self._tracked(weights)
        with torch.autocast(tracked[0].device.type, enabled=False):  # as inside the op (grouped stacking refuses FP8 under it)
            value = self.get(weights, params, backend, refresh=True).rowwise_only()
        self._value, self._refs, self.held, self._held_key = value, [weakref.ref(w) for w in tracked], True, (params, backend)
        return value

    def disown(self) -> None:
        """Stop holding the weights' primary form (their high-precision values are about to be written) and drop it."""
        self.held = False
        self.invalidate()

    def _check(self, weights, params: QuantParams, backend: Backend) -> None:
        self.checks += 1
        fresh, held = self._quantize(weights, params, backend), self._value
        if not self.grouped:
            if not same_bits(fresh, held):
                raise _stale(f"a {weights.dtype} weight {list(weights.shape)} on {weights.device}")
            return
        for e in range(held.num_groups):
            if not same_bits(fresh.expert(e), held.expert(e)):
                raise _stale(f"expert {e}'s weight {list(held.shape)}")

    def __getstate__(self) -> dict:
        # copies (copy.copy / deepcopy of a module) and pickles start empty: a copy's weight is another
        # tensor, and the storage weak reference must never be duplicated (each one frees itself once)
        if self.held:
            raise held_error("copy or pickle the layer")
        return {"check": self.check, "keep_transpose": self.keep_transpose, "grouped": self.grouped}

    def __setstate__(self, state: dict) -> None:
        grouped = state.get("grouped", type(self) is not WeightCache)  # pickles made before the two were one class
        self.__init__(check=state["check"], keep_transpose=state.get("keep_transpose", True), grouped=grouped)

    def invalidate(self) -> None:
        """Drop the cached copies; the next ``get`` re-quantizes. Refused while the cache holds the weights' primary
        form (``HeldWeightError``)."""
        if self.held:
            raise held_error("drop the layer's FP8 weight (a move, a dtype conversion or invalidate_weight_cache())")
        self._value = self._refs = self._storage_refs = self._key = None

    @property
    def nbytes(self) -> int:
        """Device memory held by the cached copies (0 when empty)."""
        return 0 if self._value is None else self._value.nbytes


class GroupedWeightCache(WeightCache):
    """A ``WeightCache`` for the ``E`` expert weights of a grouped linear (``grouped=True``); its own class so that
    ``isinstance`` and pickles of layers made with it keep working."""

    def __init__(self, *, check: bool | None = None, keep_transpose: bool = True, grouped: bool = True) -> None:
        if not grouped:
            raise ValueError("a GroupedWeightCache serves expert weights (grouped=True); use WeightCache for one weight")
        super().__init__(check=check, keep_transpose=keep_transpose, grouped=True)


def _stale(what: str) -> StaleWeightCacheError:
    return StaleWeightCacheError(
        f"the weight cache was about to serve a stale FP8 copy of {what}: its values changed without a "
        "version-counter bump (a write through .data, through another tensor sharing its storage, or by a collective) "
        "and outside an optimizer step. After such a write call invalidate() (invalidate_weight_cache() on the layer) "
        "or primus_fp8_plugin.weight_cache.mark_weights_changed(); see 'What the weight cache guarantees' in the README."
    )


def _check_expert_weights(weights, device: torch.device) -> None:
    """Every expert weight 2-D, of weight 0's shape, on ``device`` (one C-level pass per property; the loop over
    the experts runs only to name the first wrong one); stacked weights: one 3-D tensor on ``device``."""
    if isinstance(weights, torch.Tensor):
        if weights.dim() != 3 or weights.shape[0] == 0 or weights.device != device:
            raise ValueError(f"stacked expert weights must be one [E, N, K] tensor (E >= 1) on {device}, got "
                             f"{tuple(weights.shape)} on {weights.device}")  # fmt: skip
        return
    w0 = weights[0]
    if w0.dim() == 2 and set(map(_shape_of, weights)) == {w0.shape} and set(map(_device_of, weights)) == {device}:
        return
    n, k = w0.shape if w0.dim() == 2 else (w0.shape[0] if w0.dim() else None, None)
    for i, w in enumerate(weights):
        if w.dim() != 2 or tuple(w.shape) != (n, k) or w.device != device:
            raise ValueError(f"weight {i} is {tuple(w.shape)} on {w.device}: each expert needs a [{n}, {k}] weight on {device}")
