"""The run's ``train.log``: what its console shows, copied line by line.

The trainer talks to its user through ``print``, warnings and a progress bar, not through ``logging``
(which Hydra's ``train.log`` handler alone receives), so ``console_to_log`` copies ``sys.stdout`` and
``sys.stderr`` into the log file while a run lasts. A progress bar redraws its line with carriage
returns: the log gets each line as it was last drawn when it ended (the bar's final state, the
lines written above it), not every redraw. What C/C++ code writes straight to the file descriptors
(NCCL's and torch's native messages) reaches the console only.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path


class _LineLog:
    """Complete lines into an open file, each as its last carriage return left it."""

    def __init__(self, file):
        self.file = file
        self.pending = ""

    def feed(self, text: str) -> None:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            shown = line.rsplit("\r", 1)[-1]
            self.file.write(shown.rstrip() + "\n")
        if lines:
            self.file.flush()

    def close(self) -> None:
        if self.pending.rsplit("\r", 1)[-1].strip():
            self.feed("\n")


class _Tee:
    """A text stream that writes to ``stream`` and feeds the same text to a ``_LineLog``; everything
    else (``isatty``, ``fileno``, ``encoding``) is the stream's."""

    def __init__(self, stream, log: _LineLog):
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        self._log.feed(text)
        return n

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def console_to_log(path: Path):
    """Copy what is written to ``sys.stdout`` and ``sys.stderr`` into ``path`` (appended) while the
    block runs."""
    file = Path(path).open("a", encoding="utf-8")
    logs = _LineLog(file), _LineLog(file)  # one per stream: a bar's unfinished line never absorbs a print
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(saved[0], logs[0]), _Tee(saved[1], logs[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for log in logs:
            log.close()
        file.close()
