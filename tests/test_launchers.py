"""scripts/launch_pretrain.sh and recipes/*.sh as users run them, on the CPU: --help, the dry run (the
composed config and the exact torchrun / srun command for one node, several nodes and Slurm), the
interpreter they choose, and the pre-launch check of the spec the trainer builds (scripts/check_launch.py)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_pretrain.sh"
# what the launchers read from the environment: none of it leaks in from the test's own
LAUNCH_ENV = ("PYTHON", "VENV", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "PRECHECK",
              "LAUNCH_RECIPE", "PRIMUS_FP8_SRUN_TASK", "DATA_PREFIX")  # fmt: skip


def run(script: Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV and not k.startswith("SLURM_")}
    base.update(PYTHON=sys.executable, OMP_WAIT_POLICY="PASSIVE")
    base.update(env or {})
    base = {k: v for k, v in base.items() if v is not None}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=base, capture_output=True, text=True, timeout=300)


def command_after(out: str, marker: str) -> list[str]:
    """The shell words of the line after the line that contains ``marker``."""
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if marker in line)
    return shlex.split(lines[i + 1])


def test_help_works_without_any_python_and_says_the_rule(tmp_path):
    for script in (LAUNCH, ROOT / "recipes" / "pretrain_llama3_8b.sh", ROOT / "recipes" / "pretrain_moe_small.sh"):
        proc = run(script, "--help", cwd=tmp_path, env={"PYTHON": "/nonexistent/python"})
        assert proc.returncode == 0, proc.stderr
        assert "--dry-run" in proc.stdout and "NNODES, NODE_RANK" in proc.stdout and "SLURM_NODEID" in proc.stdout
        assert "Python: $PYTHON if set; else the checkout's virtualenv" in proc.stdout
    recipe = run(ROOT / "recipes" / "pretrain_llama3_8b.sh", "-h", cwd=tmp_path).stdout
    assert recipe.startswith("Llama-3-8B-shaped pretraining") and "DATA_PREFIX" in recipe
    assert "The recipe runs scripts/launch_pretrain.sh" in recipe
    conv = run(ROOT / "recipes" / "convergence_125m.sh", "--help", cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr
    assert conv.stdout.startswith("BF16 vs TE blockwise vs the plugin") and "--band BAND" in conv.stdout


def test_an_interpreter_without_torch_stops_the_launch_with_what_to_do(tmp_path):
    """No $PYTHON, no virtualenv: python3 from PATH, here one without torch: exit 2 naming it, no fallback."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 1\n")  # find_spec('torch') is None
    (fake / "python3").chmod(0o755)
    env = {"PYTHON": None, "VENV": str(tmp_path / "no_venv"), "PATH": f"{fake}:{os.environ['PATH']}"}
    for script in (LAUNCH, ROOT / "recipes" / "convergence_125m.sh"):
        proc = run(script, "--dry-run", cwd=tmp_path, env=env)
        assert proc.returncode == 2
        assert "python3 (python3 on PATH) has no torch; set PYTHON=" in proc.stderr, proc.stderr


