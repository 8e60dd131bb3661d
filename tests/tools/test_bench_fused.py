"""benchmarks/bench_fused.py's bytes-moved model against the sizes of the tensors the ops really read and
write (CPU, reference backend)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from primus_fp8_plugin import BlockwiseRecipe, TensorRole
from primus_fp8_plugin.backends import get_backend

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_fused", ROOT / "benchmarks" / "bench_fused.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

REF = get_backend("reference", "cpu")
P = BlockwiseRecipe().params(TensorRole.INPUT)


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@pytest.mark.parametrize("m, h", [(130, 300), (256, 128), (7, 1040)])
def test_norm_bytes_are_the_tensors_read_and_written(m, h):
    x, w, b = torch.randn(m, h).bfloat16(), torch.ones(h).bfloat16(), torch.zeros(h).bfloat16()
    y, mean, rstd = REF.norm_fwd(x, w, b, 1e-5, "LayerNorm")
    q = REF.quantize_act(y, P, rowwise=True, columnwise=True)
    assert bench.fp8_copies_bytes(m, h) == q.nbytes
    params, stats = nbytes(w, b), nbytes(mean, rstd)
    assert bench.bytes_norm(m, h, 2, "fused") == 2 * nbytes(x) + q.nbytes + stats + params
    assert bench.bytes_norm(m, h, 2, "unfused") == nbytes(x) + 2 * nbytes(y) + q.nbytes + stats + params
    dx = torch.empty_like(x)
    assert bench.bytes_norm_bwd(m, h, 2) == nbytes(x, x, dx, w, b)  # x and dy read, dx written, [h] gradients


@pytest.mark.parametrize("m, f", [(130, 200), (64, 128)])
def test_swiglu_bytes_are_the_tensors_read_and_written(m, f):
    h = torch.randn(m, 2 * f).bfloat16()
    a, b = h.chunk(2, -1)
    y = REF.swiglu_fwd(h)
    q = REF.quantize_act(y, P, rowwise=True, columnwise=True)
    assert bench.bytes_swiglu(m, f, 2, "fused") == nbytes(h) + q.nbytes
    assert bench.bytes_swiglu(m, f, 2, "plugin") == nbytes(h) + 2 * nbytes(y) + q.nbytes
    silu_a = torch.empty_like(a)  # torch: silu reads a, writes silu(a); the product reads it and b, writes y
    assert bench.bytes_swiglu(m, f, 2, "torch") == nbytes(a, silu_a, silu_a, b, y, y) + q.nbytes
    assert bench.bytes_swiglu_bwd(m, f, 2) == nbytes(h, y, h)  # h and dy read, dh written
