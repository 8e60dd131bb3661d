"""The spec of the fused ops in plain torch: LayerNorm / RMSNorm, SwiGLU and RoPE, forward and backward.

Every other backend reproduces these bit for bit. Each result is a fixed sequence of IEEE fp32
operations (each rounded to nearest even, no fused multiply-add), so it is the same on any device;
the reductions run in a fixed order instead of torch's (whose order depends on the device, the
CPU's vector width and the launch configuration). The rules are in ``docs/NUMERICS.md`` ("Fused
ops"); in short:

* ``lane_sum`` (a sum along the last dim, length ``n``): 128 lanes, lane ``l`` adds the elements
  ``l, l + 128, l + 256, ...`` in order starting from +0, then a pairwise tree over the lanes
  (lane ``2i`` + lane ``2i+1`` at every level).
* LayerNorm statistics: per lane a Welford update over its elements (``mean += delta * (1/n)``,
  ``m2 += delta * (x - mean)``), then the lanes merged pairwise (Chan). RMSNorm: ``lane_sum(x*x)``.
  ``rstd = 1 / sqrt(var + eps)`` with ``var = m2 / H`` (or ``sum(x^2) / H``), an IEEE square root
  (``sqrt_rn``) and division.
* Norm output ``((x - mean) * rstd) * gamma (+ beta)`` in fp32, rounded once to x's dtype.
* Norm backward: ``dx = ((g - xhat * c2) - c1) * rstd`` with ``g = dy * gamma``,
  ``c1 = lane_sum(g) / H``, ``c2 = lane_sum(g * xhat) / H`` (RMSNorm: no ``c1``); ``dgamma`` and
  ``dbeta`` are column sums: a pairwise tree over each group of ``NORM_BWD_ROWS`` rows, then
  ``lane_sum`` over the groups.
* SiLU: ``x / (1 + exp(-x))`` with ``exp_fp32`` below (Cody-Waite reduction, degree-7 Taylor
  polynomial, about 1.2 ulp); for bf16 and fp16 inputs it rounds to torch's ``F.silu`` on all
  65536 inputs (checked on the CPU by the tests, on CUDA by ``tests/gpu``).
* RoPE: Megatron's unfused ``(t * cos) + (rotate_half(t) * sin)`` with each product and the sum
  rounded to t's dtype, as torch computes it (no reduction, no exp: bit-exact with torch anywhere).
"""

from __future__ import annotations

import math

import torch

LANES = 128
"""Lanes of ``lane_sum`` (and of the LayerNorm Welford statistics)."""

NORM_BWD_ROWS = 16
"""Rows per group in the column sums of the norm backward (``dgamma``, ``dbeta``): power of 2."""

NORMALIZATIONS = ("LayerNorm", "RMSNorm")

F32 = torch.float32
# exp_fp32's constants, as fp32
_LOG2E = 1.4426950408889634
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: (t + M) - M rounds t to an integer (|t| < 2^22)
_LN2_HI = 0.693359375  # 9 significant bits: k * LN2_HI is exact for |k| <= 2^15
_LN2_LO = -2.12194440e-4  # ln 2 - LN2_HI
_EXP_COEFFS = tuple(1.0 / math.factorial(i) for i in range(7, -1, -1))  # 1/7!, ..., 1/1!, 1/0!
_EXP_CLAMP = (-104.0, 89.0)  # exp(-104) rounds to 0 and exp(89) overflows in fp32


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    """An fp32 tensor of ``like``'s shape filled with ``value``: operations below take full-size tensor
    operands (torch may turn a division by a python scalar into a multiply by its reciprocal)."""
    return torch.full_like(like, value, dtype=F32)


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The IEEE (correctly rounded) fp32 square root of an fp32 tensor, on any device: torch's own
    fp32 ``sqrt`` is not correctly rounded on every CPU. An fp64 root rounded to fp32, then moved one
    ulp where the exact test says so: a midpoint between two fp32 numbers has 25 significant bits, so
    its square is exact in fp64."""
    r = torch.sqrt(v.double()).float()
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    down = torch.nextafter(r, torch.zeros_like(r))
    vd, rd = v.double(), r.double()
    hi = (rd + up.double()) * 0.5  # midpoints, exact in fp64
    lo = (rd + down.double()) * 0.5
    r = torch.where(vd > hi * hi, up, r)
    r = torch.where((vd < lo * lo) & (r > 0), down, r)
    return torch.where(torch.isfinite(v) & (v > 0), r, torch.sqrt(v))


def pair_tree(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum along ``dim`` (a power of 2 long) by a pairwise tree: element ``2i`` + element ``2i+1``
    at every level. The dim is removed."""
    v = v.movedim(dim, -1)
    n = v.shape[-1]
    if n & (n - 1):
        raise ValueError(f"pair_tree needs a power-of-2 length, got {n}")
    while v.shape[-1] > 1:
        v = v.reshape(*v.shape[:-1], -1, 2)
        v = v[..., 0] + v[..., 1]
    return v[..., 0]


