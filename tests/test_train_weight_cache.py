"""The trainer with every weight cache in check mode (PRIMUS_FP8_CHECK_WEIGHT_CACHE=1): each copy a
cache serves in training microbatches, backward and evaluation is compared with a fresh quantization
of the current weights, and a stale one would stop the run with StaleWeightCacheError."""

from __future__ import annotations

import pytest

from .test_train import losses, train

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("parallel", ["single", "dp"], ids=["mixed_precision_optimizer", "distributed_optimizer"])
def test_training_and_evaluation_never_see_a_stale_weight_copy(tmp_path, monkeypatch, parallel):
    monkeypatch.setenv("PRIMUS_FP8_CHECK_WEIGHT_CACHE", "1")
    proc, records = train(
        tmp_path, "train.steps=4", "train.micro_batch_size=2", "train.global_batch_size=6", "train.eval_interval=2",
        "train.eval_steps=2", "logging.log_interval=1", f"parallel={parallel}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "StaleWeightCacheError" not in proc.stderr
    steps = losses(records)
    assert sorted(steps) == [1, 2, 3, 4] and len(set(steps.values())) == 4, steps
    assert len([r for r in records if "valid_loss" in r]) == 2