def test_bad_launcher_arguments_are_refused(tmp_path):
    cases = [(["-m", "fp8=bf16,blockwise"], "the launcher starts one run"), (["--cfg", "job"], "unknown option --cfg"),
             (["--gpus", "x", "--dry-run"], "--gpus must be")]  # fmt: skip
    for args, message in cases:
        proc = run(LAUNCH, *args, cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_dry_run_several_nodes_8b_recipe(tmp_path):
    """torchrun's multi-node variables reach the command; the 8B recipe runs SDPA attention with TP=8 + SP;
    the recipe's overrides and the user's (later, winning) reach the composed config."""
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29600", "DATA_PREFIX": "/data/x"}
    proc = run(ROOT / "recipes" / "pretrain_llama3_8b.sh", "--dry-run", "train.steps=50", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in ("  attention: sdpa", "  seq_length: 8192", "  tp: 8", "  sequence_parallel: true", "  path: /data/x",
                 "  steps: 50", "  dir: outputs/llama3_8b"):  # fmt: skip
        assert f"\n{line}\n" in out, line
    cmd = command_after(out, "2 node(s) x 8 process(es); command:")
    assert cmd[:3] == ["env", f"PYTHONPATH={ROOT}", "CUDA_DEVICE_MAX_CONNECTIONS=1"] or cmd[1].startswith(f"PYTHONPATH={ROOT}")
    i = cmd.index(sys.executable)
    assert cmd[i + 1 : i + 9] == ["-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1", "--nproc-per-node=8",
                                  "--master-addr=10.1.2.3", "--master-port=29600", "-m"]  # fmt: skip
    train = cmd[i + 9 :]
    assert train[0] == "primus_fp8_plugin.train" and "model.attention=sdpa" in train and train[-1] == "train.steps=50"
    assert "data.path=/data/x" in train and "nothing started" in out
    assert not (tmp_path / "outputs").exists()


def test_dry_run_in_a_slurm_allocation_uses_the_checkouts_venv(tmp_path):
    """Inside an allocation of 2 nodes: one srun task per node, each re-entering the launcher, which then runs
    torchrun with --node-rank $SLURM_NODEID and the first node as master; the interpreter is $VENV/bin/python."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho nodeA\necho nodeB\n")
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for f in (bin_dir / "scontrol", venv / "bin" / "python"):
        f.chmod(0o755)
    env = {"PYTHON": None, "VENV": str(venv), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
    proc = run(LAUNCH, "--dry-run", "fp8=bf16", "logging.dir=rel/run", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    python = str(venv / "bin" / "python")
    assert f"[launch] python: {python} (the checkout's virtualenv)" in proc.stdout
    assert "\n  mode: bf16\n" in proc.stdout and "\n  dir: rel/run\n" in proc.stdout
    srun = command_after(proc.stdout, "2 node(s) x 4 process(es); command:")
    assert srun == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "env", "PRIMUS_FP8_SRUN_TASK=1",
                    "PRECHECK=0", "MASTER_ADDR=nodeA", "MASTER_PORT=29500", f"PYTHON={python}", "bash", str(LAUNCH),
                    "--gpus", "4", "--", "fp8=bf16", "logging.dir=rel/run"]  # fmt: skip
    node = command_after(proc.stdout, "each node's task then runs:")
    assert node[node.index(python) + 1 :] == ["-m", "torch.distributed.run", "--nnodes=2", "--node-rank=$SLURM_NODEID",
                                              "--nproc-per-node=4", "--master-addr=nodeA", "--master-port=29500", "-m",
                                              "primus_fp8_plugin.train", "fp8=bf16", "logging.dir=rel/run"]  # fmt: skip
    # the task srun starts: node rank from Slurm, no second check
    env.update(PRIMUS_FP8_SRUN_TASK="1", SLURM_NODEID="1", MASTER_ADDR="nodeA")
    task = run(LAUNCH, "--dry-run", "--gpus", "4", "--", "fp8=bf16", cwd=tmp_path, env=env)
    assert task.returncode == 0, task.stderr
    assert "--node-rank=1" in command_after(task.stdout, "2 node(s) x 4 process(es); command:")


def tiny_indexed(prefix: Path) -> None:
    """A real Megatron indexed dataset of two short documents of byte tokens."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in ([72, 105, 33, 256], [10, 20, 30, 256]):
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def test_check_builds_the_spec_the_trainer_builds(tmp_path):
    """--check runs the pre-launch check: the 8B recipe's decoder (32 layers of the plugin's FP8 linears,
    SDPA attention) for 8 processes; the MoE recipe on 16 processes stops with the batch-size rule."""
    pytest.importorskip("megatron.core")
    tiny_indexed(tmp_path / "corpus")
    env = {"DATA_PREFIX": str(tmp_path / "corpus"), "TOKENIZER": "byte"}
    proc = run(ROOT / "recipes" / "pretrain_llama3_8b.sh", "--check", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert ("check_launch: OK llama3_8b, 32 layers, seq 8192, fp8=blockwise; FP8 layers: "
            "Fp8LayerNormColumnParallelLinear x64, Fp8RowParallelLinear x64; attention: SDPA (fused); "
            "8 processes = TP 8 x PP 1 x DP 1") in proc.stdout  # fmt: skip
    assert "check: nothing started" in proc.stdout
    moe = run(ROOT / "recipes" / "pretrain_moe_small.sh", "--check", "--gpus", "16", cwd=tmp_path)
    assert moe.returncode == 2
    assert "train.global_batch_size: 32 is not a multiple of train.micro_batch_size x data-parallel size = 4 x 16" in moe.stderr
    assert "stopped before starting any process" in moe.stderr


@pytest.fixture(scope="module")
def check_launch():
    pytest.importorskip("megatron.core")
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import check_launch
        from hydra_compose import compose

        yield check_launch, compose
    finally:
        sys.path.remove(str(ROOT / "scripts"))
        sys.path.remove(str(ROOT / "tests"))


def test_check_launch_per_mode(check_launch):
    """The spec check follows fp8.mode: bf16 (and all layers kept in BF16) holds no FP8 layer; the local
    attention at a long sequence gets a note; TE modes need TE; a bad batch for the world size is named."""
    mod, compose = check_launch
    summary, notes = mod.check(compose("fp8=bf16"), 1)
    assert "fp8=bf16; FP8 layers: none" in summary and "Megatron's unfused DotProductAttention" in summary and not notes
    summary, _ = mod.check(compose("fp8.bf16_layers=[0,1]"), 1)
    assert "FP8 layers: none" in summary
    summary, notes = mod.check(compose("model.seq_length=2048", "backend=reference"), 1)
    assert "Fp8LayerNormColumnParallelLinear x4, Fp8RowParallelLinear x4" in summary
    assert len(notes) == 1 and "model.attention=sdpa runs PyTorch's fused kernels" in notes[0]
    bad = "train.global_batch_size: 8 is not a multiple of train.micro_batch_size x data-parallel size = 8 x 2"
    with pytest.raises(mod.LaunchCheckError, match=bad):
        mod.check(compose("train.micro_batch_size=8", "train.global_batch_size=8"), 2)
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        with pytest.raises(mod.LaunchCheckError, match="needs Transformer Engine"):
            mod.check(compose("fp8=te_blockwise"), 1)
