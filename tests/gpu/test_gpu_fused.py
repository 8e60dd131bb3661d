"""The fused ops on a CUDA GPU (triton backend): every kernel bit for bit the spec (the reference backend, run on the CPU),
fused norm/SwiGLU -> FP8 linear bit for bit the unfused composition for each GPU backend (whose unfused
path quantizes with its own quantizer: the Gluon kernels on Hopper), SwiGLU equal to torch's CUDA F.silu
on all bf16/fp16 inputs, RoPE equal to Megatron's unfused RoPE. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from primus_fp8_plugin import (
    BlockwiseRecipe,
    TensorRole,
    backend_availability,
    fp8_blockwise_linear,
    fp8_norm_linear,
    fp8_swiglu_linear,
)
from primus_fp8_plugin.backends import get_backend
from primus_fp8_plugin.backends import reference_fused as spec
from primus_fp8_plugin.normalization import norm
from primus_fp8_plugin.rope import apply_rotary_pos_emb
from primus_fp8_plugin.swiglu import swiglu

from ..conftest import make_input

pytestmark = pytest.mark.gpu
P_IN = BlockwiseRecipe().params(TensorRole.INPUT)
REF = get_backend("reference", "cpu")


@pytest.fixture(params=["triton", "cublas", "hopper", "flydsl"])  # each skipped where unavailable
def gpu_backend(request):
    avail = backend_availability(request.param, "cuda")
    if not avail:
        pytest.skip(f"{request.param}: {avail.reason}")
    return request.param


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a, b, what=""):
    """Bit for bit on the CPU; NaN matches NaN (its payload is the hardware's)."""
    assert (a is None) == (b is None), what
    if a is None:
        return
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point() and a.element_size() > 1:
        assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN in different places"
        a, b = a[~a.isnan()], b[~b.isnan()]
    diff = bits(a) != bits(b)
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} differ"


def assert_same_fp8(a, b, what=""):
    for name, t in a.to_te().items():
        assert_same(t, b.to_te()[name], f"{what} {name}")


NORM_SHAPES = [(1, 128), (130, 300), (2048, 4096), (3000, 1040), (513, 8192), (256, 16)]


