"""Device functions of the fused ops (norm, SwiGLU), bit for bit the spec in ``reference_fused.py``.

The kernels that call them compile with ``enable_fp_fusion=False`` (``FP_OPTIONS``): a multiply
followed by an add must round twice, as torch's separate ops do, not once as an FMA would. Every
division and square root is the IEEE one (``tl.div_rn``, ``tl.sqrt_rn``; a plain ``/`` compiles to
an approximate division on sm_90). Reductions are explicit pairwise trees (``tl.reshape`` to a
trailing or middle axis of 2 and a sum over it, which is a single addition whatever the layout), so
their order does not depend on how Triton lays the tensor out over threads, nor on the interpreter.
"""

import triton
import triton.language as tl

FP_OPTIONS = {"enable_fp_fusion": False}
"""Launch and compile options of every kernel that uses these functions."""

# the producers of fused_act.py's kernels (constexpr OP)
OP_LAYERNORM = 0
OP_RMSNORM = 1
OP_SWIGLU = 2

LANES = tl.constexpr(128)

_LOG2E = tl.constexpr(1.4426950408889634)
_ROUND_MAGIC = tl.constexpr(12582912.0)
_LN2_HI = tl.constexpr(0.693359375)
_LN2_LO = tl.constexpr(-2.12194440e-4)
# 1/7!, ..., 1/1!
_C7 = tl.constexpr(1.0 / 5040)
_C6 = tl.constexpr(1.0 / 720)
_C5 = tl.constexpr(1.0 / 120)
_C4 = tl.constexpr(1.0 / 24)
_C3 = tl.constexpr(1.0 / 6)
_C2 = tl.constexpr(0.5)


@triton.jit
def tree_lanes(v, R: tl.constexpr):
    """Pairwise-tree sum of ``v [R, 128]`` along its last dim (element 2i + element 2i+1 per level) -> [R]."""
    for _ in tl.static_range(7):
        v = tl.sum(tl.reshape(v, [R, v.shape[1] // 2, 2]), axis=2)
    return tl.reshape(v, [R])


@triton.jit
def tree_rows(v, G: tl.constexpr, N: tl.constexpr, LEVELS: tl.constexpr):
    """Pairwise-tree sum of ``v [G, N]`` along its first dim (G = 2**LEVELS) -> [N]."""
    for _ in tl.static_range(LEVELS):
        v = tl.sum(tl.reshape(v, [v.shape[0] // 2, 2, N]), axis=1)
    return tl.reshape(v, [N])


@triton.jit
def welford_merge_lanes(mean, m2, count, R: tl.constexpr):
    """Chan's pairwise merge of 128 per-lane Welford states ``[R, 128]`` (lane 2i with lane 2i+1 per
    level) -> (mean [R], m2 [R]). ``count`` [R, 128] fp32; empty lanes (count 0) merge as nothing."""
    for _ in tl.static_range(7):
        ma, mb = tl.split(tl.reshape(mean, [R, mean.shape[1] // 2, 2]))
        qa, qb = tl.split(tl.reshape(m2, [R, m2.shape[1] // 2, 2]))
        na, nb = tl.split(tl.reshape(count, [R, count.shape[1] // 2, 2]))
        n = na + nb
        w = tl.where(n > 0.0, tl.div_rn(nb, tl.where(n > 0.0, n, 1.0)), 0.0)
        delta = mb - ma
        mean = ma + delta * w
        m2 = (qa + qb) + ((delta * delta) * na) * w
        count = n
    return tl.reshape(mean, [R]), tl.reshape(m2, [R])


@triton.jit
def exp_fp32(v):
    """``reference_fused.exp_fp32``: exp from IEEE +, -, * and bit operations (about 1.2 ulp)."""
    v = tl.minimum(tl.maximum(v, -104.0, propagate_nan=tl.PropagateNan.ALL), 89.0, propagate_nan=tl.PropagateNan.ALL)
    t = v * _LOG2E
    k = (t + _ROUND_MAGIC) - _ROUND_MAGIC
    r = (v - k * _LN2_HI) - k * _LN2_LO
    p = _C7 * r + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + 1.0
    p = p * r + 1.0
    ki = k.to(tl.int32)
    k1 = ki >> 1
    s1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((ki - k1 + 127) << 23).to(tl.float32, bitcast=True)
    return (p * s1) * s2


@triton.jit
def weight_rows(y, p, OUT_TY: tl.constexpr):
    """``y [R, C] * p [R]`` in fp32, rounded to OUT_TY, returned in fp32 (``reference_fused.weight_rows``: an
    activation of OUT_TY numbers scaled by per-row weights, as ``(y * p[:, None]).to(OUT_TY)`` rounds it)."""
    return (y * p[:, None]).to(OUT_TY).to(tl.float32)


@triton.jit
def swiglu_value(a, b, OUT_TY: tl.constexpr):
    """``silu(a)`` rounded to OUT_TY, times ``b``, rounded to OUT_TY, returned in fp32 (a, b: fp32
    values of OUT_TY numbers)."""
    s = tl.div_rn(a, 1.0 + exp_fp32(-a)).to(OUT_TY).to(tl.float32)
    return (s * b).to(OUT_TY).to(tl.float32)
