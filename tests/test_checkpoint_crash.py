"""Crash-safe checkpoints: a run killed (SIGKILL) at each stage of a save resumes from the newest complete
checkpoint and loses nothing; the store's recovery and pruning on their own.

The kill comes from the saving process itself (``PRIMUS_FP8_KILL_DURING_SAVE=STAGE@STEP``, the test hook
of ``training/checkpoint_store.py``). One run directory goes through a kill at every stage, each re-run
(the same command) resuming where the previous one left a complete checkpoint; then a last re-run
finishes. Every step that a resumed run computes again must give the loss it gave before the kill
(resuming is exact), and the final metrics file holds every step once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primus_fp8_plugin import env
from primus_fp8_plugin.training import checkpoint_store as store

# (stage, the step whose save is killed, the latest.txt it leaves, what else the directory holds, what the
# killed run repaired at its start); checkpoint.keep_latest=2
KILLS = [
    ("written", 2, "iter_0000001", {"iter_0000001", ".iter_0000002.partial"}, None),
    ("manifest", 3, "iter_0000002", {"iter_0000001", "iter_0000002", ".iter_0000003.partial"},
     "removed .iter_0000002.partial (an interrupted save)"),
    ("renamed", 4, "iter_0000003", {"iter_0000002", "iter_0000003", "iter_0000004"},
     "removed .iter_0000003.partial (an interrupted save)"),
    # the re-run resumes at step 3 and saves step 4 again: the earlier iter_0000004 is moved aside first
    ("aside", 4, "iter_0000003", {"iter_0000002", "iter_0000003", ".iter_0000004.replaced", ".iter_0000004.partial"}, None),
    ("latest", 5, "iter_0000005", {"iter_0000003", "iter_0000004", "iter_0000005"},
     "restored iter_0000004 (a save of the same step was interrupted)"),
    ("pruning", 6, "iter_0000006", {".iter_0000003.pruned", "iter_0000004", "iter_0000005", "iter_0000006"}, None),
]  # fmt: skip


def contents(ckpt: Path) -> set[str]:
    return {p.name for p in ckpt.iterdir() if p.name not in ("latest.txt", "run.lock")}


def test_a_run_killed_at_each_stage_of_a_save_resumes_and_loses_nothing(tmp_path):
    pytest.importorskip("megatron.core")
    pytest.importorskip("hydra")
    from tests.test_train_runs import SMALL, records, steps, trainer

    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    command = [*SMALL, "checkpoint=periodic", "checkpoint.save_interval=1", "checkpoint.keep_latest=2", "train.steps=8",
               f"logging.dir={run}", f"data.cache_dir={tmp_path / 'data'}"]  # fmt: skip
    seen: dict[int, float] = {}  # step -> loss, as first computed

    def check_losses():
        for r in records(run):
            if "loss" in r and "event" not in r:
                assert seen.setdefault(r["step"], r["loss"]) == r["loss"], (r["step"], seen[r["step"]], r["loss"])

    for i, (stage, step, latest, left, repaired) in enumerate(KILLS):
        proc = trainer(*command, cwd=tmp_path, env={env.KILL_DURING_SAVE: f"{stage}@{step}"})
        assert proc.returncode == -9, (stage, proc.returncode, proc.stderr[-3000:])
        assert (ckpt / "latest.txt").read_text() == latest, stage
        assert contents(ckpt) == left, (stage, contents(ckpt))
        assert repaired is None or f"note: checkpoint.dir: {repaired}" in proc.stdout, (stage, proc.stdout[-2000:])
        check_losses()
        if i:  # the killed run before this one left its lock behind: taken over
            assert "took over the lock of a run that is no longer running" in proc.stdout, stage
    proc = trainer(*command, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: checkpoint.dir: removed .iter_0000003.pruned (an interrupted pruning)" in proc.stdout
    check_losses()
    recs = records(run)
    assert steps(recs) == list(range(1, 9))
    assert (ckpt / "latest.txt").read_text() == "iter_0000008" and contents(ckpt) == {"iter_0000007", "iter_0000008"}
    # each attempt's start and resume events stay; its steps after the checkpoint the next one resumed from do not
    assert [r["step"] for r in recs if r.get("event") == "resume"] == [1, 2, 3, 3, 5, 6]
    assert [r["start_step"] for r in recs if r.get("event") == "start"] == [0, 1, 2, 3, 3, 5, 6]
    saves = [(r["step"], r["pruned"]) for r in recs if r.get("event") == "checkpoint"]
    assert saves[-2:] == [(7, ["iter_0000004", "iter_0000005"]), (8, ["iter_0000006"])]


def make_checkpoint(root: Path, step: int, payload: bytes = b"x") -> Path:
    path = root / store.iter_name(step)
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(payload)
    (path / "manifest.json").write_text(json.dumps({"iteration": step}))
    return path


def test_recover_puts_a_replaced_checkpoint_back_and_removes_leftovers(tmp_path):
    make_checkpoint(tmp_path, 3)
    old = make_checkpoint(tmp_path, 4, b"old")
    (tmp_path / "latest.txt").write_text("iter_0000004")
    old.rename(tmp_path / ".iter_0000004.replaced")  # killed between the two renames of a replacing save
    make_checkpoint(tmp_path, 99).rename(tmp_path / ".iter_0000004.partial")
    make_checkpoint(tmp_path, 2).rename(tmp_path / ".iter_0000002.pruned")
    (tmp_path / "latest.txt.tmp").write_text("iter_00")
    done = store.recover(tmp_path)
    assert done[0] == "restored iter_0000004 (a save of the same step was interrupted)"
    assert {p.name for p in tmp_path.iterdir()} == {"iter_0000003", "iter_0000004", "latest.txt"}
    assert (tmp_path / "iter_0000004" / "data.bin").read_bytes() == b"old"
    assert store.recover(tmp_path) == []
    # a finished replacement whose removal was cut short: the new checkpoint stays
    make_checkpoint(tmp_path, 50, b"stale").rename(tmp_path / ".iter_0000004.replaced")
    store.recover(tmp_path)
    assert (tmp_path / "iter_0000004" / "data.bin").read_bytes() == b"old" and not (tmp_path / ".iter_0000004.replaced").exists()


def test_publish_replaces_a_step_only_once_the_new_one_is_in_place(tmp_path):
    make_checkpoint(tmp_path, 4, b"old")
    staged = store.staging(tmp_path, 4)
    (staged / "data.bin").write_bytes(b"new")
    final = store.publish(tmp_path, staged, 4)
    assert final == tmp_path / "iter_0000004" and (final / "data.bin").read_bytes() == b"new"
    assert (tmp_path / "latest.txt").read_text() == "iter_0000004"
    assert {p.name for p in tmp_path.iterdir()} == {"iter_0000004", "latest.txt"}


@pytest.mark.parametrize("keep, left", [(0, [1, 2, 3, 5]), (1, [5]), (2, [3, 5]), (9, [1, 2, 3, 5])])
def test_prune_keeps_the_newest_and_never_the_latest(tmp_path, keep, left):
    for step in (1, 2, 3, 5):
        make_checkpoint(tmp_path, step)
    removed = store.prune(tmp_path, keep, tmp_path / "iter_0000005")
    assert sorted(store.checkpoints(tmp_path)) == left
    assert removed == [store.iter_name(s) for s in (1, 2, 3, 5) if s not in left]
    # latest.txt naming an older checkpoint (a resume from it): that one is kept as well
    store.prune(tmp_path, 1, tmp_path / store.iter_name(left[0]))
    assert left[0] in store.checkpoints(tmp_path)
