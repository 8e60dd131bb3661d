"""benchmarks/bench_grouped_gemm.py on the CPU: the wgrad launch-config names it parses, the names it refuses
before anything runs, and its refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_grouped_gemm


@pytest.fixture(scope="module")
def bench():
    return bench_grouped_gemm


@pytest.mark.parametrize(
    "name, fields",
    [("128x128w8s3", (128, 128, 8, 8, 3)), ("64x128w4s3g4", (64, 128, 4, 4, 3)), ("128x64w4s2g16", (128, 64, 16, 4, 2))],
)
def test_config_names_give_their_fields(bench, name, fields):
    cfg = bench.parse_config(name)
    assert (cfg.block_m, cfg.block_n, cfg.group_m, cfg.num_warps, cfg.num_stages) == fields


@pytest.mark.parametrize(
    "name, message",
    [("128x128", "not a config name"), ("96x128w4s3", "block_m 96 is not a power of 2"),
     ("128x8w4s3", "block_n 8 is not a power of 2"), ("128x128w3s3", "3 warps"), ("128x128w4s0", "0 stages")],
)  # fmt: skip
def test_bad_config_names_are_refused(bench, name, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_config(name)


def test_a_bad_config_name_stops_the_run_before_anything_runs(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--wgrad-configs", "128x128w8s3", "128x128"])
    assert exit_info.value.code == 2
    assert "'128x128' is not a config name" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(bench, capsys):
    assert bench.main(["--wgrad-configs", "64x128w4s3"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
