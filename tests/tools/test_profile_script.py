"""tools/profile_linear.py --op-overhead: the op's own host cost, measurable without a GPU."""

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


def test_ncu_targets_refuses_without_a_gpu_and_rejects_unknown_targets():
    """tools/ncu_targets.py (run under Nsight Compute on the GPU machine): without a visible GPU it
    says it needs one (exit 2); an unknown target is an argparse error."""
    import os

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # also on a GPU machine: no GPU visible
    proc = subprocess.run([sys.executable, "-m", "tools.ncu_targets", "gemm-fwd", "--impl", "ours"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, "-m", "tools.ncu_targets", "gemm-sideways"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
