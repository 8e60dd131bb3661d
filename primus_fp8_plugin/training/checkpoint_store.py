"""A directory of checkpoints that a process killed at any moment leaves usable: each checkpoint is
written aside, flushed and renamed into place, and ``latest.txt`` moves only after that.

Layout of ``checkpoint.dir``::

    latest.txt                 the name of the newest complete checkpoint (replaced atomically, last)
    iter_0000100/              a complete checkpoint (its ``manifest.json`` is written last inside it)
    .iter_0000200.partial/     a save in progress (left by a killed save: removed by ``recover``)
    .iter_0000100.replaced/    the earlier checkpoint of a step being saved again, until the new one is in place
    .iter_0000050.pruned/      an old checkpoint being removed (``checkpoint.keep_latest``)

A save of step N, in order: the files are written into ``.iter_N.partial`` (``staging``); the
manifest is written there and every file, the manifest and the directory are fsynced (the caller,
``checkpoint.py``); ``publish`` renames an existing ``iter_N`` to ``.iter_N.replaced``, renames the
new directory to ``iter_N``, replaces ``latest.txt`` (written aside, fsynced, renamed), and only
then removes ``.iter_N.replaced``; ``prune`` renames old checkpoints to ``.pruned`` before removing
them. Whatever step a kill interrupts, ``latest.txt`` names a complete checkpoint, and ``recover``
(run at start-up by the run that owns the directory) puts a checkpoint moved aside back in place and
removes the leftovers.

Test hook: with ``PRIMUS_FP8_KILL_DURING_SAVE=STAGE`` (or ``STAGE@STEP``: only in the save of that
step) the saving process sends itself SIGKILL when the save reaches ``STAGE``, one of ``SAVE_STAGES``
(tests/test_checkpoint_crash.py kills a run at each of them and resumes it).

Only the process that owns the directory (rank 0 of the run holding its lock) calls these.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
from pathlib import Path

from .. import env

LATEST = "latest.txt"
# the stages of a save, in order; a kill after each is survived (tests/test_checkpoint_crash.py)
SAVE_STAGES = (
    "written",  # every rank wrote its files into .iter_N.partial; no manifest yet
    "manifest",  # the manifest is written and every file flushed; nothing renamed yet
    "aside",  # (saving a step again) the earlier iter_N was renamed to .iter_N.replaced
    "renamed",  # the new checkpoint is iter_N; latest.txt still names the previous one
    "latest",  # latest.txt names the new checkpoint; .iter_N.replaced and old checkpoints not yet removed
    "pruning",  # an old checkpoint was renamed to .iter_K.pruned, not yet removed
)
_ITER = re.compile(r"^iter_(\d{7,})$")
_LEFTOVER = re.compile(r"^\.(iter_\d{7,})\.(partial|replaced|pruned)$")


def iter_name(step: int) -> str:
    return f"iter_{step:07d}"


def staging(root: Path, step: int) -> Path:
    """The directory a save of ``step`` writes into (``.iter_N.partial``), empty and existing."""
    path = root / f".{iter_name(step)}.partial"
    if path.exists():
        shutil.rmtree(path)  # a killed save of the same step; ``recover`` normally removed it already
    path.mkdir(parents=True)
    return path


def reached(stage: str, step: int) -> None:
    """The test hook: SIGKILL this process if ``PRIMUS_FP8_KILL_DURING_SAVE`` names ``stage`` (and
    ``step``, when it names one)."""
    want = env.kill_during_save()
    if not want:
        return
    name, _, at = want.partition("@")
    if name == stage and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_fd(fd: int) -> None:
    """Flush an open file's (or directory's) data and metadata to the storage; a file system that cannot
    sync this kind of descriptor (some network and FUSE mounts refuse directories) is left as it is."""
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def fsync_path(path: Path) -> None:
    """``fsync_fd`` of a file or directory by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written aside, fsynced, renamed, directory fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def publish(root: Path, staged: Path, step: int) -> Path:
    """Move the complete, flushed checkpoint ``staged`` into place as ``iter_N`` and point
    ``latest.txt`` at it; an earlier ``iter_N`` is removed only after that. Returns its path."""
    final = root / iter_name(step)
    replaced = root / f".{final.name}.replaced"
    fsync_path(staged)
    if final.exists():
        if replaced.exists():
            shutil.rmtree(replaced)
        os.rename(final, replaced)
        fsync_path(root)
        reached("aside", step)
    os.rename(staged, final)
    fsync_path(root)
    reached("renamed", step)
    write_atomic(root / LATEST, final.name)
    reached("latest", step)
    if replaced.exists():
        shutil.rmtree(replaced)
    return final


def checkpoints(root: Path) -> dict[int, Path]:
    """``{step: path}`` of the ``iter_N`` directories in ``root``."""
    if not root.is_dir():
        return {}
    found = {}
    for p in root.iterdir():
        m = _ITER.match(p.name)
        if m and p.is_dir():
            found[int(m.group(1))] = p
    return found


def prune(root: Path, keep: int, latest: Path) -> list[str]:
    """Remove all but the ``keep`` newest checkpoints (by step; never the one ``latest.txt`` names),
    each renamed to ``.iter_K.pruned`` first so that a kill never leaves half a checkpoint under its
    name. Returns the names removed, oldest first."""
    if keep <= 0:
        return []
    found = checkpoints(root)
    newest = sorted(found, reverse=True)[:keep]
    saving = int(_ITER.match(latest.name).group(1))
    removed = []
    for step in sorted(found):
        path = found[step]
        if step in newest or path.name == latest.name:
            continue
        doomed = root / f".{path.name}.pruned"
        os.rename(path, doomed)
        reached("pruning", saving)
        shutil.rmtree(doomed)
        removed.append(path.name)
    return removed


def recover(root: Path) -> list[str]:
    """Repair what a killed save left in ``root``: a checkpoint moved aside for a save of the same
    step goes back under its name (the new one never became ``latest``), and unfinished saves,
    finished replacements, half-removed pruned checkpoints and a half-written ``latest.txt`` go.
    Returns what it did, one line per directory, for the run's log."""
    if not root.is_dir():
        return []
    done = []
    leftovers = sorted(p for p in root.iterdir() if _LEFTOVER.match(p.name))
    for path in leftovers:  # .replaced first restores, then .partial and .pruned are removed
        name, kind = _LEFTOVER.match(path.name).groups()
        if kind == "replaced" and not (root / name).exists():
            os.rename(path, root / name)
            done.append(f"restored {name} (a save of the same step was interrupted)")
    why = {"partial": "an interrupted save", "replaced": "left by an interrupted save", "pruned": "an interrupted pruning"}
    for path in leftovers:
        if path.exists():
            shutil.rmtree(path)
            done.append(f"removed {path.name} ({why[_LEFTOVER.match(path.name).group(2)]})")
    tmp = root / (LATEST + ".tmp")
    if tmp.exists():
        tmp.unlink()
    if done:
        fsync_path(root)
    return done
