"""tools/profile_linear.py without a GPU: --op-overhead measures the op's own host cost; the GPU modes refuse."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_op_overhead_mode_runs_on_the_cpu_and_reports_each_measurement():
    proc = subprocess.run([sys.executable, "-m", "tools.profile_linear", "--op-overhead"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.rstrip().endswith(" us")]
    assert len(lines) == 3 and all(float(line.split()[-2]) > 0 for line in lines), proc.stdout


def test_gpu_modes_refuse_without_a_gpu():
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # also on a GPU machine: no GPU visible
    for extra in ([], ["--breakdown"], ["--ab-backends", "cublas,bf16"]):
        proc = subprocess.run([sys.executable, "-m", "tools.profile_linear", *extra], capture_output=True, text=True,
                              timeout=300, env=env, cwd=ROOT)  # fmt: skip
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout, proc.stdout + proc.stderr[-2000:]
