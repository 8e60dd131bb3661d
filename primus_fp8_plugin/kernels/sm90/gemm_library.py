"""The device library of the Hopper Gluon GEMMs: what the dense GEMM (``gemm.py``) and the grouped GEMMs
(``gemm_grouped.py``) are both built from, so that a grouped tile computes, bit for bit, what the dense
kernel computes for the same rows (docstrings of the two kernels: the designs).

Host side: the TMA descriptors of operands, outputs and scales (``tma_desc``, ``scale_desc``; the scale
boxes' unswizzled ``SCALE_SMEM_LAYOUT``, the 128x128 B-scale box ``B2D_SCALE_BOX``; ``tma_ready_scale``
copies a scale tensor TMA cannot read in place), the swizzled operand layouts (``shared_layout``) and the
pipeline depth beside the output buffers (``stages_that_fit``).

Device side: a consumer's release of a pipeline stage to the TMA producer (``release_stage``), the
promotion of a K block's product into the running accumulator (``promote``), the
128x128 B scale word of a stage (``b2d_block_scale``), the 256x128 tile's K block (``k_block_256x128``,
the dense and grouped wgrad mainloop) and the epilogue: ``epilogue_add`` (+ bias, + accumulate_into),
``store_piece`` (a [64, 64] piece's one rounding and TMA store), ``store_pieces`` (a warpgroup's four
pieces of a 128x256 tile), ``store_rows`` (a piece from registers, masked).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...tensor import ceil_div
from .target import SMEM_LIMIT, TORCH_TO_GL

BLOCK_K = 128  # one scale per K block: fixed by the recipe


# registers per thread at launch, every config: 12 warps (2 consumer warpgroups + the producer's
# warpgroup) share the 64K-register file, 168 * 384 <= 65536; setmaxnreg then moves registers between them
MAXNREG = 168


@functools.lru_cache(maxsize=64)
def _shared_layout_cached(block_shape: tuple[int, ...], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), TORCH_TO_GL[dtype])


def shared_layout(block_shape, dtype):
    # cached: Gluon's get_default_for costs ~12 us of Python per call, three times per GEMM
    return _shared_layout_cached(tuple(block_shape), dtype)


def tma_desc(base: torch.Tensor, shape: list[int], strides: list[int], block_shape: list[int], layout) -> TensorDescriptor:
    """``TensorDescriptor(base, shape, strides, block_shape, layout)`` without its ``__post_init__``
    checks (~6 us of Python each, five descriptors per GEMM): ``_check_inputs`` and the allocations
    here already guarantee what they check (16-byte aligned base and strides, unit last stride,
    positive shape); tests/backends/test_gemm_gluon_inputs.py rebuilds every descriptor the wrapper
    makes through the checked constructor."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout, padding="zero")
    return desc


# fp32 boxes of the scale tensors (scale_tma): unswizzled, read back with plain ld.shared
SCALE_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


# 128x128-scaled B (b_s [ceil(N/128), >=KB]): one [2, 16] box per K block holds b_s[n0 // 128 + (0, 1),
# kb] of a 128x256 tile. 16 columns wide so that each stage's box spans 128 bytes of shared memory
# (TMA destinations are 128-byte aligned); starting at column kb & ~3, 16 bytes aligned, so the scales
# are words kb & 3 and 16 + (kb & 3). The start must be 16-byte aligned: a box starting at column kb
# faults on the H200 once kb > 0 ("illegal instruction" at the producer's TMA).
B2D_SCALE_BOX = (2, 16)


def scale_desc(scale: torch.Tensor, cols: int, box: list[int]) -> TensorDescriptor:
    """TMA descriptor over ``scale[:, :cols]`` (fp32 [rows, >=cols], unit column stride) in ``box``
    boxes; TMA zero-fills what lies past the rows or ``cols``."""
    return tma_desc(scale, [scale.shape[0], cols], [scale.stride(0), 1], box, SCALE_SMEM_LAYOUT)


