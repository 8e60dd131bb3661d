from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter; the switch must be
# set before any kernel is defined (the backends import lazily, so here is early enough).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Under pytest-xdist each worker process gets its own block of ports (gloo rendezvous, torchrun): every multi-rank
# test counts from PRIMUS_FP8_TEST_PORT, read when its module is imported, after this file.
# (shifted from PRIMUS_FP8_TEST_PORT_BASE, so that a process importing this file again does not shift twice)
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw"):
    _base = int(os.environ.setdefault("PRIMUS_FP8_TEST_PORT_BASE", os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")))
    os.environ["PRIMUS_FP8_TEST_PORT"] = str(_base + 1000 * int(_worker[2:]))

GOLDEN_DIR = Path(__file__).parent / "data" / "te_golden"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped where there is none)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN_DIR


def make_input(shape, dtype=torch.bfloat16, seed=0, device="cpu", spread=True) -> torch.Tensor:
    """Random input whose rows span many binades (so tiles get different scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float32)
    if spread:
        rows = torch.exp2(torch.randint(-20, 20, (shape[0],) + (1,) * (len(shape) - 1), generator=g).float())
        x = x * rows
    return x.to(dtype).to(device)


def row_sums_in_order(dy2d: torch.Tensor, counts) -> list[torch.Tensor]:
    """Each expert's rows of ``dy2d`` added one after another in fp32 from 0, rounded once to dY's dtype: the grouped
    bias gradient's rule (``ops/layouts.segment_sums``), computed independently by a Python loop over the rows."""
    out, start = [], 0
    for c in counts:
        acc = torch.zeros(dy2d.shape[1], dtype=torch.float32, device=dy2d.device)
        for r in range(start, start + int(c)):
            acc = acc + dy2d[r].float()
        out.append(acc.to(dy2d.dtype))
        start += int(c)
    return out
