"""tools/param_memory.py at DP=2 with the distributed optimizer (two gloo processes): the linear weights' bytes per
parameter against the issue's formulas (BF16 6 + 12/d, the plugin's weight cache 8 + 12/d, FP8 primary weights
5 + 12/d, d = 2), each category against an independent count, and the FP8 copies against the layers' shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
PORT = int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 380


def blocks(n: int) -> int:
    return -(-n // 128)


def pad4(n: int) -> int:
    return -(-n // 4) * 4


def test_bytes_per_parameter_are_the_formulas(tmp_path):
    out = tmp_path / "memory.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={PORT}", "-m",
           "tools.param_memory", "--json", str(out), "backend=reference", "model.num_layers=1", "parallel=dp",
           "parallel.use_distributed_optimizer=true"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "formula" in proc.stdout and "fp8_params" in proc.stdout
    result = json.loads(out.read_text())
    assert result["d"] == 2
    from tests.hydra_compose import compose

    m = compose().model
    h, f = m.hidden_size, m.ffn_hidden_size
    linears = [(3 * h, h), (h, h), (f, h), (h, f)]  # qkv, proj, fc1, fc2 of the one layer
    w_bytes = sum(n * k + 4 * blocks(n) * pad4(blocks(k)) for n, k in linears)
    wt_bytes = sum(n * k + 4 * blocks(k) * pad4(blocks(n)) for n, k in linears)
    expected = {  # per category, bytes per linear-weight parameter (d = 2: Adam's 12 bytes halved)
        "bf16": {"weights": 2, "fp8_copies": 0, "grads": 4, "optimizer": 6},
        "blockwise": {"weights": 2, "fp8_copies": None, "grads": 4, "optimizer": 6},
        "fp8_params": {"weights": None, "fp8_copies": None, "grads": 4, "optimizer": 6},
    }
    formulas = {"bf16": 6 + 12 / 2, "blockwise": 8 + 12 / 2, "fp8_params": 5 + 12 / 2}
    count = sum(n * k for n, k in linears)
    for arm, want in expected.items():
        r = result["arms"][arm]
        assert r["params"]["linear"] == count, arm
        got = {c: v / count for c, v in r["bytes"]["linear"].items()}
        for c, v in want.items():
            if v is not None:
                assert got[c] == v, (arm, c, got[c])
        assert abs(sum(got.values()) - formulas[arm]) < 1e-3, (arm, got)  # the scales: a few bytes per 128x128 block
        other = {c: v / r["params"]["other"] for c, v in r["bytes"]["other"].items()}
        assert other == {"weights": 2, "fp8_copies": 0, "grads": 4, "optimizer": 6}, (arm, other)
    assert result["arms"]["blockwise"]["bytes"]["linear"]["fp8_copies"] == w_bytes + wt_bytes
    fp8 = result["arms"]["fp8_params"]
    assert fp8["bytes"]["linear"]["fp8_copies"] == w_bytes and fp8["fp8_primary_weights"] == 4
    assert fp8["bytes"]["linear"]["weights"] == 2 * 4  # each released weight's two-byte placeholder
    assert 0 < fp8["activations"] < result["arms"]["bf16"]["activations"]
