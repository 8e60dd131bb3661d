"""Grouped blockwise FP8 GEMMs for NVIDIA Hopper (sm_90) in Gluon: the mixture-of-experts forms of
``gemm.py``'s dense kernels, one persistent launch for all experts, no host synchronisation.

Same contracts as ``gemm_grouped.grouped_gemm`` / ``grouped_wgrad`` (the portable Triton kernels),
and the same results bit for bit as a loop of dense Gluon calls (``blockwise_gemm_gluon``), one per
expert: every tile runs the dense kernel's K loop and promotion (``promote``, the dense kernel's
chain order), only the tile schedule and the epilogue's bounds differ.

``grouped_gemm_gluon`` (fprop, dgrad): ``C [T, N]``, expert ``e``'s rows ``= A_e [c_e, K] @ B_e [N, K]^T``;
A 1x128-scaled (scales ``[KB, >=T]``), B 128x128-scaled from stacked ``[E, N, K]`` buffers (scales
``[E, NB, pad4(KB)]``). 128x256 tiles, the dense 128x256 tile's mainloop: two consumer
warpgroups of 64 rows, four m64n64k32 wgmma chains per K block through two fresh accumulators, a
1-warp TMA producer filling a 4-deep smem ring (A, B and the [2, 16] B-scale box of each K block).
The A scales are not staged through shared memory: a tile starts at any token (``offsets[e] + 128 i``)
and a TMA box must start 16-byte aligned, so each consumer thread loads its two rows' scales from
global memory (L2) one K block ahead. Rows of a tile past the expert's end are computed from the
next expert's tokens and never stored: full 64-row pieces leave by TMA store, a warpgroup's piece
that crosses the end by masked stores from registers.

``grouped_wgrad_gluon``: ``dW_e [M, N] = dY_e^T X_e`` over expert ``e``'s token columns of the padded
columnwise copies (``[M, C]``, ``[N, C]``, scales ``[C/128, >=M]``, ``[C/128, >=N]``): 256x128 tiles, the
dense 256x128 tile's K block (``k_block_256x128``, scales by TMA: every box starts at a multiple
of 128) over ``ceil(c_e/128)`` K blocks (the zero padding of the last one stands for the dense
kernel's masked loads). Output: ``acc += C`` into ``E`` fp32 ``main_grad`` tensors lying in one span
of memory (Megatron's gradient buffer; reached through a pointer table, TMA-stored through one
descriptor over the span; ``GluonUnsupported`` otherwise) or into one ``[E, M, N]`` buffer; an empty
expert leaves its ``main_grad`` untouched and writes zeros otherwise (what the dense call with K = 0
returns).

Tile schedule (device side, from the ``GroupLayout``; ``schedule.py``): fwd/dgrad, expert ``e`` owns tiles
``padded[e]/128 * NT .. padded[e+1]/128 * NT`` (``NT = ceil(N/256)``), walked in the dense kernel's
L2-grouped order within the expert; a tile finds its expert by a binary search of ``padded_offsets``
(``ceil(log2 E)`` L1-resident loads). Total tiles ``padded[E]/128 * NT`` from the device; the grid is
``min(#SMs, capacity/128 * NT)`` and programs past the last tile stop. wgrad: ``E x MT x NT`` tiles,
expert-major. The kernels take no decisions: ``heuristics.py`` picks kernel and config.

Limits (``fwd_unsupported_reason``, ``wgrad_unsupported_reason``; the heuristics send every other call to
the portable kernels, which give the same bits): sm_90; K % 16 == 0 and N % 8 == 0 (fwd/dgrad); M, N % 16
== 0 (wgrad); contiguous 16-byte aligned operands; fwd/dgrad output bf16/fp16 (the dense 128x256 tile's
fp32 output spills); wgrad accumulation only into outputs that lie in one span of memory. The wrappers
raise ``GluonUnsupported`` for such input before anything is allocated or launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from ...grouped_tensor import GroupLayout
from ...recipe import BLOCK
from ...tensor import ceil_div
from ..triton.launch import FastLauncher
from ..triton.pointer_table import pointer_table
from .gemm_library import (
    B2D_SCALE_BOX,
    BLOCK_K,
    MAXNREG,
    SCALE_SMEM_LAYOUT,
    b2d_block_scale,
    k_block_256x128,
    promote,
    release_stage,
    scale_desc,
    shared_layout,
    stages_that_fit,
    store_piece,
    store_pieces,
    store_rows,
    tma_desc,
    tma_ready_scale,
)
from .schedule import fwd_tile, log2_experts, wgrad_tile
from .target import GluonUnsupported, num_sms, runs_on


@dataclass(frozen=True)
class GroupedConfig:
    """Launch configuration of a Gluon grouped GEMM (the ones the heuristics pick: ``heuristics.py``)."""

    block_m: int
    block_n: int
    num_stages: int = 0  # 0: as many as fit (at most 6)
    group_m: int = 8
    consumer_regs: int = 240
    producer_regs: int = 24
    ctas: int | None = None  # persistent CTAs (None: one per SM)

# --------------------------------------------------------------------------------------------------
# Device-side tile schedule
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# fprop / dgrad: 128x256 tiles, 128x128-scaled B
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _fwd_producer(a_desc, b_desc, bs_desc, a_bufs, b_bufs, bs_bufs, ready, empty, offsets_ptr, padded_ptr, E, N, K,
                  GROUP_M: gl.constexpr, LOG_E: gl.constexpr):  # fmt: skip
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + bs_desc.block_type.nbytes
    num_pid_n = gl.cdiv(N, BLOCK_N)
    nb = gl.cdiv(N, BK)  # B-scale rows per expert
    nk = gl.cdiv(K, BK)
    num_tiles = gl.load(padded_ptr + E) // BLOCK_M * num_pid_n
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e, row0, end, pid_n = fwd_tile(tile, offsets_ptr, padded_ptr, E, num_pid_n, BLOCK_M, GROUP_M, LOG_E)
        off_n = pid_n * BLOCK_N
        b_row = e * N + off_n  # rows of the [E * N, K] view; rows past this expert's N feed no stored column
        bs_row = e * nb + off_n // BK
        for kb in range(nk):
            s = it % NUM_STAGES
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, kb * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [b_row, kb * BK], ready.index(s), b_bufs.index(s))
            tma.async_copy_global_to_shared(bs_desc, [bs_row, kb & ~3], ready.index(s), bs_bufs.index(s))
            it += 1


@gluon.jit
def _k_block_fwd(a_bufs, b_bufs, ready, empty, s, phase, kb, s_prev, pa, pb, acc0, acc1, acc2, acc3, sa_prev, sa,
                 sa_next_ptrs, sa_next_mask, bs_words, WG: gl.constexpr, HALF_M: gl.constexpr, Q: gl.constexpr,
                 word_layout: gl.constexpr, SB_W: gl.constexpr, FIRST: gl.constexpr):  # fmt: skip
    """One K block of the dense ``_k_block_128x256`` (128x128-scaled B), with this block's A scales ``sa``
    in registers; loads the next block's (``sa_next_ptrs``) before waiting for the stage. Same chains,
    same promotions, same order; returns chain 3 retired in ``pb``, its row scales, the next A scales."""
    sa_next = gl.load(sa_next_ptrs, mask=sa_next_mask, other=0.0)
    mbarrier.wait(ready.index(s), phase)
    s_lo = sa * b2d_block_scale(bs_words, s, kb, 0, word_layout, SB_W)
    s_hi = sa * b2d_block_scale(bs_words, s, kb, 1, word_layout, SB_W)
    a_op = a_bufs.index(s).slice(WG * HALF_M, HALF_M)
    bt = b_bufs.index(s)
    pa = warpgroup_mma(a_op, bt.slice(0, Q).permute((1, 0)), pa, use_acc=False, is_async=True)
    if not FIRST:
        acc3 = promote(acc3, pb, sa_prev, 1.0, True)
        release_stage(empty, s_prev)
    pb = warpgroup_mma(a_op, bt.slice(Q, Q).permute((1, 0)), pb, use_acc=False, is_async=True)
    pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
    acc0 = promote(acc0, pa, s_lo, 1.0, True)
    pa = warpgroup_mma(a_op, bt.slice(2 * Q, Q).permute((1, 0)), pa, use_acc=False, is_async=True)
    pb = warpgroup_mma_wait(num_outstanding=1, deps=(pb,))
    acc1 = promote(acc1, pb, s_lo, 1.0, True)
    pb = warpgroup_mma(a_op, bt.slice(3 * Q, Q).permute((1, 0)), pb, use_acc=False, is_async=True)
    pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
    acc2 = promote(acc2, pa, s_hi, 1.0, True)
    pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
    return pa, pb, acc0, acc1, acc2, acc3, s_hi, sa_next


@gluon.jit
def _fwd_consumer(a_bufs, b_bufs, bs_bufs, ready, empty, c_desc, c_bufs, a_s_ptr, bias_ptr, c_ptr, offsets_ptr,
                  padded_ptr, E, N, K, stride_as, stride_cm, stride_biase, WG: gl.constexpr, HAS_BIAS: gl.constexpr,
                  GROUP_M: gl.constexpr, LOG_E: gl.constexpr):  # fmt: skip
    """Warpgroup ``WG`` (rows WG*64 .. +63) of each 128 x 256 tile: the dense ``_consumer_128x256``'s K
    loop; epilogue bounded by the expert's last token row."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF_M: gl.constexpr = c_bufs.type.shape[1]
    Q: gl.constexpr = c_bufs.type.shape[2]
    gl.static_assert(BLOCK_N == 4 * Q)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, Q, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    word_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    SB_W: gl.constexpr = bs_bufs.type.shape[2]
    bs_words = bs_bufs._reinterpret(gl.float32, [NUM_STAGES * 2 * SB_W, 1], flat)

    num_pid_n = gl.cdiv(N, BLOCK_N)
    nk = gl.cdiv(K, BK)
    num_tiles = gl.load(padded_ptr + E) // BLOCK_M * num_pid_n
    zero = gl.zeros([HALF_M, Q], gl.float32, mma_layout)
    cols = gl.arange(0, Q, layout=col_layout)
    rows = gl.arange(0, HALF_M, layout=row_layout)
    it = 0
    pa = gl.zeros([HALF_M, Q], gl.float32, mma_layout)
    pb = gl.zeros([HALF_M, Q], gl.float32, mma_layout)
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        e, row0, end, pid_n = fwd_tile(tile, offsets_ptr, padded_ptr, E, num_pid_n, BLOCK_M, GROUP_M, LOG_E)
        off_m = row0 + WG * HALF_M
        off_n0 = pid_n * BLOCK_N
        offs_m = off_m + rows
        m_mask = offs_m < end
        sa_ptrs = a_s_ptr + offs_m
        sa = gl.load(sa_ptrs, mask=m_mask, other=0.0)

        s = it % NUM_STAGES
        pa, pb, acc0, acc1, acc2, acc3, sa3, sa = _k_block_fwd(
            a_bufs, b_bufs, ready, empty, s, (it // NUM_STAGES) & 1, 0, s, pa, pb, zero, zero, zero, zero,
            gl.zeros([HALF_M], gl.float32, row_layout), sa, sa_ptrs + stride_as, m_mask & (nk > 1), bs_words, WG,
            HALF_M, Q, word_layout, SB_W, True,
        )  # fmt: skip
        s_prev = s
        it += 1
        for kb in range(1, nk):
            s = it % NUM_STAGES
            pa, pb, acc0, acc1, acc2, acc3, sa3, sa = _k_block_fwd(
                a_bufs, b_bufs, ready, empty, s, (it // NUM_STAGES) & 1, kb, s_prev, pa, pb, acc0, acc1, acc2, acc3,
                sa3, sa, sa_ptrs + (kb + 1) * stride_as, m_mask & (kb + 1 < nk), bs_words, WG, HALF_M, Q,
                word_layout, SB_W, False,
            )  # fmt: skip
            s_prev = s
            it += 1
        acc3 = promote(acc3, pb, sa3, 1.0, True)
        release_stage(empty, s_prev)

        # ---- epilogue: the pieces that start inside N, of the rows before the expert's end
        bias_e = bias_ptr + e * stride_biase
        live = end - off_m
        if live >= HALF_M:
            store_pieces(acc0, acc1, acc2, acc3, off_m, off_n0, offs_m, m_mask, cols, c_desc, c_bufs, bias_e, c_ptr, N,
                         stride_cm, WG, HAS_BIAS, False)  # fmt: skip
        elif live > 0:
            store_rows(acc0, off_n0, offs_m, m_mask, cols, bias_e, c_ptr, N, stride_cm, HAS_BIAS, False)
            store_rows(acc1, off_n0 + Q, offs_m, m_mask, cols, bias_e, c_ptr, N, stride_cm, HAS_BIAS, False)
            store_rows(acc2, off_n0 + 2 * Q, offs_m, m_mask, cols, bias_e, c_ptr, N, stride_cm, HAS_BIAS, False)
            store_rows(acc3, off_n0 + 3 * Q, offs_m, m_mask, cols, bias_e, c_ptr, N, stride_cm, HAS_BIAS, False)
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_fwd_gluon_kernel(
    a_desc, b_desc, c_desc, bs_desc, a_s_ptr, bias_ptr, c_ptr, offsets_ptr, padded_ptr,
    E, N, K, stride_as, stride_cm, stride_biase,
    HAS_BIAS: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, LOG_E: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]
    C_N: gl.constexpr = c_desc.block_type.shape[1]
    gl.static_assert(BLOCK_M == 2 * HALF_M and BLOCK_N == 4 * C_N)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BK], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [4, HALF_M, C_N], c_desc.layout)
    bs_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + bs_desc.block_type.shape, bs_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    gl.warp_specialize([
        (_fwd_consumer, (a_bufs, b_bufs, bs_bufs, ready, empty, c_desc, c_bufs, a_s_ptr, bias_ptr, c_ptr, offsets_ptr,
                         padded_ptr, E, N, K, stride_as, stride_cm, stride_biase, 0, HAS_BIAS, GROUP_M, LOG_E)),
        (_fwd_consumer, (a_bufs, b_bufs, bs_bufs, ready, empty, c_desc, c_bufs, a_s_ptr, bias_ptr, c_ptr, offsets_ptr,
                         padded_ptr, E, N, K, stride_as, stride_cm, stride_biase, 1, HAS_BIAS, GROUP_M, LOG_E)),
        (_fwd_producer, (a_desc, b_desc, bs_desc, a_bufs, b_bufs, bs_bufs, ready, empty, offsets_ptr, padded_ptr, E, N,
                         K, GROUP_M, LOG_E)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


# --------------------------------------------------------------------------------------------------
# wgrad: 256x128 tiles, 1x128-scaled B, E outputs
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _wgrad_producer(a_desc, b_desc, as_desc, bs_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, offsets_ptr,
                    padded_ptr, E, M, N, ACCUMULATE: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + as_desc.block_type.nbytes
                            + bs_desc.block_type.nbytes)  # fmt: skip
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    it = 0
    for tile in range(gl.program_id(0), E * num_pid_m * num_pid_n, gl.num_programs(0)):
        e, pid_m, pid_n, nk, col0 = wgrad_tile(tile, offsets_ptr, padded_ptr, num_pid_m, num_pid_n, GROUP_M, BK)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        srow = col0 // BK
        for kb in range(nk):
            s = it % NUM_STAGES
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, col0 + kb * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, col0 + kb * BK], ready.index(s), b_bufs.index(s))
            tma.async_copy_global_to_shared(as_desc, [srow + kb, off_m], ready.index(s), as_bufs.index(s))
            tma.async_copy_global_to_shared(bs_desc, [srow + kb, off_n], ready.index(s), bs_bufs.index(s))
            it += 1


@gluon.jit
def _wgrad_out(c_table_ptr, c0_ptr, e, M, stride_ce, span_base, row_bytes, C_TABLE: gl.constexpr):
    """Expert ``e``'s output (its entry of the pointer table, or its slice of the stacked buffer) and its
    first row in the span descriptor (``(address - span_base) / row_bytes``; ``e * M`` when stacked)."""
    if C_TABLE:
        addr = gl.load(c_table_ptr + e)
        c_e = addr.to(gl.pointer_type(c0_ptr.dtype.element_ty))
        row0 = ((addr - span_base) // row_bytes).to(gl.int32)
    else:
        c_e = c0_ptr + e.to(gl.int64) * stride_ce
        row0 = e * M
    return c_e, row0


@gluon.jit
def _wgrad_epilogue(acc0, acc1, acc2, acc3, c_desc, c_bufs, c_e, row0, off_m, off_n, M, N, WG: gl.constexpr,
                    H: gl.constexpr, Q: gl.constexpr, row_layout: gl.constexpr, col_layout: gl.constexpr,
                    ACCUMULATE: gl.constexpr, STORE_TMA: gl.constexpr):  # fmt: skip
    """The four [64, 64] pieces (rows h, columns q) = acc0 (0, 0), acc1 (0, 1), acc2 (1, 0), acc3 (1, 1) of the
    warpgroup's 128 rows at (``off_m``, ``off_n``) of the expert's output ``c_e`` [M, N]: ``+= C`` when
    accumulating; STORE_TMA: the dense ``store_piece`` (TMA store at row ``row0 + off_m`` of the span
    descriptor ``c_desc``), else masked stores from registers."""
    offs_m0 = off_m + gl.arange(0, H, layout=row_layout)
    offs_m1 = offs_m0 + H
    cols = gl.arange(0, Q, layout=col_layout)
    if STORE_TMA:  # (pieces from row M on would reach the next output: skipped; M % 64 == 0)
        if off_m < M:
            store_piece(acc0, 0, row0 + off_m, off_n, offs_m0, offs_m0 < M, cols, c_desc, c_bufs, c_e, c_e, N, N, WG,
                        False, ACCUMULATE)  # fmt: skip
            if off_n + Q < N:
                store_piece(acc1, 1, row0 + off_m, off_n + Q, offs_m0, offs_m0 < M, cols, c_desc, c_bufs, c_e, c_e, N,
                            N, WG, False, ACCUMULATE)  # fmt: skip
        if off_m + H < M:  # (piece 0 again: piece 1 may have been skipped, see the dense epilogue)
            store_piece(acc2, 0, row0 + off_m + H, off_n, offs_m1, offs_m1 < M, cols, c_desc, c_bufs, c_e, c_e, N, N,
                        WG, False, ACCUMULATE)  # fmt: skip
            if off_n + Q < N:
                store_piece(acc3, 3, row0 + off_m + H, off_n + Q, offs_m1, offs_m1 < M, cols, c_desc, c_bufs, c_e,
                            c_e, N, N, WG, False, ACCUMULATE)  # fmt: skip
    else:
        store_rows(acc0, off_n, offs_m0, offs_m0 < M, cols, c_e, c_e, N, N, False, ACCUMULATE)
        store_rows(acc1, off_n + Q, offs_m0, offs_m0 < M, cols, c_e, c_e, N, N, False, ACCUMULATE)
        store_rows(acc2, off_n, offs_m1, offs_m1 < M, cols, c_e, c_e, N, N, False, ACCUMULATE)
        store_rows(acc3, off_n + Q, offs_m1, offs_m1 < M, cols, c_e, c_e, N, N, False, ACCUMULATE)


@gluon.jit
def _wgrad_consumer(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_desc, c_bufs, c_table_ptr, c0_ptr, offsets_ptr,
                    padded_ptr, E, M, N, stride_ce, span_base, row_bytes, WG: gl.constexpr, C_TABLE: gl.constexpr,
                    ACCUMULATE: gl.constexpr, STORE_TMA: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """Warpgroup ``WG`` (rows WG*128 .. +127) of each 256 x 128 tile: the dense ``_consumer_256x128``'s K
    loop over the expert's K blocks; epilogue into the expert's output (``_wgrad_epilogue``)."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    H: gl.constexpr = BLOCK_M // 4
    Q: gl.constexpr = BLOCK_N // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, Q, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    as_rows = as_bufs._reinterpret(gl.float32, [NUM_STAGES, BLOCK_M], flat)
    bs_scales = bs_bufs._reinterpret(gl.float32, [NUM_STAGES, BLOCK_N], flat)

    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    zero = gl.zeros([H, Q], gl.float32, mma_layout)
    it = 0
    pa = gl.zeros([H, Q], gl.float32, mma_layout)
    pb = gl.zeros([H, Q], gl.float32, mma_layout)
    for tile in range(gl.program_id(0), E * num_pid_m * num_pid_n, gl.num_programs(0)):
        e, pid_m, pid_n, nk, col0 = wgrad_tile(tile, offsets_ptr, padded_ptr, num_pid_m, num_pid_n, GROUP_M, BK)
        off_m = pid_m * BLOCK_M + WG * 2 * H
        off_n = pid_n * BLOCK_N
        if nk > 0:
            s = it % NUM_STAGES
            pa, pb, acc0, acc1, acc2, acc3, sa3 = k_block_256x128(
                a_bufs, b_bufs, ready, empty, s, (it // NUM_STAGES) & 1, s, pa, pb, zero, zero, zero, zero,
                gl.zeros([H], gl.float32, row_layout), as_rows, bs_scales, WG, H, Q, row_layout, col_layout, True,
            )  # fmt: skip
            s_prev = s
            it += 1
            for _kb in range(1, nk):
                s = it % NUM_STAGES
                pa, pb, acc0, acc1, acc2, acc3, sa3 = k_block_256x128(
                    a_bufs, b_bufs, ready, empty, s, (it // NUM_STAGES) & 1, s_prev, pa, pb, acc0, acc1, acc2, acc3,
                    sa3, as_rows, bs_scales, WG, H, Q, row_layout, col_layout, False,
                )  # fmt: skip
                s_prev = s
                it += 1
            acc3 = promote(acc3, pb, sa3, bs_scales.index(s_prev).slice(Q, Q).load(col_layout), False, True)
            release_stage(empty, s_prev)
            c_e, row0 = _wgrad_out(c_table_ptr, c0_ptr, e, M, stride_ce, span_base, row_bytes, C_TABLE)
            _wgrad_epilogue(acc0, acc1, acc2, acc3, c_desc, c_bufs, c_e, row0, off_m, off_n, M, N, WG, H, Q, row_layout,
                            col_layout, ACCUMULATE, STORE_TMA)  # fmt: skip
        elif not ACCUMULATE:  # an empty expert: a plain output is zero (main_grad is left as it is)
            c_e, row0 = _wgrad_out(c_table_ptr, c0_ptr, e, M, stride_ce, span_base, row_bytes, C_TABLE)
            _wgrad_epilogue(zero, zero, zero, zero, c_desc, c_bufs, c_e, row0, off_m, off_n, M, N, WG, H, Q,
                            row_layout, col_layout, False, STORE_TMA)  # fmt: skip
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_wgrad_gluon_kernel(
    a_desc, b_desc, as_desc, bs_desc, c_desc, c_table_ptr, c0_ptr, offsets_ptr, padded_ptr, E, M, N, stride_ce,
    span_base, row_bytes, C_TABLE: gl.constexpr, ACCUMULATE: gl.constexpr, STORE_TMA: gl.constexpr,
    NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    # c_desc: a TMA descriptor over the span of memory holding every expert's output (rows of N), or None
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BK], b_desc.layout)
    if STORE_TMA:  # two [64, 64] output buffers per consumer warpgroup, as in the dense kernel
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [4] + c_desc.block_type.shape, c_desc.layout)
        c_src = c_desc
    else:
        c_bufs = a_bufs
        c_src = a_desc
    as_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], as_desc.layout)
    bs_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_N], bs_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_wgrad_consumer, (a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_src, c_bufs, c_table_ptr, c0_ptr,
                           offsets_ptr, padded_ptr, E, M, N, stride_ce, span_base, row_bytes, 0, C_TABLE, ACCUMULATE,
                           STORE_TMA, GROUP_M)),
        (_wgrad_consumer, (a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, c_src, c_bufs, c_table_ptr, c0_ptr,
                           offsets_ptr, padded_ptr, E, M, N, stride_ce, span_base, row_bytes, 1, C_TABLE, ACCUMULATE,
                           STORE_TMA, GROUP_M)),
        (_wgrad_producer, (a_desc, b_desc, as_desc, bs_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty,
                           offsets_ptr, padded_ptr, E, M, N, ACCUMULATE, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

_launch_fwd = FastLauncher(grouped_fwd_gluon_kernel)
_launch_wgrad = FastLauncher(grouped_wgrad_gluon_kernel)


def output_span(outs: Sequence[torch.Tensor], m: int, n: int) -> tuple[torch.Tensor, int, int] | None:
    """(base tensor, rows, row bytes) of one TMA descriptor that reaches every ``[m, n]`` output in ``outs``
    as rows of ``n`` elements, or None where none does: each output's address must lie a whole number of rows
    past the lowest (Megatron's gradient buffer holds an expert linear's main_grads so), rows 16-byte aligned,
    ``m % 64 == 0`` (a 64-row piece never crosses into the next output), rows within int32."""
    row_bytes = n * outs[0].element_size()
    addrs = [o.data_ptr() for o in outs]
    base = min(addrs)
    if m % 64 or row_bytes % 16 or base % 16 or any((a - base) % row_bytes for a in addrs):
        return None
    rows = (max(addrs) - base) // row_bytes + m
    if rows >= 2**31:
        return None
    return outs[addrs.index(base)], rows, row_bytes


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    for t in (a, b):
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not t.is_contiguous():
            raise TypeError(f"FP8 (e4m3fn/e5m2) contiguous operands required, got {t.dtype}")


def _device_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if not runs_on(a.device):
        return f"the Gluon grouped GEMMs run on NVIDIA Hopper (sm_90) GPUs only, got {a.device}"
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return "the operands must be 16-byte aligned"
    return None


def fwd_unsupported_reason(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> str | None:
    """Why ``grouped_gemm_gluon`` does not take ``a [T, K]`` x ``b [E, N, K]`` into ``out_dtype`` (plus
    ``bias``), or None: sm_90, 16-byte aligned operands, K % 16 == 0 and N % 8 == 0 (TMA), a bf16/fp16 output
    (the 128x256 tile's fp32 output spills), a bias ``[E, N]`` of the output dtype with contiguous rows."""
    why = _device_reason(a, b)
    if why is not None:
        return why
    e, n, k = b.shape
    if out_dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon grouped GEMM's 128x256 tile writes bf16/fp16, not {out_dtype}"
    if k % 16 or n % 8:
        return f"K={k} must be a multiple of 16 and N={n} of 8 (TMA)"
    if bias is not None and (bias.shape != (e, n) or bias.dtype != out_dtype or bias.stride(1) != 1):
        return f"bias must be [E, N] of {out_dtype} with contiguous rows"
    return None


def wgrad_unsupported_reason(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, accumulate_into: Sequence[torch.Tensor] | None = None
) -> str | None:
    """Why ``grouped_wgrad_gluon`` does not take ``a [M, C]`` x ``b [N, C]`` into ``accumulate_into`` or new
    ``out_dtype`` tensors, or None: sm_90, 16-byte aligned operands, M and N multiples of 16 (TMA boxes of the
    scales), a bf16/fp16 output or fp32 ``accumulate_into`` lying in one span of memory (``output_span``: the
    register-store epilogue gave wrong tiles when accumulating, before the stage release was fenced
    (``gemm_library.release_stage``), and has not been run so since)."""
    why = _device_reason(a, b)
    if why is not None:
        return why
    m, n = a.shape[0], b.shape[0]
    if m % 16 or n % 16:
        return f"M={m} and N={n} must be multiples of 16 (TMA boxes of the scales)"
    if accumulate_into is None and out_dtype not in (torch.bfloat16, torch.float16):
        return (f"the Gluon grouped wgrad writes bf16/fp16 or accumulates into fp32, not {out_dtype} (a plain fp32 "
                "output spills registers, as the dense 256x128 tile's)")  # fmt: skip
    if accumulate_into is not None and m and n and output_span(list(accumulate_into), m, n) is None:
        return ("accumulating into main_grads that do not lie in one span of memory (whole rows apart, m % 64 == 0) "
                "is not supported by the Gluon kernel (its register-store epilogue is not verified for accumulation); "
                "use the portable kernel (kernels/triton/gemm_grouped.py)")  # fmt: skip
    return None


def grouped_gemm_gluon(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    layout: GroupLayout,
    *,
    out_dtype: torch.dtype,
    config: GroupedConfig,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The portable ``grouped_gemm``'s contract (kernels/triton/gemm_grouped.py) on the Gluon 128x256 kernel:
    ``C [T, N]``, expert ``e``'s rows of ``a [T, K]`` (1x128 scales ``[ceil(K/128), >=T]``) times ``b[e]^T``
    (``b [E, N, K]``, 128x128 scales ``[E, ceil(N/128), >=ceil(K/128)]``) plus ``bias[e]`` (``[E, N]``, the
    output dtype), with ``config`` (``heuristics.grouped_fwd_config``). Raises ``GluonUnsupported`` for input
    ``fwd_unsupported_reason`` refuses, before anything is allocated or launched."""
    _check_operands(a, b)
    t, k = a.shape
    e, n, kb_ = b.shape
    if kb_ != k or e != layout.num_groups or t != layout.num_tokens:
        raise ValueError(f"a is {tuple(a.shape)} and b {tuple(b.shape)} for a layout of {layout.num_groups} experts, "
                         f"{layout.num_tokens} tokens")  # fmt: skip
    why = fwd_unsupported_reason(a, b, out_dtype, bias)
    if why is not None:
        raise GluonUnsupported(why)
    cfg = config
    c = torch.empty(t, n, dtype=out_dtype, device=a.device)
    if k == 0:
        return c.zero_()
    if t == 0 or n == 0:
        return c
    bm, bn = cfg.block_m, cfg.block_n
    nbk = ceil_div(k, BLOCK_K)
    bs2d = b_scale_inv.reshape(e * b_scale_inv.shape[1], b_scale_inv.shape[2])
    bs2d = tma_ready_scale(bs2d, nbk)
    stages = stages_that_fit(bm, bn, out_dtype, cfg.num_stages, 2)
    a_desc = tma_desc(a, [t, k], [k, 1], [bm, BLOCK_K], shared_layout([bm, BLOCK_K], a.dtype))
    b2d = b.view(e * n, k)
    b_desc = tma_desc(b2d, [e * n, k], [k, 1], [bn, BLOCK_K], shared_layout([bn, BLOCK_K], b.dtype))
    c_desc = tma_desc(c, [t, n], [n, 1], [64, 64], shared_layout([64, 64], c.dtype))
    bs_desc = scale_desc(bs2d, nbk, list(B2D_SCALE_BOX))
    tiles = layout.capacity // BLOCK * ceil_div(n, bn)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    grid = (max(1, min(tiles, cfg.ctas or num_sms(dev))),)
    _launch_fwd(
        grid, a_desc, b_desc, c_desc, bs_desc, a_scale_inv, bias if bias is not None else c, c, layout.offsets,
        layout.padded_offsets, e, n, k, a_scale_inv.stride(0), c.stride(0), bias.stride(0) if bias is not None else 0,
        bias is not None, stages, cfg.group_m, log2_experts(e), cfg.consumer_regs, cfg.producer_regs,
        num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return c


def grouped_wgrad_gluon(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    layout: GroupLayout,
    *,
    out_dtype: torch.dtype,
    config: GroupedConfig,
    accumulate_into: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The portable ``grouped_wgrad``'s contract (kernels/triton/gemm_grouped.py) on the Gluon 256x128 kernel:
    ``C_e [M, N] = a_e @ b_e^T`` over each expert's token columns of ``a [M, C]`` and ``b [N, C]`` (padded
    columnwise copies, 1x128 scales ``[C/128, pad4(M)]`` and ``[C/128, pad4(N)]``), into ``accumulate_into``
    (``E`` contiguous fp32 ``[M, N]``, added to in place) or new tensors (views of one ``[E, M, N]`` of
    ``out_dtype``), with ``config`` (``heuristics.grouped_wgrad_config``). Raises ``GluonUnsupported`` for
    input ``wgrad_unsupported_reason`` refuses, before anything is allocated or launched."""
    _check_operands(a, b)
    m, cap = a.shape
    n = b.shape[0]
    e = layout.num_groups
    if b.shape[1] != cap or cap != layout.capacity:
        raise ValueError(f"a is {tuple(a.shape)}, b {tuple(b.shape)}; both need the layout's {layout.capacity} token columns")
    if accumulate_into is not None:
        outs = list(accumulate_into)
        if len(outs) != e or any(o.shape != (m, n) or o.dtype != torch.float32 or not o.is_contiguous() for o in outs):
            raise ValueError(f"accumulate_into must be {e} contiguous float32 [{m}, {n}] tensors")
    if m == 0 or n == 0:  # nothing to compute: the outputs as they are
        return outs if accumulate_into is not None else list(torch.empty(e, m, n, dtype=out_dtype, device=a.device))
    why = wgrad_unsupported_reason(a, b, out_dtype, accumulate_into)
    if why is not None:
        raise GluonUnsupported(why)
    if accumulate_into is not None:
        c0, table, stride_ce = outs[0], pointer_table(outs).addresses, 0
    else:
        stacked = torch.empty(e, m, n, dtype=out_dtype, device=a.device)
        outs = list(stacked.unbind(0))
        c0, table, stride_ce = stacked, stacked, m * n
    cfg = config
    bm, bn = cfg.block_m, cfg.block_n
    span = output_span(outs, m, n)
    store_tma = span is not None
    a_scale_inv = tma_ready_scale(a_scale_inv, m)
    b_scale_inv = tma_ready_scale(b_scale_inv, n)
    a_desc = tma_desc(a, [m, cap], [cap, 1], [bm, BLOCK_K], shared_layout([bm, BLOCK_K], a.dtype))
    b_desc = tma_desc(b, [n, cap], [cap, 1], [bn, BLOCK_K], shared_layout([bn, BLOCK_K], b.dtype))
    as_desc = tma_desc(a_scale_inv, [a_scale_inv.shape[0], m], [a_scale_inv.stride(0), 1], [1, bm], SCALE_SMEM_LAYOUT)
    bs_desc = tma_desc(b_scale_inv, [b_scale_inv.shape[0], n], [b_scale_inv.stride(0), 1], [1, bn], SCALE_SMEM_LAYOUT)
    c_desc, span_base, row_bytes = None, 0, 1
    if store_tma:
        base_t, rows, row_bytes = span
        c_desc = tma_desc(base_t, [rows, n], [n, 1], [64, 64], shared_layout([64, 64], base_t.dtype))
        span_base = base_t.data_ptr()
    tiles = e * ceil_div(m, bm) * ceil_div(n, bn)
    dev = a.device.index if a.device.index is not None else torch.cuda.current_device()
    grid = (max(1, min(tiles, cfg.ctas or num_sms(dev))),)
    _launch_wgrad(
        grid, a_desc, b_desc, as_desc, bs_desc, c_desc, table, c0, layout.offsets, layout.padded_offsets, e, m, n,
        stride_ce, span_base, row_bytes, accumulate_into is not None, accumulate_into is not None, store_tma,
        stages_that_fit(bm, bn, c0.dtype, cfg.num_stages, 1, store_tma), cfg.group_m, cfg.consumer_regs, cfg.producer_regs,
        num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return outs
