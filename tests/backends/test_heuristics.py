"""The kernel choice, on any machine: each target's heuristics module (``kernels/<target>/heuristics.py``)
alone picks the kernel and config of a call, from what each kernel states it takes; the backends only ask.
Device checks are bypassed where a choice on a Hopper GPU is under test (none here)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import primus_fp8_plugin
from primus_fp8_plugin import QuantParams
from primus_fp8_plugin.backends.reference import ReferenceBackend
from primus_fp8_plugin.backends.triton import FusedVariants, TritonBackend
from primus_fp8_plugin.kernels.gfx950 import heuristics as gfx950
from primus_fp8_plugin.kernels.sm90 import gemm_grouped
from primus_fp8_plugin.kernels.sm90 import heuristics as sm90
from primus_fp8_plugin.kernels.triton import heuristics as portable
from primus_fp8_plugin.kernels.triton.launch import FastLauncher, LaunchSettings, launch_settings

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
PACKAGE = Path(primus_fp8_plugin.__file__).parent
REF = ReferenceBackend()


def fp8(*shape):
    return torch.zeros(*shape, dtype=E4)


def test_off_hopper_every_call_takes_the_portable_kernels():
    """On CPU tensors no Gluon kernel is picked: every answer is None / False."""
    a, b = fp8(256, 512), fp8(384, 512)
    x = torch.zeros(256, 512, dtype=torch.bfloat16)
    p1, p2 = QuantParams(E4, 1), QuantParams(E4, 2)
    assert sm90.dense_gemm(a, b, b_block_dim=2, out_dtype=torch.bfloat16, bias=None, accumulate_into=None) is None
    assert not sm90.act_quant(x, p1) and not sm90.weight_quant(x, p2)
    assert sm90.fused_quant(x, 512, p1) is None
    assert sm90.grouped_gemm(a, fp8(4, 384, 512), torch.bfloat16, None) is None
    assert sm90.grouped_wgrad(fp8(384, 512), fp8(256, 512), torch.bfloat16, None) is None
    assert not sm90.weight_quant_per_expert([x, x], p2)


@pytest.fixture
def grouped_on_hopper(monkeypatch):
    monkeypatch.setattr(gemm_grouped, "runs_on", lambda device: True)


def test_grouped_fwd_kernel_and_config(grouped_on_hopper):
    a = fp8(300, 512)
    assert sm90.grouped_gemm(a, fp8(4, 1536, 512), torch.bfloat16, None) is sm90.GROUPED_FWD_128x256
    small_n = sm90.grouped_gemm(a, fp8(4, 512, 512), torch.bfloat16, None)  # 2 N tiles: group_m 4
    assert small_n is sm90.GROUPED_FWD_128x256_G4 and small_n.group_m == 4
    assert sm90.grouped_gemm(fp8(300, 520), fp8(4, 512, 520), torch.bfloat16, None) is None  # K % 16
    assert sm90.grouped_gemm(a, fp8(4, 1536, 512), torch.float32, None) is None  # fp32 output spills
    bias = torch.zeros(4, 1536, dtype=torch.float16)
    assert "bias" in gemm_grouped.fwd_unsupported_reason(a, fp8(4, 1536, 512), torch.bfloat16, bias)
    assert sm90.grouped_gemm(a, fp8(4, 1536, 512), torch.bfloat16, bias) is None


def test_grouped_wgrad_into_main_grad_takes_gluon_from_512_tokens_per_expert(grouped_on_hopper):
    """The Gluon grouped wgrad takes main_grads that lie in one span (its own rule says so); the heuristics give
    it the accumulations over at least 512 token columns per expert (the portable kernel is faster below), and
    every plain bf16 output."""
    a, b = fp8(256, 384), fp8(512, 384)  # M = 256, N = 512 over 384 token columns
    main_grads = list(torch.zeros(3, 256, 512).unbind(0))  # views of one buffer: one span
    assert gemm_grouped.wgrad_unsupported_reason(a, b, torch.float32, main_grads) is None
    assert sm90.grouped_wgrad(a, b, torch.float32, main_grads) is None  # 128 columns per expert
    long_a, long_b = fp8(256, 3 * 512), fp8(512, 3 * 512)
    assert sm90.grouped_wgrad(long_a, long_b, torch.float32, main_grads) is sm90.GROUPED_WGRAD_MAIN_GRAD_256x128
    assert sm90.grouped_wgrad(fp8(256, 3 * 512 - 16), fp8(512, 3 * 512 - 16), torch.float32, main_grads) is None
    assert sm90.grouped_wgrad(a, b, torch.bfloat16, None) is sm90.GROUPED_WGRAD_256x128
    assert sm90.grouped_wgrad(a, b, torch.float32, None) is None  # a plain fp32 output spills
    apart = [torch.zeros(256 * 512 + 4)[4 * (i % 2) :][: 256 * 512].view(256, 512) for i in range(3)]
    assert "one span" in gemm_grouped.wgrad_unsupported_reason(long_a, long_b, torch.float32, apart)
    assert sm90.grouped_wgrad(long_a, long_b, torch.float32, apart) is None
    assert sm90.grouped_wgrad_config(accumulate=True).consumer_regs == 232


def test_dense_gemm_tiles():
    assert sm90.gemm_config(2, torch.bfloat16, False) is sm90.CONFIG_128x256
    assert sm90.gemm_config(1, torch.bfloat16, False) is sm90.CONFIG_256x128
    assert sm90.gemm_config(1, torch.float32, True) is sm90.CONFIG_256x128
    assert sm90.gemm_config(1, torch.float32, True, has_bias=True) is sm90.CONFIG_128x128
    assert sm90.gemm_config(2, torch.float32, False) is sm90.CONFIG_128x128
    assert sm90.wgrad_by_cublas(False) and not sm90.wgrad_by_cublas(True)


def test_portable_configs():
    assert portable.act_quant_config(256, 512) is portable.ACT_QUANT
    assert portable.act_quant_config(17, 512) is portable.ACT_QUANT_RAGGED
    assert portable.act_quant_config(16, 520) is portable.ACT_QUANT_RAGGED
    assert portable.fused_quant_config(2, 64, 128, 256).sub_m == 64  # SwiGLU: halves of the tile
    assert portable.fused_quant_config(0, 64, 128, 130) is portable.FUSED_QUANT_RAGGED[0]  # the row stride
    assert portable.gemm_config().block_m == 128
    # the grouped wgrad: small tiles over few tokens per expert, the dense tile over many
    assert portable.grouped_wgrad_config(256) is portable.GROUPED_WGRAD_SHORT
    assert portable.grouped_wgrad_config(512) is portable.GROUPED_WGRAD_SHORT
    assert portable.grouped_wgrad_config(513) is portable.gemm_config()


def test_gfx950_choices():
    p2 = QuantParams(E4, 2)
    assert gfx950.preshuffled_weight(torch.zeros(256, 384), p2)
    assert not gfx950.preshuffled_weight(torch.zeros(256, 200), p2)  # K not a multiple of 128
    assert not gfx950.preshuffled_weight(torch.zeros(256, 384), QuantParams(E5, 2))
    assert gfx950.fwd_config(512) is gfx950.FWD_128x256 and gfx950.fwd_config(384) is gfx950.FWD_128x128
    assert gfx950.direct_gemm(fp8(128, 256), fp8(64, 256))
    assert not gfx950.direct_gemm(fp8(100, 256), fp8(64, 256)) and not gfx950.direct_gemm(fp8(128, 256).to(E5), fp8(64, 256))
    w = REF.quantize_weight(torch.randn(256, 384), p2)
    x = REF.quantize_act(torch.randn(64, 384), QuantParams(E4, 1), rowwise=True, columnwise=True)
    x5 = REF.quantize_act(torch.randn(64, 384), QuantParams(E5, 1), rowwise=True, columnwise=True)
    assert gfx950.lds_fwd(x, w) is gfx950.FWD_128x256 and gfx950.lds_fwd(x5, w) is None
    assert gfx950.lds_dgrad(x, 384, padded=True) is gfx950.FWD_128x256 and gfx950.lds_dgrad(x5, 384, True) is None
    dy = REF.quantize_act(torch.randn(64, 256), QuantParams(E4, 1), rowwise=True, columnwise=True)
    assert gfx950.lds_wgrad(dy, x) is gfx950.WGRAD_256x128
    assert gfx950.lds_wgrad(dy, REF.quantize_act(torch.randn(64, 200), QuantParams(E4, 1), rowwise=True,
                                                              columnwise=True)) is None  # fmt: skip


def test_fused_variants_are_named_settings():
    assert TritonBackend().fused == FusedVariants(stats="u4", bwd="wide", gluon="halves")
    backend = TritonBackend(fused=FusedVariants(stats="base", bwd="base"))
    assert backend._stats is portable.NORM_STATS["base"] and backend._bwd is portable.NORM_BWD["base"]
    with pytest.raises(ValueError, match="stats variants are"):
        FusedVariants(stats="fast")
    with pytest.raises(ValueError, match="gluon variants are"):
        FusedVariants(gluon="quarters")


def test_launch_settings_apply_inside_the_block_only():
    assert FastLauncher.settings == LaunchSettings()
    with launch_settings(fast=False, verify_hints=True) as s:
        assert FastLauncher.settings is s and not s.fast and s.verify_hints and s.hints
    assert FastLauncher.settings == LaunchSettings()


def _sources(*folders: str):
    for folder in folders:
        yield from sorted((PACKAGE / folder).rglob("*.py"))


def test_the_kernels_and_backends_read_no_environment_variable():
    """Configuration reaches the kernels as arguments and settings objects; Triton's own TRITON_INTERPRET is
    read once, through Triton's knob, in kernels/triton/__init__.py."""
    for path in _sources("kernels", "backends"):
        text = path.read_text()
        assert "os.environ" not in text and "getenv" not in text, path
    assert "knobs.runtime.interpret" in (PACKAGE / "kernels/triton/__init__.py").read_text()


def test_no_kernel_choice_by_exception_and_no_private_imports():
    """No ``except GluonUnsupported`` (a choice is the heuristics' answer) and no private name imported from
    another module, in the kernels and backends."""
    for path in _sources("kernels", "backends"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                assert "GluonUnsupported" not in ast.unparse(node.type), f"{path}:{node.lineno}"
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path}:{node.lineno} imports {private}"
