"""The fast Triton launch path (kernels/triton/launch.py) on a GPU: every call gives the same bits as
the ordinary ``kernel[grid]`` launch, a repeated call reuses its binary, and a change in pointer
alignment, in an int's divisibility by 16 or a dim equal to 1 picks another binary. Skipped without
a GPU (CI)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from primus_fp8_plugin import BlockwiseRecipe, TensorRole, backend_availability, get_backend
from primus_fp8_plugin.kernels.triton import launch as launch_mod
from primus_fp8_plugin.kernels.triton import quantize_act

pytestmark = pytest.mark.gpu


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.fixture
def triton_backend():
    avail = backend_availability("triton", "cuda")
    if not avail:
        pytest.skip(f"triton: {avail.reason}")
    return get_backend("triton", torch.device("cuda"))


def _parts(t):
    names = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
    return [getattr(t, n) for n in names if getattr(t, n) is not None]


def _same_bits(a, b):
    for x, y in zip(_parts(a), _parts(b), strict=True):
        xb = x.view(torch.uint8) if x.element_size() == 1 else x.view(torch.int32)
        yb = y.view(torch.uint8) if y.element_size() == 1 else y.view(torch.int32)
        assert torch.equal(xb, yb)


def _plain_launch(call):
    """``call()`` with every launch going the ordinary ``kernel[grid]`` way (FastLauncher off)."""
    with launch_mod.launch_settings(fast=False):
        return call()


@pytest.mark.parametrize("m, k, offset", [(1, 256, 0), (17, 144, 0), (256, 384, 0), (130, 256, 1), (16, 128, 3)])
def test_fast_launch_matches_plain_launch(triton_backend, m, k, offset):
    """The Triton act kernel (on Hopper the backend sends aligned shapes to the Gluon kernel): ragged M,
    M == 1, and inputs whose base pointer is not 16-byte aligned (offset elements into a buffer)."""
    gen = torch.Generator(device="cuda").manual_seed(m * 1000 + k + offset)
    buf = torch.randn(m * k + offset, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    x = buf[offset:].view(m, k)
    p = BlockwiseRecipe().params(TensorRole.INPUT)
    launcher = quantize_act._launch
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        fast1 = quantize_act.quantize_1x128_dual(x, p, rowwise=rowwise, columnwise=columnwise)
        misses = launcher.misses
        fast2 = quantize_act.quantize_1x128_dual(x, p, rowwise=rowwise, columnwise=columnwise)  # the cached binary
        assert launcher.misses == misses, "a repeated call with the same specialisation recompiled or re-bound"
        plain = _plain_launch(lambda: quantize_act.quantize_1x128_dual(x, p, rowwise=rowwise, columnwise=columnwise))
        _same_bits(fast1, plain)
        _same_bits(fast2, plain)


def test_alignment_change_takes_another_binary(triton_backend):
    """The same shape from an aligned and from a misaligned base pointer: two specialisations."""
    p = BlockwiseRecipe().params(TensorRole.INPUT)
    buf = torch.randn(64 * 256 + 1, device="cuda", dtype=torch.float16)
    launcher = quantize_act._launch
    launcher._compiled.clear()  # other test files may have launched these specialisations already
    quantize_act.quantize_1x128_dual(buf[:-1].view(64, 256), p, rowwise=True, columnwise=True)
    before = launcher.misses
    quantize_act.quantize_1x128_dual(buf[1:].view(64, 256), p, rowwise=True, columnwise=True)
    assert launcher.misses == before + 1
    quantize_act.quantize_1x128_dual(buf[:-1].view(64, 256), p, rowwise=True, columnwise=True)
    assert launcher.misses == before + 1


def test_int_specialisations_take_other_binaries(triton_backend):
    """M divisible by 16, M not divisible by 16, M == 1: three specialisations of the same kernel (the
    Triton act kernel itself: on Hopper the backend sends M % 16 == 0 to the Gluon kernel)."""
    p = BlockwiseRecipe().params(TensorRole.INPUT)
    launcher = quantize_act._launch
    launcher._compiled.clear()  # other test files may have launched these specialisations already
    quant = quantize_act.quantize_1x128_dual
    start = launcher.misses
    for m, new in ((16, True), (17, True), (1, True), (16, False), (33, False)):  # 33: same as 17's
        before = launcher.misses
        quant(torch.randn(m, 256, device="cuda"), p, rowwise=True, columnwise=True)
        assert launcher.misses == before + int(new), f"M={m}: misses {before} -> {launcher.misses}"
    assert launcher.misses == start + 3


@pytest.mark.parametrize("b_block_dim, out_dtype, accumulate", [(2, torch.bfloat16, False), (1, torch.bfloat16, False),
                                                                (1, torch.float32, True), (2, torch.float32, False)])  # fmt: skip
def test_gluon_gemm_fast_launch_matches_plain_launch(b_block_dim, out_dtype, accumulate):
    """The Gluon GEMM (TensorDescriptor arguments, maxnreg) through FastLauncher: the same bits as
    ``kernel[grid]``, and a repeated call reuses its binary."""
    from primus_fp8_plugin.kernels.sm90 import gemm as gemm_gluon
    from primus_fp8_plugin.kernels.sm90.heuristics import gemm_config

    if not gemm_gluon.runs_on(torch.device("cuda")):
        pytest.skip("the Gluon GEMM runs on sm_90 only")
    m, n, k = 200, 384, 640
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda", generator=g).to(torch.float8_e4m3fn)
    kb = k // 128
    a_s = torch.rand(kb, m, device="cuda", generator=g) + 0.5
    b_s_shape = (n // 128, 8) if b_block_dim == 2 else (kb, n)
    b_s = torch.rand(b_s_shape, device="cuda", generator=g) + 0.5
    start = torch.randn(m, n, device="cuda", generator=g)

    def run():
        acc = start.clone() if accumulate else None
        cfg = gemm_config(b_block_dim, out_dtype, accumulate)
        return gemm_gluon.blockwise_gemm_gluon(a, a_s, b, b_s, b_block_dim=b_block_dim, out_dtype=out_dtype, config=cfg,
                                               accumulate_into=acc)  # fmt: skip

    fast1 = run()
    misses = gemm_gluon._launch.misses
    fast2 = run()
    assert gemm_gluon._launch.misses == misses
    plain = _plain_launch(run)
    assert torch.equal(fast1, plain) and torch.equal(fast2, plain)


def test_hinted_launches_reuse_one_binary_per_hint_and_match_plain_launches(monkeypatch):
    """The Gluon act quantizer goes through ``FastLauncher.hinted``: a repeated call finds its binary by
    hint (no new specialisation), and the bits equal the ordinary ``kernel[grid]`` launch."""
    from primus_fp8_plugin.kernels.sm90 import quantize_act as quantize_act_gluon
    from primus_fp8_plugin.kernels.sm90.target import runs_on

    if not runs_on(torch.device("cuda")):
        pytest.skip("the Gluon quantizer runs on sm_90 only")
    p = BlockwiseRecipe().params(TensorRole.INPUT)
    x = torch.randn(272, 400, device="cuda", dtype=torch.bfloat16) * 5
    launcher = quantize_act_gluon._launch
    first = quantize_act_gluon.quantize_1x128_dual_gluon(x, p, rowwise=True, columnwise=True)
    assert any(key[-1][:5] == (torch.bfloat16, p.fp8_dtype, True, True, bool(p.pow2_scales)) for key in launcher._hinted)
    hints, misses = len(launcher._hinted), launcher.misses

    def full_path(*args, **kwargs):
        raise AssertionError("a repeated hinted call took the full-key path")

    monkeypatch.setattr(launch_mod.FastLauncher, "__call__", full_path)  # hinted() falls back to self(...)
    # hints on, verification off (it computes the full key)
    monkeypatch.setattr(launch_mod.FastLauncher, "settings", launch_mod.LaunchSettings(hints=True, verify_hints=False))
    again = quantize_act_gluon.quantize_1x128_dual_gluon(x * 1.0, p, rowwise=True, columnwise=True)
    assert (len(launcher._hinted), launcher.misses) == (hints, misses)
    monkeypatch.undo()
    plain = _plain_launch(lambda: quantize_act_gluon.quantize_1x128_dual_gluon(x, p, rowwise=True, columnwise=True))
    _same_bits(first, plain)
    _same_bits(again, plain)


def test_a_hint_that_misses_a_varying_property_is_caught_when_verifying(triton_backend, monkeypatch):
    """A hint that stands for two specialisations (here: it ignores whether N is divisible by 16) is a
    wrapper bug; with hint verification on (as in this GPU suite) the second call raises before
    launching the wrong binary."""
    launcher = launch_mod.FastLauncher(_copy)
    x = torch.randn(512, device="cuda")
    y = torch.zeros_like(x)
    launcher.hinted(("copy",), (4,), x, y, 512, 128)  # first call of the hint: the full path
    launcher.hinted(("copy",), (4,), x, y, 512, 128)  # found by hint
    assert torch.equal(x, y)
    monkeypatch.setattr(launch_mod.FastLauncher, "settings", launch_mod.LaunchSettings(verify_hints=True))
    with pytest.raises(RuntimeError, match="stands for two specialisations"):
        launcher.hinted(("copy",), (4,), x, y, 500, 128)  # 500: not divisible by 16, another binary
