"""Per-rank logs: each rank's output also goes to OUT/logs/rank_N.log, so that what any rank of any node
printed (a traceback, a NCCL or gloo warning) can be read afterwards from the run folder.

The copy is made at the file descriptors (1 and 2), by a `tee -a` process per stream, so it holds what
C++ and child processes print as well as Python's output, and it is complete even when the rank ends
with os._exit or is killed: `tee` writes out what it has read once the rank's end of the pipe closes.
The tee processes ignore the stop signals (a Ctrl-C, Slurm's SIGTERM) that the rank turns into a saved
checkpoint, so the rank can still say where it stopped. Standard output is copied unless it is a
terminal: there it is what the user watches, and the progress bar needs to know it is one; standard
error is always copied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# the shell ignores the signals before it becomes tee (ignored signals stay ignored across exec)
_TEE = 'trap "" INT TERM HUP USR1 USR2; exec tee -a "$0"'


class RankLog:
    """This process's stdout and stderr copied to `path` until `restore()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.saved: dict[int, int] = {}  # stream fd -> a duplicate of what it was before
        self.tees: list[subprocess.Popen] = []

    @classmethod
    def start(cls, out: Path, rank: int, *, attempt: int = 0) -> RankLog:
        log = cls(Path(out) / "logs" / f"rank_{rank}.log")
        if shutil.which("tee") is None:  # nothing to copy with: the output still reaches the terminal
            return log
        log.path.parent.mkdir(parents=True, exist_ok=True)
        if attempt:
            with open(log.path, "a", encoding="utf-8") as f:
                f.write(f"--- restart {attempt} ---\n")
        for fd in (1, 2):
            if fd == 1 and os.isatty(fd):
                continue
            log._copy(fd)
        return log

    def _copy(self, fd: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        tee = subprocess.Popen(["sh", "-c", _TEE, str(self.path)], stdin=subprocess.PIPE, stdout=fd,
                               start_new_session=True)
        self.saved[fd] = os.dup(fd)
        os.dup2(tee.stdin.fileno(), fd)
        tee.stdin.close()  # the stream's fd is now the pipe's only writer here
        self.tees.append(tee)

    def restore(self) -> None:
        """Put the streams back; the tee processes end once they have written everything."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self.saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self.saved.clear()
        for tee in self.tees:
            try:
                tee.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a child of the rank still holds the pipe: leave it to finish
                pass
        self.tees.clear()
