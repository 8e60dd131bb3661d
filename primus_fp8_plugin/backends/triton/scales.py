"""TE's scale rule as a Triton device function, shared by the quantization kernels."""

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def scale_from_amax(amax, fp8_max, amax_eps, in_max, POW2: tl.constexpr):
    """fp32 scale per tile from its (finite) fp32 amax: TE's steps 1-5 (docs/NUMERICS.md)."""
    amax = tl.maximum(amax, amax_eps)
    # IEEE division: a plain `/` compiles to the approximate div.full.f32 on sm_90.
    scale = tl.div_rn(tl.zeros_like(amax) + fp8_max, amax)
    scale = tl.where(scale > FP32_MAX, in_max, scale)  # inf (amax tiny or 0) -> input dtype max
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def quantize_with_scale(x, scale, bad, fp8_max, out_dtype: tl.constexpr):
    """``fp8(clamp(x * scale))``; tiles flagged ``bad`` (held NaN/Inf) become NaN."""
    q = tl.minimum(tl.maximum(x * scale, -fp8_max), fp8_max)
    q = tl.where(bad, float("nan"), q)
    return q.to(out_dtype)


@triton.jit
def abs_or_inf(x):
    """|x| with NaN mapped to +inf: a tile's max of it is > FP32_MAX exactly when the tile holds NaN
    or +-Inf, so one ordinary max reduction gives both the amax and the non-finite verdict."""
    a = tl.abs(x)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def is_bad(amax):
    """True where an amax of ``abs_or_inf`` values is inf (the tile held NaN or +-Inf)."""
    return amax > FP32_MAX
