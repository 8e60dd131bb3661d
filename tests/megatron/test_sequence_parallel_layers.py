"""The plugin's column-parallel Megatron layers under sequence parallelism at TP=2 and TP=4 (gloo processes on the
CPU): ``Fp8ColumnParallelLinear`` (with and without gradient-accumulation fusion) and the fused norm layer
all-gather the quantized shard in FP8, and give the bits, outputs and every gradient, of the bf16 all-gather they
used before; shards whose rows are not a multiple of 128 take the bf16 gather (tests/megatron/sp_layer_workers.py
holds the checks)."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp

from . import sp_layer_workers

PORT = int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 50


@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_layers_fp8_gather_bit_for_bit(world):
    mp.spawn(sp_layer_workers.run, args=(world, PORT + world, 11 * world), nprocs=world, join=True)
