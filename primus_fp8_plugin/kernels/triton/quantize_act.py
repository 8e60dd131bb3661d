"""Dual 1x128 quantization of activations and gradients: one HBM read of X, both copies written.

Each program owns one 128x128 tile of X [M, K]. By default (``SUB_M == BLOCK``) it loads the whole
tile at once (all loads in flight together: the kernel is bound by the bytes it keeps in flight per
SM, docs/PERFORMANCE.md) and makes both copies from registers:

* the rowwise copy [M, K] (1x128 tiles: an amax per row), with its scale_inv entries ``[kb, m]`` of
  the TE layout ``[ceil(K/128), pad4(M)]``;
* the columnwise copy X^T [K, M] (128x1 tiles: an amax per column of the tile), quantized, then
  transposed as FP8 bytes through shared memory, with its scale_inv entries ``[mb, k]`` of
  ``[ceil(M/128), pad4(K)]``.

With ``SUB_M < BLOCK`` (fewer registers; ``heuristics.act_quant_config``; ``benchmarks/bench_quant.py --variants``
sweeps it) the program
walks the tile in chunks of SUB_M rows in a rolled loop: rowwise copy and a running column amax per
chunk, then a second pass over the chunks (from L2) for the columnwise copy.

Per element: one NaN-propagating max per copy, one multiply and one saturating conversion
(scales.py says why no clamp or NaN select is needed); interior tiles take unmasked loads and
stores. Programs on the last tile row/column also write the layout's padding entries (1.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4, scale_inv_shape
from .heuristics import QuantizeConfig, act_quant_config
from .launch import FastLauncher
from .scales import amax_nan, max_nan, scale_and_inverse

MAX_DIM = 2**31 // BLOCK  # in-tile offsets (row * K, col * M within a 128-tile) are int32
MAX_GRID_Y = 65535 * BLOCK  # K blocks run on grid axis 1, which CUDA caps at 65535 programs


@triton.jit
def _load_rows(x_tile, r, c, stride_xm, mask, full):
    """Rows ``r`` x columns ``c`` of the tile, in fp32 (unmasked on interior tiles)."""
    if full:
        x = tl.load(x_tile + r[:, None] * stride_xm + c[None, :]).to(tl.float32)
    else:
        x = tl.load(x_tile + r[:, None] * stride_xm + c[None, :], mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def rowwise_copy(x, r, c, rq_tile, row_s_ptr, pid_k, m0, M, K, M_PAD, mask, full, fp8_max, amax_eps, in_max,
                  POW2: tl.constexpr):  # fmt: skip
    """Quantize and store rows ``r`` of the rowwise copy (an amax per row) and their scale_inv entries."""
    scale, s_inv = scale_and_inverse(amax_nan(x, 1), fp8_max, amax_eps, in_max, POW2)
    q = (scale[:, None] * x).to(rq_tile.dtype.element_ty)
    if full:
        tl.store(rq_tile + r[:, None] * K + c[None, :], q)
    else:
        tl.store(rq_tile + r[:, None] * K + c[None, :], q, mask=mask)
    rows = m0 + r
    s_inv = tl.where(rows < M, s_inv, 1.0)  # padding entries of the TE layout
    tl.store(row_s_ptr + pid_k * M_PAD + rows, s_inv, mask=rows < M_PAD)


@triton.jit
def columnwise_copy(x, scale, r, c, cq_tile, M, mask, full):
    """Quantize rows ``r`` of the tile with the column scales and store them transposed (FP8 bytes)."""
    q = tl.trans((scale[None, :] * x).to(cq_tile.dtype.element_ty))
    if full:
        tl.store(cq_tile + c[:, None] * M + r[None, :], q)
    else:
        tl.store(cq_tile + c[:, None] * M + r[None, :], q, mask=tl.trans(mask))


@triton.jit
def column_scales(s_inv, c, col_s_ptr, pid_m, k0, K, K_PAD):
    cols = k0 + c
    s_inv = tl.where(cols < K, s_inv, 1.0)  # padding entries of the TE layout
    tl.store(col_s_ptr + pid_m * K_PAD + cols, s_inv, mask=cols < K_PAD)


@triton.jit
def quantize_1x128_dual_kernel(
    x_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, M, K, M_PAD, K_PAD, stride_xm, fp8_max, amax_eps, in_max,
    ROWWISE: tl.constexpr, COLWISE: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr, SUB_M: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    m0 = pid_m * BLOCK
    k0 = pid_k * BLOCK
    sub = tl.arange(0, SUB_M)
    blk = tl.arange(0, BLOCK)
    full = (m0 + BLOCK <= M) & (k0 + BLOCK <= K)  # interior tiles need no masks
    # 64-bit tile bases; in-tile offsets fit in 32 bits
    x_tile = x_ptr + m0.to(tl.int64) * stride_xm + k0
    rq_tile = row_q_ptr + m0.to(tl.int64) * K + k0
    cq_tile = col_q_ptr + k0.to(tl.int64) * M + m0
    if SUB_M == BLOCK:
        # The whole tile loaded once (all loads issued together), both copies made from registers
        # (4 warps: 229 registers, two programs per SM; 8 warps: 126 registers but slower, 56%
        # against 65% of copy on the H200).
        mask = (m0 + blk < M)[:, None] & (k0 + blk < K)[None, :]
        x = _load_rows(x_tile, blk, blk, stride_xm, mask, full)
        if ROWWISE:
            rowwise_copy(x, blk, blk, rq_tile, row_s_ptr, pid_k, m0, M, K, M_PAD, mask, full, fp8_max, amax_eps,
                          in_max, POW2)  # fmt: skip
        if COLWISE:
            scale, s_inv = scale_and_inverse(amax_nan(x, 0), fp8_max, amax_eps, in_max, POW2)
            columnwise_copy(x, scale, blk, blk, cq_tile, M, mask, full)
            column_scales(s_inv, blk, col_s_ptr, pid_m, k0, K, K_PAD)
    else:
        # Chunks of SUB_M rows: rowwise copy and a running column amax, then the columnwise copy in a
        # second pass over the chunks (from L2)
        col_amax2d = tl.zeros([SUB_M, BLOCK], dtype=tl.float32)  # reduced once after the chunks
        for c in tl.range(0, BLOCK // SUB_M):
            r = c * SUB_M + sub
            mask = (m0 + r < M)[:, None] & (k0 + blk < K)[None, :]
            x = _load_rows(x_tile, r, blk, stride_xm, mask, full)
            if ROWWISE:
                rowwise_copy(x, r, blk, rq_tile, row_s_ptr, pid_k, m0, M, K, M_PAD, mask, full, fp8_max, amax_eps,
                              in_max, POW2)  # fmt: skip
            if COLWISE:
                col_amax2d = max_nan(col_amax2d, tl.abs(x))
        if COLWISE:
            scale, s_inv = scale_and_inverse(tl.reduce(col_amax2d, 0, max_nan), fp8_max, amax_eps, in_max, POW2)
            for c in tl.range(0, BLOCK // SUB_M):
                r = c * SUB_M + sub
                mask = (m0 + r < M)[:, None] & (k0 + blk < K)[None, :]
                columnwise_copy(_load_rows(x_tile, r, blk, stride_xm, mask, full), scale, r, blk, cq_tile, M, mask, full)
            column_scales(s_inv, blk, col_s_ptr, pid_m, k0, K, K_PAD)


_launch = FastLauncher(quantize_1x128_dual_kernel)


def dual_outputs(x: torch.Tensor, params: QuantParams, rowwise: bool, columnwise: bool):
    """Uninitialised outputs of a dual 1x128 quantization of ``x [M, K]``: ``(row_q [M, K], row_s,
    col_q [K, M], col_s, parts)``, the copies not asked for None, scales in TE's layouts, and
    ``parts`` the ``BlockwiseFp8Tensor`` keyword arguments of those that exist."""
    m, k = x.shape
    dev, f8 = x.device, params.fp8_dtype
    parts = {}
    row_q = row_s = col_q = col_s = None
    if rowwise:
        row_q = torch.empty(m, k, dtype=f8, device=dev)
        row_s = torch.empty(scale_inv_shape(m, k, 1), dtype=torch.float32, device=dev)
        parts.update(rowwise_data=row_q, rowwise_scale_inv=row_s)
    if columnwise:
        col_q = torch.empty(k, m, dtype=f8, device=dev)
        col_s = torch.empty(scale_inv_shape(k, m, 1), dtype=torch.float32, device=dev)
        parts.update(columnwise_data=col_q, columnwise_scale_inv=col_s)
    return row_q, row_s, col_q, col_s, parts


def quantize_1x128_dual(
    x: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool, config: QuantizeConfig | None = None
) -> BlockwiseFp8Tensor:
    """Rowwise and/or columnwise 1x128 quantization of a contiguous 2-D ``x [M, K]`` in one pass over
    HBM. ``config``: the launch (default: ``heuristics.act_quant_config``)."""
    assert x.dim() == 2 and x.is_contiguous() and params.block_dim == 1
    m, k = x.shape
    cfg = config or act_quant_config(m, k)
    if max(m, k) >= MAX_DIM:
        raise ValueError(f"x is [{m}, {k}]: this kernel's in-tile offsets are 32-bit, so M and K must stay below "
                         f"{MAX_DIM}; quantize it in row blocks")  # fmt: skip
    if k > MAX_GRID_Y:
        raise ValueError(f"x is [{m}, {k}]: K's {ceil_div(k, BLOCK)} blocks exceed the 65535 programs of a CUDA "
                         f"grid's second axis (K <= {MAX_GRID_Y}); quantize it in column blocks")  # fmt: skip
    f8 = params.fp8_dtype
    row_q, row_s, col_q, col_s, parts = dual_outputs(x, params, rowwise, columnwise)
    if m > 0:
        # pad4(n) never crosses a 128 boundary, so the last tile also writes the padding entries.
        grid = (ceil_div(m, BLOCK), ceil_div(k, BLOCK))
        q_any = row_q if row_q is not None else col_q
        s_any = row_s if row_s is not None else col_s
        _launch(
            grid, x, row_q if rowwise else q_any, row_s if rowwise else s_any, col_q if columnwise else q_any,
            col_s if columnwise else s_any, m, k, pad4(m), pad4(k), x.stride(0),
            params.fp8_max, params.amax_epsilon, torch.finfo(x.dtype).max,
            rowwise, columnwise, params.pow2_scales, BLOCK, cfg.sub_m,  # ROWWISE, COLWISE, POW2, BLOCK, SUB_M
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    elif columnwise:
        col_s.fill_(1.0)
    return BlockwiseFp8Tensor((m, k), 1, f8, x.dtype, **parts)
