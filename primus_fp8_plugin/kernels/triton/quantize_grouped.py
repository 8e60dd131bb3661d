"""Grouped quantization for mixture-of-experts layers: one launch for all experts, no host synchronisation.

Activations / output gradients (``quantize_grouped_1x128``): the permuted tokens ``x [T, K]`` of ``E`` experts
(layouts: ``grouped_tensor.py``), or, with ``swiglu=True``, SwiGLU of fc1's output ``h [T, 2K] = [gate | up]``
(``fused_math.swiglu_value``: the values ``swiglu_fwd`` writes; optionally times per-row weights, ``weight_rows``),
produced in the kernel instead of loaded, as ``fused_act.py`` does for a dense tensor; with ``rows``, permuted row
``p`` is read from row ``rows[p]`` of the unpermuted tokens (the token permutation of an MoE layer, fused with the
quantization: no permuted bf16 copy is written). Programs run over 128-row
tiles of the *padded* token axis (each expert's count rounded up to 128) times 128-column blocks of K; a program
finds its expert from the device-side prefix sums of the ``GroupLayout`` (``padded_offsets``) and reads the
expert's rows of that tile, masked at the expert's end. It writes

* the rowwise copy of those rows (``[T, K]``, scales ``[kb, t]``), as the dense kernel would;
* the columnwise copy: the 128x1 column tiles of the expert's rows, transposed to ``[K, C]`` at the tile's
  padded position, the rows past the expert's end as FP8 zeros, with scales ``[tile, k]``.

The grid covers ``GroupLayout.capacity`` (an upper bound where the counts are only on the device); programs
past the last expert's padded end write nothing. Per element the work is the dense kernel's
(``quantize_act.py``; TE's scale rule from ``scales.py``), so each expert's copies equal a dense
quantization of its own tokens bit for bit.

Weights (``quantize_128x128_batched``): ``E`` weights ``[N, K]``, each anywhere in memory (a device table of
their addresses) or one ``[E, N, K]`` tensor, quantized by the dense 128x128 kernel's body on a third grid
axis over the experts, into stacked W / W^T buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ...grouped_tensor import GroupedFp8Tensor, GroupedFp8Weight, GroupLayout
from ...recipe import BLOCK, QuantParams
from ...tensor import ceil_div, pad4, scale_inv_shape
from .fused_math import FP_OPTIONS, swiglu_value, weight_rows
from .heuristics import QuantizeConfig, act_quant_config, weight_quant_config
from .launch import FastLauncher
from .pointer_table import pointer_table
from .quantize_act import MAX_DIM, MAX_GRID_Y
from .quantize_weight import quantize_128x128_kernel
from .scales import amax_nan, max_nan, scale_and_inverse

INT32_MAX = tl.constexpr(2**31 - 1)


def block_e(num_groups: int) -> int:
    """Vector width over which a program searches for its expert (a power of two, >= 16)."""
    return max(16, triton.next_power_of_2(num_groups))


@triton.jit
def find_group(padded_ptr, p0, E, BLOCK_E: tl.constexpr):
    """The expert whose padded token segment holds padded row ``p0`` (``E`` if none: past the last one)."""
    ge = tl.arange(0, BLOCK_E)
    ends = tl.load(padded_ptr + 1 + ge, mask=ge < E, other=INT32_MAX)
    return tl.sum((ends <= p0).to(tl.int32), 0)


@triton.jit
def _rows(x_tile, r, c, stride_xm, mask, full):
    if full:
        x = tl.load(x_tile + r[:, None] * stride_xm + c[None, :]).to(tl.float32)
    else:
        x = tl.load(x_tile + r[:, None] * stride_xm + c[None, :], mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _values(x_tile, x_cols, rows_tile, r, c, stride_xm, mask, full, live, up_offset, probs_tile,
            GATHER: tl.constexpr, SWIGLU: tl.constexpr, HAS_PROBS: tl.constexpr):  # fmt: skip
    """Rows ``r`` x columns ``c`` of the tile's values in fp32: ``x`` loaded (with ``GATHER`` from the source rows
    ``rows_tile[r]`` of ``x_cols``, the tile's columns of the unpermuted tokens), or SwiGLU of ``h``'s gate and up
    halves (``up_offset`` elements apart) rounded to h's dtype, times the rows' weights (``probs_tile``) where
    given; 0 outside the tile's live rows (a zero gate and up give 0)."""
    if GATHER:
        x_tile = x_cols
        r = tl.load(rows_tile + r, mask=r < live, other=0).to(tl.int64)
        full = False
    x = _rows(x_tile, r, c, stride_xm, mask, full)
    if SWIGLU:
        ty = x_tile.dtype.element_ty
        x = swiglu_value(x, _rows(x_tile + up_offset, r, c, stride_xm, mask, full), ty)
        if HAS_PROBS:
            x = weight_rows(x, tl.load(probs_tile + r, mask=r < live, other=0.0).to(tl.float32), ty)
    return x


