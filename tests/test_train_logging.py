"""Where a run's records go besides metrics.jsonl: train.log (a copy of the console) and the optional
TensorBoard and W&B sinks (a clear error naming the setting when their package is absent)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

pytest.importorskip("hydra")

from primus_fp8_plugin.config.schema import ConfigError  # noqa: E402
from primus_fp8_plugin.training.metrics import TENSORBOARD_NAMES, open_sinks  # noqa: E402
from tests.hydra_compose import compose  # noqa: E402

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def test_the_console_copy_keeps_lines_as_last_drawn(tmp_path):
    from primus_fp8_plugin.training.console_log import console_to_log

    log = tmp_path / "train.log"
    with console_to_log(log):
        print("first line")
        sys.stderr.write("\r 10%|#  | 1/10\r 50%|#####| 5/10")  # a progress bar redrawn in place
        print("a line above the bar")
        sys.stderr.write("\r" + " " * 20 + "\rwritten above the bar\n\r 50%|#####| 5/10")
        sys.stderr.write("\r100%|##########| 10/10\n")
        print("unfinished", end="")
    assert log.read_text() == "first line\na line above the bar\nwritten above the bar\n100%|##########| 10/10\nunfinished\n"


@pytest.mark.skipif(HAVE_TENSORBOARD, reason="tensorboard is installed here")
def test_tensorboard_without_its_package_is_a_named_error(tmp_path):
    cfg = compose(f"logging.dir={tmp_path}", f"logging.tensorboard_dir={tmp_path / 'tb'}")
    message = "logging.tensorboard_dir: TensorBoard logging needs the tensorboard package .*pip install tensorboard"
    with pytest.raises(ConfigError, match=message):
        open_sinks(cfg, "abc", {})


@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="needs tensorboard (pip install tensorboard)")
def test_tensorboard_gets_megatrons_scalar_names(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose(f"logging.dir={tmp_path}", f"logging.tensorboard_dir={tmp_path / 'tb'}")
    (sink,) = open_sinks(cfg, "abc", {})
    sink.write({"event": "start", "params": 5})
    for step, loss in ((1, 6.5), (2, 5.25)):
        sink.write({"step": step, "loss": loss, "lr": 1e-3 * step, "grad_norm": 2.0, "step_time_s": 0.5, "tokens_per_s": 100.0,
                    "mfu": None, "memory_bytes": 2**30, "consumed_samples": 8 * step, "update_ok": True})  # fmt: skip
    sink.write({"step": 2, "valid_loss": 5.5})
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(v for k, v in TENSORBOARD_NAMES.items() if k != "mfu")
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 6.5), (2, 5.25)]
    assert [(e.step, e.value) for e in events.Scalars("lm loss validation")] == [(2, 5.5)]


@pytest.mark.skipif(HAVE_WANDB, reason="wandb is installed here")
def test_wandb_without_its_package_is_a_named_error(tmp_path):
    cfg = compose(f"logging.dir={tmp_path}", "logging.wandb_project=mine")
    with pytest.raises(ConfigError, match="logging.wandb_project: W&B logging needs the wandb package .*pip install wandb"):
        open_sinks(cfg, "abc", {})


def test_no_sinks_unless_asked(tmp_path):
    assert open_sinks(compose(f"logging.dir={tmp_path}"), "abc", {}) == []