def _lane_view(v: torch.Tensor) -> torch.Tensor:
    """``v [R, n]`` zero-padded to whole chunks of ``LANES`` and viewed as ``[R, chunks, LANES]``."""
    r, n = v.shape
    chunks = -(-n // LANES)
    if n != chunks * LANES:
        v = torch.nn.functional.pad(v, (0, chunks * LANES - n))
    return v.reshape(r, chunks, LANES)


def lane_sum(v: torch.Tensor) -> torch.Tensor:
    """Row sums of an fp32 ``v [R, n]`` in the plugin's order (module docstring) -> ``[R]``."""
    chunks = _lane_view(v)
    acc = torch.zeros(v.shape[0], LANES, dtype=F32, device=v.device)
    for k in range(chunks.shape[1]):
        acc = acc + chunks[:, k]
    return pair_tree(acc)


def column_sum(v: torch.Tensor, group: int = NORM_BWD_ROWS) -> torch.Tensor:
    """Column sums of an fp32 ``v [M, H]``: a pairwise tree over each group of ``group`` rows (the
    last one zero-padded), then ``lane_sum`` over the groups -> ``[H]``."""
    m, h = v.shape
    groups = -(-m // group)
    if m != groups * group:
        v = torch.nn.functional.pad(v, (0, 0, 0, groups * group - m))
    partial = pair_tree(v.reshape(groups, group, h), dim=1)  # [groups, H]
    return lane_sum(partial.t().contiguous())


# ---- normalization -----------------------------------------------------------------------------


def _welford_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, m2) per row of an fp32 ``x [M, H]``: Welford per lane, lanes merged pairwise (Chan)."""
    m, h = x.shape
    chunks = _lane_view(x)
    valid = _lane_view(torch.ones(1, h, dtype=torch.bool, device=x.device))[0]  # [chunks, LANES]
    mean = torch.zeros(m, LANES, dtype=F32, device=x.device)
    m2 = torch.zeros_like(mean)
    count = torch.zeros(LANES, dtype=F32, device=x.device)
    one = torch.ones(LANES, dtype=F32, device=x.device)
    for k in range(chunks.shape[1]):
        v, ok = chunks[:, k], valid[k]
        inv = one / _full(one, k + 1)
        delta = v - mean
        new_mean = mean + delta * inv
        new_m2 = m2 + delta * (v - new_mean)
        mean = torch.where(ok, new_mean, mean)
        m2 = torch.where(ok, new_m2, m2)
        count = torch.where(ok, _full(count, k + 1), count)
    count = count.expand(m, LANES)
    while mean.shape[1] > 1:
        (ma, mb), (qa, qb), (na, nb) = (t.reshape(m, -1, 2).unbind(-1) for t in (mean, m2, count))
        n = na + nb
        w = torch.where(n > 0, nb / torch.where(n > 0, n, torch.ones_like(n)), torch.zeros_like(n))
        delta = mb - ma
        mean = ma + delta * w
        m2 = (qa + qb) + ((delta * delta) * na) * w
        count = n
    return mean[:, 0], m2[:, 0]


def norm_stats(x: torch.Tensor, normalization: str, eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(mean, rstd)`` (fp32 ``[M]``; mean None for RMSNorm) of ``x [M, H]`` over its last dim."""
    xf = x.float()
    hf = _full(xf[:, 0], x.shape[1])
    if normalization == "LayerNorm":
        mean, m2 = _welford_stats(xf)
        var = m2 / hf
    elif normalization == "RMSNorm":
        mean, var = None, lane_sum(xf * xf) / hf
    else:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    rstd = _full(var, 1.0) / sqrt_rn(var + _full(var, eps))
    return mean, rstd


def _xhat(xf, mean, rstd):
    return (xf - mean[:, None]) * rstd[:, None] if mean is not None else xf * rstd[:, None]


def norm_apply(x, gamma, beta, mean, rstd) -> torch.Tensor:
    """The norm's output in x's dtype: ``xhat * gamma (+ beta)`` in fp32, rounded once."""
    y = _xhat(x.float(), mean, rstd) * gamma.float()[None, :]
    if beta is not None:
        y = y + beta.float()[None, :]
    return y.to(x.dtype)


def norm_fwd(x, gamma, beta, eps, normalization):
    """``(y, mean, rstd)``: the plugin's LayerNorm / RMSNorm of ``x [M, H]`` (y in x's dtype)."""
    mean, rstd = norm_stats(x, normalization, eps)
    return norm_apply(x, gamma, beta, mean, rstd), mean, rstd


def norm_bwd(dy, x, gamma, mean, rstd, *, need_dgamma: bool = True, need_dbeta: bool = False):
    """``(dx, dgamma, dbeta)`` of the norm (``mean`` None for RMSNorm); dx in x's dtype, dgamma in
    gamma's, dbeta (if asked) in gamma's dtype as well."""
    xf, dyf = x.float(), dy.float()
    hf = _full(xf[:, 0], x.shape[1])
    xhat = _xhat(xf, mean, rstd)
    g = dyf * gamma.float()[None, :]
    c2 = lane_sum(g * xhat) / hf
    t = g - xhat * c2[:, None]
    if mean is not None:
        t = t - (lane_sum(g) / hf)[:, None]
    dx = (t * rstd[:, None]).to(x.dtype)
    dgamma = column_sum(dyf * xhat).to(gamma.dtype) if need_dgamma else None
    dbeta = column_sum(dyf).to(gamma.dtype) if need_dbeta else None
    return dx, dgamma, dbeta


# ---- SwiGLU ------------------------------------------------------------------------------------


def exp_fp32(v: torch.Tensor) -> torch.Tensor:
    """exp of an fp32 tensor from IEEE +, -, * and bit operations only (the same bits on any device):
    k = round(v log2 e), r = (v - k ln2_hi) - k ln2_lo, Taylor polynomial of degree 7 in r (Horner),
    times 2^(k//2) and then 2^(k - k//2). Max error about 1.2 ulp; NaN stays NaN."""
    v = v.clamp(*_EXP_CLAMP)
    t = v * _full(v, _LOG2E)
    magic = _full(v, _ROUND_MAGIC)
    k = (t + magic) - magic
    r = (v - k * _full(v, _LN2_HI)) - k * _full(v, _LN2_LO)
    p = _full(v, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + _full(v, c)
    ki = k.to(torch.int32)
    k1 = ki >> 1
    s1 = ((k1 + 127) << 23).view(F32)
    s2 = ((ki - k1 + 127) << 23).view(F32)
    return (p * s1) * s2


def silu_fp32(af: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` in fp32 with ``exp_fp32``."""
    return af / (_full(af, 1.0) + exp_fp32(-af))


def _halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if h.shape[-1] % 2:
        raise ValueError(f"SwiGLU needs an even last dim [.., 2F], got {tuple(h.shape)}")
    a, b = h.chunk(2, dim=-1)
    return a, b


ROW_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def weight_rows(a: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``a [M, F]`` scaled by per-row weights ``probs [M]`` (fp32, bf16 or fp16): the fp32 product rounded once
    to a's dtype, the bits of Megatron's ``(a * probs[:, None]).to(a.dtype)`` for these dtypes (torch computes a
    product of two such tensors in fp32 and rounds it to the result dtype)."""
    return (a.float() * probs.float()[:, None]).to(a.dtype)


def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` of ``h [M, 2F] = [a | b]`` (Megatron's gated layout: gate first), each of the
    two steps rounded to h's dtype (torch's ``F.silu(a) * b`` in h's dtype) -> ``[M, F]``."""
    a, b = _halves(h)
    s = silu_fp32(a.float()).to(h.dtype)
    return (s.float() * b.float()).to(h.dtype)


def swiglu_bwd(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``dh [M, 2F]`` of ``swiglu_fwd`` for the output gradient ``dy [M, F]``, laid out as torch's
    autograd computes ``F.silu(a) * b`` in h's dtype: ``db = dy * silu(a)``, ``gs = dy * b`` (each
    rounded), ``da = (gs * sig) * (1 + a * (1 - sig))`` with ``sig = 1 / (1 + exp(-a))``, rounded."""
    a, b = _halves(h)
    af, gf = a.float(), dy.float()
    one = _full(af, 1.0)
    e = exp_fp32(-af)
    s = (af / (one + e)).to(h.dtype)
    sig = one / (one + e)
    gs = (gf * b.float()).to(h.dtype).float()
    da = ((gs * sig) * (one + af * (one - sig))).to(h.dtype)
    db = (gf * s.float()).to(h.dtype)
    return torch.cat((da, db), dim=-1)


# ---- MoE token combine ---------------------------------------------------------------------------


def unpermute(y: torch.Tensor, sorted_indices: torch.Tensor, num_tokens: int, probs: torch.Tensor | None) -> torch.Tensor:
    """Megatron's ``unpermute`` (``moe_utils``): ``y * probs[:, None]`` (the product's dtype) scatter-added into
    zeros ``[num_tokens, H]`` at each row's token, then cast to y's dtype. On the CPU torch sums each output's rows
    in fp32 in row order and rounds once (the expanded-index ``scatter_add``)."""
    src = y if probs is None else y * probs.unsqueeze(-1)
    out = torch.zeros(num_tokens, y.shape[1], dtype=src.dtype, device=y.device)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, y.shape[1]), src)
    return out.to(y.dtype)


# ---- RoPE --------------------------------------------------------------------------------------


def rope_cos_sin(freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(freqs) * mscale`` and ``sin(freqs) * mscale`` in ``dtype``, as Megatron's unfused RoPE
    makes them (the same torch ops, so the same bits on each device)."""
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def _partner(rot: int, interleaved: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of the ``rot`` rotated features: the index it is paired with and the sign that
    ``rotate_half`` gives the partner (``rotate_half(t)[d] = sign[d] * t[partner[d]]``)."""
    d = torch.arange(rot, device=device)
    if interleaved:
        partner = d ^ 1
        negative = d % 2 == 0
    else:
        half = rot // 2
        partner = torch.where(d < half, d + half, d - half)
        negative = d < half
    return partner, negative


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool, backward: bool) -> torch.Tensor:
    """Rotary embedding of ``t [s, b, h, d]`` (sbhd) with ``cos``/``sin`` ``[s, 1 or b, 1, rot]`` in t's
    dtype; features ``rot..d`` pass through. Forward: ``(t * cos) + (rotate_half(t) * sin)``, each
    product and the sum rounded to t's dtype. ``backward``: the gradient of that for an output gradient
    ``t`` (torch's autograd of the forward: ``g * cos`` plus ``rotate_half``'s transpose of ``g * sin``,
    then ``+ 0.0``)."""
    rot = cos.shape[-1]
    if rot % 2 or rot > t.shape[-1]:
        raise ValueError(f"RoPE needs an even rotary dim <= the head dim, got {rot} for {tuple(t.shape)}")
    x, rest = t[..., :rot], t[..., rot:]
    partner, negative = _partner(rot, interleaved, t.device)
    xp = x[..., partner]
    if backward:  # grad of rotate_half(x) * sin: feature d gets the partner's g * sin, sign flipped
        rotated = xp * sin[..., partner]
        rotated = torch.where(negative, rotated, -rotated)
    else:
        rotated = torch.where(negative, -xp, xp) * sin
    out = torch.cat(((x * cos) + rotated, rest), dim=-1)
    # torch's autograd adds the gradients of the two slices of t (rotated, passed through) as
    # full-size tensors, zero elsewhere: every -0 of the gradient comes out +0
    return out + 0.0 if backward else out
