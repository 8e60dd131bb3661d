"""Launch hints stand for one specialisation each (kernels/triton/launch.py, ``FastLauncher.hinted``),
checked on CPU over many inputs: each Gluon wrapper runs with its launcher replaced by a recorder that
computes Triton's full specialisation of every argument (``native_specialize_impl`` on CPU tensors,
the constexprs by type and value, the launch options) and groups the keys by hint. A hint that
covered two keys would launch a wrong binary for one of them. (The GPU suite runs with
``verify_hints`` on as well, on fewer shapes.)"""

from __future__ import annotations

import itertools

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from primus_fp8_plugin import QuantParams

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


class _Recorder:
    """Stands in for a FastLauncher: records, per hint, the full keys of the calls that gave it."""

    def __init__(self, real):
        self.real = real
        self.keys: dict[tuple, set] = {}

    def hinted(self, hint, grid, *args, **options):
        spec = tuple(native_specialize_impl(BaseBackend, args[i], c, s, a) for i, c, s, a in self.real._runtime)
        constexprs = tuple((type(args[i]).__name__, repr(args[i])) for i in self.real._constexpr)
        self.keys.setdefault(hint, set()).add((tuple(sorted(options.items())), spec, constexprs))

    def assert_one_key_per_hint(self, least_hints: int):
        bad = {h: k for h, k in self.keys.items() if len(k) > 1}
        assert not bad, f"hints standing for more than one specialisation: {list(bad.items())[:2]}"
        assert len(self.keys) >= least_hints  # the inputs did vary what they should


