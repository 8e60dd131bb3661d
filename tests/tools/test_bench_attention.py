"""benchmarks/bench_attention.py on the CPU: its FLOP count against a count of the matmuls it stands for, and
its refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_attention as bench


@pytest.mark.parametrize("b, s, h, d", [(2, 2048, 32, 128), (1, 37, 3, 64)])
def test_causal_flops_count_the_kept_half_of_every_matmul(b, s, h, d):
    kept = s * (s + 1) // 2  # score entries at or below the diagonal, ~ s^2 / 2
    matmul = 2 * b * h * kept * d  # one [s, d] x [d, s] (or [s, s] x [s, d]) product over the kept entries
    fwd = 2 * matmul  # Q K^T and P V
    bwd = 5 * matmul  # dV = P^T dO, dP = dO V^T, dS -> dQ = dS K, dK = dS^T Q, and the recomputed Q K^T
    assert bench.causal_flops(b, s, h, d) == pytest.approx(fwd + bwd, rel=1.0 / s)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["bench_attention.py"])
    assert bench.main() == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
