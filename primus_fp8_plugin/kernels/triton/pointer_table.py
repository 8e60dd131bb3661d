"""Device tables of tensor addresses, for kernels that read or write ``E`` tensors anywhere in memory (each
expert's weight or ``main_grad``, which Megatron's gradient buffers do not lay out next to each other).

A table is an int64 tensor ``[E]`` of ``data_ptr()`` values on the tensors' device; a kernel loads entry
``e`` and casts it to a pointer, which the compiler knows nothing about: ``PointerTable.align`` (16 where every
address is a multiple of 16 bytes, else 1) is the alignment a kernel may declare for it (``tl.multiple_of``), so
that its loads and stores through the pointer are vectorised (16-byte accesses instead of one per element).

Tables are cached by the addresses they hold (an address reused by another tensor of the same layout needs the
same table), so the host-to-device copy happens once per set of buffers (parameters and gradient buffers keep
their storage across steps). The copy comes from pinned memory without a synchronisation; the pinned buffer is
kept alive with the table.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

MAX_TABLES = 512  # a few per grouped layer (weights, main_grads), for models of many layers

VECTOR_BYTES = 16  # the widest load/store a GPU thread issues


class PointerTable(NamedTuple):
    """A device table of addresses and the alignment (bytes) every address has: ``VECTOR_BYTES`` or 1."""

    addresses: torch.Tensor  # int64 [E], on the tensors' device
    align: int


_TABLES: OrderedDict[tuple, tuple[PointerTable, torch.Tensor]] = OrderedDict()


def pointer_table(tensors: Sequence[torch.Tensor]) -> PointerTable:
    """int64 ``[len(tensors)]`` table of the tensors' addresses, on their device (one device for all), with
    their common alignment."""
    device = tensors[0].device
    if set(map(operator.attrgetter("device"), tensors)) != {device}:
        raise ValueError("a pointer table's tensors must all be on one device")
    key = (device, tuple(map(torch.Tensor.data_ptr, tensors)))  # C-level passes: no Python call per tensor
    entry = _TABLES.get(key)
    if entry is not None:
        _TABLES.move_to_end(key)
        return entry[0]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a grouped kernel's pointer table (the experts' weights or main_grads) was first needed inside a CUDA-graph "
            "capture, where it cannot be copied to the GPU safely: run one step outside the capture first (warm-up)"
        )
    host = torch.tensor(key[1], dtype=torch.int64)
    align = VECTOR_BYTES if all(a % VECTOR_BYTES == 0 for a in key[1]) else 1
    if device.type == "cuda":
        host = host.pin_memory()
        table = PointerTable(host.to(device, non_blocking=True), align)
    else:
        table = PointerTable(host.to(device), align)
    _TABLES[key] = (table, host)
    while len(_TABLES) > MAX_TABLES:
        _TABLES.popitem(last=False)
    return table
