"""tools/ncu.py without a GPU or ncu: ``summary`` on a small synthetic source-page CSV, ``run``'s refusals."""

import os
import subprocess
import sys
from pathlib import Path

from tools import ncu

ROOT = Path(__file__).resolve().parents[2]

CSV = """\
"Address","Source","stall_short_sb","stall_barrier","stall_wait","stall_short_sb (Not Issued)"
"7f00c0010","FMUL R1, R2, R3","30","0","2","99"
"7f00c0020","@!P0 FMUL.FTZ R4, R2, R5","10","0","0","99"
"7f00c0030","LDS.64 R6, [R7+0x10]","0","0","5","99"
"7f00c0040","NOP","0","50","0","99"
"""


def test_stalls_sums_by_reason_and_by_instruction_kind(tmp_path):
    assert ncu.instruction_kind("@!P0 FMUL.FTZ R4, R2, R5") == "FMUL"
    assert ncu.instruction_kind("LDS.64 R6, [R7+0x10]") == "LDS"
    csv_file = tmp_path / "k_sass.csv"
    csv_file.write_text(CSV)
    lines = ncu.stalls(csv_file, top=3)
    assert lines[0] == "total samples 97"  # the "(Not Issued)" column is left out
    kinds = lines[lines.index("by instruction kind (share of all samples; top reasons):") + 1 :][:3]
    # NOP 50 / 97, FMUL (both predicated and plain) 40 + 2 = 42 / 97, LDS 5 / 97
    assert kinds[0].split()[:2] == ["NOP", "51.5%"]
    assert kinds[1].split()[:3] == ["FMUL", "43.3%", "short_sb:41.2"]
    assert kinds[2].split()[:2] == ["LDS", "5.2%"]


def test_run_refuses_without_a_gpu_and_rejects_unknown_targets():
    """``tools.ncu run`` (run under Nsight Compute on the GPU machine): without a visible GPU it
    says it needs one (exit 2); an unknown target is an argparse error."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # also on a GPU machine: no GPU visible
    proc = subprocess.run([sys.executable, "-m", "tools.ncu", "run", "gemm-fwd", "--impl", "ours"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, "-m", "tools.ncu", "run", "gemm-sideways"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
