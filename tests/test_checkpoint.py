"""Checkpoints of the trainer: a resume with a changed schedule follows the new schedule as an
uninterrupted run would; corrupted, partial and mismatched checkpoints stop the run at start-up with a
message naming the file (exit 2, no traceback); the manifest's checks one by one."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("hydra")

from primus_fp8_plugin.config.schema import ConfigError  # noqa: E402
from primus_fp8_plugin.training.checkpoint import (  # noqa: E402
    CheckpointError,
    check_same_model,
    latest_checkpoint,
    read_manifest,
    verify_files,
)
from tests.hydra_compose import compose  # noqa: E402
from tests.test_train import losses, train  # noqa: E402

COMMON = ["logging.log_interval=1", "data.max_bytes=2000000"]  # a small corpus: written once, quickly
# what the resumed run and its uninterrupted control change against the 4-step run that saved
NEW_SCHEDULE = ["train.steps=8", "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=3",
                "train.lr_decay_style=linear", "train.weight_decay=0.05"]  # fmt: skip


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """(data-cache override, checkpoint dir) of a 4-step run (cosine to 3e-4 from 3e-3, 2 warmup steps)
    saved at its end; the data cache is shared by the tests of this module."""
    root = tmp_path_factory.mktemp("four")
    proc, _ = train(root, "train.steps=4", *COMMON, f"checkpoint.dir={root / 'ckpt'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return f"data.cache_dir={root / 'data'}", root / "ckpt"


def copy_of(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def lrs(records):
    return {r["step"]: r["lr"] for r in records if "lr" in r and "event" not in r}


def test_the_manifest_lists_every_file_with_its_hash(four_steps):
    _, ckpt = four_steps
    path = ckpt / "iter_0000004"
    assert (ckpt / "latest.txt").read_text() == "iter_0000004"
    manifest = json.loads((path / "manifest.json").read_text())
    files = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == files and any(f.endswith(".distcp") for f in files)
    for name in files:
        data = (path / name).read_bytes()
        assert manifest["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["iteration"] == 4 and manifest["config"]["model"]["hidden_size"] == 256


def test_resume_with_a_changed_schedule_follows_it(four_steps, tmp_path):
    """4 steps saved; resumed to 8 with another lr, min_lr, warmup, decay style and weight decay:
    steps 5-8 get the learning rates an uninterrupted 8-step run with those values has."""
    data, ckpt = four_steps
    ckpt = copy_of(ckpt, tmp_path)
    proc, resumed = train(tmp_path, *COMMON, data, *NEW_SCHEDULE, f"checkpoint.dir={ckpt}", name="resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, control = train(tmp_path, *COMMON, data, *NEW_SCHEDULE, name="control")
    assert proc.returncode == 0, proc.stderr[-3000:]
    event = next(r for r in resumed if r.get("event") == "resume")
    assert event["step"] == 4 and event["changed"] == {
        "train.steps": [4, 8], "train.lr": [3e-3, 1e-3], "train.min_lr": [3e-4, 1e-4], "train.warmup_steps": [2, 3],
        "train.lr_decay_style": ["cosine", "linear"], "train.weight_decay": [0.1, 0.05],
    }  # fmt: skip
    got, want = lrs(resumed), lrs(control)
    assert sorted(got) == [5, 6, 7, 8]
    assert all(got[s] == want[s] for s in got), (got, want)
    # linear decay from 1e-3 after 3 warmup steps to 1e-4 at step 8
    assert all(got[s] == pytest.approx(1e-4 + 9e-4 * (1 - (s - 3) / 5), rel=1e-12) for s in got)
    assert sorted(losses(resumed)) == [5, 6, 7, 8]


@pytest.mark.parametrize("ranks", [1, 2])
def test_distributed_optimizer_checkpoint_resumes_exactly(four_steps, tmp_path, ranks):
    """parallel=dp (Megatron's distributed optimizer; 2 ranks: each reads its own half of every global
    batch): saved at step 2 of 4, resumed in fresh processes, steps 3-4 repeat bit for bit."""
    data, _ = four_steps
    ckpt = tmp_path / "ckpt"
    common = [*COMMON, data, "parallel=dp", "train.steps=4", f"checkpoint.dir={ckpt}", "checkpoint.save_interval=2",
              f"train.global_batch_size={8 * ranks}"]  # fmt: skip
    proc, full = train(tmp_path, *common, name="full", torchrun=ranks if ranks > 1 else 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt / "latest.txt").write_text("iter_0000002")
    proc, resumed = train(tmp_path, *common, name="resumed", torchrun=ranks if ranks > 1 else 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = losses(full), losses(resumed)
    assert sorted(b) == [3, 4] and all(a[s] == b[s] for s in b), (a, b)


def _flip_low_bits(path, n=100_000, seed=0):
    import random

    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    for i in rng.sample(range(len(data)), n):
        data[i] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", ["bit flips", "other model"])
def test_a_bad_checkpoint_stops_the_resume_naming_the_file(four_steps, tmp_path, case):
    data, ckpt = four_steps
    ckpt = copy_of(ckpt, tmp_path)
    path = ckpt / "iter_0000004"
    extra = []
    if case == "bit flips":  # 100k low bits of the tensor data flipped: loads and trains without the check
        _flip_low_bits(path / "__0_0.distcp")
        message = f"checkpoint.dir: {path / '__0_0.distcp'} is corrupted: its SHA-256 differs"
    else:
        extra = ["model.hidden_size=128", "model.num_attention_heads=2"]
        message = f"checkpoint.dir: {path} holds a different model (model.hidden_size=256 there, 128 here"
    proc, records = train(tmp_path, "train.steps=8", *COMMON, data, *extra, f"checkpoint.dir={ckpt}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not records  # stopped before the run started: nothing logged


def test_a_partial_or_unreadable_checkpoint_is_named(four_steps, tmp_path):
    _, ckpt = four_steps
    ckpt = copy_of(ckpt, tmp_path)
    path = ckpt / "iter_0000004"
    cfg = compose(f"checkpoint.dir={ckpt}", "train.steps=8")
    assert latest_checkpoint(ckpt) == path
    manifest = read_manifest(path)
    verify_files(path, manifest)  # intact
    check_same_model(path, manifest, cfg)

    meta = path / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(good[:-10])
    with pytest.raises(CheckpointError, match=f"{meta} has {len(good) - 10} bytes, manifest.json says {len(good)}"):
        verify_files(path, manifest)
    meta.unlink()
    with pytest.raises(CheckpointError, match=f"{meta} is missing .* the checkpoint is incomplete"):
        verify_files(path, manifest)

    (path / "manifest.json").write_text('{"format": ')
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        read_manifest(path)
    (path / "manifest.json").write_text('{"files": {}}')
    with pytest.raises(CheckpointError, match="manifest.json is not a manifest of this trainer"):
        read_manifest(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json not found: the save of iter_0000004 did not finish"):
        read_manifest(path)

    (ckpt / "latest.txt").write_text("iter_0000009")
    with pytest.raises(CheckpointError, match=r"latest.txt names 'iter_0000009', which is not a checkpoint directory"):
        latest_checkpoint(ckpt)
    assert latest_checkpoint(tmp_path / "empty") is None


def test_model_check_reads_seq_length_only_for_learned_positions(four_steps):
    _, ckpt = four_steps
    path = ckpt / "iter_0000004"
    manifest = read_manifest(path)
    with pytest.raises(CheckpointError, match="model.seq_length=128 there, 256 here"):
        check_same_model(path, manifest, compose("model.seq_length=256"))
    with pytest.raises(CheckpointError, match="model.position_embedding_type='learned_absolute' there, 'rope' here"):
        check_same_model(path, manifest, compose("model.seq_length=256", "model.position_embedding_type=rope"))
    assert issubclass(CheckpointError, ConfigError)  # the trainer's main exits 2 on it
