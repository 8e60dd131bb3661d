"""Token exchanges of the FP8 linear core: where X's rows come from and where dX's rows go.

``Local``: the rows are this process's. ``Permuted(routing, backend)``: an MoE layer's token permutation
(below).  ``SequenceParallel(group)``: Megatron's sequence parallelism for a
column-parallel layer. Each tensor-parallel rank holds ``m`` of the sequence's rows; as Transformer Engine does,

Forward:  X_local [m, K] --quantize (the input stage)--> all-gather the rowwise FP8 data and scales -> X [tp*m, K]
Saved:    the local shard's columnwise FP8 copy (``m*K*(1 + 1/32)`` bytes), never the gathered X.
Backward: the saved columnwise copies all-gathered again (FP8) for wgrad while dgrad runs; dX [tp*m, K]
          reduce-scattered to the shard's rows (``reduce_scatter_tensor``, as Megatron's
          ``gather_from_sequence_parallel_region``) while wgrad runs.

Bit for bit the bf16 way (``gather_rows`` then the local op): a rowwise tile lies in one row, and a columnwise 128x1
tile lies in one rank's shard when ``m % 128 == 0``, so quantizing the shards gives the bits of quantizing the
gathered rows (``fp8_gather_possible``; elsewhere the caller takes the bf16 way, as TE does). The rows are the
input's flattened leading dims, so the sequence must be the outermost dim (Megatron's ``[s, b, h]``).

Every rank's shard must have the same shape: the forward all-gathers the row counts (a few bytes) and checks them,
on the GPU without a host synchronisation (a device-side assert), so unequal shards stop the run instead of
gathering garbage.

Layouts (``tensor.py``): the gathered rowwise copy is the ranks' data stacked along rows, its scales
``[ceil(K/128), pad4(tp*m)]`` re-packed from the ranks' ``[ceil(K/128), pad4(m)]``; the gathered columnwise copy is
``[K, tp*m]`` (the ranks' ``[K, m]`` side by side) with scales ``[tp*m/128, pad4(K)]`` (the ranks' scales stacked).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..recipe import BLOCK
from ..tensor import BlockwiseFp8Tensor, pad4


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # gloo has no FP8 types: FP8 data moves as bytes
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def all_gather_rows(t: torch.Tensor, group, world: int, async_op: bool = False):
    """``[world * rows, ...]``: every rank's ``t`` stacked in rank order (and the work handle when ``async_op``)."""
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    work = dist.all_gather_into_tensor(_bytes(out), _bytes(t.contiguous()), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(t: torch.Tensor, group, world: int, async_op: bool = False):
    """This rank's ``[rows / world, ...]`` block of the sum over ranks of ``t`` (and the work handle)."""
    out = torch.empty((t.shape[0] // world, *t.shape[1:]), dtype=t.dtype, device=t.device)
    work = dist.reduce_scatter_tensor(out, t.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


class _GatherRows(torch.autograd.Function):
    """bf16 all-gather along dim 0 whose backward reduce-scatters (the bf16 way's gather)."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        return all_gather_rows(x, group, world)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_rows(dy, ctx.group, ctx.world), None, None


def gather_rows(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather ``x [s_local, ...]`` along dim 0 over ``group`` -> ``[world * s_local, ...]``; the gradient is
    reduce-scattered back (each rank's gradient of the gathered tensor is a partial sum)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    check_equal_shards(x.shape, group, world, x.device)
    return _GatherRows.apply(x, group, world)


def check_equal_shards(shape: torch.Size, group, world: int, device: torch.device) -> None:
    """Refuse shards of different shapes across the group's ranks. On a GPU the check is a device-side assert (no
    host synchronisation: the run stops with the message below); elsewhere a ValueError on every rank."""
    mine = torch.tensor(list(shape), dtype=torch.int64, device=device)
    every = all_gather_rows(mine.unsqueeze(0), group, world)
    message = (f"sequence-parallel shards differ across the {world} tensor-parallel ranks (this rank's shard is "
               f"{tuple(shape)}): every rank needs the same number of rows; make the sequence length a multiple of the "
               "tensor-parallel size")  # fmt: skip
    if device.type == "cuda":
        torch._assert_async((every == mine).all(), message)
    elif not bool((every == mine).all()):
        raise ValueError(f"{message}; the ranks' shards are {[tuple(r) for r in every.tolist()]}")


def fp8_gather_possible(local_rows: int, need_wgrad: bool) -> bool:
    """Whether a shard of ``local_rows`` rows can be quantized before the all-gather with the bits of the gathered
    rows: always for the rowwise copy alone; with wgrad's columnwise copy (128x1 tiles along the rows) when
    ``local_rows % 128 == 0``."""
    return local_rows > 0 and (not need_wgrad or local_rows % BLOCK == 0)


class Local:
    """The rows stay where they are."""

    world = 1

    def gathered_shape(self, shape: torch.Size) -> tuple:
        return tuple(shape)

    def check(self, shape: torch.Size, device: torch.device) -> None:
        return None

    def gather_rowwise(self, xq):
        return xq

    def start_gather_columnwise(self, data, scale_inv):
        return data, scale_inv

    def finish_gather_columnwise(self, started):
        return started

    def reduce_scatter(self, dx2d):
        return dx2d, None


class SequenceParallel:
    """The FP8 all-gather of a column-parallel layer's input shard over the tensor-parallel ``group`` (module
    docstring). Dense layouts only (MoE experts get their tokens from Megatron's token dispatcher)."""

    def __init__(self, group, world: int) -> None:
        self.group, self.world = group, world

    def gathered_shape(self, shape: torch.Size) -> tuple:
        return (self.world * shape[0], *shape[1:])

    def check(self, shape: torch.Size, device: torch.device) -> None:
        check_equal_shards(shape, self.group, self.world, device)

    def gather_rowwise(self, xq: BlockwiseFp8Tensor) -> BlockwiseFp8Tensor:
        m, k = xq.shape
        data, w1 = all_gather_rows(xq.rowwise_data, self.group, self.world, async_op=True)
        scales, w2 = all_gather_rows(xq.rowwise_scale_inv.unsqueeze(0), self.group, self.world, async_op=True)
        w1.wait()
        w2.wait()
        kb = scales.shape[1]  # scales: [world, K/128, pad4(m)] -> [K/128, pad4(world*m)]
        scale_inv = torch.ones((kb, pad4(self.world * m)), dtype=torch.float32, device=data.device)
        scale_inv[:, : self.world * m].view(kb, self.world, m).copy_(scales[:, :, :m].permute(1, 0, 2))
        return BlockwiseFp8Tensor((self.world * m, k), 1, xq.fp8_dtype, xq.orig_dtype, rowwise_data=data,
                                  rowwise_scale_inv=scale_inv)  # fmt: skip

    def start_gather_columnwise(self, data: torch.Tensor, scale_inv: torch.Tensor):
        """Start the all-gather of the shard's columnwise copy (``[K, m]`` data, ``[m/128, pad4(K)]`` scales)."""
        gathered, w1 = all_gather_rows(data.unsqueeze(0), self.group, self.world, async_op=True)  # [world, K, m]
        scales, w2 = all_gather_rows(scale_inv, self.group, self.world, async_op=True)  # [world*m/128, pad4(K)]: final
        return gathered, scales, (w1, w2)

    def finish_gather_columnwise(self, started):
        gathered, scales, works = started
        for w in works:
            w.wait()
        world, k, m = gathered.shape
        return gathered.permute(1, 0, 2).reshape(k, world * m), scales  # the ranks' [K, m] side by side

    def reduce_scatter(self, dx2d: torch.Tensor):
        return reduce_scatter_rows(dx2d, self.group, self.world, async_op=True)


class Permuted:
    """An MoE layer's token permutation (``permutation.Routing``), with the grouped layout that reads through it
    (``layouts.Grouped(rows=)``): the op's input is the tokens ``x [T, K]`` in token order; its rows are their copies
    in expert order, ``x[sorted_indices]`` ``[N, K]``, which the grouped quantization reads through the permutation
    (no permuted bf16 copy is written). Backward: each token's dX is the sum of its copies' rows in fp32 in row order,
    rounded once to dX's dtype (``Routing.rows_sum``): the gradient autograd gives ``x.index_select(0,
    sorted_indices)`` (Megatron's ``permute``) on the CPU bit for bit, where ``index_add_`` sums so; on a GPU the same
    bits every run (``index_add_`` there adds with atomics in any order). No host synchronisation."""

    world = 1

    def __init__(self, routing, backend) -> None:
        self.routing, self.backend = routing, backend
        self.sorted_indices, self.num_tokens = routing.sorted_indices, routing.num_tokens

    def gathered_shape(self, shape: torch.Size) -> tuple:
        return (self.sorted_indices.numel(),)

    def check(self, shape: torch.Size, device: torch.device) -> None:
        rows = math.prod(shape[:-1])
        if rows != self.num_tokens or self.sorted_indices.device != device:
            raise ValueError(f"the routing routes {self.num_tokens} tokens on {self.sorted_indices.device}; the input "
                             f"has {rows} rows on {device} (pass the tokens in token order, [T, K])")  # fmt: skip

    # forward's rows and wgrad's columnwise copy stay on this process, as Local's
    gather_rowwise = Local.gather_rowwise
    start_gather_columnwise = Local.start_gather_columnwise
    finish_gather_columnwise = Local.finish_gather_columnwise

    def reduce_scatter(self, dx2d):
        return self.routing.rows_sum(dx2d.contiguous(), None, self.backend), None
