"""TE's scale rule as Triton device functions, shared by the quantization kernels, Triton and Gluon
alike (a Gluon kernel can call them as long as they build no tensor from a shape alone: no
``tl.zeros``/``tl.zeros_like``, which need a Gluon layout; scalars broadcast against the tensor
arguments instead).

The kernels are tight on instructions per element (the H200 issues about 33 per element at copy
bandwidth), so the per-element work is: one NaN-propagating max of ``|x|`` per copy (the abs is an
operand modifier of ``max.NaN.f32``), one multiply and one saturating FP8 conversion. No clamp and
no per-element NaN select are needed, because:

* ``cvt.rn.satfinite`` saturates, and ``|x * scale| <= fp8_max * (1 + 2^-23)`` always holds
  (``scale <= RN(fp8_max / max(amax, eps))``; in the overflow case ``in_max <= FP32_MAX <=
  fp8_max / amax``; pow2 only rounds ``scale`` down): clamping then rounding equals rounding with
  saturation, bit for bit;
* a tile holding NaN or +-Inf has a NaN or inf amax, gets ``scale = NaN``, so ``scale * x`` is NaN
  (the GPU's FMUL returns the canonical NaN: FP8 0x7F whatever the sign of the NaN in X; the operand
  order ``scale * x`` keeps the CPU interpreter, where the first operand's NaN wins, identical).
"""

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def scale_from_amax(amax, fp8_max, amax_eps, in_max, POW2: tl.constexpr):
    """fp32 scale per tile from its (finite) fp32 amax: TE's steps 1-5 (docs/NUMERICS.md)."""
    amax = tl.maximum(amax, amax_eps)
    # IEEE division: a plain `/` compiles to the approximate div.full.f32 on sm_90.
    scale = tl.div_rn(fp8_max, amax)
    scale = tl.where(scale > FP32_MAX, in_max, scale)  # inf (amax tiny or 0) -> input dtype max
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax == 0.0, 1.0, scale)


@triton.jit
def max_nan(a, b):
    """max that propagates NaN (``max.NaN.f32``)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_nan(x, axis: tl.constexpr):
    """max |x| along ``axis``; NaN anywhere gives NaN, +-Inf gives inf."""
    return tl.reduce(tl.abs(x), axis, max_nan)


@triton.jit
def scale_and_inverse(amax, fp8_max, amax_eps, in_max, POW2: tl.constexpr):
    """(scale to multiply by, scale_inv to store) of tiles with this NaN-propagated amax.

    A bad tile (NaN or +-Inf inside: amax is NaN or inf, i.e. not <= FP32_MAX) gets scale NaN, so
    its data comes out NaN from the multiply, and scale_inv NaN."""
    ok = amax <= FP32_MAX
    scale = scale_from_amax(tl.where(ok, amax, 0.0), fp8_max, amax_eps, in_max, POW2)
    if POW2:
        # 1 / 2^e is exact: exponent field 254 - (e + 127), i.e. bits 0x7F000000 - bits(scale), for
        # e <= 126; 2^127 (tiny amax) has the subnormal inverse 2^-127 (bits 0x00400000).
        bits = scale.to(tl.int32, bitcast=True)
        inv = (0x7F000000 - bits).to(tl.float32, bitcast=True)
        inv = tl.where(bits < 0x7F000000, inv, 2.0**-127)
    else:
        inv = tl.div_rn(1.0, scale)
    return tl.where(ok, scale, float("nan")), tl.where(ok, inv, float("nan"))
