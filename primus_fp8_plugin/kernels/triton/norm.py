"""LayerNorm / RMSNorm over the residual stream ``x [M, H]``: statistics, output (plain or quantized
to FP8 directly) and backward, bit for bit ``reference_fused.py``.

Forward, two kernels:

1. ``stats_kernel``: a program per few rows walks the row in 128-column chunks (several loaded per
   loop step: ``heuristics.StatsConfig``), one lane per column of a chunk (LayerNorm: a Welford
   update per lane; RMSNorm: a running sum of squares), then merges the 128 lanes pairwise: mean
   (LayerNorm) and rstd, fp32 [M]. One read of x.
2. ``fused_act``'s kernels, tile-parallel over 128x128 tiles: the output ``xhat * gamma (+ beta)``
   rounded to x's dtype, then either written (``norm_fwd``) or quantized to the rowwise 1x128 and
   columnwise 128x1 FP8 copies with their scales (``fused_act.quantize_fused``, or on Hopper
   ``kernels/sm90/fused_act.py``: the backend's ``quantize_norm_act``): a second read of x and the FP8
   bytes written, against a read, a write and a read of the bf16 output in the unfused path.

Backward, two kernels: ``bwd_kernel`` (a program per ``NORM_BWD_ROWS`` rows: pass 1 over the row
for the two row sums, pass 2 for dx and the group's column sums of ``dy * xhat`` and ``dy``, in
column steps wide enough that each thread holds all the group's rows of its columns, and walking
the row backwards so that it starts on what pass 1 left in L2: ``heuristics.BwdConfig``), then
``column_sum_kernel`` merges the groups' partial sums in the spec's order (``lane_sum`` over the
groups) into dgamma and dbeta.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...backends.reference_fused import NORM_BWD_ROWS, NORMALIZATIONS
from .fused_act import apply_fused
from .fused_math import FP_OPTIONS, LANES, OP_LAYERNORM, OP_RMSNORM, tree_lanes, tree_rows, welford_merge_lanes
from .heuristics import BwdConfig, StatsConfig, norm_bwd_config, norm_stats_config
from .launch import FastLauncher


@triton.jit
def stats_kernel(x_ptr, mean_ptr, rstd_ptr, M, H, stride_xm, eps, RMS: tl.constexpr, R: tl.constexpr,
                  U: tl.constexpr):  # fmt: skip
    """mean (LayerNorm) and rstd of R rows; each loop step loads U chunks of 128 columns, then takes
    them in column order (the spec's per-lane order, whatever U)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    lanes = tl.arange(0, LANES)
    rows_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    hf = H.to(tl.float32)
    if RMS:
        acc = tl.zeros([R, LANES], dtype=tl.float32)
        for k0 in tl.range(0, H, LANES * U):
            for u in tl.static_range(U):
                cols = k0 + u * LANES + lanes
                x = tl.load(x_rows + cols[None, :], mask=rows_ok[:, None] & (cols < H)[None, :], other=0.0)
                x = x.to(tl.float32)
                acc = acc + x * x
        var = tl.div_rn(tree_lanes(acc, R), hf)
    else:
        mean = tl.zeros([R, LANES], dtype=tl.float32)
        m2 = tl.zeros([R, LANES], dtype=tl.float32)
        n = tl.zeros([], dtype=tl.float32)  # elements per lane so far, chunk index + 1
        for k0 in tl.range(0, H, LANES * U):
            for u in tl.static_range(U):
                cols = k0 + u * LANES + lanes
                ok = rows_ok[:, None] & (cols < H)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                n = n + 1.0
                delta = x - mean
                new_mean = mean + delta * tl.div_rn(1.0, n)
                new_m2 = m2 + delta * (x - new_mean)
                # rows past M are computed like real ones (their x is 0) and not stored: only columns
                # past H are empty lanes (a chunk wholly past H changes nothing)
                col_ok = (cols < H)[None, :]
                mean = tl.where(col_ok, new_mean, mean)
                m2 = tl.where(col_ok, new_m2, m2)
        # elements of each lane: ceil((H - lane) / 128), 0 for lanes past H (exact small integers)
        count = tl.maximum(tl.cdiv(H - lanes, LANES), 0).to(tl.float32)
        count = tl.broadcast_to(count[None, :], [R, LANES])
        mean_r, m2_r = welford_merge_lanes(mean, m2, count, R)
        var = tl.div_rn(m2_r, hf)
        tl.store(mean_ptr + rows, mean_r, mask=rows_ok)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    tl.store(rstd_ptr + rows, rstd, mask=rows_ok)


@triton.jit
def _bwd_rows(dy_ptr, x_ptr, mean_ptr, rstd_ptr, c_ptr, gamma, dx_ptr, rows, cols, M, H, stride_dy, stride_x,
              RMS: tl.constexpr, SUB: tl.constexpr, LEVELS: tl.constexpr):  # fmt: skip
    """dx of ``SUB`` rows at ``cols`` (stored), and the pairwise trees over those rows of ``dy * xhat``
    and ``dy`` per column. ``c_ptr``: c2 [M] then c1 [M], from pass 1."""
    rows_ok = rows < M
    r64 = rows.to(tl.int64)[:, None]
    ok = rows_ok[:, None] & (cols < H)[None, :]
    rstd = tl.load(rstd_ptr + rows, mask=rows_ok, other=0.0)
    c2 = tl.load(c_ptr + rows, mask=rows_ok, other=0.0)
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if RMS:
        xhat = x * rstd[:, None]
    else:
        mean = tl.load(mean_ptr + rows, mask=rows_ok, other=0.0)
        xhat = (x - mean[:, None]) * rstd[:, None]
    g = dy * gamma[None, :]
    t = g - xhat * c2[:, None]
    if not RMS:
        c1 = tl.load(c_ptr + M + rows, mask=rows_ok, other=0.0)
        t = t - c1[:, None]
    dx = t * rstd[:, None]
    tl.store(dx_ptr + r64 * H + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
    pg = tree_rows(tl.where(ok, dy * xhat, 0.0), SUB, cols.shape[0], LEVELS)
    pb = tree_rows(dy, SUB, cols.shape[0], LEVELS)
    return pg, pb


@triton.jit
def bwd_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, gamma_ptr, dx_ptr, pg_ptr, pb_ptr, c_ptr, M, H, stride_dy, stride_x,
                RMS: tl.constexpr, DGAMMA: tl.constexpr, DBETA: tl.constexpr, G: tl.constexpr,
                U: tl.constexpr, W: tl.constexpr, SUB: tl.constexpr, REVERSE: tl.constexpr):  # fmt: skip
    """G rows (a column-sum group). Pass 1: U chunks of 128 columns per step, the row sums in the
    spec's per-lane order, c2 and c1 stored to ``c_ptr`` ([2, M] fp32) for pass 2. Pass 2: W columns
    per step (backwards if REVERSE), the group in G / SUB blocks of SUB rows (SUB a power of 2 of
    at least G / 4): dx, and the pairwise tree over the group's rows per column as the trees over
    the blocks combined pairwise (the top levels of the same tree)."""
    pid = tl.program_id(0)
    rows = pid * G + tl.arange(0, G)
    lanes = tl.arange(0, LANES)
    rows_ok = rows < M
    r64 = rows.to(tl.int64)[:, None]
    hf = H.to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=rows_ok, other=0.0)
    if RMS:
        mean = tl.zeros([G], dtype=tl.float32)
    else:
        mean = tl.load(mean_ptr + rows, mask=rows_ok, other=0.0)
    # pass 1: c2 = sum(g * xhat) / H and (LayerNorm) c1 = sum(g) / H, g = dy * gamma
    acc2 = tl.zeros([G, LANES], dtype=tl.float32)
    acc1 = tl.zeros([G, LANES], dtype=tl.float32)
    for k0 in tl.range(0, H, LANES * U):
        for u in tl.static_range(U):
            cols = k0 + u * LANES + lanes
            ok = rows_ok[:, None] & (cols < H)[None, :]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            gamma = tl.load(gamma_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
            if RMS:
                xhat = x * rstd[:, None]
            else:
                xhat = (x - mean[:, None]) * rstd[:, None]
            g = dy * gamma[None, :]
            acc2 = acc2 + tl.where(ok, g * xhat, 0.0)
            if not RMS:
                acc1 = acc1 + tl.where(ok, g, 0.0)
    tl.store(c_ptr + rows, tl.div_rn(tree_lanes(acc2, G), hf), mask=rows_ok)
    if not RMS:
        tl.store(c_ptr + M + rows, tl.div_rn(tree_lanes(acc1, G), hf), mask=rows_ok)
    tl.debug_barrier()  # pass 2's threads read the row sums other threads stored
    # pass 2: dx, and this group's column sums (a pairwise tree over its G rows)
    NB: tl.constexpr = G // SUB
    LEVELS: tl.constexpr = SUB.bit_length() - 1
    sub = pid * G + tl.arange(0, SUB)
    cw = tl.arange(0, W)
    steps = tl.cdiv(H, W)
    last = (steps - 1) * W
    for i in tl.range(0, steps):
        if REVERSE:
            k0 = last - i * W
        else:
            k0 = i * W
        cols = k0 + cw
        gamma = tl.load(gamma_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        pg, pb = _bwd_rows(dy_ptr, x_ptr, mean_ptr, rstd_ptr, c_ptr, gamma, dx_ptr, sub, cols, M, H, stride_dy,
                           stride_x, RMS, SUB, LEVELS)  # fmt: skip
        if NB >= 2:
            pg1, pb1 = _bwd_rows(dy_ptr, x_ptr, mean_ptr, rstd_ptr, c_ptr, gamma, dx_ptr, sub + SUB, cols, M, H,
                                 stride_dy, stride_x, RMS, SUB, LEVELS)  # fmt: skip
            pg, pb = pg + pg1, pb + pb1
        if NB == 4:
            pg2, pb2 = _bwd_rows(dy_ptr, x_ptr, mean_ptr, rstd_ptr, c_ptr, gamma, dx_ptr, sub + 2 * SUB, cols, M, H,
                                 stride_dy, stride_x, RMS, SUB, LEVELS)  # fmt: skip
            pg3, pb3 = _bwd_rows(dy_ptr, x_ptr, mean_ptr, rstd_ptr, c_ptr, gamma, dx_ptr, sub + 3 * SUB, cols, M, H,
                                 stride_dy, stride_x, RMS, SUB, LEVELS)  # fmt: skip
            pg, pb = pg + (pg2 + pg3), pb + (pb2 + pb3)
        if DGAMMA:
            tl.store(pg_ptr + pid.to(tl.int64) * H + cols, pg, mask=cols < H)
        if DBETA:
            tl.store(pb_ptr + pid.to(tl.int64) * H + cols, pb, mask=cols < H)


@triton.jit
def column_sum_kernel(p_ptr, out_ptr, NG, H, N: tl.constexpr):
    """out[j] = lane_sum over the NG groups of p[:, j]: 128 lanes over the groups, then a pairwise tree."""
    cols = tl.program_id(0) * N + tl.arange(0, N)
    lanes = tl.arange(0, LANES)
    acc = tl.zeros([LANES, N], dtype=tl.float32)
    for g0 in tl.range(0, NG, LANES):
        grp = g0 + lanes
        acc = acc + tl.load(p_ptr + grp.to(tl.int64)[:, None] * H + cols[None, :],
                            mask=(grp < NG)[:, None] & (cols < H)[None, :], other=0.0)  # fmt: skip
    tl.store(out_ptr + cols, tree_rows(acc, LANES, N, 7).to(out_ptr.dtype.element_ty), mask=cols < H)


_launch_stats = FastLauncher(stats_kernel)
_launch_bwd = FastLauncher(bwd_kernel)
_launch_column_sum = FastLauncher(column_sum_kernel)


def norm_op(normalization: str) -> int:
    """The fused quantizer's producer (``fused_math.OP_*``) of ``normalization``."""
    if normalization == "LayerNorm":
        return OP_LAYERNORM
    if normalization == "RMSNorm":
        return OP_RMSNORM
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def contiguous(*ts):
    """The norm's parameters (gamma, beta: [H] or None) as the kernels read them: contiguous."""
    return [None if t is None else t.contiguous() for t in ts]


def norm_stats(
    x: torch.Tensor, eps: float, normalization: str, config: StatsConfig | None = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(mean or None, rstd), fp32 [M], of ``x [M, H]`` (last dim contiguous). ``config``: the launch variant
    (default: ``heuristics.norm_stats_config()``)."""
    rms = norm_op(normalization) == OP_RMSNORM
    m, h = x.shape
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        cfg = config or norm_stats_config()
        _launch_stats((triton.cdiv(m, cfg.rows),), x, rstd if rms else mean, rstd, m, h, x.stride(0), float(eps),
                      rms, cfg.rows, cfg.unroll, num_warps=cfg.warps, **FP_OPTIONS)  # fmt: skip
    return mean, rstd


def norm_fwd(x, gamma, beta, eps, normalization, stats_config: StatsConfig | None = None):
    """``Backend.norm_fwd``: the statistics, then the output in x's dtype."""
    gamma, beta = contiguous(gamma, beta)
    mean, rstd = norm_stats(x, eps, normalization, stats_config)
    y = apply_fused(x, norm_op(normalization), k=x.shape[1], mean=mean, rstd=rstd, gamma=gamma, beta=beta)
    return y, mean, rstd


def norm_bwd(dy, x, gamma, mean, rstd, *, need_dgamma, need_dbeta, config: BwdConfig | None = None):
    """``Backend.norm_bwd``. ``config``: the launch variant (default: ``heuristics.norm_bwd_config()``)."""
    (gamma,) = contiguous(gamma)
    m, h = x.shape
    rms = mean is None
    dx = torch.empty(m, h, dtype=x.dtype, device=x.device)
    groups = triton.cdiv(m, NORM_BWD_ROWS)
    pg = torch.empty(groups, h, dtype=torch.float32, device=x.device) if need_dgamma else None
    pb = torch.empty(groups, h, dtype=torch.float32, device=x.device) if need_dbeta else None
    cfg = config or norm_bwd_config()
    if m > 0:
        c = torch.empty(2, m, dtype=torch.float32, device=x.device)  # pass 1's row sums c2, c1
        width = max(LANES, min(cfg.width, triton.next_power_of_2(h)))
        _launch_bwd((groups,), dy, x, rstd if rms else mean, rstd, gamma, dx, pg if pg is not None else rstd,
                    pb if pb is not None else rstd, c, m, h, dy.stride(0), x.stride(0), rms, bool(need_dgamma),
                    bool(need_dbeta), NORM_BWD_ROWS, cfg.unroll, width, cfg.sub, cfg.reverse,
                    num_warps=cfg.warps, num_stages=cfg.stages, **FP_OPTIONS)  # fmt: skip
    out = []
    for p in (pg, pb):
        if p is None:
            out.append(None)
            continue
        total = torch.empty(h, dtype=gamma.dtype, device=x.device)
        if m == 0:
            total.zero_()
        else:
            _launch_column_sum((triton.cdiv(h, cfg.colsum_cols),), p, total, groups, h, cfg.colsum_cols,
                               num_warps=cfg.colsum_warps, **FP_OPTIONS)  # fmt: skip
        out.append(total)
    return dx, out[0], out[1]
