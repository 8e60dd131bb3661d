"""The fused ops' kernels (norm, SwiGLU, RoPE) against the spec (reference backend), bit for bit, and the
spec against independent computations: torch's own ops, fp64, numpy's IEEE square root, a plain loop.

Triton runs through the CPU interpreter here (tests/conftest.py); tests/gpu/test_gpu_fused.py repeats the
bit-exactness on CUDA.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from primus_fp8_plugin import BlockwiseRecipe, TensorRole, available_backends
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.backends import reference_fused as spec
from primus_fp8_plugin.backends.base import Backend

from ..conftest import make_input

REF = get_backend("reference", "cpu")
P_IN = BlockwiseRecipe().params(TensorRole.INPUT)
HAS_TRITON = bool(available_backends("cpu").get("triton"))
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton's CPU interpreter is not available")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a, b, what=""):
    """Bit for bit (NaN matches NaN whatever its payload: NaN's bits are the hardware's, not the spec's)."""
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point() and a.element_size() > 1:
        assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN in different places"
        a, b = a[~a.isnan()], b[~b.isnan()]
    assert torch.equal(bits(a), bits(b)), f"{what}: {int((bits(a) != bits(b)).sum())} of {a.numel()} differ"


def assert_same_fp8(a, b):
    for name, t in a.to_te().items():
        assert_same(t, b.to_te()[name], name)


def norm_inputs(m, h, dtype, seed, *, nonfinite=False):
    g = torch.Generator().manual_seed(seed)
    x = (make_input((m, h), dtype=torch.float32, seed=seed, spread=False) * 3 + 0.7).to(dtype)
    x[m // 2] = 0  # a zero row: variance 0, rstd = 1/sqrt(eps)
    if m > 3:
        x[1] = 5.0  # a constant row
    if nonfinite:
        x[min(2, m - 1), h // 3] = float("nan")
        x[m - 1, 0] = float("inf")
    gamma = (torch.rand(h, generator=g) + 0.5).to(dtype)
    beta = torch.randn(h, generator=g).to(dtype)
    dy = make_input((m, h), dtype=torch.float32, seed=seed + 1, spread=False).to(dtype)
    return x, gamma, beta, dy


# ---- the spec against independent computations --------------------------------------------------


def test_lane_sum_and_column_sum_follow_their_stated_order():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(3, 300, generator=g) * torch.exp2(torch.randint(-20, 20, (3, 300), generator=g).float())
    for r in range(3):  # a plain-Python rendering of the stated order, with fp32 rounding after each add
        lanes = [np.float32(0)] * 128
        for i, val in enumerate(v[r].tolist()):
            lanes[i % 128] = np.float32(lanes[i % 128] + np.float32(val))
        while len(lanes) > 1:
            lanes = [np.float32(lanes[2 * i] + lanes[2 * i + 1]) for i in range(len(lanes) // 2)]
        assert spec.lane_sum(v)[r].item() == float(lanes[0])
    m = torch.randn(37, 5, generator=g)
    groups = [spec.pair_tree(torch.nn.functional.pad(m[i : i + 16].t(), (0, 16 - m[i : i + 16].shape[0]))) for i in (0, 16, 32)]
    expected = spec.lane_sum(torch.stack(groups, 1))
    assert torch.equal(spec.column_sum(m), expected)
    assert torch.allclose(spec.column_sum(m).double(), m.double().sum(0), rtol=1e-6, atol=1e-6)


def test_sqrt_rn_is_the_ieee_square_root():
    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.rand(200_000, generator=g) * 4,
                   torch.exp2(torch.randint(-149, 127, (100_000,), generator=g).float()) * torch.rand(100_000, generator=g),
                   torch.tensor([0.0, -0.0, 1e-45, float("inf"), 3.4e38, -1.0, float("nan")])])  # fmt: skip
    with np.errstate(invalid="ignore"):
        ieee = torch.from_numpy(np.sqrt(v.numpy()))
    ours = spec.sqrt_rn(v)
    assert torch.equal(ours.isnan(), ieee.isnan())
    assert torch.equal(bits(ours[~ours.isnan()]), bits(ieee[~ieee.isnan()]))


def test_exp_fp32_is_within_1_3_ulp_and_overflows_like_ieee():
    v = torch.linspace(-103.0, 88.72, 400_001)
    exact = torch.exp(v.double())
    ours = spec.exp_fp32(v).double()
    ulp = (torch.nextafter(exact.float(), torch.tensor(float("inf"))).double() - exact.float().double()).abs()
    normal = exact > 1.2e-38
    assert float(((ours - exact).abs() / ulp)[normal].max()) < 1.3
    special = torch.tensor([89.0, 100.0, float("inf"), -104.5, -float("inf"), float("nan")])
    out = spec.exp_fp32(special)
    assert out[:3].isinf().all() and torch.equal(out[3:5], torch.zeros(2)) and out[5].isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_forward_is_torchs_silu_times_b_on_every_input(dtype):
    """silu(a) rounded to bf16/fp16 equals torch's F.silu for all 65536 inputs (vectorised and scalar
    paths of torch's CPU kernel); the product then rounds identically."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[torch.isfinite(every)]
    ones = torch.ones_like(every)
    h = torch.stack([every, ones], 1).reshape(-1, 2)  # F = 1: [a | b] per row
    assert_same(spec.swiglu_fwd(h)[:, 0], F.silu(every), "vectorised")
    some = every[::97]
    assert_same(torch.stack([F.silu(v.reshape(1))[0] for v in some]), spec.swiglu_fwd(torch.stack([some, ones[::97]], 1))[:, 0])
    a, b = make_input((64, 96), dtype=dtype, seed=5, spread=False) * 4, make_input((64, 96), dtype=dtype, seed=6, spread=False)
    assert_same(spec.swiglu_fwd(torch.cat([a, b], 1)), F.silu(a) * b, "silu(a) * b")


def test_swiglu_backward_is_close_to_torch_autograd():
    h = (make_input((200, 256), dtype=torch.float32, seed=7, spread=False) * 3).to(torch.bfloat16)
    hq = h.clone().requires_grad_(True)
    a, b = hq.chunk(2, -1)
    dy = make_input((200, 128), seed=8, spread=False)
    (F.silu(a) * b).backward(dy)
    ours = spec.swiglu_bwd(dy, h)
    assert (ours != hq.grad).float().mean() < 1e-3  # the same formula; only exp's last bits can differ
    assert torch.allclose(ours.float(), hq.grad.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_spec_is_close_to_torch_and_its_gradients(normalization, dtype):
    x, gamma, beta, dy = norm_inputs(67, 300, dtype, seed=11)
    beta = beta if normalization == "LayerNorm" else None
    y, mean, rstd = spec.norm_fwd(x, gamma, beta, 1e-5, normalization)
    if normalization == "LayerNorm":
        torch_y = F.layer_norm(x, (300,), gamma, beta, 1e-5)
        assert torch.allclose(mean.double(), x.double().mean(1), rtol=1e-6, atol=1e-6)
    else:
        torch_y = F.rms_norm(x, (300,), gamma, 1e-5)
    close = 1e-2 if dtype is torch.bfloat16 else 1e-5
    assert torch.allclose(y.float(), torch_y.float(), rtol=close, atol=close)
    assert (y != torch_y).float().mean() < (0.01 if dtype is torch.bfloat16 else 0.6)  # last-bit differences only
    xs = [t.detach().double().requires_grad_(True) for t in (x, gamma) + ((beta,) if beta is not None else ())]
    ref = F.layer_norm(xs[0], (300,), xs[1], xs[2], 1e-5) if beta is not None else F.rms_norm(xs[0], (300,), xs[1], 1e-5)
    ref.backward(dy.double())
    dx, dgamma, dbeta = spec.norm_bwd(dy, x, gamma, mean, rstd, need_dgamma=True, need_dbeta=beta is not None)
    tol = 2e-2 if dtype is torch.bfloat16 else 1e-4
    for ours, exact in zip((dx, dgamma, dbeta), (t.grad for t in xs)):
        assert float((ours.double() - exact).norm() / exact.norm()) < tol


# ---- the kernels against the spec ------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize(
    "m, h, dtype, normalization, nonfinite",
    [
        (130, 200, torch.bfloat16, "LayerNorm", False),  # two row tiles (the second of 2 rows), ragged H
        (256, 256, torch.bfloat16, "RMSNorm", False),  # whole tiles: the one-pass kernel path
        (37, 136, torch.float32, "LayerNorm", True),  # fp32, NaN and Inf in the input
        (20, 64, torch.float16, "RMSNorm", False),  # one partial tile, H < 128
    ],
)
def test_norm_kernels_match_the_spec_bit_for_bit(m, h, dtype, normalization, nonfinite):
    tri = get_backend("triton", "cpu")
    x, gamma, beta, dy = norm_inputs(m, h, dtype, seed=m + h, nonfinite=nonfinite)
    beta = beta if normalization == "LayerNorm" else None
    y_t, mean_t, rstd_t = tri.norm_fwd(x, gamma, beta, 1e-5, normalization)
    y_r, mean_r, rstd_r = REF.norm_fwd(x, gamma, beta, 1e-5, normalization)
    assert_same(mean_t, mean_r, "mean")
    assert_same(rstd_t, rstd_r, "rstd")
    assert_same(y_t, y_r, "norm output")
    q_t, mean_q, rstd_q = tri.quantize_norm_act(x, gamma, beta, 1e-5, normalization, P_IN, rowwise=True, columnwise=True)
    assert_same_fp8(q_t, REF.quantize_act(y_r, P_IN, rowwise=True, columnwise=True))
    assert_same(rstd_q, rstd_r, "rstd of the fused path")
    if nonfinite:  # the non-finite rows' tiles are NaN, as the quantizer makes them from the unfused output
        assert q_t.scales("rowwise")[2].isnan().any() and not q_t.scales("rowwise")[0].isnan().any()
        x, dy = x.nan_to_num(0.0, 0.0, 0.0), dy  # finite input for the backward below
        y_r, mean_r, rstd_r = REF.norm_fwd(x, gamma, beta, 1e-5, normalization)
    got = tri.norm_bwd(dy, x, gamma, mean_r, rstd_r, need_dgamma=True, need_dbeta=beta is not None)
    want = REF.norm_bwd(dy, x, gamma, mean_r, rstd_r, need_dgamma=True, need_dbeta=beta is not None)
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, want):
        assert_same(a, b, name)


@needs_triton
@pytest.mark.parametrize("kind", ["stats", "bwd"])
def test_every_norm_launch_variant_is_the_spec_bit_for_bit(kind):
    """Each launch variant of the norm statistics and backward kernels (kernels/triton/heuristics.py) on fresh
    random ragged shapes: rows not a multiple of 16, rows longer than a variant's column step (several
    steps, a partial last one) and shorter than one chunk of 128."""
    from primus_fp8_plugin.backends.triton import FusedVariants, TritonBackend
    from primus_fp8_plugin.kernels.triton import heuristics

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    for name in {"stats": heuristics.NORM_STATS, "bwd": heuristics.NORM_BWD}[kind]:
        tri = TritonBackend(fused=FusedVariants(**{kind: name}))
        for m, h in ((rng.randint(17, 45), rng.randint(1025, 1400)), (rng.randint(3, 40), rng.randint(40, 300))):
            normalization = rng.choice(["LayerNorm", "RMSNorm"])
            dtype = rng.choice([torch.bfloat16, torch.float32])
            what = f"{kind}={name} {normalization} {dtype} [{m}, {h}] (seed {seed})"
            x, gamma, beta, dy = norm_inputs(m, h, dtype, seed=rng.randint(0, 2**31))
            beta = beta if normalization == "LayerNorm" else None
            y_r, mean_r, rstd_r = REF.norm_fwd(x, gamma, beta, 1e-5, normalization)
            if kind == "stats":
                y_t, mean_t, rstd_t = tri.norm_fwd(x, gamma, beta, 1e-5, normalization)
                assert_same(mean_t, mean_r, f"mean, {what}")
                assert_same(rstd_t, rstd_r, f"rstd, {what}")
                assert_same(y_t, y_r, f"output, {what}")
                continue
            got = tri.norm_bwd(dy, x, gamma, mean_r, rstd_r, need_dgamma=True, need_dbeta=beta is not None)
            want = REF.norm_bwd(dy, x, gamma, mean_r, rstd_r, need_dgamma=True, need_dbeta=beta is not None)
            for part, a, b in zip(("dx", "dgamma", "dbeta"), got, want):
                assert_same(a, b, f"{part}, {what}")


@needs_triton
def test_norm_columnwise_only_and_rowwise_only_copies():
    tri = get_backend("triton", "cpu")
    x, gamma, beta, _ = norm_inputs(40, 160, torch.bfloat16, seed=2)
    y = REF.norm_fwd(x, gamma, beta, 1e-5, "LayerNorm")[0]
    for row, col in ((True, False), (False, True)):
        got = tri.quantize_norm_act(x, gamma, beta, 1e-5, "LayerNorm", P_IN, rowwise=row, columnwise=col)[0]
        assert got.has_rowwise == row and got.has_columnwise == col
        assert_same_fp8(got, REF.quantize_act(y, P_IN, rowwise=row, columnwise=col))


@needs_triton
@pytest.mark.parametrize("m, f, dtype", [(130, 200, torch.bfloat16), (64, 128, torch.float32), (9, 24, torch.float16)])
def test_swiglu_kernels_match_the_spec_bit_for_bit(m, f, dtype):
    tri = get_backend("triton", "cpu")
    h = (make_input((m, 2 * f), dtype=torch.float32, seed=m, spread=False) * 4).to(dtype)
    h[0, :8] = torch.tensor([0.0, -0.0, 20.0, -20.0, 90.0, -90.0, 1e-30, -1e-30])
    h[1, 3] = float("nan")
    y = REF.swiglu_fwd(h)
    assert_same(tri.swiglu_fwd(h), y, "swiglu")
    assert_same_fp8(tri.quantize_swiglu_act(h, P_IN, rowwise=True, columnwise=True),
                    REF.quantize_act(y, P_IN, rowwise=True, columnwise=True))  # fmt: skip
    dy = make_input((m, f), dtype=dtype, seed=m + 1, spread=False)
    assert_same(tri.swiglu_bwd(dy, h), REF.swiglu_bwd(dy, h), "swiglu backward")


@needs_triton
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype, rot, d", [(torch.bfloat16, 64, 64), (torch.float32, 32, 48)])
def test_rope_kernel_matches_the_spec_bit_for_bit(interleaved, dtype, rot, d):
    tri = get_backend("triton", "cpu")
    s, b, nh = 6, 2, 3
    qkv = make_input((s, b, nh, 3 * d), dtype=dtype, seed=rot + d, spread=False)
    t = qkv[..., d : 2 * d]  # a strided view, as Megatron's split of the fused QKV projection
    t[0, 0, 0] = -0.0
    freqs = torch.rand(s, 1, 1, rot) * 10
    cos, sin = spec.rope_cos_sin(freqs, dtype, 1.0)
    for backward in (False, True):
        assert_same(tri.rope(t, cos, sin, interleaved=interleaved, backward=backward),
                    REF.rope(t, cos, sin, interleaved=interleaved, backward=backward), f"backward={backward}")  # fmt: skip


def test_backends_without_fused_ops_say_what_to_use():
    class Bare(Backend):
        name = "bare"
        availability = quantize_act = quantize_weight = gemm_fwd = gemm_dgrad = gemm_wgrad = None

    with pytest.raises(NotImplementedError, match="'triton'.*'reference'"):
        Bare().quantize_norm_act(None, None, None, 1e-5, "RMSNorm", P_IN, rowwise=True, columnwise=True)
