"""Who owns a run's directories, piece by piece: the lock (a live holder named, a dead one's lock taken
over, a reused pid seen through), the metrics file (one run per file; a resumed run cut back to its
checkpoint), the identity comparison and its opt-in, and where the command line sends Hydra's output."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")

from primus_fp8_plugin.config.schema import ConfigError, validate  # noqa: E402
from primus_fp8_plugin.training.lock import LOCK_NAME, DirectoryLock, DirectoryLockedError  # noqa: E402
from primus_fp8_plugin.training.metrics import claim_metrics_file  # noqa: E402
from tests.hydra_compose import compose  # noqa: E402


def write_lock(directory: Path, **info) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    path.write_text(json.dumps(info))
    return path


def test_a_live_holder_is_named_and_its_lock_kept(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        started = psutil.Process(sleeper.pid).create_time()
        path = write_lock(tmp_path, pid=sleeper.pid, host=socket.gethostname(), pid_started=started, started=0,
                          command=["train", "fp8=bf16"])  # fmt: skip
        message = rf"logging.dir: {tmp_path} is in use by another run: pid {sleeper.pid} on"
        with pytest.raises(DirectoryLockedError, match=message):
            DirectoryLock.acquire(tmp_path, "logging.dir")
        assert json.loads(path.read_text())["pid"] == sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()
    lock = DirectoryLock.acquire(tmp_path, "logging.dir")  # now dead: stale, taken over
    assert lock.took_over["pid"] == sleeper.pid and json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()
    assert not path.exists()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path):
    # this very process's pid with another start time: the lock's process ended, the pid was reused
    write_lock(tmp_path, pid=os.getppid(), host=socket.gethostname(), pid_started=1.0)
    lock = DirectoryLock.acquire(tmp_path, "checkpoint.dir")
    assert lock.took_over["pid"] == os.getppid()
    lock.release()


def test_another_hosts_lock_is_refused_with_the_file_to_delete(tmp_path):
    path = write_lock(tmp_path, pid=1, host="elsewhere.example", pid_started=1.0)
    with pytest.raises(DirectoryLockedError, match=f"it runs on another host, .* once it has ended, delete {path}"):
        DirectoryLock.acquire(tmp_path, "checkpoint.dir")


def test_this_process_holding_it_already_is_an_earlier_sweep_job(tmp_path):
    lock = DirectoryLock.acquire(tmp_path, "logging.dir", run_dir="multirun/x/0")
    with pytest.raises(DirectoryLockedError, match="already in use by an earlier run of this process"):
        DirectoryLock.acquire(tmp_path, "logging.dir")
    lock.release()


def lines(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_one_run_per_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert claim_metrics_file(path, "abc", None) == 0  # absent
    path.write_text("")
    assert claim_metrics_file(path, "abc", None) == 0  # empty
    run = [{"event": "start", "run_id": "abc", "start_step": 0}, {"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0},
           {"event": "checkpoint", "step": 2, "path": "x"}, {"step": 3, "loss": 3.0}, {"step": 3, "valid_loss": 3.5}]  # fmt: skip
    path.write_text(lines(*run) + '{"step": 4, "lo')  # the last line cut short by a kill
    with pytest.raises(ConfigError, match=f"logging.dir: {path} already holds the metrics of run abc .* this run starts fresh"):
        claim_metrics_file(path, "abc", None)
    with pytest.raises(ConfigError, match="already holds the metrics of run abc .* this run resumes run xyz"):
        claim_metrics_file(path, "xyz", 2)
    # resuming run abc at step 2: what came after step 2 (and the torn line) goes, the rest stays as it was
    assert claim_metrics_file(path, "abc", 2) == 3
    assert path.read_text() == lines(*run[:4])


def test_a_damaged_metrics_file_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "start", "run_id": "abc"}\nnot json\n{"step": 1}\n')
    with pytest.raises(ConfigError, match=f"logging.dir: line 2 of {path} is not JSON"):
        claim_metrics_file(path, "abc", 1)


@pytest.mark.parametrize(
    "entries, ok",
    [(["fp8"], True), (["fp8.mode", "parallel.tp"], True), (["parallel"], True), (["backend"], True), (["data.path"], True),
     (["train.seed"], True), (["model.attention"], True), (["fp9"], False), (["train.lr"], False),
     (["parallel.cpu_initialization"], False), (["fp8.nonsense"], False), (["backend.name"], False)],
)  # fmt: skip
def test_allow_changes_names_identity_fields(entries, ok):
    cfg = compose(f"checkpoint.allow_changes=[{','.join(entries)}]")
    if ok:
        validate(cfg)
    else:
        with pytest.raises(ConfigError, match=f"checkpoint.allow_changes: '{entries[0]}' is not a field of the run's identity"):
            validate(cfg)


def test_the_identity_comparison_names_each_field():
    from primus_fp8_plugin.training.checkpoint import compare_runs, run_fields

    saved = run_fields({"model": {"hidden_size": 256}, "fp8": {"mode": "bf16"}, "train": {"seed": 1, "lr": 0.1},
                        "parallel": {"tp": 1}, "data": {"cache_dir": "a"}, "logging": {"dir": "x"}, "checkpoint": {"dir": "c"}},
                       {"backend": None, "world_size": 1})  # fmt: skip
    mine = run_fields({"model": {"hidden_size": 256}, "fp8": {"mode": "blockwise"}, "train": {"seed": 2, "lr": 0.2},
                       "parallel": {"tp": 2}, "data": {"cache_dir": "b"}, "logging": {"dir": "y"}, "checkpoint": {"dir": "d"}},
                      {"backend": "triton", "world_size": 2})  # fmt: skip
    changed, refused = compare_runs(saved, mine, [])
    assert changed == {"fp8.mode": ("bf16", "blockwise"), "parallel.tp": (1, 2), "parallel.world_size": (1, 2),
                       "train.lr": (0.1, 0.2), "train.seed": (1, 2)}  # fmt: skip
    assert list(refused) == ["fp8.mode", "parallel.tp", "train.seed"]
    _, refused = compare_runs(saved, mine, ["fp8", "parallel.tp"])
    assert list(refused) == ["train.seed"]
    # the resolved backend counts where both runs ran the plugin's linears
    changed, refused = compare_runs({"backend.resolved": "triton"}, {"backend.resolved": "reference"}, [])
    assert refused == {"backend.resolved": ("triton", "reference")}


def test_hydra_command_line_for_sweeps_and_cfg():
    from primus_fp8_plugin.train import hydra_args

    # a sweep's logging.dir is the sweep's directory: each job writes into its own DIR/N
    assert hydra_args(["-m", "logging.dir=a", "fp8=bf16,blockwise"], rank=0) == ["-m", "fp8=bf16,blockwise", "hydra.sweep.dir=a"]
    assert hydra_args(["-m", "logging.dir=a,b", "fp8=bf16"], rank=0) == ["-m", "logging.dir=a,b", "fp8=bf16"]
    # the added overrides follow the given ones, so that an option never splits them
    assert hydra_args(["logging.dir=X", "--cfg", "job"], rank=0) == ["logging.dir=X", "hydra.run.dir=X", "--cfg", "job"]
    assert hydra_args(["--cfg", "job", "logging.dir=X"], rank=0) == ["--cfg", "job", "logging.dir=X", "hydra.run.dir=X"]
    assert hydra_args(["a=1", "--cfg", "job"], rank=1)[:5] == ["a=1", "hydra.run.dir=.", "hydra.output_subdir=null",
                                                                "hydra/job_logging=none", "hydra/hydra_logging=none"]  # fmt: skip


def test_the_trainer_locks_both_directories_once_each(tmp_path):
    pytest.importorskip("megatron.core")
    import contextlib

    from primus_fp8_plugin.training.loop import lock_run_dirs

    for ckpt in (tmp_path / "ckpt", tmp_path):  # checkpoints beside the logs, or in the same directory
        cfg = compose(f"logging.dir={tmp_path}", f"checkpoint.dir={ckpt}")
        with contextlib.ExitStack() as stack:
            lock_run_dirs(cfg, stack)
            assert (tmp_path / LOCK_NAME).is_file() and (ckpt / LOCK_NAME).is_file()
            with pytest.raises(ConfigError, match="already in use by an earlier run of this process"):
                lock_run_dirs(cfg, contextlib.ExitStack())
        assert not (tmp_path / LOCK_NAME).exists() and not (ckpt / LOCK_NAME).exists()
