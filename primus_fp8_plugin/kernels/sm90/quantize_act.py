"""Dual 1x128 quantization of activations for Hopper (sm_90), written in Gluon with the thread tiles
it shares with the Gluon weight quantizer (``quantize_tiles.py``): same contract and bits as
:func:`..triton.quantize_act.quantize_1x128_dual`.

One program per 128x128 tile of X [M, K], 8 warps, **one block barrier**. The tile is loaded once
into registers (layout ``L``: 4 rows x 2 x 8 columns per thread, 8 lanes along K, 4 along M, warps
along M):

* columnwise copy X^T [K, M]: the raw tile (input dtype) goes into a swizzled shared buffer
  transposed (from the M-first register order ``LN``: 8-byte stores of 4 rows of a column), and
  comes back as [K, M] rows (``LT_RAW``: 8 consecutive M of one column per thread, 8 lanes along M).
  Each column then lives in one warp: its amax is in-thread plus 3 shuffles, its scale is computed
  there, and the FP8 values are stored with 8-byte stores; scale_inv ``[mb, k]`` of
  ``[ceil(M/128), pad4(K)]``;
* rowwise copy [M, K], from the registers while the other warps reach the barrier: an amax per row
  (in-thread, then 3 shuffles across the 8 K lanes), its scale, FP8 stored from registers (8-byte
  stores); scale_inv ``[kb, m]`` of ``[ceil(K/128), pad4(M)]``, padding rows written 1.0.

The one barrier is the design's point: reducing the columns across warps in the ``L`` registers
and sending the scales and the FP8 tile back through shared memory would take eight, and the
kernel is bound by how often its warps wait for each other (``quantize_tiles.py``).

Masked loads and stores handle partial tiles; the kernel takes M % 16 == 0 and K % 16 == 0 (16-byte
rows of both FP8 copies: ``unsupported_reason``); the heuristics give other inputs to the Triton
kernel, and the wrapper raises ``GluonUnsupported`` for them."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...recipe import BLOCK, QuantParams
from ...tensor import BlockwiseFp8Tensor, ceil_div, pad4
from ..triton.launch import FastLauncher, aligned
from ..triton.quantize_act import MAX_GRID_Y, dual_outputs
from ..triton.scales import amax_nan, scale_and_inverse
from .quantize_tiles import load_tile, raw_transpose_layouts, store_tile, transpose_tile_layouts
from .quantize_tiles import unsupported_reason as tile_rules
from .target import GluonUnsupported

NUM_WARPS = 8


@gluon.jit
def quantize_1x128_dual_gluon_kernel(
    x_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, M, K, M_PAD, K_PAD, fp8_max, amax_eps, in_max,
    ROWWISE: gl.constexpr, COLWISE: gl.constexpr, POW2: gl.constexpr,
    L: gl.constexpr, LN: gl.constexpr, LT_RAW: gl.constexpr, T_RAW: gl.constexpr,
):  # fmt: skip
    B: gl.constexpr = 128
    pid_m = gl.program_id(0)
    pid_k = gl.program_id(1)
    m0 = pid_m * B
    k0 = pid_k * B

    xr = load_tile(x_ptr, m0, k0, M, K, K, L)

    if COLWISE:
        t_raw = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [B, B], T_RAW)
        t_raw.permute((1, 0)).store(gl.convert_layout(xr, LN, assert_trivial=True))

    if ROWWISE:
        x = xr.to(gl.float32)
        scale, s_inv = scale_and_inverse(amax_nan(x, 1), fp8_max, amax_eps, in_max, POW2)
        store_tile((gl.expand_dims(scale, 1) * x).to(row_q_ptr.dtype.element_ty), row_q_ptr, m0, k0, M, K, L)
        rows = m0 + gl.arange(0, B, layout=gl.SliceLayout(1, L))
        gl.store(row_s_ptr + pid_k * M_PAD + rows, gl.where(rows < M, s_inv, 1.0), mask=rows < M_PAD)

    if COLWISE:
        gl.thread_barrier()  # the only one: the transposed tile is complete
        xt = t_raw.load(LT_RAW).to(gl.float32)  # [B (k), B (m)]: each column of X inside one warp
        cscale, cs_inv = scale_and_inverse(amax_nan(xt, 1), fp8_max, amax_eps, in_max, POW2)
        store_tile((gl.expand_dims(cscale, 1) * xt).to(col_q_ptr.dtype.element_ty), col_q_ptr, k0, m0, K, M, LT_RAW)
        cols = k0 + gl.arange(0, B, layout=gl.SliceLayout(1, LT_RAW))
        gl.store(col_s_ptr + pid_m * K_PAD + cols, gl.where(cols < K, cs_inv, 1.0), mask=cols < K_PAD)


def unsupported_reason(x: torch.Tensor, params: QuantParams) -> str | None:
    """Why this kernel does not take ``x`` (the Triton kernel then does), or None."""
    if params.block_dim != 1:
        return "1x128 tiles (block_dim=1) only"
    why = tile_rules(x, "activation")
    if why is None and x.shape[1] > MAX_GRID_Y:
        why = f"K = {x.shape[1]} > {MAX_GRID_Y}: K blocks run on grid axis 1 (at most 65535 programs)"
    return why


_launch = FastLauncher(quantize_1x128_dual_gluon_kernel)


def layouts(element_size: int) -> tuple:
    """(L, LN, LT_RAW, T_RAW) for an input of ``element_size`` bytes (each part cached)."""
    lay, lay_n, _, _ = transpose_tile_layouts()
    return (lay, lay_n, *raw_transpose_layouts(element_size))


def quantize_1x128_dual_gluon(x: torch.Tensor, params: QuantParams, *, rowwise: bool, columnwise: bool) -> BlockwiseFp8Tensor:
    """Same contract and bits as :func:`..triton.quantize_act.quantize_1x128_dual`. Raises
    ``GluonUnsupported`` before launching anything where ``unsupported_reason`` says so."""
    why = unsupported_reason(x, params)
    if why is not None:
        raise GluonUnsupported(why)
    m, k = x.shape
    rowwise, columnwise = bool(rowwise), bool(columnwise)  # constexprs: 1 and True would compile apart
    row_q, row_s, col_q, col_s, parts = dual_outputs(x, params, rowwise, columnwise)
    if m > 0 and k > 0 and (rowwise or columnwise):
        lay, lay_n, lt_raw, t_raw = layouts(x.element_size())
        q_any = row_q if row_q is not None else col_q
        s_any = row_s if row_s is not None else col_s
        pow2 = bool(params.pow2_scales)
        # what can vary between calls, with the outputs' alignment (16 bytes from torch's caching
        # allocator, checked for other allocators); unsupported_reason fixes the rest: 16-byte aligned
        # x, M and K multiples of 16 below MAX_DIM, so pad4(M) == M; float scalars
        hint = (x.dtype, params.fp8_dtype, rowwise, columnwise, pow2, aligned(row_q, row_s, col_q, col_s))
        _launch.hinted(
            hint, (ceil_div(m, BLOCK), ceil_div(k, BLOCK)), x, row_q if rowwise else q_any,
            row_s if rowwise else s_any, col_q if columnwise else q_any, col_s if columnwise else s_any, m, k,
            pad4(m), pad4(k), params.fp8_max, float(params.amax_epsilon), torch.finfo(x.dtype).max,
            rowwise, columnwise, pow2, lay, lay_n, lt_raw, t_raw,
            num_warps=NUM_WARPS,
        )  # fmt: skip
    elif m == 0 and columnwise:
        col_s.fill_(1.0)
    return BlockwiseFp8Tensor((m, k), 1, params.fp8_dtype, x.dtype, **parts)