@pytest.fixture
def on_hopper(monkeypatch):
    """Let the Gluon wrappers run their host side on a CPU (the launch is recorded, nothing runs)."""
    import primus_fp8_plugin.kernels.sm90.gemm as G
    import primus_fp8_plugin.kernels.sm90.quantize_tiles as T

    monkeypatch.setattr(G, "runs_on", lambda device: True)
    monkeypatch.setattr(G, "num_sms", lambda index: 132)
    monkeypatch.setattr(T, "runs_on", lambda device: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _scales(m, n, k, bdim, kind):
    kb = -(-k // 128)
    a_s = torch.ones(kb, -(-m // 4) * 4)
    b_s = torch.ones(-(-n // 128), -(-kb // 4) * 4) if bdim == 2 else torch.ones(kb, -(-n // 4) * 4)
    if kind == "unpadded":
        a_s, b_s = a_s[:, :m].contiguous(), b_s[:, : (kb if bdim == 2 else n)].contiguous()
    elif kind == "unaligned":
        a_s = torch.cat([torch.ones(a_s.shape[0], 1), a_s], 1)[:, 1:]
        b_s = torch.cat([torch.ones(b_s.shape[0], 1), b_s], 1)[:, 1:]
    elif kind == "wide":
        a_s = torch.ones(kb, a_s.shape[1] + 17)[:, : a_s.shape[1]]
        b_s = torch.ones(b_s.shape[0], b_s.shape[1] + 17)[:, : b_s.shape[1]]
    return a_s, b_s


def test_gemm_hints(on_hopper, monkeypatch):
    import primus_fp8_plugin.kernels.sm90.gemm as G
    from primus_fp8_plugin.kernels.sm90.heuristics import gemm_config

    rec = _Recorder(G._launch)
    monkeypatch.setattr(G, "_launch", rec)
    cases = itertools.product([1, 16, 17, 130], [8, 16, 136], [16, 256], [1, 2], [torch.bfloat16, torch.float32],
                              ["padded", "unpadded", "unaligned", "wide"], [None, "aligned", "misaligned", "fp32"],
                              [None, "c", "wide"], [E4, E5])  # fmt: skip
    for m, n, k, bdim, out, scale_kind, bias_kind, acc_kind, a_dtype in cases:
        a, b = torch.zeros(m, k, dtype=a_dtype), torch.zeros(n, k, dtype=E4)
        a_s, b_s = _scales(m, n, k, bdim, scale_kind)
        bias = {None: None, "aligned": torch.zeros(n, dtype=out), "misaligned": torch.zeros(n + 1, dtype=out)[1:],
                "fp32": torch.zeros(n)}[bias_kind]  # fmt: skip
        acc = {None: None, "c": torch.zeros(m, n), "wide": torch.zeros(m, n + 4)[:, :n]}[acc_kind]
        try:
            cfg = gemm_config(bdim, torch.float32 if acc is not None else out, acc is not None, bias is not None)
            G.blockwise_gemm_gluon(a, a_s, b, b_s, b_block_dim=bdim, out_dtype=out, config=cfg, bias=bias,
                                   accumulate_into=acc)  # fmt: skip
        except (NotImplementedError, ValueError, TypeError):
            pass  # refused before launching: nothing recorded
    rec.assert_one_key_per_hint(least_hints=200)


def test_act_quantizer_hints(on_hopper, monkeypatch):
    import primus_fp8_plugin.kernels.sm90.quantize_act as A

    rec = _Recorder(A._launch)
    monkeypatch.setattr(A, "_launch", rec)
    flags = [(True, True), (True, False), (False, True), (1, 0)]
    cases = itertools.product([16, 48, 272], [16, 400], [torch.bfloat16, torch.float16, torch.float32], [E4, E5],
                              [True, False, 1], [0, 0.0, 1e-12], flags)  # fmt: skip
    for m, k, dtype, f8, pow2, eps, (row, col) in cases:
        A.quantize_1x128_dual_gluon(torch.zeros(m, k, dtype=dtype), QuantParams(f8, 1, pow2, eps), rowwise=row, columnwise=col)
    rec.assert_one_key_per_hint(least_hints=36)


def test_weight_quantizer_hints(on_hopper, monkeypatch):
    import primus_fp8_plugin.kernels.sm90.quantize_weight as W

    rec = _Recorder(W._launch)
    monkeypatch.setattr(W, "_launch", rec)
    dims = [16, 144, 400, 2064, 4096]
    for n, k, dtype, f8, pow2 in itertools.product(dims, dims, [torch.bfloat16, torch.float32], [E4, E5], [True, False]):
        W.quantize_128x128_gluon(torch.zeros(n, k, dtype=dtype), QuantParams(f8, 2, pow2, 0.0))
    rec.assert_one_key_per_hint(least_hints=16)


def test_fused_quantizer_hints(on_hopper, monkeypatch):
    """The Hopper fused quantizer (norm / SwiGLU producer) over ops, dtypes, flags and its launch variants
    (heuristics.FUSED_QUANT: the tile in halves and register caps change the binary, so the hint holds them)."""
    import primus_fp8_plugin.kernels.sm90.fused_act as FG
    from primus_fp8_plugin.kernels.sm90.heuristics import FUSED_QUANT
    from primus_fp8_plugin.kernels.triton.fused_math import OP_LAYERNORM, OP_RMSNORM, OP_SWIGLU

    rec = _Recorder(FG._launch)
    monkeypatch.setattr(FG, "_launch", rec)
    monkeypatch.setattr(FG, "runs_on", lambda device: True)
    cases = itertools.product([OP_LAYERNORM, OP_RMSNORM, OP_SWIGLU], [16, 272], [16, 400],
                              [torch.bfloat16, torch.float32], [E4, E5], [(True, True), (True, False), (False, True)],
                              list(FUSED_QUANT.values()))  # fmt: skip
    for op, m, k, dtype, f8, (row, col), variant in cases:
        kw = {"k": k}
        if op == OP_SWIGLU:
            src, kw["up_offset"] = torch.zeros(m, 2 * k, dtype=dtype), k
        else:
            src = torch.zeros(m, k, dtype=dtype)
            kw.update(rstd=torch.ones(m), gamma=torch.ones(k, dtype=dtype))
            if op == OP_LAYERNORM:
                kw.update(mean=torch.zeros(m), beta=torch.zeros(k, dtype=dtype))
        FG.quantize_fused_gluon(src, op, QuantParams(f8, 1, True, 0.0), config=variant, rowwise=row, columnwise=col, **kw)
    rec.assert_one_key_per_hint(least_hints=3 * 2 * 2 * 3 * len(FUSED_QUANT))