def tma_ready_scale(scale: torch.Tensor, cols: int) -> torch.Tensor:
    """``scale`` itself where TMA can read it (16-byte aligned base and row stride: TE's [KB, pad4(.)]
    layout), else a copy of ``scale[:, :cols]`` with rows padded to a multiple of 4."""
    if scale.data_ptr() % 16 == 0 and (scale.stride(0) * 4) % 16 == 0:
        return scale
    padded = torch.zeros(scale.shape[0], ceil_div(cols, 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :cols] = scale[:, :cols]
    return padded


def c_block_n(block_m: int, block_n: int) -> int:
    # 128x256 and 256x128 tiles store four [64, 64] pieces per warpgroup through two buffers
    return 64 if block_n == 256 or block_m == 256 else block_n


def stages_that_fit(
    block_m: int, block_n: int, out_dtype: torch.dtype, requested: int = 0, b_block_dim: int = 1,
    output_buffers: bool = True,
) -> int:  # fmt: skip
    """Pipeline stages of a ``block_m`` x ``block_n`` tile (``requested``, or as many as fit, at most 6)
    next to the output buffers (none where ``output_buffers`` is False: an epilogue that stores from
    registers); raises ValueError when fewer than 2, or ``requested``, do not fit."""
    four_pieces = block_n == 256 or block_m == 256
    stage_bytes = (block_m + block_n) * BLOCK_K  # fp8 A and B tiles
    if four_pieces:  # + the fp32 A-scale row slice and the B scales of the K block (scale_tma)
        stage_bytes += (block_m + (B2D_SCALE_BOX[0] * B2D_SCALE_BOX[1] if b_block_dim == 2 else block_n)) * 4
    # [64, c_block_n] output buffers: two per warpgroup with four pieces, else one
    c_bufs = (4 if four_pieces else 2) if output_buffers else 0
    c_bytes = c_bufs * 64 * c_block_n(block_m, block_n) * out_dtype.itemsize
    fit = (SMEM_LIMIT - c_bytes - 512) // stage_bytes  # 512: mbarriers and alignment (264-320 bytes in use)
    stages = min(fit, 6) if requested <= 0 else requested
    if stages < 2 or stages > fit:
        raise ValueError(f"{stages} stages of a {block_m}x{block_n} tile do not fit in shared memory (max {fit})")
    return stages


@gluon.jit
def release_stage(empty, s):
    """Give stage ``s`` back to the TMA producer: a proxy fence, then the arrival on its ``empty`` barrier.

    The consumers read a stage's scales with ``ld.shared`` (the generic proxy) and the producer's TMA
    overwrites them (the async proxy); the barrier orders the two only within one proxy, so without the
    fence a scale load still in flight at the arrival could return the next tile's value. It did: the
    grouped wgrad into main_grad at 240 / 24 registers, whose tiles are one K block long, gave wrong
    tile columns (the last chain's column scales) in 21 of 100 calls on an H100, 0 of 100 with the
    fence (``python -m tools.grouped_wgrad_repeat``)."""
    fence_async_shared()
    mbarrier.arrive(empty.index(s))


@gluon.jit
def promote(acc, part, sa, sb, B_2D: gl.constexpr, ROW_FIRST: gl.constexpr = False):
    # ROW_FIRST (1x128 B): (part * sa) * sb, whose FMULs by the row scales need not wait for the
    # column scales' ld.shared; equal to part * (sa * sb) for power-of-2 scales (TE's default), within
    # an ulp otherwise
    if B_2D:
        acc = acc + part * gl.expand_dims(sa * sb, 1)
    elif ROW_FIRST:
        acc = acc + (part * gl.expand_dims(sa, 1)) * gl.expand_dims(sb, 0)
    else:
        acc = acc + part * (gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0))
    return acc


@gluon.jit
def b2d_block_scale(bs_words, s, kb, half, word_layout: gl.constexpr, SB_W: gl.constexpr):
    """The 128x128 B scale of tile half ``half`` for K block ``kb``: one word of stage ``s``'s [2, SB_W]
    box (word ``half * SB_W + (kb & 3)``), loaded by every thread (a broadcast ld.shared)."""
    SB_N: gl.constexpr = 2 * SB_W
    word = bs_words.index(s * SB_N + half * SB_W + (kb & 3)).load(word_layout)
    return gl.sum(word, axis=0)


