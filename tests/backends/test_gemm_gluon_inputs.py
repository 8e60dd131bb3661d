"""The Hopper Gluon GEMM's wrapper on any machine: wrong inputs raise ValueError / TypeError (so the
triton backend never hands them to another kernel), valid inputs it does not take raise
GluonUnsupported (so the backend falls back), all before anything is allocated or launched. The
kernel itself is checked on the GPU (tests/gpu) and compiled in CI (test_triton_aot.py)."""

from __future__ import annotations

import pytest
import torch

from primus_fp8_plugin.backends.triton.gemm_gluon import GluonUnsupported, blockwise_gemm_gluon, runs_on

E4M3 = torch.float8_e4m3fn


def operands(m=64, n=128, k=256, b_block_dim=2):
    a = torch.randn(m, k).to(E4M3)
    b = torch.randn(n, k).to(E4M3)
    kb = -(-k // 128)
    a_s = torch.ones(kb, -(-m // 4) * 4)
    b_s = torch.ones(-(-n // 128), -(-kb // 4) * 4) if b_block_dim == 2 else torch.ones(kb, -(-n // 4) * 4)
    return a, a_s, b, b_s


def call(a, a_s, b, b_s, b_block_dim=2, out_dtype=torch.bfloat16, **kw):
    return blockwise_gemm_gluon(a, a_s, b, b_s, b_block_dim=b_block_dim, out_dtype=out_dtype, **kw)


@pytest.mark.parametrize(
    "accumulate_into, match",
    [
        (torch.zeros(64, 64), r"accumulate_into must be a float32 \[64, 128\]"),  # wrong shape
        (torch.zeros(64, 128, dtype=torch.float16), r"accumulate_into must be a float32"),  # wrong dtype
        (torch.zeros(128, 64).t(), r"unit column stride"),  # not row-contiguous
    ],
)
def test_a_wrong_accumulate_into_is_a_value_error(accumulate_into, match):
    with pytest.raises(ValueError, match=match):
        call(*operands(b_block_dim=1), b_block_dim=1, accumulate_into=accumulate_into)


def test_wrong_dtypes_and_scales_are_errors_not_fallbacks():
    a, a_s, b, b_s = operands()
    with pytest.raises(TypeError, match="FP8 operands"):
        call(a.to(torch.bfloat16), a_s, b, b_s)
    with pytest.raises(TypeError, match="out_dtype"):
        call(a, a_s, b, b_s, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="a_scale_inv has shape"):
        call(a, a_s[:, :8], b, b_s)
    for err in (TypeError, ValueError):
        assert not issubclass(err, GluonUnsupported)


@pytest.mark.parametrize(
    "shape, match",
    [((64, 128, 24), "K=24 must be a multiple of 16"), ((64, 12, 256), "N=12 must be a multiple of 8")],
)
def test_tma_layout_rules_are_gluon_unsupported(shape, match):
    m, n, k = shape
    with pytest.raises(GluonUnsupported, match=match):
        call(*operands(m, n, k))


def test_valid_inputs_off_hopper_are_gluon_unsupported():
    """On this machine (CPU tensors) every valid call is refused as unsupported: the backend's cue to
    use the portable kernel."""
    assert not runs_on(torch.device("cpu"))
    with pytest.raises(GluonUnsupported, match="sm_90"):
        call(*operands())
    assert issubclass(GluonUnsupported, NotImplementedError)


def test_unchecked_descriptors_equal_the_checked_constructor():
    """``_desc`` skips TensorDescriptor's ``__post_init__`` checks for speed: same fields, same type."""
    import dataclasses

    from primus_fp8_plugin.backends.triton import gemm_gluon as G

    def same(x, y):
        fields = [f.name for f in dataclasses.fields(G.TensorDescriptor)]
        return type(x) is type(y) and x.base is y.base and all(getattr(x, f) == getattr(y, f) for f in fields if f != "base")

    a, a_s, b, _ = operands(m=256, n=384, k=512)
    for t, block in ((a, [128, 128]), (b, [256, 128]), (torch.empty(256, 384, dtype=torch.bfloat16), [64, 128])):
        layout = G._shared_layout(block, t.dtype)
        assert layout is G._shared_layout(list(block), t.dtype)  # cached
        fast = G._desc(t, list(t.shape), list(t.stride()), block, layout)
        checked = G.TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
        assert same(fast, checked)
    fast = G._scale_desc(a_s, 256, [1, 128])
    checked = G.TensorDescriptor(a_s, [a_s.shape[0], 256], [a_s.stride(0), 1], [1, 128], G._SCALE_SMEM_LAYOUT)
    assert same(fast, checked)
