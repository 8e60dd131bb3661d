"""Grouped (mixture-of-experts) FP8 tensors: the permuted tokens of all local experts, and all experts' weights.

Tokens routed to ``E`` experts arrive permuted, as one ``x [T, K]`` whose rows are expert 0's tokens, then
expert 1's, ... with ``counts[e]`` rows for expert ``e`` (``sum(counts) == T``, counts may be 0). A
:class:`GroupLayout` holds the counts and the offsets derived from them, on the device, so that kernels find
each expert's rows without a host synchronisation:

* ``offsets [E + 1]``: expert ``e``'s tokens are rows ``offsets[e] .. offsets[e+1]`` of ``x``;
* ``padded_offsets [E + 1]``: the same with each expert's count rounded up to a multiple of 128.

:class:`GroupedFp8Tensor` (activations and output gradients, 1x128 tiles) holds

* the **rowwise** copy exactly as a dense ``BlockwiseFp8Tensor`` of ``x [T, K]`` would (tiles along K never
  cross a token, so it is every expert's rowwise copy, stacked): ``data [T, K]``, ``scale_inv
  [ceil(K/128), pad4(T)]`` (entry ``[kb, t]``, padding entries 1.0);
* the **columnwise** copy in the wgrad layout: ``data [K, C]`` where expert ``e`` owns columns
  ``padded_offsets[e] .. padded_offsets[e+1]``: its ``counts[e]`` tokens (quantized over 128x1 tiles along
  its own tokens), then FP8 zeros up to the next multiple of 128. ``scale_inv [C/128, pad4(K)]``: row
  ``padded_offsets[e]/128 + i`` holds expert ``e``'s tile ``i``. Zero rows change no amax and no product,
  so each expert's part is exactly the columnwise copy a dense quantization of its own tokens gives.
  ``C`` (``GroupLayout.capacity``) is the exact padded total when the counts are known on the host,
  else the bound ``(T // 128 + E) * 128``; columns past ``padded_offsets[E]`` are unspecified.

:class:`GroupedFp8Weight` holds ``E`` weights ``[N, K]`` quantized with 128x128 blocks, stacked: ``W``
``[E, N, K]`` with ``scale_inv [E, ceil(N/128), pad4(ceil(K/128))]`` and ``W^T`` ``[E, K, N]`` with
``scale_inv [E, ceil(K/128), pad4(ceil(N/128))]``; slice ``e`` of each is expert ``e``'s dense layout.

``split()`` / ``expert(e)`` give the per-expert ``BlockwiseFp8Tensor`` (``split`` reads the counts on the
host); ``from_experts`` builds the grouped form from per-expert tensors (the reference backend's way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .recipe import BLOCK
from .tensor import FP8_DTYPES, BlockwiseFp8Tensor, ceil_div, pad4, scale_inv_shape, scales_to_te_layout

COUNT_DTYPE = torch.int32


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True, eq=False)
class GroupLayout:
    """Where each expert's tokens are, for ``num_tokens`` permuted tokens routed to ``num_groups`` experts.

    Attributes:
        counts: int32 ``[E]`` tokens per expert, on the tokens' device.
        offsets: int32 ``[E + 1]`` exclusive prefix sum of ``counts`` (``offsets[E] == T``).
        padded_offsets: int32 ``[E + 1]`` prefix sum of ``counts`` rounded up to multiples of 128.
        num_tokens: ``T``.
        capacity: ``C``, the number of token columns of a grouped columnwise copy (a multiple of 128).
        host_counts: the counts as Python ints where they were given on the host, else None.
    """

    counts: torch.Tensor
    offsets: torch.Tensor
    padded_offsets: torch.Tensor
    num_tokens: int
    capacity: int
    host_counts: tuple[int, ...] | None = None

    @property
    def num_groups(self) -> int:
        return int(self.counts.shape[0])

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def counts_list(self) -> list[int]:
        """The counts on the host (a device synchronisation unless they were given on the host)."""
        return list(self.host_counts) if self.host_counts is not None else [int(c) for c in self.counts.tolist()]


def capacity_bound(num_tokens: int, num_groups: int) -> int:
    """Columns a grouped columnwise copy needs at most: ``sum_e ceil(c_e/128) <= T // 128 + E`` tiles."""
    return (num_tokens // BLOCK + num_groups) * BLOCK


def group_layout(
    counts: torch.Tensor | Sequence[int],
    num_tokens: int,
    device: torch.device | str | None = None,
    *,
    num_groups: int | None = None,
) -> GroupLayout:
    """The :class:`GroupLayout` of ``num_tokens`` permuted tokens with per-expert ``counts``.

    ``counts``: a list/tuple of ints (checked on the host: non-negative, summing to ``num_tokens``; one host-to-device
    copy, from pinned memory on CUDA) or an integer tensor ``[E]`` (no host synchronisation on a GPU; safe inside a
    CUDA-graph capture). Device counts are checked where they live: on a GPU by a device-side assert (counts below 0
    or not summing to ``num_tokens`` stop the run with a message naming the counts), elsewhere by a ValueError. Either
    way the offsets the kernels read are clamped to ``[0, num_tokens]`` first, so no kernel reads or writes outside
    its tensors whatever the counts. ``device``: where the layout lives (default: the tensor's device, else the
    CPU). ``num_groups``: the number of experts the counts must describe (checked when given).
    """
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise ValueError(f"counts must be a 1-D integer tensor (tokens per expert), got {counts.dtype} {tuple(counts.shape)}")
        if counts.numel() == 0 or (num_groups is not None and counts.numel() != num_groups):
            raise ValueError(f"counts describe {counts.numel()} experts; the layer has {num_groups if num_groups else '>= 1'}")
        dev = torch.device(device) if device is not None else counts.device
        return _device_layout(counts.to(dev), int(num_tokens))
    host = tuple(map(int, counts))  # C-level passes over the counts: no Python call per expert
    if num_groups is not None and len(host) != num_groups:
        raise ValueError(f"{len(host)} counts given for {num_groups} experts: one count per expert")
    if not host or min(host) < 0 or sum(host) != num_tokens:
        raise ValueError(f"counts {list(host)[:8]}{'...' if len(host) > 8 else ''} must be >= 0 and sum to the "
                         f"number of tokens {num_tokens} (they sum to {sum(host)}), one count per expert")  # fmt: skip
    e = len(host)
    packed = torch.zeros(3 * e + 2, dtype=torch.int64)
    c = torch.tensor(host, dtype=torch.int64)
    packed[:e] = c
    torch.cumsum(c, 0, out=packed[e + 1 : 2 * e + 1])
    torch.cumsum((c + (BLOCK - 1)) // BLOCK * BLOCK, 0, out=packed[2 * e + 2 :])
    capacity = int(packed[-1])  # a CPU tensor: no device synchronisation
    packed = packed.to(COUNT_DTYPE)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        if capturing():
            raise RuntimeError("counts given on the host cannot be captured into a CUDA graph (the graph would "
                               "replay the captured counts): pass them as a device tensor")  # fmt: skip
        packed = packed.pin_memory().to(dev, non_blocking=True)
    elif dev.type != "cpu":
        packed = packed.to(dev)
    c, o, p = packed[:e], packed[e : 2 * e + 1], packed[2 * e + 1 :]
    return GroupLayout(c, o, p, int(num_tokens), capacity, host)


def _device_layout(counts: torch.Tensor, num_tokens: int) -> GroupLayout:
    """The layout of device counts: checked where they live, clamped for the kernels (``group_layout``)."""
    e = counts.shape[0]
    wide = counts.to(torch.int64)
    valid = (wide >= 0).all() & (wide.sum() == num_tokens)
    message = (f"grouped token counts must be >= 0 and sum to the number of tokens ({num_tokens}), one per expert "
               f"({e}): the router's counts and the permuted tokens disagree")  # fmt: skip
    if counts.device.type == "cuda":
        torch._assert_async(valid, message)  # reported by the GPU, no host synchronisation
    elif not bool(valid):
        shown = wide.tolist()
        raise ValueError(f"{message}; got {shown[:8]}{'...' if e > 8 else ''} (sum {sum(shown)})")
    # whatever the counts: offsets within [0, T], each expert's count the difference of its offsets
    ends = torch.cumsum(wide.clamp(min=0), 0).clamp(max=num_tokens)
    offsets = torch.zeros(e + 1, dtype=COUNT_DTYPE, device=counts.device)
    offsets[1:] = ends
    c = offsets[1:] - offsets[:-1]
    padded = torch.zeros(e + 1, dtype=COUNT_DTYPE, device=counts.device)
    torch.cumsum((c + (BLOCK - 1)) // BLOCK * BLOCK, 0, out=padded[1:])
    return GroupLayout(c, offsets, padded, num_tokens, capacity_bound(num_tokens, e))


def _check_copy(name: str, data, scale, shape, scale_shape, fp8_dtype, device) -> torch.device:
    if (data is None) != (scale is None):
        raise ValueError(f"{name}: data and scale_inv must both be given or both be None")
    if data is None:
        return device
    if data.dtype != fp8_dtype or tuple(data.shape) != tuple(shape) or not data.is_contiguous():
        raise ValueError(f"{name}_data must be contiguous {fp8_dtype} {tuple(shape)}, got {data.dtype} {tuple(data.shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(scale_shape) or not scale.is_contiguous():
        raise ValueError(
            f"{name}_scale_inv must be contiguous float32 {tuple(scale_shape)}, got {scale.dtype} {tuple(scale.shape)}"
        )
    for t in (data, scale):
        if device is not None and t.device != device:
            raise ValueError(f"all parts must be on one device, found {device} and {t.device}")
        device = t.device
    return device


@dataclass(eq=False)
class GroupedFp8Tensor:
    """Permuted tokens of ``E`` experts quantized with 1x128 tiles (layouts in the module docstring).

    Attributes:
        layout: the :class:`GroupLayout` (counts, offsets) the copies were made for.
        shape: ``(T, K)``.
        fp8_dtype, orig_dtype: the FP8 type and the high-precision source's dtype.
        rowwise_data ``[T, K]``, rowwise_scale_inv ``[ceil(K/128), pad4(T)]``, or None.
        columnwise_data ``[K, C]``, columnwise_scale_inv ``[C/128, pad4(K)]`` (``C = layout.capacity``), or None.
    """

    layout: GroupLayout
    shape: tuple[int, int]
    fp8_dtype: torch.dtype
    orig_dtype: torch.dtype
    rowwise_data: torch.Tensor | None = None
    rowwise_scale_inv: torch.Tensor | None = None
    columnwise_data: torch.Tensor | None = None
    columnwise_scale_inv: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        self.check()

    def check(self) -> None:
        """Raise ValueError if a stored copy breaks the layout contract of the module docstring."""
        t, k = self.shape
        if self.fp8_dtype not in FP8_DTYPES:
            raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {self.fp8_dtype}")
        if t != self.layout.num_tokens:
            raise ValueError(f"shape {self.shape} does not match the layout's {self.layout.num_tokens} tokens")
        if self.rowwise_data is None and self.columnwise_data is None:
            raise ValueError("a GroupedFp8Tensor needs a rowwise or a columnwise copy (or both)")
        cap = self.layout.capacity
        dev = _check_copy("rowwise", self.rowwise_data, self.rowwise_scale_inv, (t, k), scale_inv_shape(t, k, 1),
                          self.fp8_dtype, None)  # fmt: skip
        dev = _check_copy("columnwise", self.columnwise_data, self.columnwise_scale_inv, (k, cap), (cap // BLOCK, pad4(k)),
                          self.fp8_dtype, dev)  # fmt: skip
        if dev != self.layout.device:
            raise ValueError(f"the copies are on {dev} but the layout is on {self.layout.device}")

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    @property
    def nbytes(self) -> int:
        parts = (self.rowwise_data, self.rowwise_scale_inv, self.columnwise_data, self.columnwise_scale_inv)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    def split(self) -> list[BlockwiseFp8Tensor]:
        """Expert ``e``'s part as the dense ``BlockwiseFp8Tensor`` of its ``counts[e]`` tokens (copies; reads
        the counts on the host)."""
        counts = self.layout.counts_list()
        _, k = self.shape
        out, off, poff = [], 0, 0
        for c in counts:
            parts = {}
            if self.has_rowwise:
                s = self.rowwise_scale_inv[:, off : off + c].t()
                parts.update(rowwise_data=self.rowwise_data[off : off + c].contiguous(),
                             rowwise_scale_inv=scales_to_te_layout(s, c, k, 1))  # fmt: skip
            if self.has_columnwise:
                t0, t1 = poff // BLOCK, poff // BLOCK + ceil_div(c, BLOCK)
                parts.update(columnwise_data=self.columnwise_data[:, poff : poff + c].contiguous(),
                             columnwise_scale_inv=self.columnwise_scale_inv[t0:t1].contiguous())  # fmt: skip
            out.append(BlockwiseFp8Tensor((c, k), 1, self.fp8_dtype, self.orig_dtype, **parts))
            off, poff = off + c, poff + ceil_div(c, BLOCK) * BLOCK
        return out

    @classmethod
    def from_experts(cls, parts: Sequence[BlockwiseFp8Tensor], layout: GroupLayout, k: int) -> GroupedFp8Tensor:
        """The grouped tensor whose expert ``e`` is ``parts[e]`` (dense 1x128 tensors ``(counts[e], k)``)."""
        counts = layout.counts_list()
        if len(parts) != len(counts) or any(p.shape != (c, k) or p.block_dim != 1 for p, c in zip(parts, counts)):
            raise ValueError("parts must be one 1x128 BlockwiseFp8Tensor (counts[e], K) per expert")
        first = parts[0]
        t, dev, cap = layout.num_tokens, layout.device, layout.capacity
        fields = {}
        if first.has_rowwise:
            data = torch.cat([p.rowwise_data for p in parts]) if t else torch.empty(0, k, dtype=first.fp8_dtype, device=dev)
            compact = torch.cat([p.scales("rowwise") for p in parts]) if t else torch.empty(0, ceil_div(k, BLOCK), device=dev)
            fields.update(rowwise_data=data.contiguous(), rowwise_scale_inv=scales_to_te_layout(compact, t, k, 1))
        if first.has_columnwise:
            data = torch.zeros(k, cap, dtype=first.fp8_dtype, device=dev)
            scale = torch.ones(cap // BLOCK, pad4(k), dtype=torch.float32, device=dev)
            poff = 0
            for p, c in zip(parts, counts):
                data[:, poff : poff + c] = p.columnwise_data
                scale[poff // BLOCK : poff // BLOCK + ceil_div(c, BLOCK)] = p.columnwise_scale_inv
                poff += ceil_div(c, BLOCK) * BLOCK
            fields.update(columnwise_data=data, columnwise_scale_inv=scale)
        return cls(layout, (t, k), first.fp8_dtype, first.orig_dtype, **fields)


@dataclass(eq=False)
class GroupedFp8Weight:
    """``E`` weights ``[N, K]`` quantized with 128x128 blocks into W and W^T, stacked (module docstring).

    Attributes:
        shape: ``(N, K)`` of one expert's weight.
        fp8_dtype, orig_dtype: as for ``BlockwiseFp8Tensor``.
        rowwise_data ``[E, N, K]``, rowwise_scale_inv ``[E, ceil(N/128), pad4(ceil(K/128))]``;
        columnwise_data ``[E, K, N]``, columnwise_scale_inv ``[E, ceil(K/128), pad4(ceil(N/128))]``, or both None
        (W only: W^T is made on demand, ``Backend.transpose_weight_grouped``).
    """

    shape: tuple[int, int]
    fp8_dtype: torch.dtype
    orig_dtype: torch.dtype
    rowwise_data: torch.Tensor
    rowwise_scale_inv: torch.Tensor
    columnwise_data: torch.Tensor | None = None
    columnwise_scale_inv: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.shape = (int(self.shape[0]), int(self.shape[1]))
        self.check()

    def check(self) -> None:
        n, k = self.shape
        if self.rowwise_data is None:
            raise ValueError("a GroupedFp8Weight holds W (rowwise_data and rowwise_scale_inv); W^T is optional")
        e = self.num_groups
        dev = _check_copy("rowwise", self.rowwise_data, self.rowwise_scale_inv, (e, n, k), (e, *scale_inv_shape(n, k, 2)),
                          self.fp8_dtype, None)  # fmt: skip
        _check_copy("columnwise", self.columnwise_data, self.columnwise_scale_inv, (e, k, n), (e, *scale_inv_shape(k, n, 2)),
                    self.fp8_dtype, dev)  # fmt: skip

    @property
    def num_groups(self) -> int:
        return int(self.rowwise_data.shape[0])

    @property
    def device(self) -> torch.device:
        return self.rowwise_data.device

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    @property
    def nbytes(self) -> int:
        parts = (self.rowwise_data, self.rowwise_scale_inv, self.columnwise_data, self.columnwise_scale_inv)
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    def with_columnwise(self, data: torch.Tensor, scale_inv: torch.Tensor) -> GroupedFp8Weight:
        """These weights' W copies with ``data`` / ``scale_inv`` as their W^T copies (checked)."""
        return GroupedFp8Weight(self.shape, self.fp8_dtype, self.orig_dtype, self.rowwise_data, self.rowwise_scale_inv,
                                data, scale_inv)  # fmt: skip

    def rowwise_only(self) -> GroupedFp8Weight:
        """These weights without their W^T copies (the same W buffers); itself when it has none."""
        if self.columnwise_data is None:
            return self
        return GroupedFp8Weight(self.shape, self.fp8_dtype, self.orig_dtype, self.rowwise_data, self.rowwise_scale_inv)

    @classmethod
    def empty(cls, num_groups: int, shape: tuple[int, int], fp8_dtype, orig_dtype, device) -> GroupedFp8Weight:
        """Uninitialised buffers, except the scales' padding entries, which hold 1.0."""
        n, k = shape
        e = num_groups
        return cls(
            (n, k), fp8_dtype, orig_dtype,
            torch.empty(e, n, k, dtype=fp8_dtype, device=device),
            torch.ones(e, *scale_inv_shape(n, k, 2), dtype=torch.float32, device=device),
            torch.empty(e, k, n, dtype=fp8_dtype, device=device),
            torch.ones(e, *scale_inv_shape(k, n, 2), dtype=torch.float32, device=device),
        )  # fmt: skip

    def expert(self, e: int) -> BlockwiseFp8Tensor:
        """Expert ``e``'s weight as a dense ``BlockwiseFp8Tensor`` (views of this tensor's buffers)."""
        col = {} if self.columnwise_data is None else {"columnwise_data": self.columnwise_data[e],
                                                       "columnwise_scale_inv": self.columnwise_scale_inv[e]}  # fmt: skip
        return BlockwiseFp8Tensor(self.shape, 2, self.fp8_dtype, self.orig_dtype, rowwise_data=self.rowwise_data[e],
                                  rowwise_scale_inv=self.rowwise_scale_inv[e], **col)  # fmt: skip

    @classmethod
    def from_experts(cls, parts: Sequence[BlockwiseFp8Tensor]) -> GroupedFp8Weight:
        """Stack per-expert 128x128 tensors (each with both copies) of one shape."""
        first = parts[0]
        if any(p.shape != first.shape or p.block_dim != 2 or not (p.has_rowwise and p.has_columnwise) for p in parts):
            raise ValueError("parts must be 128x128 BlockwiseFp8Tensors of one shape, each with both copies")
        stack = lambda name: torch.stack([getattr(p, name) for p in parts])  # noqa: E731
        return cls(first.shape, first.fp8_dtype, first.orig_dtype, stack("rowwise_data"), stack("rowwise_scale_inv"),
                   stack("columnwise_data"), stack("columnwise_scale_inv"))  # fmt: skip