@gluon.jit
def k_block_256x128(a_bufs, b_bufs, ready, empty, s, phase, s_prev, pa, pb, acc0, acc1, acc2, acc3, sa_prev,
                     as_rows, bs_scales, WG: gl.constexpr, H: gl.constexpr, Q: gl.constexpr,
                     row_layout: gl.constexpr, col_layout: gl.constexpr, FIRST: gl.constexpr):  # fmt: skip
    """One K block of _consumer_256x128 (1x128-scaled B): four m64n64k32 chains over the warpgroup's
    128 x 128, in column-major order (rows h, columns q) = (0, 0), (1, 0), (0, 1), (1, 1), into the
    fresh accumulators pa, pb, pa, pb, each promoted while the next runs, as in _k_block_128x256. Each
    column-scale vector serves two consecutive chains: loaded once, and the two are never held
    together (in row-major order both would be live across a promotion, which spills). Promotions
    are (part * row scale) * column scale, so their first 32 FMULs need no ld.shared. Unless FIRST,
    the previous block's chain 3 (in ``pb``, row scales ``sa_prev``, column scales re-read from its
    stage) is promoted while chain 0 runs, and its stage released. Returns with chain 3 retired, in
    ``pb``, and its row scales."""
    mbarrier.wait(ready.index(s), phase)
    rows = as_rows.index(s).slice(WG * 2 * H, 2 * H)
    sa0 = rows.slice(0, H).load(row_layout)
    sa1 = rows.slice(H, H).load(row_layout)
    a_all = a_bufs.index(s).slice(WG * 2 * H, 2 * H)
    a0 = a_all.slice(0, H)
    a1 = a_all.slice(H, H)
    bt = b_bufs.index(s)
    b0 = bt.slice(0, Q).permute((1, 0))
    b1 = bt.slice(Q, Q).permute((1, 0))
    pa = warpgroup_mma(a0, b0, pa, use_acc=False, is_async=True)
    if not FIRST:
        sb3_prev = bs_scales.index(s_prev).slice(Q, Q).load(col_layout)
        acc3 = promote(acc3, pb, sa_prev, sb3_prev, False, True)
        release_stage(empty, s_prev)
    sb0 = bs_scales.index(s).slice(0, Q).load(col_layout)
    pb = warpgroup_mma(a1, b0, pb, use_acc=False, is_async=True)
    pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
    acc0 = promote(acc0, pa, sa0, sb0, False, True)
    pa = warpgroup_mma(a0, b1, pa, use_acc=False, is_async=True)
    pb = warpgroup_mma_wait(num_outstanding=1, deps=(pb,))
    acc2 = promote(acc2, pb, sa1, sb0, False, True)
    sb1 = bs_scales.index(s).slice(Q, Q).load(col_layout)
    pb = warpgroup_mma(a1, b1, pb, use_acc=False, is_async=True)
    pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
    acc1 = promote(acc1, pa, sa0, sb1, False, True)
    pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
    return pa, pb, acc0, acc1, acc2, acc3, sa1


@gluon.jit
def epilogue_add(acc, offs_m, m_mask, offs_n, n_mask, bias_ptr, c_ptr, stride_cm, HAS_BIAS: gl.constexpr,
                 ACCUMULATE: gl.constexpr):  # fmt: skip
    """The epilogue's fp32 arithmetic on rows ``offs_m`` x columns ``offs_n`` of the output: ``acc`` + the bias
    (per column) + the output's current value (``accumulate_into``), before the one rounding."""
    if HAS_BIAS:
        acc = acc + gl.expand_dims(gl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(gl.float32), 0)
    if ACCUMULATE:
        c_ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1) + gl.expand_dims(offs_n, 0)
        acc = acc + gl.load(c_ptrs, mask=gl.expand_dims(m_mask, 1) & gl.expand_dims(n_mask, 0), other=0.0)
    return acc


