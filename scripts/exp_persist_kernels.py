import triton
import triton.language as tl

from primus_fp8_plugin.backends.triton.quantize_act import _column_scales, _columnwise_copy, _rowwise_copy
from primus_fp8_plugin.backends.triton.scales import amax_nan, max_nan, scale_and_inverse


@triton.jit
def act_persist_kernel(
    x_ptr,
    row_q_ptr,
    row_s_ptr,
    col_q_ptr,
    col_s_ptr,
    M,
    K,
    M_PAD,
    K_PAD,
    stride_xm,
    fp8_max,
    amax_eps,
    in_max,
    n_tiles,
    n_k_tiles,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    EVEN: tl.constexpr,
):
    blk = tl.arange(0, BLOCK)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=LOOP_STAGES):
        pid_m = t // n_k_tiles
        pid_k = t % n_k_tiles
        m0 = pid_m * BLOCK
        k0 = pid_k * BLOCK
        x_tile = x_ptr + m0.to(tl.int64) * stride_xm + k0
        rq_tile = row_q_ptr + m0.to(tl.int64) * K + k0
        cq_tile = col_q_ptr + k0.to(tl.int64) * M + m0
        if EVEN:
            full = m0 >= 0  # always true; folded
            mask = (blk < BLOCK)[:, None] & (blk < BLOCK)[None, :]
            x = tl.load(x_tile + blk[:, None] * stride_xm + blk[None, :]).to(tl.float32)
        else:
            full = (m0 + BLOCK <= M) & (k0 + BLOCK <= K)
            mask = (m0 + blk < M)[:, None] & (k0 + blk < K)[None, :]
            x = tl.load(x_tile + blk[:, None] * stride_xm + blk[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROWWISE:
            _rowwise_copy(x, blk, blk, rq_tile, row_s_ptr, pid_k, m0, M, K, M_PAD, mask, full, fp8_max, amax_eps, in_max, POW2)
        if COLWISE:
            scale, s_inv = scale_and_inverse(amax_nan(x, 0), fp8_max, amax_eps, in_max, POW2)
            _columnwise_copy(x, scale, blk, blk, cq_tile, M, mask, full)
            _column_scales(s_inv, blk, col_s_ptr, pid_m, k0, K, K_PAD)


@triton.jit
def weight_persist_kernel(
    w_ptr,
    q_ptr,
    qt_ptr,
    s_ptr,
    st_ptr,
    N,
    K,
    stride_wn,
    stride_s,
    stride_st,
    fp8_max,
    amax_eps,
    in_max,
    n_tiles,
    n_k_tiles,
    POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    EVEN: tl.constexpr,
    ONE_LOAD: tl.constexpr,
):
    blk = tl.arange(0, BLOCK)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=LOOP_STAGES):
        pid_n = t // n_k_tiles
        pid_k = t % n_k_tiles
        n0 = pid_n * BLOCK
        k0 = pid_k * BLOCK
        w_blk = w_ptr + n0.to(tl.int64) * stride_wn + k0
        q_blk = q_ptr + n0.to(tl.int64) * K + k0
        qt_blk = qt_ptr + k0.to(tl.int64) * N + n0
        offs = blk[:, None] * stride_wn + blk[None, :]
        if EVEN:
            mask = (blk < BLOCK)[:, None] & (blk < BLOCK)[None, :]
        else:
            mask = (n0 + blk < N)[:, None] & (k0 + blk < K)[None, :]
        x = tl.load(w_blk + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.reduce(tl.abs(x), 1, max_nan), 0, max_nan)
        scale, s_inv = scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2)
        q = (scale * x).to(q_ptr.dtype.element_ty)
        tl.store(q_blk + blk[:, None] * K + blk[None, :], q, mask=mask)
        if ONE_LOAD:
            qt = tl.trans(q)
        else:
            x2 = tl.load(w_blk + offs, mask=mask, other=0.0).to(tl.float32)
            qt = (scale * tl.trans(x2)).to(qt_ptr.dtype.element_ty)
        if EVEN:
            tl.store(qt_blk + blk[:, None] * N + blk[None, :], qt)
        else:
            tl.store(qt_blk + blk[:, None] * N + blk[None, :], qt, mask=tl.trans(mask))
        tl.store(s_ptr + pid_n * stride_s + pid_k, s_inv)
        tl.store(st_ptr + pid_k * stride_st + pid_n, s_inv)
