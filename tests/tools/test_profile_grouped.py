"""tools/profile_grouped.py on the CPU: the per-step kernel table against a hand-made trace, and the refusal
without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from tools.profile_grouped import kernels_per_step, main


def test_kernels_per_step_sums_each_name_over_the_steps(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "wgrad", "ts": 0, "dur": 2000},
        {"ph": "X", "cat": "kernel", "name": "fwd", "ts": 2000, "dur": 250},
        {"ph": "X", "cat": "kernel", "name": "fwd", "ts": 2300, "dur": 150},
        {"ph": "X", "cat": "kernel", "name": "wgrad", "ts": 5000, "dur": 2200},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 0, "dur": 9000},  # not a kernel
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    rows = kernels_per_step(trace, steps=2)
    assert [r[0] for r in rows] == ["wgrad", "fwd"]
    assert rows[0][1:] == pytest.approx((1.0, 2.1))  # (2000 + 2200) us over 2 steps
    assert rows[1][1:] == pytest.approx((1.0, 0.2))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(capsys):
    assert main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