@pytest.mark.parametrize("m, h", NORM_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_kernels_are_the_spec_bit_for_bit(m, h, dtype, normalization):
    be = get_backend("triton", "cuda")  # the backends built on it run the same fused kernels
    g = torch.Generator().manual_seed(m + h)
    x = (make_input((m, h), dtype=torch.float32, seed=m * h, spread=False) * 3 + 0.5).to(dtype)
    if m > 4:
        x[m // 2] = 0
        x[3, h // 2] = float("nan")
    gamma = (torch.rand(h, generator=g) + 0.5).to(dtype)
    beta = torch.randn(h, generator=g).to(dtype) if normalization == "LayerNorm" else None
    dy = make_input((m, h), dtype=torch.float32, seed=m + 7, spread=False).to(dtype)
    cuda = [None if t is None else t.cuda() for t in (x, gamma, beta, dy)]
    y, mean, rstd = be.norm_fwd(cuda[0], cuda[1], cuda[2], 1e-5, normalization)
    y_r, mean_r, rstd_r = REF.norm_fwd(x, gamma, beta, 1e-5, normalization)
    assert_same(mean, mean_r, "mean")
    assert_same(rstd, rstd_r, "rstd")
    assert_same(y, y_r, "norm output")
    q, _, _ = be.quantize_norm_act(cuda[0], cuda[1], cuda[2], 1e-5, normalization, P_IN, rowwise=True, columnwise=True)
    assert_same_fp8(q, REF.quantize_act(y_r, P_IN, rowwise=True, columnwise=True), "vs the spec")
    assert_same_fp8(q, be.quantize_act(y, P_IN, rowwise=True, columnwise=True), "vs this backend's quantizer")
    x, cx = x.nan_to_num(0.0), cuda[0].nan_to_num(0.0)
    _, mean_r, rstd_r = REF.norm_fwd(x, gamma, beta, 1e-5, normalization)
    got = be.norm_bwd(cuda[3], cx, cuda[1], None if mean_r is None else mean_r.cuda(), rstd_r.cuda(), need_dgamma=True,
                      need_dbeta=beta is not None)  # fmt: skip
    want = REF.norm_bwd(dy, x, gamma, mean_r, rstd_r, need_dgamma=True, need_dbeta=beta is not None)
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, want):
        assert_same(a, b, name)


@pytest.mark.parametrize("m, f", [(1, 64), (130, 200), (2048, 1408), (4100, 3584)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu_kernels_are_the_spec_bit_for_bit(m, f, dtype):
    be = get_backend("triton", "cuda")
    h = (make_input((m, 2 * f), dtype=torch.float32, seed=m + f, spread=False) * 4).to(dtype)
    h[0, : min(8, 2 * f)] = torch.tensor([0.0, -0.0, 20.0, -20.0, 90.0, -90.0, 1e-30, -1e-30])[: min(8, 2 * f)].to(dtype)
    dy = make_input((m, f), dtype=torch.float32, seed=m, spread=False).to(dtype)
    y_r = REF.swiglu_fwd(h)
    assert_same(be.swiglu_fwd(h.cuda()), y_r, "swiglu")
    q = be.quantize_swiglu_act(h.cuda(), P_IN, rowwise=True, columnwise=True)
    assert_same_fp8(q, REF.quantize_act(y_r, P_IN, rowwise=True, columnwise=True), "vs the spec")
    assert_same_fp8(q, be.quantize_act(y_r.cuda(), P_IN, rowwise=True, columnwise=True), "vs this backend's quantizer")
    assert_same(be.swiglu_bwd(dy.cuda(), h.cuda()), REF.swiglu_bwd(dy, h), "swiglu backward")


@pytest.mark.parametrize("op, m, k", [("LayerNorm", 2048, 4096), ("RMSNorm", 512, 1040), ("SwiGLU", 1024, 3584)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gluon_fused_quantizer_is_the_triton_one_on_hopper(op, m, k, dtype):
    from primus_fp8_plugin.kernels.sm90.fused_act import quantize_fused_gluon, unsupported_reason
    from primus_fp8_plugin.kernels.sm90.heuristics import FUSED_QUANT
    from primus_fp8_plugin.kernels.triton.fused_act import quantize_fused
    from primus_fp8_plugin.kernels.triton.fused_math import OP_LAYERNORM, OP_RMSNORM, OP_SWIGLU
    from primus_fp8_plugin.kernels.triton.norm import norm_stats

    width = 2 * k if op == "SwiGLU" else k
    src = (make_input((m, width), dtype=torch.float32, seed=k, spread=False) * 3).to(dtype).cuda()
    src[5, 7] = float("nan")
    if unsupported_reason(src, k, P_IN) is not None:
        pytest.skip(unsupported_reason(src, k, P_IN))
    kw = {"k": k}
    if op == "SwiGLU":
        code, kw["up_offset"] = OP_SWIGLU, k
    else:
        code = OP_LAYERNORM if op == "LayerNorm" else OP_RMSNORM
        kw["mean"], kw["rstd"] = norm_stats(src, 1e-5, op)
        kw["gamma"] = (torch.rand(k, device="cuda") + 0.5).to(dtype)
        kw["beta"] = torch.randn(k, device="cuda").to(dtype) if op == "LayerNorm" else None
    for row, col in ((True, True), (True, False), (False, True)):
        want = quantize_fused(src, code, P_IN, rowwise=row, columnwise=col, **kw)
        for name, cfg in FUSED_QUANT.items():  # every launch variant of the Gluon kernel
            gluon = quantize_fused_gluon(src, code, P_IN, config=cfg, rowwise=row, columnwise=col, **kw)
            assert_same_fp8(gluon, want, f"{op} {row} {col} gluon={name}")


@pytest.mark.parametrize("op", ["LayerNorm", "RMSNorm", "SwiGLU"])
def test_every_fused_launch_variant_is_the_unfused_composition_on_fresh_shapes(op):
    """Each launch variant (FusedVariants) of the norm statistics, the Hopper fused quantizer and the
    norm backward against the unfused composition (the spec's op, then this backend's quantizer) on
    fresh random shapes: M and K multiples of 16 (the Gluon kernel) with partial 128-tiles, and ragged."""
    import os
    import random

    from primus_fp8_plugin.backends.triton import FusedVariants, TritonBackend
    from primus_fp8_plugin.kernels.sm90.heuristics import FUSED_QUANT
    from primus_fp8_plugin.kernels.triton.heuristics import NORM_BWD, NORM_STATS

    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    shapes = [(16 * rng.randint(9, 130), 16 * rng.randint(9, 200)), (rng.randint(130, 1500), rng.randint(130, 2100))]
    for m, k in shapes:
        dtype = rng.choice([torch.bfloat16, torch.float16])
        what = f"{op} [{m}, {k}] {dtype} (seed {seed})"
        if op == "SwiGLU":
            h = (make_input((m, 2 * k), dtype=torch.float32, seed=rng.randint(0, 2**31), spread=False) * 4).to(dtype)
            want = REF.quantize_act(REF.swiglu_fwd(h), P_IN, rowwise=True, columnwise=True)
            for gv in FUSED_QUANT:
                be = TritonBackend(fused=FusedVariants(gluon=gv))
                got = be.quantize_swiglu_act(h.cuda(), P_IN, rowwise=True, columnwise=True)
                assert_same_fp8(got, want, f"{what} gluon={gv}")
            continue
        g = torch.Generator().manual_seed(rng.randint(0, 2**31))
        x = (make_input((m, k), dtype=torch.float32, seed=rng.randint(0, 2**31), spread=False) * 3 + 0.5).to(dtype)
        gamma = (torch.rand(k, generator=g) + 0.5).to(dtype)
        beta = torch.randn(k, generator=g).to(dtype) if op == "LayerNorm" else None
        dy = make_input((m, k), dtype=torch.float32, seed=rng.randint(0, 2**31), spread=False).to(dtype)
        y_r, mean_r, rstd_r = REF.norm_fwd(x, gamma, beta, 1e-5, op)
        want = REF.quantize_act(y_r, P_IN, rowwise=True, columnwise=True)
        cx, cg, cb, cdy = (None if t is None else t.cuda() for t in (x, gamma, beta, dy))
        for sv in NORM_STATS:
            for gv in FUSED_QUANT:
                be = TritonBackend(fused=FusedVariants(stats=sv, gluon=gv))
                q, mean, rstd = be.quantize_norm_act(cx, cg, cb, 1e-5, op, P_IN, rowwise=True, columnwise=True)
                assert_same(rstd, rstd_r, f"rstd, {what} stats={sv}")
                assert_same_fp8(q, want, f"{what} stats={sv} gluon={gv}")
        bwd_r = REF.norm_bwd(dy, x, gamma, mean_r, rstd_r, need_dgamma=True, need_dbeta=beta is not None)
        stats = (None if mean_r is None else mean_r.cuda(), rstd_r.cuda())
        for bv in NORM_BWD:
            be = TritonBackend(fused=FusedVariants(bwd=bv))
            got = be.norm_bwd(cdy, cx, cg, *stats, need_dgamma=True, need_dbeta=beta is not None)
            for part, a, b in zip(("dx", "dgamma", "dbeta"), got, bwd_r):
                assert_same(a, b, f"{part}, {what} bwd={bv}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swiglu_is_torchs_cuda_silu_times_b_on_every_input(dtype):
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every[torch.isfinite(every)].cuda()
    h = torch.stack([every, torch.ones_like(every)], 1)
    ours = swiglu(h, backend="triton")[:, 0]
    theirs = F.silu(every)
    bad = (bits(ours) != bits(theirs)).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} inputs differ, e.g. {every[bad[:8]].tolist()}"


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype, rot, d", [(torch.bfloat16, 128, 128), (torch.float32, 64, 96), (torch.float16, 32, 64)])
def test_rope_is_megatrons_unfused_rope_on_cuda(interleaved, dtype, rot, d):
    s, b, nh = 257, 2, 8
    qkv = make_input((s, b, nh, 3 * d), dtype=dtype, seed=d, spread=False).cuda()
    t = qkv[..., :d]
    t[0, 0, 0] = -0.0
    freqs = (torch.rand(s, 1, 1, rot) * 50).cuda()
    dy = make_input((s, b, nh, d), dtype=dtype, seed=d + 1, spread=False).cuda()
    dy[1, 0, 0] = -0.0
    ours_t = t.detach().clone().requires_grad_(True)
    ours = apply_rotary_pos_emb(ours_t, freqs, rotary_interleaved=interleaved, backend="triton")
    ours.backward(dy)
    cos, sin = spec.rope_cos_sin(freqs, dtype)  # torch's CUDA cos/sin, as Megatron's
    assert_same(ours, REF.rope(t.cpu(), cos.cpu(), sin.cpu(), interleaved=interleaved, backward=False), "rope")
    assert_same(ours_t.grad, REF.rope(dy.cpu(), cos.cpu(), sin.cpu(), interleaved=interleaved, backward=True), "grad")
    try:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    except ImportError:
        return
    theirs_t = t.detach().clone().requires_grad_(True)
    theirs = _apply_rotary_pos_emb_bshd(theirs_t, freqs, rotary_interleaved=interleaved)
    theirs.backward(dy)
    assert_same(ours, theirs, "vs Megatron")
    assert_same(ours_t.grad, theirs_t.grad, "grad vs Megatron")


def _leaves(*ts):
    return [None if t is None else t.detach().clone().cuda().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("m, h, n, fmt", [(2000, 1024, 3072, "HYBRID"), (4096, 4096, 1024, "E4M3"), (77, 272, 144, "E4M3")])
def test_fused_linears_are_the_unfused_composition_bit_for_bit(gpu_backend, normalization, m, h, n, fmt):
    recipe = BlockwiseRecipe(fp8_format=fmt)
    g = torch.Generator().manual_seed(m)
    x = make_input((m, h), dtype=torch.float32, seed=m, spread=False).bfloat16()
    nw = (torch.rand(h, generator=g) + 0.5).bfloat16()
    nb = torch.randn(h, generator=g).bfloat16() if normalization == "LayerNorm" else None
    w = (torch.randn(n, h, generator=g) / h**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    dy = make_input((m, n), seed=n, spread=False).cuda()
    runs = []
    for fused in (True, False):
        xs, nws, nbs, ws, bs = _leaves(x, nw, nb, w, b)
        if fused:
            y = fp8_norm_linear(xs, nws, nbs, ws, bs, normalization=normalization, recipe=recipe, backend=gpu_backend)
        else:
            y = fp8_blockwise_linear(norm(xs, normalization, nws, nbs, backend=gpu_backend), ws, bs, recipe=recipe,
                                     backend=gpu_backend)  # fmt: skip
        y.backward(dy)
        runs.append([y] + [None if t is None else t.grad for t in (xs, nws, nbs, ws, bs)])
    for name, a, c in zip(("out", "dx", "dgamma", "dbeta", "dW", "db"), *runs):
        assert_same(a, c, name)
    # SwiGLU -> fc2 with fc2's input width h / 2
    hid = make_input((m, h), dtype=torch.float32, seed=m + 1, spread=False).bfloat16() * 3
    w2 = (torch.randn(n, h // 2, generator=g) / h**0.5).bfloat16()
    runs = []
    for fused in (True, False):
        hs, ws, bs = _leaves(hid, w2, b)
        if fused:
            y = fp8_swiglu_linear(hs, ws, bs, recipe=recipe, backend=gpu_backend)
        else:
            y = fp8_blockwise_linear(swiglu(hs, backend=gpu_backend), ws, bs, recipe=recipe, backend=gpu_backend)
        y.backward(dy)
        runs.append([y, hs.grad, ws.grad, bs.grad])
    for name, a, c in zip(("swiglu out", "dh", "dW", "db"), *runs):
        assert_same(a, c, name)


def test_plugin_norm_is_close_to_torchs_cuda_norm():
    """Not bit-exact by design (torch's reduction order depends on its launch): the share of bf16 outputs
    one ulp apart is printed; it must stay small."""
    x = make_input((4096, 4096), seed=3, spread=False).cuda() * 2 + 0.5
    w = torch.rand(4096, device="cuda").bfloat16() + 0.5
    b = torch.randn(4096, device="cuda").bfloat16()
    for name, ours, theirs in (
        ("LayerNorm", norm(x, "LayerNorm", w, b, backend="triton"), F.layer_norm(x, (4096,), w, b, 1e-5)),
        ("RMSNorm", norm(x, "RMSNorm", w, backend="triton"), F.rms_norm(x, (4096,), w, 1e-5)),
    ):
        share = float((ours != theirs).float().mean())
        print(f"{name}: {share:.2e} of bf16 outputs differ from torch's (max {float((ours - theirs).abs().max()):.2e})")
        assert share < 0.01
        assert torch.allclose(ours.float(), theirs.float(), rtol=1e-2, atol=1e-2)
