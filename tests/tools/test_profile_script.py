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
