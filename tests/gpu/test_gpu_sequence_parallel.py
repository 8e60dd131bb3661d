"""Sequence-parallel FP8 linears on 2 GPUs (NCCL, TP=2): the checks of tests/sp_workers.py (outputs and every
gradient bit for bit the bf16 all-gather's, the bf16 fallback, the saved bytes) with the GPU backends' kernels."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from primus_fp8_plugin import backend_availability

from .. import sp_workers

pytestmark = pytest.mark.gpu
PORT = int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 80


@pytest.mark.parametrize("backend", ["triton", "cublas", "hopper"])
def test_sequence_parallel_linears_on_two_gpus(backend):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    if not backend_availability(backend, "cuda"):
        pytest.skip(backend_availability(backend, "cuda").reason)
    port = PORT + ["triton", "cublas", "hopper"].index(backend)
    mp.spawn(sp_workers.run, args=(2, port, 5, "cuda", backend), nprocs=2, join=True)
