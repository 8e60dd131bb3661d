"""Runs as users start them, end to end on the CPU: a two-arm sweep with checkpoints trains both arms in
full, each in its own directory; re-running a directory resumes that run and continues its metrics,
and a changed identity is refused unless allowed; another run's metrics file, a live run's lock and a
checkpoint that cannot be loaded stop the run at start-up (exit 2); train.log holds what the console
showed; the start event's parameter and FP8-cache bytes against an independent computation."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("hydra")

ROOT = Path(__file__).resolve().parents[1]
# a one-layer tiny GPT on a 2 MB corpus, exact reference kernels, no evaluation: seconds per run
SMALL = ["backend=reference", "model.num_layers=1", "train.warmup_steps=2", "train.eval_interval=0",
         "logging.progress=false", "logging.log_interval=1", "data.max_bytes=2000000"]  # fmt: skip


def trainer(*args, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    """``python -m primus_fp8_plugin.train ARGS`` in ``cwd`` (``env``: extra variables), in a session of
    its own: a run killed by SIGKILL leaves Megatron's checkpoint-writer queue process (a
    multiprocessing manager) behind, which holds the output open; it is ended with its group."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "MASTER_PORT")},
           **(env or {})}  # fmt: skip
    env.update(PYTHONPATH=str(ROOT), OMP_WAIT_POLICY=env.get("OMP_WAIT_POLICY", "PASSIVE"))
    cmd = [sys.executable, "-m", "primus_fp8_plugin.train", *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.returncode is None or proc.returncode < 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, rc, out.read(), err.read())


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(recs: list[dict]) -> list[int]:
    return [r["step"] for r in recs if "loss" in r and "event" not in r]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """The issue's sweep, ``-m fp8=bf16,blockwise checkpoint=periodic train.steps=10``, on the small setup:
    (working directory, sweep directory, the sweep's process, data-cache override)."""
    cwd = tmp_path_factory.mktemp("sweep")
    data = f"data.cache_dir={cwd / 'data'}"
    proc = trainer("-m", "fp8=bf16,blockwise", "checkpoint=periodic", "train.steps=10", *SMALL, data, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = (cwd / "multirun").glob("*/*")
    return cwd, sweep_dir, proc, data


def test_a_two_arm_sweep_with_checkpoints_trains_both_arms_in_full(sweep):
    _, sweep_dir, _, _ = sweep
    for job, mode in (("0", "bf16"), ("1", "blockwise")):
        recs = records(sweep_dir / job)
        assert steps(recs) == list(range(1, 11)), (job, steps(recs))
        assert not [r for r in recs if r.get("event") == "resume"], job  # nobody resumed anybody
        start = next(r for r in recs if r.get("event") == "start")
        assert start["fp8"] == mode and start["start_step"] == 0
        ckpt = sweep_dir / job / "checkpoints"  # each job saves into its own output directory
        assert (ckpt / "latest.txt").read_text() == "iter_0000010"
        manifest = json.loads((ckpt / "iter_0000010" / "manifest.json").read_text())
        assert manifest["config"]["fp8"]["mode"] == mode and manifest["run"]["run_id"] == start["run_id"]
        saved = next(r for r in recs if r.get("event") == "checkpoint")
        assert saved["bytes"] == sum(f["bytes"] for f in manifest["files"].values())
    assert not (sweep_dir.parents[2] / "outputs").exists()  # no shared outputs/checkpoints


def test_train_log_holds_what_the_console_showed(sweep):
    _, sweep_dir, proc, _ = sweep
    for job in ("0", "1"):
        log = (sweep_dir / job / "train.log").read_text().splitlines()
        recs = records(sweep_dir / job)
        # every metrics line the console printed for this job, the save message and the final line
        shown = [line for line in proc.stdout.splitlines() if f"run_id={recs[0]['run_id']}" in line]
        assert shown and shown[0] in log
        assert any(line.startswith("step=10 loss=") and "mem=" in line and "mfu=n/a" in line for line in log), log
        assert any(line.startswith("saved checkpoint iter_0000010 (") and " MiB) in " in line for line in log), log
        assert f"done: 10 steps, final loss {recs[-1]['loss']:.4f}" in log[-1], log[-3:]
        for line in log:
            if line.startswith("step="):
                assert line in proc.stdout
    log0 = (sweep_dir / "0" / "train.log").read_text()
    assert "fp8=bf16" in log0 and "fp8=blockwise" not in log0  # one job's console per log


def test_the_start_event_names_the_layout_and_the_bytes(sweep):
    """param_bytes: bf16 parameters of the one-layer model (parameter_count of the config, the byte
    tokenizer's 257 ids padded to 384, a multiple of 128 as Megatron pads); fp8_cache_bytes: each FP8
    linear [N, K] caches W and W^T (N K bytes each) and their 128x128 block scales in TE's layout (fp32
    [ceil(N/128), pad4(ceil(K/128))] and transposed)."""
    from primus_fp8_plugin import __version__
    from primus_fp8_plugin.config.resources import parameter_count
    from tests.hydra_compose import compose

    _, sweep_dir, _, _ = sweep
    cfg = compose("model.num_layers=1")
    h, f = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    blocks = lambda n: -(-n // 128)  # noqa: E731
    pad4 = lambda n: -(-n // 4) * 4  # noqa: E731
    linears = [(3 * h, h), (h, h), (f, h), (h, f)]  # qkv, proj, fc1, fc2
    cache = sum(2 * n * k + 4 * (blocks(n) * pad4(blocks(k)) + blocks(k) * pad4(blocks(n))) for n, k in linears)
    for job, fp8_bytes, resolved in (("0", 0, None), ("1", cache, "reference")):
        recs = records(sweep_dir / job)
        start = next(r for r in recs if r.get("event") == "start")
        assert start["param_bytes"] == 2 * parameter_count(cfg, 384) == 2 * start["params"]
        assert (start["tp"], start["pp"], start["sp"], start["ep"], start["dp"]) == (1, 1, False, 1, 1)
        assert start["version"] == __version__ and start["backend"] == "reference"
        assert start["backend_resolved"] == resolved
        first = next(r for r in recs if r.get("step") == 1 and "loss" in r)
        assert first["fp8_cache_bytes"] == fp8_bytes, (job, first["fp8_cache_bytes"], fp8_bytes)
        assert first["mfu"] is None and first["memory_bytes"] > 0  # a CPU: no peak to compare with


def test_rerunning_a_run_dir_with_another_fp8_mode_is_refused_naming_the_field(sweep):
    """The reproducer: a fp8=blockwise run would silently have continued a fp8=bf16 run's weights."""
    cwd, sweep_dir, _, data = sweep
    job = sweep_dir / "0"
    before = (job / "metrics.jsonl").read_bytes()
    proc = trainer("fp8=blockwise", "checkpoint=periodic", "train.steps=12", *SMALL, data, f"logging.dir={job}", cwd=cwd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "fp8.mode: 'bf16' -> 'blockwise'" in proc.stderr and "checkpoint.allow_changes=[fp8.mode]" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (job / "metrics.jsonl").read_bytes() == before
    assert "fp8.mode: 'bf16' -> 'blockwise'" in (job / "train.log").read_text()


def test_an_allowed_change_resumes_and_continues_the_metrics_file(sweep, tmp_path):
    """Job 1 (blockwise, 10 steps) re-run in its directory with another seed (allowed) and 12 steps:
    it resumes at step 10, the resume event lists both changes, metrics.jsonl holds steps 1-12 once."""
    cwd, sweep_dir, _, data = sweep
    job = sweep_dir / "1"
    proc = trainer("fp8=blockwise", "checkpoint=periodic", "train.steps=12", "train.seed=7",
                   "checkpoint.allow_changes=[train.seed]", *SMALL, data, f"logging.dir={job}", cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(job)
    assert steps(recs) == list(range(1, 13))
    resume = next(r for r in recs if r.get("event") == "resume")
    assert resume["step"] == 10 and resume["source"] == "checkpoint.dir"
    assert resume["changed"] == {"train.seed": [1234, 7], "train.steps": [10, 12]}
    starts = [r for r in recs if r.get("event") == "start"]
    assert len(starts) == 2 and starts[0]["run_id"] == starts[1]["run_id"] and starts[1]["start_step"] == 10
    assert (job / "checkpoints" / "latest.txt").read_text() == "iter_0000012"


def test_a_fresh_run_refuses_a_logging_dir_holding_another_runs_metrics(sweep):
    cwd, sweep_dir, _, data = sweep
    job = sweep_dir / "0"
    before = (job / "metrics.jsonl").read_bytes()
    proc = trainer("fp8=bf16", "train.steps=3", *SMALL, data, f"logging.dir={job}", cwd=cwd)  # checkpoint=none: fresh
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"logging.dir: {job / 'metrics.jsonl'} already holds the metrics of run " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (job / "metrics.jsonl").read_bytes() == before
    # the directory's Hydra record stays the first run's; this invocation's went beside it
    assert "mode: bf16" in (job / ".hydra" / "config.yaml").read_text()
    assert any("steps: 3" in (p / "config.yaml").read_text() for p in (job / ".hydra").iterdir() if p.is_dir())


def test_a_second_live_run_on_the_same_directory_is_refused_naming_it(sweep, tmp_path):
    cwd, _, _, data = sweep
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from primus_fp8_plugin.training.lock import DirectoryLock; "
         "DirectoryLock.acquire(Path(sys.argv[1]), 'logging.dir'); print('locked', flush=True); time.sleep(600)",
         str(tmp_path / "run")],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = trainer("train.steps=3", *SMALL, data, f"logging.dir={tmp_path / 'run'}", cwd=cwd)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"logging.dir: {tmp_path / 'run'} is in use by another run: pid {holder.pid} on host " in proc.stderr
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_resuming_with_the_distributed_optimizer_toggled_is_a_named_error_not_a_traceback(sweep, tmp_path):
    """The reproducer: job 1's checkpoints (plain optimizer) resumed with the distributed optimizer
    printed a 72-line traceback. Now the change is refused, naming the field; allowed, the load fails
    and torch's CheckpointException (a BaseException) becomes the CheckpointError: exit status 2."""
    cwd, sweep_dir, _, data = sweep
    copy = tmp_path / "ckpt"
    shutil.copytree(sweep_dir / "1" / "checkpoints", copy)
    proc = trainer("fp8=blockwise", "train.steps=12", *SMALL, data, f"logging.dir={tmp_path / 'resumed'}",
                   f"checkpoint.dir={copy}", "parallel.use_distributed_optimizer=true", cwd=cwd)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "parallel.use_distributed_optimizer: False -> True" in proc.stderr and "Traceback" not in proc.stderr
    saved = sweep_dir / "1" / "checkpoints" / "iter_0000010"
    proc = trainer("fp8=blockwise", "train.steps=12", *SMALL, data, f"logging.dir={tmp_path / 'run'}", f"checkpoint.load={saved}",
                   "parallel.use_distributed_optimizer=true", "checkpoint.allow_changes=[parallel.use_distributed_optimizer]",
                   cwd=cwd)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"checkpoint.load: cannot load {saved}" in proc.stderr
    assert "saved with parallel.use_distributed_optimizer=False" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 10, proc.stderr[-3000:]


def test_version_prints_the_plugins_version(tmp_path):
    from primus_fp8_plugin import __version__

    proc = trainer("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"primus-fp8-plugin {__version__}", proc.stdout
    assert not any(tmp_path.iterdir())


def test_cfg_job_with_a_logging_dir_prints_the_config(tmp_path):
    proc = trainer("logging.dir=X", "checkpoint=periodic", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dir: X" in proc.stdout and "dir: ${logging.dir}/checkpoints" in proc.stdout and not any(tmp_path.iterdir())


def test_sweep_jobs_sharing_a_checkpoint_dir_stop_at_the_second(sweep, tmp_path):
    """A sweep over the learning rate with one explicit checkpoint.dir: the second job would resume the
    first's final checkpoint (a schedule change is no identity change) and train nothing."""
    cwd, _, _, data = sweep
    proc = trainer("-m", "train.lr=1e-3,2e-3", "train.steps=3", *SMALL, data, f"checkpoint.dir={tmp_path / 'ckpt'}",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=cwd)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"checkpoint.dir: {tmp_path / 'ckpt'} is also the checkpoint.dir of job 0 of this sweep" in proc.stderr
    assert steps(records(tmp_path / "sweep" / "0")) == [1, 2, 3] and not (tmp_path / "sweep" / "1" / "metrics.jsonl").exists()


@pytest.mark.gpu
def test_mfu_on_a_gpu_in_the_peak_table(tmp_path):
    """On a GPU of flops.PEAK_BF16_TFLOPS every step record has an MFU in (0, 1), equal to the formula's
    model FLOPs over the step time and the peak; the start event names the backend auto chose."""
    import torch

    from primus_fp8_plugin.training import flops
    from tests.hydra_compose import compose

    peak = flops.peak_flops(torch.cuda.get_device_name(0))
    if peak is None:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is not in the peak table")
    proc = trainer("train.steps=6", "train.warmup_steps=1", "train.eval_interval=0", "logging.progress=false",
                   "logging.log_interval=1", "data.max_bytes=2000000", f"logging.dir={tmp_path / 'run'}",
                   cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = records(tmp_path / "run")
    start = next(r for r in recs if r.get("event") == "start")
    assert start["backend"] == "auto" and start["backend_resolved"] not in (None, "auto", "reference")
    # one process: a global batch of 8; the byte tokenizer's 257 ids padded to 3 x 128
    per_step = flops.model_flops_per_step(compose("train.global_batch_size=8"), 384)
    for r in recs:
        if "loss" in r and "event" not in r:
            assert 0 < r["mfu"] < 1 and r["mfu"] == pytest.approx(per_step / (r["step_time_s"] * peak), rel=1e-9)
    assert "mfu=" in proc.stdout and "mfu=n/a" not in proc.stdout
