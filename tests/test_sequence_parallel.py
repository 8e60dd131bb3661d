"""Sequence-parallel FP8 linears (``sequence_parallel.py``) at TP=2 and TP=4 in gloo processes on the CPU: outputs
and every gradient bit for bit the plain way's (bf16 all-gather of the input, then the FP8 linear on the gathered
sequence), the bf16 fallback where a shard's rows are not a multiple of 128, and what is saved for backward: the
local shard's columnwise FP8 copy only (tests/sp_workers.py holds the checks each rank runs)."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp

from . import sp_workers

PORT = int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 40


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_linears_match_the_bf16_gather_bit_for_bit(world):
    mp.spawn(sp_workers.run, args=(world, PORT + world, 7 * world), nprocs=world, join=True)