@triton.jit
def _rowwise(x, r, c, rq_tile, rs_tile, K, mask, live, full, fp8_max, amax_eps, in_max, POW2: tl.constexpr):
    """Rows ``r`` of the rowwise copy (an amax per row) and their scale_inv entries (rows ``< live`` only)."""
    scale, s_inv = scale_and_inverse(amax_nan(x, 1), fp8_max, amax_eps, in_max, POW2)
    q = (scale[:, None] * x).to(rq_tile.dtype.element_ty)
    if full:
        tl.store(rq_tile + r[:, None] * K + c[None, :], q)
        tl.store(rs_tile + r, s_inv)
    else:
        tl.store(rq_tile + r[:, None] * K + c[None, :], q, mask=mask)
        tl.store(rs_tile + r, s_inv, mask=r < live)


@triton.jit
def _columnwise(x, scale, r, c, cq_tile, CAP, live, kmask, full):
    """Rows ``r`` of the tile quantized with the column scales, stored transposed; rows ``>= live`` as zeros."""
    y = scale[None, :] * x
    if full:
        tl.store(cq_tile + c[:, None] * CAP + r[None, :], tl.trans(y.to(cq_tile.dtype.element_ty)))
    else:
        y = tl.where((r < live)[:, None], y, 0.0)
        tl.store(cq_tile + c[:, None] * CAP + r[None, :], tl.trans(y.to(cq_tile.dtype.element_ty)), mask=kmask[:, None])


@triton.jit
def _column_scales(s_inv, cols, cs_tile, K, K_PAD):
    tl.store(cs_tile + cols, tl.where(cols < K, s_inv, 1.0), mask=cols < K_PAD)  # padding entries 1.0


