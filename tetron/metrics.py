"""What one rank reports each step: a progress bar on the terminal and a JSON line in the run folder."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tetron.errors import StorageError
from tetron.fs import write_text


def say(message: str) -> None:
    """One line of the run's story on the console (rank 0 or the launching process): `tetron: ...`."""
    print(f"tetron: {message}", flush=True)


def mfu(tokens_per_s: float, flops_per_token: float, *, peak_tflops: float | None, world_size: int) -> float | None:
    """Model FLOP utilisation: achieved training FLOP/s over the peak of all ranks, None when unknown."""
    if not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * world_size)


class ProgressBar:
    """One line redrawn in place on a terminal; a plain line every `every` steps elsewhere (logs, CI)."""

    def __init__(self, total: int, *, every: int = 1, stream: TextIO = sys.stdout) -> None:
        self.total, self.every, self.stream = total, every, stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, fields: dict[str, Any]) -> None:
        done = step == self.total
        if not (done or step % self.every == 0 or step == 1):
            return
        width = 24
        filled = int(width * step / self.total)
        elapsed = time.perf_counter() - self.start
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        line = f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} {text} | {elapsed:.0f}s"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if done else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class MetricsLog:
    """Appends one JSON object per step to OUT/metrics.jsonl, flushed so a killed run keeps its history."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as err:  # a full disk: one line naming the log, not a stack
            raise StorageError(f"{self.path}: cannot write the step's record ({err.strerror}); free space or "
                               f"fix it, then --resume auto") from None

    def close(self) -> None:
        self.file.close()


def trim_after(path: Path, step: int) -> None:
    """Resuming at `step` into a run folder whose log goes further: the later records (and a line torn
    by a kill) belong to the abandoned attempt. Move the whole old log aside, keep steps 1..step."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step and line.endswith("\n"):
            keep.append(line)
    if len(keep) == len(lines):
        return
    shutil.copyfile(path, path.with_name(f"metrics.before-resume-{step}.jsonl"))
    write_text(path, "".join(keep))
