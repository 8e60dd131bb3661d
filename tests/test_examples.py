"""The runnable examples in docs/examples/, run as a user runs them (a separate Python process, on the CPU
with the exact reference backend): they finish, print what they promise, and their loss falls."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"


def run_example(name: str, *args: str) -> str:
    with socket.socket() as s:  # a free port for the example's gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": str(port), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(EXAMPLES / name), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def step_losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)", out, flags=re.M)]


def test_convert_example_reports_each_linear_and_trains():
    out = run_example("convert_pytorch.py", "--steps", "4", "--backend", "reference")
    lines = out.splitlines()
    assert lines[0] == "converted 2 linear layer(s) to Fp8BlockwiseLinear, skipped 3"
    assert [line.split()[:2] for line in lines[1:6]] == [
        ["converted", "mlp.0"], ["converted", "mlp.2"], ["skipped", "proj_in"], ["skipped", "attn.out_proj"],
        ["skipped", "head"],
    ]  # fmt: skip
    assert "module_filter_fn returned False" in lines[3] and "out_features=10 is not a multiple of 16" in lines[5]
    losses = step_losses(out)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(10)) < 0.3  # 10 classes, at initialisation: about ln 10
    assert all(b < a for a, b in zip(losses, losses[1:])), losses  # one fixed batch: memorised step by step


def test_megatron_gpt_example_trains_the_plugin_spec_end_to_end():
    pytest.importorskip("megatron.core")
    out = run_example("megatron_gpt.py", "--steps", "4", "--backend", "reference")
    # 2 layers x (qkv, fc1 with their norms fused in | proj, fc2)
    assert "FP8 layers: {'Fp8LayerNormColumnParallelLinear': 4, 'Fp8RowParallelLinear': 4}" in out
    losses = step_losses(out)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    # the mean token cross-entropy over a 1024-token vocabulary at initialisation is about ln 1024 = 6.93
    # (a report that the schedule had divided by the 2 micro-batches would read 3.5)
    assert abs(losses[0] - math.log(1024)) < 0.3, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert out.count("update_ok True") == 4