@gluon.jit
def store_piece(acc, PIECE: gl.constexpr, off_m, off_n, offs_m, m_mask, cols, c_desc, c_bufs, bias_ptr, c_ptr, N,
                stride_cm, WG: gl.constexpr, HAS_BIAS: gl.constexpr, ACCUMULATE: gl.constexpr):  # fmt: skip
    """Epilogue of one [64, 64] piece: ``epilogue_add``, one rounding, TMA store through the warpgroup's
    buffer ``PIECE & 1``. Piece 0 waits for every earlier store (the previous tile's, long done: a tile at
    the N edge may have stored 1 or 3 pieces, so its last store can use either buffer); pieces 1-3 wait for
    the store two pieces back, the last user of their buffer. (Bulk store groups are counted per thread:
    this relies on Triton issuing every TMA store of the warpgroup from the same elected lane, as its PTX
    shows, with a barrier after each wait.)"""
    offs_n = off_n + cols
    n_mask = offs_n < N
    acc = epilogue_add(acc, offs_m, m_mask, offs_n, n_mask, bias_ptr, c_ptr, stride_cm, HAS_BIAS, ACCUMULATE)
    c_smem = c_bufs.index(WG * 2 + (PIECE & 1))
    tma.store_wait(pendings=0 if PIECE == 0 else 1)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def store_rows(acc, off_n, offs_m, m_mask, cols, bias_ptr, c_ptr, N, stride_cm, HAS_BIAS: gl.constexpr,
               ACCUMULATE: gl.constexpr):  # fmt: skip
    """``store_piece`` from registers: ``epilogue_add``, one rounding, masked stores of the rows in
    ``m_mask`` (a grouped tile's piece that crosses its expert's end; outputs that no one TMA descriptor
    reaches)."""
    offs_n = off_n + cols
    n_mask = offs_n < N
    acc = epilogue_add(acc, offs_m, m_mask, offs_n, n_mask, bias_ptr, c_ptr, stride_cm, HAS_BIAS, ACCUMULATE)
    ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1) + gl.expand_dims(offs_n, 0)
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=gl.expand_dims(m_mask, 1) & gl.expand_dims(n_mask, 0))


@gluon.jit
def store_pieces(acc0, acc1, acc2, acc3, off_m, off_n0, offs_m, m_mask, cols, c_desc, c_bufs, bias_ptr, c_ptr, N,
                 stride_cm, WG: gl.constexpr, HAS_BIAS: gl.constexpr, ACCUMULATE: gl.constexpr):  # fmt: skip
    """Epilogue of a warpgroup's 64 x 256 rows of a 128x256 tile: its four [64, 64] pieces that start inside
    N (``store_piece``), at columns ``off_n0``, +64, +128, +192."""
    Q: gl.constexpr = c_bufs.type.shape[2]
    store_piece(acc0, 0, off_m, off_n0, offs_m, m_mask, cols, c_desc, c_bufs, bias_ptr, c_ptr, N, stride_cm, WG,
                HAS_BIAS, ACCUMULATE)  # fmt: skip
    if off_n0 + Q < N:
        store_piece(acc1, 1, off_m, off_n0 + Q, offs_m, m_mask, cols, c_desc, c_bufs, bias_ptr, c_ptr, N, stride_cm,
                    WG, HAS_BIAS, ACCUMULATE)  # fmt: skip
    if off_n0 + 2 * Q < N:
        store_piece(acc2, 2, off_m, off_n0 + 2 * Q, offs_m, m_mask, cols, c_desc, c_bufs, bias_ptr, c_ptr, N,
                    stride_cm, WG, HAS_BIAS, ACCUMULATE)  # fmt: skip
    if off_n0 + 3 * Q < N:
        store_piece(acc3, 3, off_m, off_n0 + 3 * Q, offs_m, m_mask, cols, c_desc, c_bufs, bias_ptr, c_ptr, N,
                    stride_cm, WG, HAS_BIAS, ACCUMULATE)  # fmt: skip
