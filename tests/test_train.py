"""The Hydra training entry: start-up validation, a short CPU run whose loss falls, exact resume,
and a 2-process tensor- and sequence-parallel run (torchrun, gloo)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("hydra")

ROOT = Path(__file__).resolve().parents[1]
# torchrun's rendezvous port; PRIMUS_FP8_TEST_PORT lets two checkouts run these tests side by side
PORT = int(os.environ.get("PRIMUS_FP8_TEST_PORT", "29611")) + 260
FAST = ["backend=reference", "logging.progress=false", "train.warmup_steps=2", "train.eval_interval=0"]


def train(tmp_path, *overrides, torchrun=0, name="run", progress=False):
    fast = FAST if not progress else [o for o in FAST if not o.startswith("logging.progress")]
    args = [*fast, f"logging.dir={tmp_path / name}", f"data.cache_dir={tmp_path / 'data'}", *overrides]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}", f"--master-port={PORT}",
               "-m", "primus_fp8_plugin.train", *args]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "primus_fp8_plugin.train", *args]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as scripts/run.sh: no spinning threads on a shared CPU
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    records = []
    path = tmp_path / name / "metrics.jsonl"
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines()]
    return proc, records


def losses(records):
    return {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=-5", "train.steps: must be > 0"),
        ("model.hidden_size=250", "model.hidden_size: must be divisible"),
        ("parallel.sequence_parallel=true", "parallel.sequence_parallel: needs parallel.tp > 1"),
        ("backend.name=cuda_magic", "backend.name: 'cuda_magic' is not one of"),
        ("fp8=nonsense", "Could not find 'fp8/nonsense'"),
        ("train.lr=fast", "train.lr"),
        ("model.attention=flash", "model.attention: 'flash' is not one of local, sdpa"),
        ("model.moe_grouped_gemm=true", "model.moe_grouped_gemm: needs model.num_experts"),
        ("train.steps=abc", "train.steps=abc\nValue 'abc' of type 'str' could not be converted to Integer"),
        ("+train.foo=1", "train.foo: unknown key"),
        ("fp8.bf16_layers=[5]", "fp8.bf16_layers: [5] out of range for model.num_layers=2"),
        ("train.micro_batch_size=0", "train.micro_batch_size: must be > 0"),
        ("model.seq_length=1000000", "model.seq_length: a training step needs at least"),
    ],
)
def test_bad_configuration_stops_at_start_up_naming_the_field(tmp_path, override, message):
    proc, _ = train(tmp_path, override)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_unusable_paths_stop_the_run_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc, _ = train(tmp_path, f"checkpoint.dir={blocker / 'ckpt'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"checkpoint.dir: cannot write to {blocker / 'ckpt'}" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    proc, _ = train(tmp_path, "data=indexed", f"data.path={tmp_path / 'nowhere'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"data.path: {tmp_path / 'nowhere'}.bin not found" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cuda_graphs_on_the_cpu_are_refused(tmp_path, device):
    if device == "auto" and torch.cuda.is_available():
        pytest.skip("a GPU is visible: device=auto would run on it")
    proc, _ = train(tmp_path, "train.cuda_graph=true", f"device={device}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "train.cuda_graph: CUDA graphs need a GPU" in proc.stderr


@pytest.mark.parametrize("mode", ["te_blockwise", "te_bf16", "te_spec_blockwise"])
def test_te_modes_without_transformer_engine_are_refused(tmp_path, mode):
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    proc, _ = train(tmp_path, f"fp8={mode}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"fp8.mode: {mode} needs Transformer Engine" in proc.stderr


def test_run_with_the_progress_bar_logs_validation_and_ends_cleanly(tmp_path):
    # the README's main job runs with the bar on: validation losses and the end event go through it too
    proc, records = train(tmp_path, "train.steps=4", "train.eval_interval=2", "logging.log_interval=1", progress=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step=2 valid_loss=" in proc.stderr + proc.stdout
    assert records[-1]["event"] == "end" and records[-1]["step"] == 4
    assert sum("valid_loss" in r for r in records) == 2


def test_a_split_without_documents_is_refused_not_looped_on(tmp_path):
    # Megatron's GPTDataset counts epochs forever when a split it must draw samples from is empty.
    proc, _ = train(tmp_path, "data.max_bytes=200000", "train.eval_interval=2", "train.steps=4")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the valid split" in proc.stderr and "data.max_bytes" in proc.stderr


def test_short_cpu_run_learns_and_logs(tmp_path):
    proc, records = train(tmp_path, "train.steps=40", "logging.log_interval=5", "train.eval_interval=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = next(r for r in records if r.get("event") == "start")
    assert start["fp8"] == "blockwise" and start["device"] == "cpu" and start["params"] > 1e6
    steps = [r for r in records if "loss" in r and "event" not in r]
    assert {"lr", "grad_norm", "tokens_per_s", "step_time_s", "memory_bytes"} <= steps[-1].keys()
    assert steps[-1]["loss"] < 0.6 * steps[0]["loss"], (steps[0]["loss"], steps[-1]["loss"])
    assert [r["valid_loss"] for r in records if "valid_loss" in r]
    assert "done: 40 steps" in proc.stdout


def test_resume_reproduces_the_next_steps_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["train.steps=8", "logging.log_interval=1", f"checkpoint.dir={ckpt}", "checkpoint.save_interval=4"]
    common += ["data.split='100,0,0'"]  # no validation share: evaluation is off (train.eval_interval=0)
    proc, full = train(tmp_path, *common, name="full")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "iter_0000004").is_dir() and (ckpt / "latest.txt").read_text() == "iter_0000008"
    # resume from step 4 in a fresh process
    (ckpt / "latest.txt").write_text("iter_0000004")
    shutil.rmtree(ckpt / "iter_0000008")
    proc, resumed = train(tmp_path, *common, name="resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert next(r for r in resumed if r.get("event") == "start")["start_step"] == 4
    a, b = losses(full), losses(resumed)
    assert sorted(b) == [5, 6, 7, 8]
    assert all(a[s] == b[s] for s in b), (a, b)


def test_moe_run_with_grouped_experts(tmp_path):
    """model.moe_grouped_gemm=true: the experts are the plugin's grouped ones, and the MoE model trains; with SwiGLU
    experts the tokens go straight from the router into the grouped FP8 layout (``moe_dispatch`` says so)."""
    moe = ["model.num_experts=4", "model.add_bias_linear=false", "train.steps=6", "logging.log_interval=1",
           "train.micro_batch_size=2", "train.global_batch_size=2"]  # fmt: skip
    proc, records = train(tmp_path, *moe, "model.moe_grouped_gemm=true", "model.swiglu=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    start = next(r for r in records if r.get("event") == "start")
    assert start["experts"] == "Fp8GroupedMLP" and start["moe_dispatch"] == "routed"  # TEGroupedMLP, fused SwiGLU
    loss = losses(records)
    assert sorted(loss) == [1, 2, 3, 4, 5, 6] and loss[6] < loss[1]


def test_two_process_tensor_and_sequence_parallel_run(tmp_path):
    # the same padded vocabulary (512 rows: 257 rounded up to 256 x TP=1 and 128 x TP=2), so the same initial weights
    proc, tp1 = train(tmp_path, "train.steps=6", "logging.log_interval=1", "model.make_vocab_size_divisible_by=256", name="tp1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, tp2 = train(tmp_path, "train.steps=6", "logging.log_interval=1", "parallel=tp2_sp", torchrun=2, name="tp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert next(r for r in tp2 if r.get("event") == "start")["world_size"] == 2
    a, b = losses(tp1), losses(tp2)
    # same data and initial weights; TP changes only where partial sums round (FP8 noise level)
    assert abs(a[1] - b[1]) / a[1] < 5e-3
    assert b[6] < b[1]


@pytest.mark.parametrize("mode", ["te_blockwise", "te_bf16", "te_spec_blockwise"])
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model.attention", "sdpa", "model.attention: 'sdpa' does not apply to fp8.mode="),
        ("fp8.bf16_layers", [0, -1], "fp8.bf16_layers: is not supported with fp8.mode="),
    ],
)
def test_te_modes_refuse_settings_they_would_ignore(mode, key, value, message):
    from omegaconf import OmegaConf

    from primus_fp8_plugin.config.schema import Config, ConfigError, validate

    cfg = OmegaConf.structured(Config)
    cfg.fp8.mode = mode
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
