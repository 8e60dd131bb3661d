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
     ("128x8w4s3", "block_n 8 is not a power of 2"), ("128x128w3s3", "3 warps"), ("128x128w4s0", "0 stages"),
     ("128x128w4s3g0", "group_m 0")],
)  # fmt: skip
def test_bad_config_names_are_refused(bench, name, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_config(name)


@pytest.mark.parametrize(
    "argv, message",
    [(["--wgrad-configs", "128x128w8s3", "128x128"], "'128x128' is not a config name"),
     (["--wgrad-configs", "64x64w4s2", "64x64w4s2"], "names a config twice"),
     (["--ops", "fwd", "--wgrad-configs", "64x64w4s2"], "add wgrad to --ops")],
)  # fmt: skip
def test_bad_wgrad_config_arguments_stop_the_run_before_anything_runs(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_refuses_without_a_gpu(bench, capsys):
    assert bench.main(["--wgrad-configs", "64x128w4s3"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_config_bits_compares_each_config_with_the_default(bench, monkeypatch):
    """On the CPU (the Triton interpreter): configs that tile the same wgrad differently add the default's bits; a
    config whose launch fails is reported as None and does not stop the others; a changed result is False."""
    from primus_fp8_plugin import BlockwiseRecipe, TensorRole
    from primus_fp8_plugin.grouped import group_layout, quantize_activation_grouped
    from primus_fp8_plugin.kernels.triton import gemm_grouped

    counts, k, n = [130, 0, 64], 256, 128
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), k, generator=g).to(torch.bfloat16)
    dy = torch.randn(sum(counts), n, generator=g).to(torch.bfloat16)
    layout = group_layout(torch.tensor(counts, dtype=torch.int32), sum(counts), "cpu")
    recipe = BlockwiseRecipe()
    xq = quantize_activation_grouped(x, layout, recipe.params(TensorRole.INPUT), backend="triton")
    dyq = quantize_activation_grouped(dy, layout, recipe.params(TensorRole.GRAD_OUTPUT), backend="triton")
    args = (dyq.columnwise_data, dyq.columnwise_scale_inv, xq.columnwise_data, xq.columnwise_scale_inv, layout)
    assert bench.config_bits(args, ["64x64w4s2", "32x128w4s1g2"]) == {"portable-64x64w4s2": True,
                                                                      "portable-32x128w4s1g2": True}  # fmt: skip

    real = gemm_grouped.grouped_wgrad

    def spoiled(*a, config=None, **kw):
        if config is not None and config.block_m == 16:
            raise RuntimeError("out of resources")
        out = real(*a, config=config, **kw)
        if config is not None and config.block_m == 32:
            kw["accumulate_into"][0].view(-1)[0] += 1.0  # one value off
        return out

    monkeypatch.setattr(gemm_grouped, "grouped_wgrad", spoiled)
    bits = bench.config_bits(args, ["16x64w4s2", "32x64w4s2", "64x64w4s2"])
    assert bits == {"portable-16x64w4s2": None, "portable-32x64w4s2": False, "portable-64x64w4s2": True}
