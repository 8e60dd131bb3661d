"""The Hopper Gluon GEMM's wrapper and its heuristics on any machine: wrong inputs raise ValueError /
TypeError, as the portable wrapper's do (the contract both share, check_operands); valid inputs outside
the kernel's limits are refused by ``unsupported_reason``, so that the heuristics pick the portable
kernel and the wrapper raises GluonUnsupported, all before anything is allocated or launched. The kernel
itself is checked on the GPU (tests/gpu) and compiled in CI (tests/tools/test_triton_aot.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from primus_fp8_plugin.kernels.sm90 import gemm as G
from primus_fp8_plugin.kernels.sm90 import heuristics as H
from primus_fp8_plugin.kernels.sm90.gemm import blockwise_gemm_gluon
from primus_fp8_plugin.kernels.sm90.target import GluonUnsupported, runs_on
from primus_fp8_plugin.kernels.triton.gemm import blockwise_gemm

E4M3 = torch.float8_e4m3fn


def operands(m=64, n=128, k=256, b_block_dim=2):
    a = torch.randn(m, k).to(E4M3)
    b = torch.randn(n, k).to(E4M3)
    kb = -(-k // 128)
    a_s = torch.ones(kb, -(-m // 4) * 4)
    b_s = torch.ones(-(-n // 128), -(-kb // 4) * 4) if b_block_dim == 2 else torch.ones(kb, -(-n // 4) * 4)
    return a, a_s, b, b_s


def call(a, a_s, b, b_s, b_block_dim=2, out_dtype=torch.bfloat16, wrapper=blockwise_gemm_gluon, **kw):
    if wrapper is blockwise_gemm_gluon and "config" not in kw:  # the heuristics' pick
        acc, bias = kw.get("accumulate_into"), kw.get("bias")
        kw["config"] = H.gemm_config(b_block_dim, torch.float32 if acc is not None else out_dtype, acc is not None,
                                     bias is not None)  # fmt: skip
    return wrapper(a, a_s, b, b_s, b_block_dim=b_block_dim, out_dtype=out_dtype, **kw)


# Both wrappers share the wrong-input contract (gemm.check_operands); the portable one would run.
WRAPPERS = pytest.mark.parametrize("wrapper", [blockwise_gemm_gluon, blockwise_gemm], ids=["gluon", "portable"])


@pytest.mark.parametrize(
    "accumulate_into, match",
    [
        (torch.zeros(64, 64), r"accumulate_into must be a float32 \[64, 128\]"),  # wrong shape
        (torch.zeros(64, 128, dtype=torch.float16), r"accumulate_into must be a float32"),  # wrong dtype
        (torch.zeros(128, 64).t(), r"unit column stride"),  # not row-contiguous
    ],
)
@WRAPPERS
def test_a_wrong_accumulate_into_is_a_value_error(accumulate_into, match, wrapper):
    with pytest.raises(ValueError, match=match):
        call(*operands(b_block_dim=1), b_block_dim=1, accumulate_into=accumulate_into, wrapper=wrapper)


@WRAPPERS
def test_wrong_dtypes_and_scales_are_errors_not_fallbacks(wrapper):
    a, a_s, b, b_s = operands()
    with pytest.raises(TypeError, match="FP8 operands"):
        call(a.to(torch.bfloat16), a_s, b, b_s, wrapper=wrapper)
    with pytest.raises(TypeError, match="out_dtype"):
        call(a, a_s, b, b_s, out_dtype=torch.int32, wrapper=wrapper)
    with pytest.raises(ValueError, match="a_scale_inv has shape"):
        call(a, a_s[:, :8], b, b_s, wrapper=wrapper)
    with pytest.raises(ValueError, match="b_scale_inv has shape"):
        call(a, a_s, b, b_s[:, :1], wrapper=wrapper)
    with pytest.raises(ValueError, match="bias"):
        call(a, a_s, b, b_s, bias=torch.zeros(7), wrapper=wrapper)
    for err in (TypeError, ValueError):
        assert not issubclass(err, GluonUnsupported)


@pytest.mark.parametrize(
    "shape, match",
    [((64, 128, 24), "K=24 must be a multiple of 16"), ((64, 12, 256), "N=12 must be a multiple of 8")],
)
def test_tma_layout_rules_send_the_call_to_the_portable_kernel(shape, match, monkeypatch):
    """Dims TMA cannot take: the kernel states why, the heuristics pick the portable GEMM (None), and the
    wrapper, called anyway, raises GluonUnsupported (device check bypassed: no Hopper GPU here)."""
    monkeypatch.setattr(G, "runs_on", lambda device: True)
    m, n, k = shape
    a, a_s, b, b_s = operands(m, n, k)
    assert match in G.unsupported_reason(a, b)
    assert H.dense_gemm(a, b, b_block_dim=2, out_dtype=torch.bfloat16, bias=None, accumulate_into=None) is None
    with pytest.raises(GluonUnsupported, match=match):
        call(a, a_s, b, b_s)
    a, a_s, b, b_s = operands()
    assert G.unsupported_reason(a, b) is None
    assert H.dense_gemm(a, b, b_block_dim=2, out_dtype=torch.bfloat16, bias=None, accumulate_into=None) is H.CONFIG_128x256
    acc = torch.zeros(64, 128)
    assert H.dense_gemm(a, b, b_block_dim=1, out_dtype=torch.bfloat16, bias=None, accumulate_into=acc) is H.CONFIG_256x128
    unaligned = torch.zeros(64 * 128 + 1)[1:].view(64, 128)
    assert "16-byte aligned" in G.unsupported_reason(a, b, unaligned)
    assert H.dense_gemm(a, b, b_block_dim=1, out_dtype=torch.float32, bias=None, accumulate_into=unaligned) is None


def test_valid_inputs_off_hopper_are_gluon_unsupported():
    """On this machine (CPU tensors) every valid call is refused: the heuristics pick the portable kernel."""
    assert not runs_on(torch.device("cpu"))
    a, _, b, _ = operands()
    assert H.dense_gemm(a, b, b_block_dim=2, out_dtype=torch.bfloat16, bias=None, accumulate_into=None) is None
    with pytest.raises(GluonUnsupported, match="sm_90"):
        call(*operands())
    assert issubclass(GluonUnsupported, NotImplementedError)


def _descriptor_cases():
    for m in (1, 130):
        for n in (8, 136, 384):
            for k in (16, 656):
                for bdim in (1, 2):
                    for out in ("bf16", "fp32", "accumulate"):
                        for scales in ("te", "unpadded", "unaligned"):
                            yield m, n, k, bdim, out, scales


@pytest.mark.parametrize("m, n, k, bdim, out, scales", list(_descriptor_cases()))
def test_unchecked_descriptors_pass_the_checked_constructor(monkeypatch, m, n, k, bdim, out, scales):
    """``_desc`` skips TensorDescriptor's ``__post_init__`` checks (host cost): every descriptor the
    wrapper really builds (operands, output or accumulate_into, the TMA scale boxes, scale copies)
    passes those checks when rebuilt through the checked constructor, for ragged and aligned shapes,
    both B scale layouts and scales TMA cannot read in place."""
    import dataclasses

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    launched = []
    monkeypatch.setattr(G, "runs_on", lambda device: True)
    monkeypatch.setattr(G, "num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(G, "_launch", SimpleNamespace(hinted=lambda hint, grid, *args, **options: launched.append(args)))
    a, a_s, b, b_s = operands(m, n, k, bdim)
    if scales == "unpadded":
        a_s = a_s[:, :m].contiguous()
        b_s = b_s[:, : (-(-k // 128) if bdim == 2 else n)].contiguous()
    elif scales == "unaligned":
        a_s = torch.cat([torch.ones(a_s.shape[0], 1), a_s], 1)[:, 1:]
        b_s = torch.cat([torch.ones(b_s.shape[0], 1), b_s], 1)[:, 1:]
    acc = torch.zeros(m, n) if out == "accumulate" else None
    out_dtype = torch.float32 if out != "bf16" else torch.bfloat16
    call(a, a_s, b, b_s, b_block_dim=bdim, out_dtype=out_dtype, accumulate_into=acc)
    (args,) = launched
    descs = [x for x in args if isinstance(x, TensorDescriptor)]
    assert len(descs) == (5 if H.gemm_config(bdim, out_dtype, acc is not None).scale_tma else 3)
    for d in descs:
        fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(TensorDescriptor)}
        TensorDescriptor(**fields)  # runs the skipped checks; raises AssertionError on a violation


def test_config_selection_and_shared_memory():
    """256x128 tiles for 1x128 B scales (wgrad) with bf16/fp16 outputs and accumulate_into; 128x256
    tiles for 128x128 B scales there and for a bias with 1x128 B; the 128x128 kernel for a plain fp32
    output and for a bias into accumulate_into with 1x128 B scales (the 128x256 one spills there).
    Only 128x256 and 256x128 tiles stage their scales through shared memory, and their four [64, 64]
    output buffers take as much shared memory as one [128, 128] tile's."""
    from primus_fp8_plugin.kernels.sm90 import gemm_library as L

    for out_dtype, acc in ((torch.bfloat16, False), (torch.float16, False), (torch.float32, True)):
        assert H.gemm_config(1, out_dtype, acc) is H.CONFIG_256x128
        assert H.gemm_config(2, out_dtype, acc) is H.CONFIG_128x256
    assert H.gemm_config(1, torch.bfloat16, False, has_bias=True) is H.CONFIG_128x256
    for bdim in (1, 2):
        assert H.gemm_config(bdim, torch.float32, False).block_n == 128
        assert "spills" in G.supports(H.CONFIG_128x256, bdim, torch.float32, False)
    # 256x128 tiles take 1x128 B scales only, without a bias or a plain fp32 output
    assert "1x128" in G.supports(H.CONFIG_256x128, 2)
    assert "bias" in G.supports(H.CONFIG_256x128, 1, torch.bfloat16, False, has_bias=True)
    assert "float32" in G.supports(H.CONFIG_256x128, 1, torch.float32, False)
    # a bias into accumulate_into with 1x128 B scales: 128x128 (the 128x256 epilogue spills there)
    assert H.gemm_config(1, torch.float32, True, has_bias=True).block_n == 128
    assert H.gemm_config(2, torch.float32, True, has_bias=True) is H.CONFIG_128x256
    assert "spills" in G.supports(H.CONFIG_128x256, 1, torch.float32, True, has_bias=True)
    assert H.CONFIG_128x256.scale_tma and H.CONFIG_256x128.scale_tma and not H.CONFIG_128x128.scale_tma
    assert H.CONFIG_256x128.block_m == 256 and H.CONFIG_128x256.block_m == 128
    assert L.c_block_n(128, 256) == 64 and L.c_block_n(128, 128) == 128 and L.c_block_n(256, 128) == 64
    assert H.gemm_config(1, torch.float32, False) is H.CONFIG_128x128
    # a bf16 output: 4 stages of 128x256 with 128x128 B (48 KiB + 640 B of scales each) next to 32 KiB of
    # output buffers; 3 with 1x128 B (48 KiB + 1.5 KiB of scales), in either tile shape
    assert L.stages_that_fit(128, 256, torch.bfloat16, 0, 2) == 4
    assert L.stages_that_fit(128, 256, torch.bfloat16, 0, 1) == 3
    assert L.stages_that_fit(256, 128, torch.bfloat16, 0, 1) == 3


