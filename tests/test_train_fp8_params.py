"""``fp8.params=true`` in the trainer: 20 steps with FP8 primary weights give the losses and gradient norms of the
same run with BF16 weights and the weight cache bit for bit (CPU, reference backend); the start event reports the
parameters' bytes with each FP8 linear's weight as its FP8 W; checkpoints move between the two modes both ways
(a BF16-weight run's into an FP8-weight run and an FP8-weight run's into a BF16-weight run, each continuing the
uninterrupted run exactly)."""

from __future__ import annotations

import pytest

from .test_train import losses, train

pytest.importorskip("megatron.core")

ONE_LAYER = ["model.num_layers=1", "logging.log_interval=1", "data.max_bytes=2000000", "data.split='100,0,0'"]


def norms(records):
    return {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8_params")
    out = {}
    for name, params in (("bf16_weights", "false"), ("fp8_weights", "true")):
        proc, out[name] = train(tmp, *ONE_LAYER, "train.steps=20", f"fp8.params={params}", f"checkpoint.dir={tmp / name}",
                                "checkpoint.save_interval=15", name=name)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out


def test_fp8_weights_give_the_bf16_weight_runs_losses_bit_for_bit(runs):
    _, out = runs
    a, b = out["bf16_weights"], out["fp8_weights"]
    assert sorted(losses(a)) == list(range(1, 21))
    assert losses(a) == losses(b) and norms(a) == norms(b)
    assert losses(a)[20] < losses(a)[1]


def test_the_start_event_counts_each_linear_weight_as_its_fp8_w(runs):
    """The difference in ``param_bytes``: each FP8 linear [N, K] of the one layer holds N K bytes of FP8 W and its
    fp32 128x128 scales (TE's layout, [ceil(N/128), pad4(ceil(K/128))]) instead of 2 N K bf16 bytes; the first step's
    ``fp8_cache_bytes`` is W and scales only (no W^T)."""
    from tests.hydra_compose import compose

    _, out = runs
    cfg = compose("model.num_layers=1")
    h, f = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    blocks = lambda n: -(-n // 128)  # noqa: E731
    pad4 = lambda n: -(-n // 4) * 4  # noqa: E731
    linears = [(3 * h, h), (h, h), (f, h), (h, f)]  # qkv, proj, fc1, fc2
    fp8 = sum(n * k + 4 * blocks(n) * pad4(blocks(k)) for n, k in linears)
    bf16 = sum(2 * n * k for n, k in linears)
    start = {name: next(r for r in recs if r.get("event") == "start") for name, recs in out.items()}
    assert start["fp8_weights"]["param_bytes"] == start["bf16_weights"]["param_bytes"] - bf16 + fp8
    assert start["fp8_weights"]["fp8_params"] and not start["bf16_weights"]["fp8_params"]
    first = next(r for r in out["fp8_weights"] if r.get("step") == 1 and "loss" in r)
    assert first["fp8_cache_bytes"] == fp8


@pytest.mark.parametrize("saved_by, loaded_by", [("bf16_weights", "true"), ("fp8_weights", "false")])
def test_checkpoints_move_between_bf16_and_fp8_weights(runs, saved_by, loaded_by):
    """Step 15 of one mode's run, loaded by the other mode (``checkpoint.load``; ``fp8.params`` is not part of the
    run's identity): steps 16-20 are the uninterrupted run's, bit for bit."""
    tmp, out = runs
    name = f"{saved_by}_to_{loaded_by}"
    proc, recs = train(tmp, *ONE_LAYER, "train.steps=20", f"fp8.params={loaded_by}",
                       f"checkpoint.load={tmp / saved_by / 'iter_0000015'}", name=name)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    resume = next(r for r in recs if r.get("event") == "resume")
    assert resume["step"] == 15 and resume["changed"]["fp8.params"] == [loaded_by != "true", loaded_by == "true"]
    full = losses(out[saved_by])
    assert losses(recs) == {s: full[s] for s in range(16, 21)}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["fp8=bf16", "fp8.params=true"], "fp8.params: FP8 primary weights are the plugin's linears'"),
        (["fp8.params=true", "train.cuda_graph=true"], "fp8.params: FP8 primary weights are re-made every step"),
        (["checkpoint.allow_changes=[fp8.params]"], "'fp8.params' is not a field of the run's identity"),
    ],
)
def test_settings_fp8_params_cannot_take_are_refused(overrides, message):
    from primus_fp8_plugin.config.schema import ConfigError, validate
    from tests.hydra_compose import compose

    with pytest.raises(ConfigError, match=message):
        validate(compose(*overrides))
