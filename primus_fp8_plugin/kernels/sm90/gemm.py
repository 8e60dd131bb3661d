"""Blockwise-scaled FP8 GEMM for NVIDIA Hopper (sm_90) in Gluon: ``C [M, N] = A [M, K] @ B [N, K]^T``.

Same math, scale layouts and wrapper contract as the portable ``blockwise_gemm`` (kernels/triton/gemm.py):
each 128-wide K block's tensor-core product is scaled by ``a_scale_inv[kb, m] * b_scale(n, kb)`` and added
to an fp32 accumulator (TE ``Float8BlockScaling`` / DeepSeek-V3 promotion). A is 1x128-scaled; B is 128x128-scaled
(fprop, dgrad: ``b_block_dim=2``) or 1x128-scaled (wgrad: ``b_block_dim=1``).

Design: persistent and warp specialised. One CTA per SM walks the output tiles in an L2-grouped order
(GROUP_M rows of tiles sweep the N tiles together). A 1-warp producer partition TMA-loads each K
block's A and B FP8 tiles into NVMMA-swizzled shared memory through a NUM_STAGES-deep ready/empty
mbarrier ring. Two 4-warp consumer partitions (one warpgroup each, half of the tile's rows) run async
``wgmma`` (m64nNk32, e4m3/e5m2 operands) of each K block into a fresh fp32 accumulator and promote it
into the running accumulator on the CUDA cores (``acc += part * a_scale[m] * b_scale[n]``) while the
tensor cores run the next chain. Registers move between the partitions with ``setmaxnreg``; the
kernel has 12 warps under ``maxnreg=168`` (168 x 384 threads fit the 64K-register file). Epilogue per
warpgroup: + bias (fp32), + ``accumulate_into`` (fp32), one rounding to the output dtype, registers ->
swizzled shared memory -> TMA store, whose completion overlaps the next tile's K loop.

Tiles (``GluonGemmConfig``; ``heuristics.gemm_config`` picks one per call; BLOCK_K is always 128):

  tile     config           picked for                         one consumer warpgroup, per K block
  128x256  CONFIG_128x256   128x128-scaled B (fwd, dgrad),     64 rows; four m64n64k32 chains (B rows 0-63,
                            and 1x128-scaled B with a bias     ..., 192-255) alternating between two fresh
                                                               accumulators: chain j is promoted while j+1 runs
  256x128  CONFIG_256x128   1x128-scaled B without a bias      128 rows as two m64 halves; four m64n64k32 chains
                            (wgrad)                            in column-major order, so that each 64-column
                                                               scale vector serves two consecutive chains
  128x128  CONFIG_128x128   what the two above refuse: a       64 rows; one m64n128k32 chain, waited for, its
                            plain fp32 output; 1x128 B with    stage released, then promoted (the other
                            accumulate_into and a bias         warpgroup's wgmma fills the tensor cores)
  128x64   block_n=64       an explicit ``config=`` only       as 128x128, with one m64n64k32 chain

* 128x256 and 256x128: the producer also TMA-loads each K block's scales into the stage (the A-scale
  row slice [BLOCK_M]; 1x128 B: the [BLOCK_N] row slice; 128x128 B: a [2, 16] box holding the tile's
  two block scales, ``B2D_SCALE_BOX``), and the consumers read them with ld.shared a chain ahead of
  their use (a 128x128 B scale as one broadcast word). The last chain of a K block is retired inside
  the block: a wgmma in flight across the K loop's back edge makes ptxas serialise every wgmma. Four
  running + two fresh accumulators are 4 x 32 + 2 x 32 fp32 registers per thread; setmaxnreg 240 /
  24. The epilogue stores four [64, 64] pieces per warpgroup through two buffers, so that one piece's
  store overlaps the next piece's conversion.
* 256x128 promotes as ``(part * a_scale) * b_scale``: the FMULs by the row scales (in registers
  since the stage's ready wait) need not wait for the column scales' ld.shared. Equal to
  ``part * (a_scale * b_scale)`` for power-of-2 scales (TE's default), within an ulp otherwise.
* 128x128 and 128x64: the scales come from global memory (L2-resident), prefetched into registers one
  K block ahead; one [64, BLOCK_N] output buffer per warpgroup; setmaxnreg 232 / 40.
* Pipeline depth: as many stages as fit in 227 KiB of shared memory beside the output buffers, at
  most 6 (``stages_that_fit``), unless the config asks for a number.

Scale layouts: TE's [KB, pad4(M)] (1x128) and [NB, pad4(KB)] (128x128) tensors have 16-byte aligned
rows, as TMA needs, and are read in place; other layouts are copied first (``tma_ready_scale``);
TMA zero-fills entries past the tensor.

Limits (``unsupported_reason``: what the kernel takes; the heuristics send every other call to the
portable kernel, kernels/triton/gemm.py): NVIDIA sm_90; A and B row-major (K contiguous) and 16-byte
aligned, K % 16 == 0 (TMA row strides), N % 8 == 0 (the output's TMA store); operands float8_e4m3fn
or float8_e5m2; ``accumulate_into`` with 16-byte aligned rows. Configs (``supports``: which configs
take which calls): 128x256 not with a plain fp32 output, nor with 1x128 B, ``accumulate_into`` and a
bias (both spill registers); 256x128 only with 1x128 B, no bias and no plain fp32 output. The wrapper
checks all of it before anything is allocated or launched: wrong inputs raise ValueError / TypeError
(the contract shared with the portable kernel), inputs outside the limits ``GluonUnsupported``, a
config that does not take the call NotImplementedError.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...tensor import ceil_div
from ..triton.gemm import check_operands
from ..triton.launch import FastLauncher, aligned, int_class
from .gemm_library import (
    B2D_SCALE_BOX,
    BLOCK_K,
    MAXNREG,
    b2d_block_scale,
    c_block_n,
    epilogue_add,
    k_block_256x128,
    promote,
    release_stage,
    scale_desc,
    shared_layout,
    stages_that_fit,
    store_piece,
    store_pieces,
    tma_desc,
    tma_ready_scale,
)
from .schedule import tile_coords, tile_grid
from .target import GluonUnsupported, num_sms, runs_on


@dataclass(frozen=True)
class GluonGemmConfig:
    """Launch configuration: the output tile (``block_m`` x ``block_n``: 128x64, 128x128, 128x256, or
    256x128 for 1x128-scaled B), the pipeline depth, the L2 grouping and the setmaxnreg split (the
    defaults: the 128x128 tile; the configs the heuristics pick: ``heuristics.py``)."""

    block_m: int = 128  # 128: each consumer warpgroup owns 64 rows; 256: 128 rows (block_n=128 only)
    block_n: int = 128
    num_stages: int = 0  # 0: as many as fit in shared memory (at most 6)
    group_m: int = 8
    consumer_regs: int = 232
    producer_regs: int = 40

    @property
    def scale_tma(self) -> bool:
        """Whether the producer TMA-loads each K block's scales into the smem stage with the tiles
        (128x256 and 256x128 tiles); 128x128 and 128x64 tiles read them from global memory."""
        return self.block_n == 256 or self.block_m == 256


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, as_desc, bs_desc, as_bufs, bs_bufs,
              GROUP_M: gl.constexpr, SCALE_TMA: gl.constexpr, B_2D: gl.constexpr):  # fmt: skip
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    num_pid_m, num_pid_n, num_tiles, nk = tile_grid(M, N, K, BLOCK_M, BLOCK_N, BK)
    if SCALE_TMA:
        # + the K block's A-scale [1, BLOCK_M] row slice and B-scale box ([1, BLOCK_N], or [2, 16] for
        # 128x128 B scales) (fp32; entries past the tensor are zero-filled and, like the tiles'
        # out-of-bounds bytes, count towards the bytes)
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + as_desc.block_type.nbytes
                                + bs_desc.block_type.nbytes)  # fmt: skip
    else:
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kb in range(nk):
            s = it % NUM_STAGES
            phase = (it // NUM_STAGES) & 1
            # The ring starts empty: the first wait on each slot (parity 1) passes at once.
            mbarrier.wait(empty.index(s), phase ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, kb * BK], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [off_n, kb * BK], ready.index(s), b_bufs.index(s))
            if SCALE_TMA:
                tma.async_copy_global_to_shared(as_desc, [kb, off_m], ready.index(s), as_bufs.index(s))
                if B_2D:  # b_s[n // 128 + (0, 1), kb] in a [2, 16] box starting at the 16-byte aligned
                    # column kb & ~3 (B2D_SCALE_BOX)
                    tma.async_copy_global_to_shared(bs_desc, [off_n // BK, kb & ~3], ready.index(s), bs_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(bs_desc, [kb, off_n], ready.index(s), bs_bufs.index(s))
            it += 1


@gluon.jit
def _load_scales(a_s_ptr, b_s_ptr, kb, nk, offs_m, m_mask, offs_n, n_mask, sb_row_ptr, stride_as, stride_bs,
                 B_2D: gl.constexpr):  # fmt: skip
    # a_scale [64] (rows of this warpgroup); b_scale: [BLOCK_N] for 1x128 B, a scalar for 128x128 B
    # (kb == nk happens for the prefetch after the last K block: masked off)
    sa = gl.load(a_s_ptr + kb * stride_as + offs_m, mask=m_mask & (kb < nk), other=0.0)
    if B_2D:
        sb = gl.load(sb_row_ptr + kb, mask=kb < nk, other=0.0)
    else:
        sb = gl.load(b_s_ptr + kb * stride_bs + offs_n, mask=n_mask & (kb < nk), other=0.0)
    return sa, sb


@gluon.jit
def _consumer_128x128(a_bufs, b_bufs, ready, empty, c_desc, c_bufs, a_s_ptr, b_s_ptr, bias_ptr, c_ptr,
                      M, N, K, stride_as, stride_bs, stride_cm,
                      WG: gl.constexpr, B_2D: gl.constexpr, HAS_BIAS: gl.constexpr, ACCUMULATE: gl.constexpr,
                      GROUP_M: gl.constexpr):  # fmt: skip
    """Warpgroup ``WG`` of a 128 x BLOCK_N tile (BLOCK_N = 64 or 128): rows WG*64 .. +63, one
    m64nBLOCK_Nk32 chain per K block, its scales loaded from global memory one K block ahead. One
    [64, BLOCK_N] output buffer."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF_M: gl.constexpr = c_bufs.type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    num_pid_m, num_pid_n, num_tiles, nk = tile_grid(M, N, K, BLOCK_M, BLOCK_N, BK)
    c_smem = c_bufs.index(WG)
    zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, mma_layout)

    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M + WG * HALF_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + gl.arange(0, HALF_M, layout=row_layout)
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=col_layout)
        m_mask = offs_m < M
        n_mask = offs_n < N
        sb_row_ptr = b_s_ptr + (off_n // BK) * stride_bs  # 128x128 B scales: row n // 128

        sa, sb = _load_scales(a_s_ptr, b_s_ptr, 0, nk, offs_m, m_mask, offs_n, n_mask, sb_row_ptr, stride_as,
                              stride_bs, B_2D)  # fmt: skip
        acc = zero
        # per K block: wgmma, wait, release the stage, promote (the other warpgroup's wgmma fills the
        # tensor cores meanwhile)
        for kb in range(nk):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            part = warpgroup_mma(a_bufs.index(s).slice(WG * HALF_M, HALF_M), b_bufs.index(s).permute((1, 0)),
                                 zero, use_acc=False, is_async=True)  # fmt: skip
            it += 1
            sa_n, sb_n = _load_scales(a_s_ptr, b_s_ptr, kb + 1, nk, offs_m, m_mask, offs_n, n_mask, sb_row_ptr,
                                      stride_as, stride_bs, B_2D)  # fmt: skip
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            release_stage(empty, s)
            acc = promote(acc, part, sa, sb, B_2D)
            sa = sa_n
            sb = sb_n

        # ---- epilogue: bias, accumulate, one rounding, TMA store of this warpgroup's 64 rows
        acc = epilogue_add(acc, offs_m, m_mask, offs_n, n_mask, bias_ptr, c_ptr, stride_cm, HAS_BIAS, ACCUMULATE)
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _col_scales(bs_scales, s, J: gl.constexpr, Q: gl.constexpr, col_layout: gl.constexpr, B_2D: gl.constexpr):
    """Column scales of piece J from stage ``s``: the piece's 64 1x128 B scales, or 1.0 for 128x128 B
    (whose block scale the row scales carry)."""
    if B_2D:
        sb = 1.0
    else:
        sb = bs_scales.index(s).slice(J * Q, Q).load(col_layout)
    return sb


@gluon.jit
def _k_block_128x256(a_bufs, b_bufs, ready, empty, s, phase, kb, s_prev, pa, pb, acc0, acc1, acc2, acc3, sa_prev,
                     as_rows, bs_scales, WG: gl.constexpr, HALF_M: gl.constexpr, Q: gl.constexpr,
                     row_layout: gl.constexpr, col_layout: gl.constexpr, word_layout: gl.constexpr, SB_W: gl.constexpr,
                     B_2D: gl.constexpr, FIRST: gl.constexpr):  # fmt: skip
    """One K block of _consumer_128x256: chains 0-3 (B rows 0-63, ..., 192-255 of stage ``s``) into the
    fresh accumulators pa, pb, pa, pb, each promoted while the next runs; unless FIRST, the previous
    K block's chain 3 (retired, in ``pb``, its row scales ``sa_prev``) is promoted while chain 0 runs
    and its stage ``s_prev`` released. ``bs_scales``: the B-scale boxes as single words (B_2D: the
    [2, SB_W] box of each stage) or as [NUM_STAGES, BLOCK_N] rows (1x128 B). Returns with chain 3
    retired, in ``pb``, and its row scales.

    Scale loads are issued a chain ahead: the row scales right after the stage's ready wait, chains
    0 and 1's column scales after chain 3's promotion, chain 2's after chain 0's. The wgmmas read
    their operands from shared memory through the same queue as these loads, so a load issued just
    before the wait of its own chain would leave the promotion's FMULs waiting for it. Chain 0's
    column scales are not loaded before chain 3's promotion: holding them there spills registers."""
    # Promotions go through promote with row scales and column scales: for 128x128 B the rows carry
    # the block's B scale already (s_lo, s_hi) and the column scale is 1.0 (folded away).
    if not FIRST:  # chain 3's 1x128 B scales, from its stage (not released yet)
        sb3_prev = _col_scales(bs_scales, s_prev, 3, Q, col_layout, B_2D)
    mbarrier.wait(ready.index(s), phase)
    sa = as_rows.index(s).slice(WG * HALF_M, HALF_M).load(row_layout)
    if B_2D:
        s_lo = sa * b2d_block_scale(bs_scales, s, kb, 0, word_layout, SB_W)
        s_hi = sa * b2d_block_scale(bs_scales, s, kb, 1, word_layout, SB_W)
    else:
        s_lo = sa
        s_hi = sa
    a_op = a_bufs.index(s).slice(WG * HALF_M, HALF_M)
    bt = b_bufs.index(s)
    pa = warpgroup_mma(a_op, bt.slice(0, Q).permute((1, 0)), pa, use_acc=False, is_async=True)
    if not FIRST:
        acc3 = promote(acc3, pb, sa_prev, sb3_prev, B_2D)
        release_stage(empty, s_prev)
    sb0 = _col_scales(bs_scales, s, 0, Q, col_layout, B_2D)
    sb1 = _col_scales(bs_scales, s, 1, Q, col_layout, B_2D)
    pb = warpgroup_mma(a_op, bt.slice(Q, Q).permute((1, 0)), pb, use_acc=False, is_async=True)
    # chain 0
    pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
    acc0 = promote(acc0, pa, s_lo, sb0, B_2D)
    sb2 = _col_scales(bs_scales, s, 2, Q, col_layout, B_2D)
    pa = warpgroup_mma(a_op, bt.slice(2 * Q, Q).permute((1, 0)), pa, use_acc=False, is_async=True)
    # chain 1
    pb = warpgroup_mma_wait(num_outstanding=1, deps=(pb,))
    acc1 = promote(acc1, pb, s_lo, sb1, B_2D)
    pb = warpgroup_mma(a_op, bt.slice(3 * Q, Q).permute((1, 0)), pb, use_acc=False, is_async=True)
    # chain 2
    pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
    acc2 = promote(acc2, pa, s_hi, sb2, B_2D)
    pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
    return pa, pb, acc0, acc1, acc2, acc3, s_hi


@gluon.jit
def _consumer_128x256(a_bufs, b_bufs, ready, empty, c_desc, c_bufs, bias_ptr, c_ptr, M, N, K, stride_cm, as_bufs,
                      bs_bufs, WG: gl.constexpr, B_2D: gl.constexpr, HAS_BIAS: gl.constexpr, ACCUMULATE: gl.constexpr,
                      GROUP_M: gl.constexpr):  # fmt: skip
    """Warpgroup ``WG`` of a 128 x 256 tile (rows WG*64 .. +63), scales staged through shared memory:
    each K block runs four m64n64k32 wgmma chains (B rows 0-63, ..., 192-255) alternately into two
    fresh accumulators (``pa``, ``pb``), so that while chain j is promoted into its running
    accumulator ``acc_j`` chain j+1 runs (chain 3 is promoted while the next K block's chain 0 runs;
    its stage is released after that). The warpgroup waits with no chain of its own in flight once
    per K block (for chain 3). Per thread: 4 x 32 running + 2 x 32 fresh fp32 registers. Pieces 0-1
    lie in the tile's first 128x128 B scale block, 2-3 in the second. Epilogue: four [64, 64] pieces
    through two buffers per warpgroup."""
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
    word_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # one word, in every thread

    num_pid_m, num_pid_n, num_tiles, nk = tile_grid(M, N, K, BLOCK_M, BLOCK_N, BK)
    zero = gl.zeros([HALF_M, Q], gl.float32, mma_layout)
    cols = gl.arange(0, Q, layout=col_layout)
    # the TMA boxes (unswizzled) seen as plain fp32 rows per stage (A scales, 1x128 B scales) or, for
    # the [2, SB_W] boxes of 128x128 B scales, as single words
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    as_rows = as_bufs._reinterpret(gl.float32, [NUM_STAGES, BLOCK_M], flat)
    SB_W: gl.constexpr = bs_bufs.type.shape[2]  # (B_2D only)
    if B_2D:
        bs_scales = bs_bufs._reinterpret(gl.float32, [NUM_STAGES * 2 * SB_W, 1], flat)
    else:
        bs_scales = bs_bufs._reinterpret(gl.float32, [NUM_STAGES, BLOCK_N], flat)

    it = 0
    # the fresh accumulators: own registers, never read by anything but the wgmma that overwrites them
    pa = gl.zeros([HALF_M, Q], gl.float32, mma_layout)
    pb = gl.zeros([HALF_M, Q], gl.float32, mma_layout)
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M + WG * HALF_M
        off_n0 = pid_n * BLOCK_N
        offs_m = off_m + gl.arange(0, HALF_M, layout=row_layout)
        m_mask = offs_m < M

        s = it % NUM_STAGES
        pa, pb, acc0, acc1, acc2, acc3, sa3 = _k_block_128x256(
            a_bufs, b_bufs, ready, empty, s, (it // NUM_STAGES) & 1, 0, s, pa, pb, zero, zero, zero, zero,
            gl.zeros([HALF_M], gl.float32, row_layout), as_rows, bs_scales, WG, HALF_M, Q, row_layout, col_layout,
            word_layout, SB_W, B_2D, True,
        )  # fmt: skip
        s_prev = s
        it += 1
        for kb in range(1, nk):
            s = it % NUM_STAGES
            pa, pb, acc0, acc1, acc2, acc3, sa3 = _k_block_128x256(
                a_bufs, b_bufs, ready, empty, s, (it // NUM_STAGES) & 1, kb, s_prev, pa, pb, acc0, acc1, acc2,
                acc3, sa3, as_rows, bs_scales, WG, HALF_M, Q, row_layout, col_layout, word_layout, SB_W, B_2D, False,
            )  # fmt: skip
            s_prev = s
            it += 1
        acc3 = promote(acc3, pb, sa3, _col_scales(bs_scales, s_prev, 3, Q, col_layout, B_2D), B_2D)
        release_stage(empty, s_prev)

        # ---- epilogue: four [64, 64] pieces (those that start inside N)
        store_pieces(acc0, acc1, acc2, acc3, off_m, off_n0, offs_m, m_mask, cols, c_desc, c_bufs, bias_ptr, c_ptr, N,
                     stride_cm, WG, HAS_BIAS, ACCUMULATE)  # fmt: skip
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer_256x128(a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ptr, M, N, K, stride_cm, as_bufs, bs_bufs,
                      WG: gl.constexpr, ACCUMULATE: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """Warpgroup ``WG`` of a 256 x 128 tile, 1x128-scaled B (wgrad): rows WG*128 .. +127 as two m64
    halves, four m64n64k32 chains per K block (see k_block_256x128); per thread 4 x 32 running + 2 x
    32 fresh fp32 registers, as in _consumer_128x256; three 64-column scale vectors loaded per K block
    for 128 x 128 outputs, where _consumer_128x256 loads four for 64 x 256. Epilogue: four [64, 64]
    pieces through two buffers per warpgroup (no bias)."""
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    H: gl.constexpr = c_bufs.type.shape[1]
    Q: gl.constexpr = c_bufs.type.shape[2]
    gl.static_assert(BLOCK_M == 4 * H)
    gl.static_assert(BLOCK_N == 2 * Q)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, Q, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)

    num_pid_m, num_pid_n, num_tiles, nk = tile_grid(M, N, K, BLOCK_M, BLOCK_N, BK)
    zero = gl.zeros([H, Q], gl.float32, mma_layout)
    cols = gl.arange(0, Q, layout=col_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    as_rows = as_bufs._reinterpret(gl.float32, [NUM_STAGES, BLOCK_M], flat)
    bs_scales = bs_bufs._reinterpret(gl.float32, [NUM_STAGES, BLOCK_N], flat)

    it = 0
    pa = gl.zeros([H, Q], gl.float32, mma_layout)
    pb = gl.zeros([H, Q], gl.float32, mma_layout)
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M + WG * 2 * H
        off_n = pid_n * BLOCK_N
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
                a_bufs, b_bufs, ready, empty, s, (it // NUM_STAGES) & 1, s_prev, pa, pb, acc0, acc1, acc2, acc3, sa3,
                as_rows, bs_scales, WG, H, Q, row_layout, col_layout, False,
            )  # fmt: skip
            s_prev = s
            it += 1
        acc3 = promote(acc3, pb, sa3, bs_scales.index(s_prev).slice(Q, Q).load(col_layout), False, True)
        release_stage(empty, s_prev)

        # ---- epilogue: pieces (rows h, columns q) = acc0 (0, 0), acc1 (0, 1), acc2 (1, 0), acc3 (1, 1)
        offs_m0 = off_m + gl.arange(0, H, layout=row_layout)
        offs_m1 = offs_m0 + H
        store_piece(acc0, 0, off_m, off_n, offs_m0, offs_m0 < M, cols, c_desc, c_bufs, c_ptr, c_ptr, N, stride_cm, WG,
                    False, ACCUMULATE)  # fmt: skip
        if off_n + Q < N:
            store_piece(acc1, 1, off_m, off_n + Q, offs_m0, offs_m0 < M, cols, c_desc, c_bufs, c_ptr, c_ptr, N,
                        stride_cm, WG, False, ACCUMULATE)  # fmt: skip
        # acc2 as piece 0 (buffer 0, waiting for every earlier store): piece 1 may have been skipped at
        # the N edge, so the store two pieces back is not the last one in buffer 0
        store_piece(acc2, 0, off_m + H, off_n, offs_m1, offs_m1 < M, cols, c_desc, c_bufs, c_ptr, c_ptr, N, stride_cm,
                    WG, False, ACCUMULATE)  # fmt: skip
        if off_n + Q < N:
            store_piece(acc3, 3, off_m + H, off_n + Q, offs_m1, offs_m1 < M, cols, c_desc, c_bufs, c_ptr, c_ptr, N,
                        stride_cm, WG, False, ACCUMULATE)  # fmt: skip
    tma.store_wait(pendings=0)


@gluon.jit
def blockwise_gemm_gluon_kernel(
    a_desc, b_desc, c_desc, a_s_ptr, b_s_ptr, bias_ptr, c_ptr,
    M, N, K, stride_as, stride_bs, stride_cm, as_desc, bs_desc,
    B_2D: gl.constexpr, HAS_BIAS: gl.constexpr, ACCUMULATE: gl.constexpr,
    NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    # as_desc / bs_desc: TMA descriptors of the A and B scales ([1, BLOCK_M] and [1, BLOCK_N] boxes;
    # [2, 16] B-scale boxes for 128x128 B scales) for 128x256 tiles, else None
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]  # 64: the rows of one wgmma chain
    TILE_256x128: gl.constexpr = BLOCK_M == 4 * HALF_M  # 256x128 tiles (_consumer_256x128)
    gl.static_assert(BLOCK_M == 2 * HALF_M or TILE_256x128)
    C_N: gl.constexpr = c_desc.block_type.shape[1]
    TILE_128x256: gl.constexpr = BLOCK_N == 4 * C_N  # BLOCK_N=256 in four 64-column chains (_consumer_128x256)
    gl.static_assert(BLOCK_N == C_N or TILE_128x256 or (TILE_256x128 and BLOCK_N == 2 * C_N))
    SCALE_TMA: gl.constexpr = TILE_128x256 or TILE_256x128  # scales staged through the smem ring by the producer

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BK], b_desc.layout)
    # one output buffer per consumer warpgroup (two with TILE_128x256)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [4 if TILE_128x256 or TILE_256x128 else 2, HALF_M, C_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()

    if SCALE_TMA:
        as_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, BLOCK_M], as_desc.layout)
        bs_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES] + bs_desc.block_type.shape, bs_desc.layout)
        as_src = as_desc
        bs_src = bs_desc
    else:  # stand-ins for the unused scale descriptors and buffers
        as_bufs = a_bufs
        bs_bufs = b_bufs
        as_src = a_desc
        bs_src = b_desc
    # The argument tuples must be written inline: a tuple assigned to a variable turns its
    # constexprs into tensors.
    if TILE_256x128:
        gl.warp_specialize([
            (_consumer_256x128, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ptr, M, N, K, stride_cm, as_bufs,
                                 bs_bufs, 0, ACCUMULATE, GROUP_M)),
            (_consumer_256x128, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, c_ptr, M, N, K, stride_cm, as_bufs,
                                 bs_bufs, 1, ACCUMULATE, GROUP_M)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, as_src, bs_src, as_bufs, bs_bufs,
                         GROUP_M, SCALE_TMA, B_2D)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
    elif TILE_128x256:
        gl.warp_specialize([
            (_consumer_128x256, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, bias_ptr, c_ptr, M, N, K, stride_cm,
                                 as_bufs, bs_bufs, 0, B_2D, HAS_BIAS, ACCUMULATE, GROUP_M)),
            (_consumer_128x256, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, bias_ptr, c_ptr, M, N, K, stride_cm,
                                 as_bufs, bs_bufs, 1, B_2D, HAS_BIAS, ACCUMULATE, GROUP_M)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, as_src, bs_src, as_bufs, bs_bufs,
                         GROUP_M, SCALE_TMA, B_2D)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip
    else:
        gl.warp_specialize([
            (_consumer_128x128, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, a_s_ptr, b_s_ptr, bias_ptr, c_ptr, M, N, K,
                                 stride_as, stride_bs, stride_cm, 0, B_2D, HAS_BIAS, ACCUMULATE, GROUP_M)),
            (_consumer_128x128, (a_bufs, b_bufs, ready, empty, c_desc, c_bufs, a_s_ptr, b_s_ptr, bias_ptr, c_ptr, M, N, K,
                                 stride_as, stride_bs, stride_cm, 1, B_2D, HAS_BIAS, ACCUMULATE, GROUP_M)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, as_src, bs_src, as_bufs, bs_bufs,
                         GROUP_M, SCALE_TMA, B_2D)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------

# The compiled kernel per specialisation, launched without JITFunction.run's per-call Python (launch.py)
_launch = FastLauncher(blockwise_gemm_gluon_kernel)


def unsupported_reason(a: torch.Tensor, b: torch.Tensor, accumulate_into: torch.Tensor | None = None) -> str | None:
    """Why this kernel does not take ``a [M, K] @ b [N, K]^T`` (into ``accumulate_into``), or None: the
    limits of the module docstring, for operands that pass ``check_operands``."""
    if not runs_on(a.device):
        return f"the Gluon blockwise GEMM runs on NVIDIA Hopper (sm_90) GPUs only, got {a.device}"
    if a.dim() != 2 or b.dim() != 2 or not (a.is_contiguous() and b.is_contiguous()):
        return "a and b must be contiguous 2-D tensors (row-major, K-contiguous)"
    k = a.shape[1]
    n = b.shape[0]
    if k % 16 != 0:
        return f"K={k} must be a multiple of 16 (TMA needs 16-byte row strides)"
    if n % 8 != 0:
        return f"N={n} must be a multiple of 8 (TMA store of the output)"
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return "a and b must be 16-byte aligned"
    c = accumulate_into
    if c is not None and ((c.stride(0) * 4) % 16 or c.data_ptr() % 16):
        return "accumulate_into must be 16-byte aligned, with 16-byte aligned rows"
    return None


def supports(
    cfg: GluonGemmConfig, b_block_dim: int, out_dtype: torch.dtype | None = None, accumulate: bool = False,
    has_bias: bool = False,
) -> str | None:  # fmt: skip
    """None when the kernel runs ``cfg`` for this B scale layout (and output), else why not."""
    if cfg.block_n not in (64, 128, 256):
        return f"block_n={cfg.block_n}: 64, 128 or 256 (Triton tensors are powers of two)"
    if cfg.block_m not in (128, 256):
        return f"block_m={cfg.block_m}: 128 or 256 (two consumer warpgroups of 64 or 128 rows)"
    if cfg.block_m == 256 and (cfg.block_n != 128 or b_block_dim != 1 or has_bias):
        return "256x128 tiles are implemented for 1x128-scaled B (wgrad) with block_n=128 and no bias"
    if cfg.block_m == 256 and out_dtype == torch.float32 and not accumulate:
        return ("256x128 tiles with a float32 output (without accumulate_into) are not implemented; use bf16/fp16 "
                "or accumulate_into")  # fmt: skip
    if cfg.block_n == 256 and out_dtype == torch.float32 and not accumulate:
        return ("block_n=256 with a float32 output (without accumulate_into) spills registers (ptxas, either B "
                "scale layout); use bf16/fp16 or accumulate_into")  # fmt: skip
    if cfg.block_n == 256 and b_block_dim == 1 and accumulate and has_bias:
        return ("block_n=256 with 1x128 B scales, accumulate_into and a bias spills registers (16 bytes, in the "
                "epilogue); use block_n=128")  # fmt: skip
    if b_block_dim == 2 and cfg.block_n < 128 and 128 % cfg.block_n != 0:
        return "128x128-scaled B needs block_n dividing 128 (one B scale per tile and K block)"
    if cfg.consumer_regs * 256 + cfg.producer_regs * 128 > 65536 or cfg.consumer_regs % 8 or cfg.producer_regs % 8:
        return (f"setmaxnreg budget: 2 x 128 x {cfg.consumer_regs} + 128 x {cfg.producer_regs} > 64K registers, "
                "or not multiples of 8")  # fmt: skip
    return None


@functools.lru_cache(maxsize=64)
def _stages(config: GluonGemmConfig, b_block_dim: int, out_dtype: torch.dtype, accumulate: bool, has_bias: bool) -> int:
    """The pipeline stages of a call with ``config``, after ``supports`` (cached: the wrapper's host time
    counts; a refused config raises every time, exceptions are not cached)."""
    why = supports(config, b_block_dim, out_dtype, accumulate, has_bias)
    if why is not None:
        raise NotImplementedError(f"{config} does not take this call: {why}")
    return stages_that_fit(config.block_m, config.block_n, out_dtype, config.num_stages, b_block_dim)


def blockwise_gemm_gluon(
    a: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b: torch.Tensor,
    b_scale_inv: torch.Tensor,
    *,
    b_block_dim: int,
    out_dtype: torch.dtype,
    config: GluonGemmConfig,
    bias: torch.Tensor | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T`` with blockwise scale promotion; same contract as the portable
    ``blockwise_gemm`` (kernels/triton/gemm.py), on the tile ``config`` (``heuristics.gemm_config``).

    Returns ``accumulate_into`` (updated in place: ``C += A @ B^T``) when given, else a new
    ``[M, N]`` tensor of ``out_dtype``. Raises before allocating or launching anything: ValueError /
    TypeError for wrong inputs, ``GluonUnsupported`` for inputs outside the kernel's limits
    (``unsupported_reason``), NotImplementedError for a config that does not take the call.
    """
    check_operands(a, a_scale_inv, b, b_scale_inv, b_block_dim, out_dtype, bias, accumulate_into)
    why = unsupported_reason(a, b, accumulate_into)
    if why is not None:
        raise GluonUnsupported(why)
    m, k = a.shape
    n = b.shape[0]
    if accumulate_into is not None:
        c = accumulate_into
    else:
        c = torch.empty(m, n, dtype=out_dtype, device=a.device)
        if k == 0:
            return c.zero_()
    if m == 0 or n == 0 or k == 0:
        return c
    cfg = config
    stages = _stages(cfg, b_block_dim, c.dtype, accumulate_into is not None, bias is not None)
    bm, bn = cfg.block_m, cfg.block_n
    cn = c_block_n(bm, bn)
    a_desc = tma_desc(a, [m, k], [k, 1], [bm, BLOCK_K], shared_layout([bm, BLOCK_K], a.dtype))
    b_desc = tma_desc(b, [n, k], [k, 1], [bn, BLOCK_K], shared_layout([bn, BLOCK_K], b.dtype))
    c_desc = tma_desc(c, [m, n], [c.stride(0), 1], [64, cn], shared_layout([64, cn], c.dtype))
    as_desc = bs_desc = None
    if cfg.scale_tma:
        a_scale_inv = tma_ready_scale(a_scale_inv, m)
        as_desc = scale_desc(a_scale_inv, m, [1, bm])
        if b_block_dim == 2:
            kb = ceil_div(k, BLOCK_K)
            b_scale_inv = tma_ready_scale(b_scale_inv, kb)
            bs_desc = scale_desc(b_scale_inv, kb, list(B2D_SCALE_BOX))
        else:
            b_scale_inv = tma_ready_scale(b_scale_inv, n)
            bs_desc = scale_desc(b_scale_inv, n, [1, bn])
    num_tiles = ceil_div(m, bm) * ceil_div(n, bn)
    grid = (min(num_tiles, num_sms(a.device.index if a.device.index is not None else torch.cuda.current_device())),)
    # what can vary between calls with this config: dtypes (the descriptors' layouts follow from them and
    # the config), the ints' and the plain pointers' specialisation (the operands are 16-byte aligned)
    hint = (
        a.dtype, b.dtype, c.dtype, None if bias is None else bias.dtype, b_block_dim, accumulate_into is not None,
        cfg, stages, int_class(m), int_class(n), int_class(k), int_class(a_scale_inv.stride(0)),
        int_class(b_scale_inv.stride(0)), int_class(c.stride(0)), aligned(a_scale_inv, b_scale_inv, bias, c),
    )  # fmt: skip
    _launch.hinted(
        hint, grid, a_desc, b_desc, c_desc, a_scale_inv, b_scale_inv, bias if bias is not None else c, c,
        m, n, k, a_scale_inv.stride(0), b_scale_inv.stride(0), c.stride(0), as_desc, bs_desc,
        b_block_dim == 2, bias is not None, accumulate_into is not None,  # B_2D, HAS_BIAS, ACCUMULATE
        stages, cfg.group_m, cfg.consumer_regs, cfg.producer_regs,
        num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return c