@pytest.mark.parametrize("bias, acc, out_dtype", [(True, True, torch.float32), (False, False, torch.float32)])
def test_an_explicit_128x256_config_that_spills_is_refused(monkeypatch, bias, acc, out_dtype):
    """An explicit ``config=CONFIG_128x256`` where the 128x256 kernel spills (a plain fp32 output; a bias
    into accumulate_into with 1x128 B scales) raises NotImplementedError before launching; the heuristics
    give the same call the 128x128 kernel."""

    launched = []
    monkeypatch.setattr(G, "runs_on", lambda device: True)
    monkeypatch.setattr(G, "num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(G, "_launch", SimpleNamespace(hinted=lambda hint, grid, *args, **options: launched.append(args)))
    a, a_s, b, b_s = operands(130, 136, 256, b_block_dim=1)
    kw = {"bias": torch.zeros(136) if bias else None, "accumulate_into": torch.zeros(130, 136) if acc else None}
    with pytest.raises(NotImplementedError, match="spills"):
        call(a, a_s, b, b_s, b_block_dim=1, out_dtype=out_dtype, config=H.CONFIG_128x256, **kw)
    assert not launched
    call(a, a_s, b, b_s, b_block_dim=1, out_dtype=out_dtype, **kw)
    assert len(launched) == 1 and H.gemm_config(1, out_dtype, acc, bias).block_n == 128
