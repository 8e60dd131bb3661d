"""FP8 primary weights (``fp8_params.py``) under Megatron-core's DDP and optimizers, on the CPU with gloo: a tiny
plugin GPT (dense, and grouped MoE experts) trained with ``Fp8Params`` gives the losses, gradient norms and weights
of the same run with BF16 weights and the weight cache bit for bit, under the mixed-precision and the distributed
optimizer, at one rank, at DP=2 (distributed optimizer; driven by the loop, and by the hooks that
``PRIMUS_FP8_PARAMS=1`` installs for Megatron-LM's loop), grouped experts at EP=2, and at TP=2 with sequence
parallelism;
while it runs forward and backward the FP8 weights' storage is a two-byte placeholder and, under the distributed
optimizer, DDP's param buffers hold no bytes."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.multiprocessing as mp

from . import fp8_params_workers as workers

_ports = itertools.count(int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 340)


def check_same_run(result: dict, dist_opt: bool) -> None:
    bf16, fp8 = result["bf16"], result["fp8"]
    assert bf16["losses"] == fp8["losses"] and bf16["norms"] == fp8["norms"]
    assert bf16["losses"][-1] < bf16["losses"][0]
    assert bf16["weights"].keys() == fp8["weights"].keys()
    for name, w in bf16["weights"].items():
        assert torch.equal(w, fp8["weights"][name]), name
    held = fp8["held"]
    assert held["weight_storage"] == [2]  # one bf16 NaN behind every FP8 weight
    assert held["buffers"] == ([0] * len(held["buffers"]) if dist_opt else [])
    assert bf16["held"]["buffers"] == [] or min(bf16["held"]["buffers"]) > 0
    assert held["param_bytes"] < fp8["param_bytes_before"] == bf16["param_bytes_before"] == bf16["held"]["param_bytes"]
    assert held["fp8_bytes"] > 0
    if dist_opt:  # released in every step, not only the first (the hooks: the model's own hook from step 2 on)
        assert all(b == [0] * len(b) for b in fp8["buffers_each_step"]) and len(fp8["buffers_each_step"]) > 1


@pytest.mark.parametrize(
    "job",
    [
        {"name": "dense_mixed_precision"},
        {"name": "dense_distributed", "dist_opt": True},
        {"name": "moe_grouped", "moe": True},
        {"name": "moe_grouped_distributed", "moe": True, "dist_opt": True},
        {"name": "moe_single_grouped_weight_distributed", "moe": True, "dist_opt": True, "single": True},
    ],
    ids=lambda j: j["name"],
)
def test_one_rank(megatron_world, job):
    check_same_run({"bf16": workers.train(job, fp8_params=False), "fp8": workers.train(job, fp8_params=True)},
                   job.get("dist_opt", False))  # fmt: skip


def test_param_bytes_count_each_fp8_weight_as_its_w(megatron_world):
    """``param_bytes`` while held: the BF16 run's bytes, less 2 bytes per FP8 weight element, plus the FP8 W and
    scales the caches hold (computed from the weights' shapes: N K + 4 ceil(N/128) pad4(ceil(K/128)))."""
    from primus_fp8_plugin.fp8_params import Fp8Params, param_bytes

    model = workers.build({})
    before = param_bytes(model)
    primary = Fp8Params(model)
    primary.release()
    blocks = lambda n: -(-n // 128)  # noqa: E731
    fp8 = sum(w.numel() + 4 * blocks(w.shape[0]) * (-(-blocks(w.shape[1]) // 4) * 4) for w in primary.weights)
    assert primary.fp8_bytes() == fp8
    assert param_bytes(model) == before - sum(2 * w.numel() for w in primary.weights) + fp8
    primary.restore()
    assert param_bytes(model) == before


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Two ranks: data-parallel with the distributed optimizer (each rank its own batches; grouped experts under
    EP=2), and TP=2 with sequence parallelism."""
    tmp = tmp_path_factory.mktemp("fp8_params")
    out = {}
    dp2 = [{"name": "dp2_distributed", "dist_opt": True, "ep": 2},  # EP=2 set up for the MoE job; dense: plain DP=2
           {"name": "ep2_moe_distributed", "moe": True, "ep": 2, "dist_opt": True},
           {"name": "dp2_distributed_hooks", "dist_opt": True, "hooks": True}]  # last: it installs the hooks
    for group in (dp2, [{"name": "tp2_sp", "tp": 2, "sp": True}]):
        mp.spawn(workers.run, args=(2, next(_ports), group, str(tmp)), nprocs=2, join=True)
        out |= {job["name"]: (torch.load(tmp / f"{job['name']}.pt"), job) for job in group}
    return out


@pytest.mark.parametrize("name", ["dp2_distributed", "ep2_moe_distributed", "dp2_distributed_hooks", "tp2_sp"])
def test_two_ranks(spawned, name):
    result, job = spawned[name]
    check_same_run(result, job.get("dist_opt", False))
    if job.get("hooks"):  # no global module hook left to slow every module call after the first step
        assert result["fp8"]["global_hook_after_first_step"] is False


def test_the_hooks_refuse_a_step_no_ddp_model_trained_for():
    """PRIMUS_FP8_PARAMS=1 asked for FP8 primary weights; an optimizer step before any Megatron DDP model ran a
    training forward (FSDP, a model outside Megatron's DDP) got none: refused, naming the variable."""
    from primus_fp8_plugin.megatron.fp8_params import install_hooks, remove_hooks

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    install_hooks()
    try:
        with pytest.raises(NotImplementedError, match="PRIMUS_FP8_PARAMS=1, but no Megatron-core DistributedDataParallel"):
            opt.step()
    finally:
        remove_hooks()
    opt.step()  # without the hooks: an ordinary step
