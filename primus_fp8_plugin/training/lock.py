"""Directory locks: one live run per logging directory and per checkpoint directory.

A lock is the file ``<dir>/run.lock`` (JSON: pid, host, the process's start time, when, the run's
output directory and command line), created exclusively (``O_CREAT | O_EXCL``, atomic also on NFS).
A lock whose process is gone is stale and taken over: on the same host, when no process has its pid,
or one has but started at another time (the pid was reused). A lock held from another host cannot be
checked from here: it refuses, and the message says which file to delete once that run has ended.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "run.lock"


class DirectoryLockedError(RuntimeError):
    """Another live run holds the directory; the message names it."""


def _process_start(pid: int) -> float | None:
    """The start time of process ``pid`` (seconds since the epoch), None when there is none."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return -1.0  # exists, but its start time cannot be read: treat as alive


def holder_alive(info: dict) -> bool | None:
    """Whether the process a lock names runs: True/False on this host, None from another host."""
    if not info:
        return False  # empty or unreadable for seconds: its process died while writing it
    if info.get("host") != socket.gethostname():
        return None
    pid = info.get("pid")
    if not isinstance(pid, int):
        return False
    started = _process_start(pid)
    if started is None:
        return False
    recorded = info.get("pid_started")
    # a pid reused by a later process (containers reuse small pids): its start time differs
    return started == -1.0 or not isinstance(recorded, (int, float)) or abs(started - recorded) < 1.0


def describe(info: dict) -> str:
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    command = " ".join(info.get("command") or [])
    return f"pid {info.get('pid')} on host {info.get('host')}, started {when}" + (f" ({command})" if command else "")


@dataclass
class DirectoryLock:
    """The lock of ``directory`` held by this process (``acquire``), released by ``release``."""

    path: Path
    took_over: dict | None = None  # the stale lock this one replaced

    @classmethod
    def acquire(cls, directory: Path, what: str, run_dir: str = "") -> DirectoryLock:
        """Lock ``directory`` (made if missing) for this process. ``what`` names the setting
        (``logging.dir``) in the message when another live run holds it (DirectoryLockedError)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        me = {
            "pid": os.getpid(), "host": socket.gethostname(), "pid_started": _process_start(os.getpid()),
            "started": time.time(), "run_dir": run_dir, "command": list(sys.argv),
        }  # fmt: skip
        took_over = None
        for _ in range(50):  # each round either takes the lock, refuses, or removes one stale lock
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
                    f.flush()
                    os.fsync(f.fileno())
                return cls(path, took_over)
            info = _read(path)
            if info is None:
                continue  # removed meanwhile: try again
            if not info and _age(path) < 5.0:  # being written by a process that created it just now
                time.sleep(0.2)
                continue
            alive = holder_alive(info)
            if info.get("pid") == me["pid"] and info.get("host") == me["host"]:
                raise DirectoryLockedError(
                    f"{what}: {directory} is already in use by an earlier run of this process (a job of this "
                    f"sweep: its output directory {info.get('run_dir')}); give each run its own {what}"
                )
            if alive is not False:
                tail = (
                    "wait for it to end or choose another directory"
                    if alive
                    else f"it runs on another host, which this one cannot check; once it has ended, delete {path}"
                )
                raise DirectoryLockedError(f"{what}: {directory} is in use by another run: {describe(info)}; {tail}")
            # stale: move exactly this file aside (one of several racing processes wins the rename)
            aside = path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            if _read(aside) != info:  # another process's fresh lock: put it back and look again
                os.rename(aside, path)
                continue
            aside.unlink()
            took_over = info
        raise DirectoryLockedError(f"{what}: could not lock {directory} ({path} keeps changing); try again")

    def release(self) -> None:
        """Remove the lock file if it is still this process's."""
        info = _read(self.path)
        if info is not None and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _read(path: Path) -> dict | None:
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # unreadable (a half-written lock of a killed process): stale on this host
    return info if isinstance(info, dict) else {}
