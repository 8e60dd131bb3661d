"""The weight cache: a weight's quantized copies (W for fprop, W^T for dgrad, with scales), made by
one pass over the weight and reused until the weight changes.

Training reads each weight once per microbatch in forward and once in backward, but changes it once
per optimizer step: quantizing it once per step instead of twice per microbatch saves a full pass
over every weight per use. The cache must never serve a stale copy, so an entry is valid only for
the exact weight it was made from:

* ``weight._version``: bumped by every in-place write through the tensor (optimizer updates,
  ``load_state_dict``'s ``copy_``, ``w.mul_(...)`` under ``no_grad``);
* ``weight.data_ptr()``, dtype, shape, device: a new storage (``.to()``, ``w.data = ...``);
* the quantization parameters and backend;
* a global optimizer-step counter, bumped after every ``torch.optim.Optimizer.step`` (a
  registered post-hook): writes that bypass the version counter — ``w.data.copy_(...)``, as
  Megatron's optimizers copy fp32 main params into model params — happen right after a step, so
  the next forward re-quantizes;
* ``refresh=True`` (a module's ``is_first_microbatch``, which Megatron sets on the first
  microbatch of each step) forces a new copy.

What no key can see: a write through ``.data`` outside an optimizer step. Call ``invalidate()``
(``Fp8BlockwiseLinear.invalidate_weight_cache()``) after such a write.

Under CUDA-graph capture the host-side key check would be frozen into the graph: a graph captured
while the cache was valid would replay without quantizing and read the copy of the capture step
after every later optimizer step. So while the current stream is capturing, ``get`` always
quantizes (the graph re-quantizes on every replay, correct for any weight values), and the entry it
makes is not trusted afterwards outside the graph.
"""

from __future__ import annotations

import itertools

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .backends import Backend
from .recipe import QuantParams
from .tensor import BlockwiseFp8Tensor

_optimizer_steps = itertools.count(1)
_step_epoch = 0


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    global _step_epoch
    _step_epoch = next(_optimizer_steps)


register_optimizer_step_post_hook(_after_optimizer_step)


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def optimizer_step_epoch() -> int:
    """How many ``torch.optim`` optimizer steps this process has taken (any optimizer)."""
    return _step_epoch


class WeightCache:
    """Quantized copies of one weight, valid for one version of it."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: BlockwiseFp8Tensor | None = None
        self.refreshes = 0  # how many times the weight was quantized (for tests and logs)

    @staticmethod
    def _key_of(weight: torch.Tensor, params: QuantParams, backend: Backend) -> tuple:
        return (
            weight._version,
            weight.data_ptr(),
            weight.dtype,
            tuple(weight.shape),
            weight.device,
            params,
            backend.name,
            _step_epoch,
        )

    def get(self, weight: torch.Tensor, params: QuantParams, backend: Backend, *, refresh: bool = False) -> BlockwiseFp8Tensor:
        """The quantized copies of ``weight`` (both W and W^T), re-made if anything changed."""
        key = self._key_of(weight, params, backend)
        capturing = _capturing()
        if refresh or capturing or key != self._key or self._value is None:
            with torch.no_grad():
                self._value = backend.quantize_weight(weight.detach().contiguous(), params)
            # a copy made inside a graph capture lives in the graph's memory pool and is rewritten
            # by each replay: never serve it by key outside the graph
            self._key = None if capturing else key
            self.refreshes += 1
        return self._value

    def invalidate(self) -> None:
        """Drop the cached copies; the next ``get`` re-quantizes."""
        self._key, self._value = None, None

    @property
    def nbytes(self) -> int:
        """Device memory held by the cached copies (0 when empty)."""
        return 0 if self._value is None else self._value.nbytes