@triton.jit
def quantize_grouped_1x128_kernel(
    x_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, offsets_ptr, padded_ptr, probs_ptr, rows_ptr, E, T, K,
    T_PAD, CAP, K_PAD, stride_xm, up_offset, fp8_max, amax_eps, in_max,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, SUB_M: tl.constexpr,
    BLOCK_E: tl.constexpr, SWIGLU: tl.constexpr, HAS_PROBS: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)  # 128-row tile of the padded token axis
    pid_k = tl.program_id(1)
    p0 = pid_t * BLOCK
    k0 = pid_k * BLOCK
    blk = tl.arange(0, BLOCK)
    if ROWWISE:
        if pid_t == 0:  # the TE layout's padding entries [T, pad4(T)) of this K block
            pad = T + tl.arange(0, 4)
            tl.store(row_s_ptr + pid_k * T_PAD + pad, tl.full([4], 1.0, tl.float32), mask=pad < T_PAD)
    e = find_group(padded_ptr, p0, E, BLOCK_E)
    if e < E:
        tok0 = tl.load(offsets_ptr + e)
        row0 = tok0 + (p0 - tl.load(padded_ptr + e))  # the tile's first token
        live = tl.load(offsets_ptr + e + 1) - row0  # rows of the tile that are this expert's tokens (> 0)
        full = (live >= BLOCK) & (k0 + BLOCK <= K)
        kmask = k0 + blk < K
        # 64-bit tile bases; in-tile offsets fit in 32 bits
        x_tile = x_ptr + row0.to(tl.int64) * stride_xm + k0
        rq_tile = row_q_ptr + row0.to(tl.int64) * K + k0
        rs_tile = row_s_ptr + pid_k.to(tl.int64) * T_PAD + row0
        cq_tile = col_q_ptr + k0.to(tl.int64) * CAP + p0
        cs_tile = col_s_ptr + pid_t.to(tl.int64) * K_PAD
        probs_tile = probs_ptr + row0
        rows_tile = rows_ptr + row0
        x_cols = x_ptr + k0
        if SUB_M == BLOCK:  # the whole tile in registers, both copies from it
            mask = (blk < live)[:, None] & kmask[None, :]
            x = _values(x_tile, x_cols, rows_tile, blk, blk, stride_xm, mask, full, live, up_offset, probs_tile, GATHER,
                        SWIGLU, HAS_PROBS)
            if ROWWISE:
                _rowwise(x, blk, blk, rq_tile, rs_tile, K, mask, live, full, fp8_max, amax_eps, in_max, POW2)
            if COLWISE:
                scale, s_inv = scale_and_inverse(amax_nan(x, 0), fp8_max, amax_eps, in_max, POW2)
                _columnwise(x, scale, blk, blk, cq_tile, CAP, live, kmask, full)
                _column_scales(s_inv, k0 + blk, cs_tile, K, K_PAD)
        else:  # chunks of SUB_M rows: rowwise copy and a running column amax, then a second pass (from L2)
            sub = tl.arange(0, SUB_M)
            col_amax2d = tl.zeros([SUB_M, BLOCK], dtype=tl.float32)
            for c in tl.range(0, BLOCK // SUB_M):
                r = c * SUB_M + sub
                mask = (r < live)[:, None] & kmask[None, :]
                x = _values(x_tile, x_cols, rows_tile, r, blk, stride_xm, mask, full, live, up_offset, probs_tile,
                            GATHER, SWIGLU, HAS_PROBS)
                if ROWWISE:
                    _rowwise(x, r, blk, rq_tile, rs_tile, K, mask, live, full, fp8_max, amax_eps, in_max, POW2)
                if COLWISE:
                    col_amax2d = max_nan(col_amax2d, tl.abs(x))
            if COLWISE:
                scale, s_inv = scale_and_inverse(tl.reduce(col_amax2d, 0, max_nan), fp8_max, amax_eps, in_max, POW2)
                for c in tl.range(0, BLOCK // SUB_M):
                    r = c * SUB_M + sub
                    mask = (r < live)[:, None] & kmask[None, :]
                    x = _values(x_tile, x_cols, rows_tile, r, blk, stride_xm, mask, full, live, up_offset, probs_tile,
                            GATHER, SWIGLU, HAS_PROBS)
                    _columnwise(x, scale, r, blk, cq_tile, CAP, live, kmask, full)
                _column_scales(s_inv, k0 + blk, cs_tile, K, K_PAD)


_launch_act = FastLauncher(quantize_grouped_1x128_kernel)


def quantize_grouped_1x128(
    x: torch.Tensor, layout: GroupLayout, params: QuantParams, *, rowwise: bool, columnwise: bool,
    config: QuantizeConfig | None = None, swiglu: bool = False, probs: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> GroupedFp8Tensor:  # fmt: skip
    """Rowwise and/or padded columnwise 1x128 quantization of the permuted tokens ``x [T, K]`` (contiguous), or,
    with ``swiglu``, of SwiGLU of ``x [T, 2K]`` (fc1's ``[gate | up]``), each row times ``probs [T]`` where given:
    the same bits as this quantization of ``swiglu_fwd(x)`` (and ``reference_fused.weight_rows``), which is never
    written. ``rows`` (int ``[T']``, in ``[0, T)``): quantize ``x[rows]`` (``T'`` permuted tokens) without writing it.
    ``config``: the launch (default: ``heuristics.act_quant_config`` for 16 rows: only K decides the alignment, as
    token rows start anywhere)."""
    assert x.dim() == 2 and x.is_contiguous() and params.block_dim == 1 and (swiglu or probs is None)
    t, k = x.shape[0] if rows is None else rows.shape[0], x.shape[1] // 2 if swiglu else x.shape[1]
    if rows is not None and (rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or not rows.is_contiguous()):
        raise ValueError(f"rows must be a contiguous 1-D int32/int64 tensor, got {rows.dtype} {tuple(rows.shape)}")
    if probs is not None and (probs.shape != (t,) or not probs.is_contiguous()):
        raise ValueError(f"probs must be a contiguous [{t}] tensor (one weight per token), got {tuple(probs.shape)}")
    e, cap = layout.num_groups, layout.capacity
    cfg = config or act_quant_config(16, k)
    if max(t, k, cap) >= MAX_DIM:
        raise ValueError(f"x is [{t}, {k}] (padded tokens {cap}): in-tile offsets are 32-bit, so T, K and the padded "
                         f"token count must stay below {MAX_DIM}; quantize the tokens in parts")  # fmt: skip
    if k > MAX_GRID_Y:
        raise ValueError(f"x is [{t}, {k}]: K's {ceil_div(k, BLOCK)} blocks exceed the 65535 programs of a CUDA grid's "
                         f"second axis (K <= {MAX_GRID_Y})")  # fmt: skip
    dev, f8 = x.device, params.fp8_dtype
    parts = {}
    if rowwise:
        parts.update(rowwise_data=torch.empty(t, k, dtype=f8, device=dev),
                     rowwise_scale_inv=torch.empty(scale_inv_shape(t, k, 1), dtype=torch.float32, device=dev))  # fmt: skip
    if columnwise:
        parts.update(columnwise_data=torch.empty(k, cap, dtype=f8, device=dev),
                     columnwise_scale_inv=torch.empty(cap // BLOCK, pad4(k), dtype=torch.float32, device=dev))  # fmt: skip
    if cap > 0:
        q_any = parts.get("rowwise_data", parts.get("columnwise_data"))
        s_any = parts.get("rowwise_scale_inv", parts.get("columnwise_scale_inv"))
        _launch_act(
            (cap // BLOCK, ceil_div(k, BLOCK)), x, parts.get("rowwise_data", q_any), parts.get("rowwise_scale_inv", s_any),
            parts.get("columnwise_data", q_any), parts.get("columnwise_scale_inv", s_any), layout.offsets,
            layout.padded_offsets, probs if probs is not None else x, rows if rows is not None else layout.offsets, e, t,
            k, pad4(t), cap, pad4(k), x.stride(0), k, params.fp8_max, params.amax_epsilon, torch.finfo(x.dtype).max,
            rowwise, columnwise, params.pow2_scales, BLOCK, cfg.sub_m, block_e(e), swiglu, probs is not None,
            rows is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **(FP_OPTIONS if swiglu else {}),
        )  # fmt: skip
    return GroupedFp8Tensor(layout, (t, k), f8, x.dtype, **parts)


@triton.jit
def quantize_128x128_batched_kernel(
    w_table_ptr, w0_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, stride_wn, stride_we, stride_s, stride_st, stride_se,
    stride_ste, fp8_max, amax_eps, in_max, W_TABLE: tl.constexpr, TABLE_ALIGN: tl.constexpr, POW2: tl.constexpr,
    BLOCK: tl.constexpr, SUB_M: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(2)
    if W_TABLE:  # (TABLE_ALIGN: the table's alignment, so that the weights are read in 16-byte accesses)
        w_ptr = tl.multiple_of(tl.load(w_table_ptr + e).to(tl.pointer_type(w0_ptr.dtype.element_ty)), TABLE_ALIGN)
    else:
        w_ptr = w0_ptr + e.to(tl.int64) * stride_we
    qe = e.to(tl.int64) * N * K
    quantize_128x128_kernel(
        w_ptr, q_ptr + qe, qt_ptr + qe, s_ptr + e * stride_se, st_ptr + e * stride_ste, N, K, stride_wn, stride_s,
        stride_st, fp8_max, amax_eps, in_max, POW2, BLOCK, SUB_M,
    )  # fmt: skip


_launch_weight = FastLauncher(quantize_128x128_batched_kernel)


def grouped_weight_out(
    num_groups: int, first: torch.Tensor, params: QuantParams, out: GroupedFp8Weight | None
) -> GroupedFp8Weight:
    """``out`` checked against ``num_groups`` weights shaped and placed as ``first`` (allocated when None)."""
    e, (n, k) = num_groups, first.shape
    out = out or GroupedFp8Weight.empty(e, (n, k), params.fp8_dtype, first.dtype, first.device)
    if out.num_groups != e or out.shape != (n, k) or out.fp8_dtype != params.fp8_dtype or out.device != first.device:
        raise ValueError(f"out holds {out.num_groups} x {out.shape} {out.fp8_dtype} on {out.device}, expected "
                         f"{e} x {(n, k)} {params.fp8_dtype} on {first.device}")  # fmt: skip
    return out


def quantize_128x128_batched(
    weights: Sequence[torch.Tensor] | torch.Tensor, params: QuantParams, out: GroupedFp8Weight | None = None, *,
    config: QuantizeConfig | None = None,
) -> GroupedFp8Weight:  # fmt: skip
    """Both copies of ``E`` weights (contiguous ``[N, K]`` tensors, or one contiguous ``[E, N, K]``) quantized
    with 128x128 blocks in one launch, into ``out`` (allocated when None). ``config``: the launch (default:
    ``heuristics.weight_quant_config``)."""
    cfg = config or weight_quant_config()
    stacked = isinstance(weights, torch.Tensor)
    first = weights[0]
    e = weights.shape[0] if stacked else len(weights)
    n, k = first.shape
    assert params.block_dim == 2 and (weights.is_contiguous() if stacked else all(w.is_contiguous() for w in weights))
    if max(n, k) >= MAX_DIM:
        raise ValueError(f"weights are [{n}, {k}]: in-block offsets are 32-bit, so N and K must stay below {MAX_DIM}")
    if k > MAX_GRID_Y or e > 65535:
        raise ValueError(f"{e} weights [{n}, {k}]: K's blocks and the experts run on CUDA grid axes of at most 65535 "
                         f"programs (K <= {MAX_GRID_Y}, E <= 65535)")  # fmt: skip
    out = grouped_weight_out(e, first, params, out)
    table, align = (weights, 1) if stacked else pointer_table(weights)  # (stacked: any tensor as the unused table)
    s, st = out.rowwise_scale_inv, out.columnwise_scale_inv
    _launch_weight(
        (ceil_div(n, BLOCK), ceil_div(k, BLOCK), e), table, first, out.rowwise_data, out.columnwise_data, s, st,
        n, k, first.stride(0), n * k, s.stride(1), st.stride(1), s.stride(0), st.stride(0),
        params.fp8_max, params.amax_epsilon, torch.finfo(first.dtype).max,
        not stacked, align, params.pow2_scales, BLOCK, cfg.sub_m,  # W_TABLE, TABLE_ALIGN, POW2, BLOCK, SUB_M
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    out.orig_dtype = first.dtype
    return out
