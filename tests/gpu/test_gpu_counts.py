"""Grouped token counts on the GPU: checked by a device-side assert that stops the run with a message naming the
counts (no host synchronisation on the good path), and never an out-of-bounds kernel access.

Each bad case runs in its own process (a device-side assert leaves the CUDA context unusable)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from primus_fp8_plugin import fp8_grouped_linear
    counts = torch.tensor([int(c) for c in sys.argv[1].split(",")], device="cuda")
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    y = fp8_grouped_linear(x, counts, ws, backend=sys.argv[2])
    torch.cuda.synchronize()
    print("finite", bool(torch.isfinite(y.float()).all()))
    """
)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("counts", ["100,0,100", "300,-44,0", "256,256,0"])
def test_bad_device_counts_stop_the_run_with_the_message(counts, backend):
    run = subprocess.run([sys.executable, "-c", SCRIPT, counts, backend], capture_output=True, text=True, timeout=300)
    print(counts, backend, "rc", run.returncode, run.stderr[-400:])
    assert run.returncode != 0
    assert "grouped token counts must be >= 0 and sum to the number of tokens (256)" in run.stderr


def test_good_device_counts_make_no_host_synchronisation():
    from primus_fp8_plugin import fp8_grouped_linear

    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    counts = torch.tensor([100, 0, 156], device="cuda")
    fp8_grouped_linear(x, counts, ws, backend="triton")  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = fp8_grouped_linear(x, counts, ws, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(y.float()).all()
