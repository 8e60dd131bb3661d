"""The 128x128-tile machinery the two Hopper Gluon quantizers (``quantize_act.py``,
``quantize_weight.py``) share: their register and shared-memory layouts, the tile load and
store, the weight kernel's FP8 transpose through shared memory, and the input rules.

Both kernels are bound by how often their 8 warps wait for each other, more than by instructions:
each block-wide barrier (a reduction across warps, a transpose through shared memory, a layout
conversion that the compiler routes through shared memory) stalls the whole program while it holds
a tile's loads. The act kernel therefore has one barrier and the weight kernel two."""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..triton.quantize_act import MAX_DIM  # in-tile offsets are int32, tile bases int64, as in the Triton kernels
from .target import runs_on


@functools.cache  # built once: the wrappers' host time counts
def transpose_tile_layouts():
    """Layouts for a 128x128 tile [r, c] and 8 warps: ``L`` (registers of the loaded tile) and ``LN``
    (the same threads and values, r-first register order: FP8 pairs along r, or 4 consecutive rows
    of a column), used by both quantizers; ``LT`` (the transposed [c, r] FP8 tile, 16 bytes of a row
    per thread) and ``T_SMEM`` (the swizzled [c, r] FP8 buffer between LN and LT), used by the
    weight quantizer's ``store_transposed`` (the act quantizer transposes the raw tile instead:
    ``raw_transpose_layouts``)."""
    # [r, c]: 4 rows x (2 x 8) columns per thread; 8 lanes along c (128 contiguous bytes of bf16 per
    # warp and row), 4 along r; warps along r, so the block amax crosses warps once
    reg_c_first = [[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [0, 64]]
    reg_r_first = [[1, 0], [2, 0], [0, 1], [0, 2], [0, 4], [0, 64]]
    lanes = [[0, 8], [0, 16], [0, 32], [4, 0], [8, 0]]
    warps = [[16, 0], [32, 0], [64, 0]]
    block = gl.DistributedLinearLayout(reg_c_first, lanes, warps, [], [128, 128])
    block_r_first = gl.DistributedLinearLayout(reg_r_first, lanes, warps, [], [128, 128])
    transposed = gl.BlockedLayout([1, 16], [4, 8], [8, 1], [1, 0])  # [c, r]: 16 bytes of a row per thread
    # [c, r] FP8 buffer: 16-byte units XOR (c // 8) % 8, so the rows 8 apart that one store
    # instruction writes (4 lanes along r x 8 along c) fall in 32 distinct banks
    t_smem = gl.SwizzledSharedLayout(vec=16, per_phase=8, max_phase=8, order=[1, 0])
    return block, block_r_first, transposed, t_smem


@functools.cache
def raw_transpose_layouts(element_size: int):
    """Layouts of the input tile transposed through shared memory in its own dtype (the act
    quantizer's columnwise copy): ``LT_RAW`` ([c, r] registers: 8 consecutive r of one column per
    thread, 8 lanes along r, 4 along c, warps along c) and ``T_RAW`` (the swizzled [c, r] buffer
    that ``LN`` registers are stored into: 16-byte units XOR (c // 8) % 8, as for ``T_SMEM``; each
    store instruction writes 8 rows x 32 bytes and each read 4 rows x 128 bytes without bank
    conflicts for 2-byte inputs (fp32 reads are 2-way conflicted; fp32 inputs are rare)."""
    lt_raw = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    t_raw = gl.SwizzledSharedLayout(vec=16 // element_size, per_phase=8, max_phase=8, order=[1, 0])
    return lt_raw, t_raw


@gluon.jit
def load_tile(ptr, r0, c0, R, C, stride, L: gl.constexpr):
    """Tile ``[r0:r0+128, c0:c0+128]`` of a row-major ``[R, C]`` tensor with row stride ``stride``, in
    its own dtype and layout ``L`` (zeros outside, which never raise an amax)."""
    B: gl.constexpr = 128
    rr = gl.arange(0, B, layout=gl.SliceLayout(1, L))
    rc = gl.arange(0, B, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(r0 + rr < R, 1) & gl.expand_dims(c0 + rc < C, 0)
    tile = ptr + r0.to(gl.int64) * stride + c0
    return gl.load(tile + gl.expand_dims(rr * stride, 1) + gl.expand_dims(rc, 0), mask=mask, other=0.0)


@gluon.jit
def store_tile(vals, ptr, r0, c0, R, C, L: gl.constexpr):
    """Store ``vals`` ([128, 128], layout ``L``) as the tile ``[r0:r0+128, c0:c0+128]`` of the
    contiguous row-major ``[R, C]`` tensor at ``ptr``, masked at the edges. Every FP8 copy of both
    quantizers goes out through it (rowwise from ``L``, transposed from ``LT`` / ``LT_RAW``)."""
    B: gl.constexpr = 128
    rr = gl.arange(0, B, layout=gl.SliceLayout(1, L))
    rc = gl.arange(0, B, layout=gl.SliceLayout(0, L))
    mask = gl.expand_dims(r0 + rr < R, 1) & gl.expand_dims(c0 + rc < C, 0)
    tile = ptr + r0.to(gl.int64) * C + c0
    gl.store(tile + gl.expand_dims(rr * C, 1) + gl.expand_dims(rc, 0), vals, mask=mask)


@gluon.jit
def store_transposed(q, t_s, out_ptr, r0, c0, R, C, LT: gl.constexpr):
    """Store the FP8 tile ``q`` ([128 r, 128 c] of ``[R, C]``, layout ``LN``: 4 consecutive rows per
    thread, FP8 pairs along r) transposed into the row-major ``[C, R]`` tensor at ``out_ptr``: 32-bit
    words into the swizzled shared buffer ``t_s`` ([128, 128], ``T_SMEM``; allocated by the caller
    before anything else, so that no other buffer shares its bytes and needs a barrier of its own),
    then 16 bytes of a row per thread (``LT``)."""
    t_s.permute((1, 0)).store(q)
    gl.thread_barrier()
    store_tile(t_s.load(LT), out_ptr, c0, r0, C, R, LT)  # [128 (c), 128 (r)] of [C, R]


def unsupported_reason(t: torch.Tensor, what: str) -> str | None:
    """Why the Gluon ``what`` quantizer does not take ``t`` (the Triton kernel then does), or None:
    NVIDIA sm_90, a contiguous 2-D bf16/fp16/fp32 tensor, both dims multiples of 16 (16-byte vectors
    of both FP8 copies) and below MAX_DIM, 16-byte aligned."""
    if not runs_on(t.device):
        return f"the Gluon {what} quantizer runs on NVIDIA Hopper (sm_90) only"
    if t.dim() != 2 or not t.is_contiguous():
        return "the input must be a contiguous 2-D tensor"
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input dtype {t.dtype} not supported (bf16, fp16, fp32)"
    rows, cols = t.shape
    if rows % 16 or cols % 16:
        return f"the input is [{rows}, {cols}]: both dims must be multiples of 16 (16-byte vectors of both copies)"
    if max(rows, cols) >= MAX_DIM:
        return f"the input is [{rows}, {cols}]: both dims must stay below {MAX_DIM} (32-bit in-tile offsets)"
    if t.data_ptr() % 16:
        return "the input must be 16-byte aligned"
    return None
