"""What one rank reports each step: a progress bar on the terminal and a JSON line in the run folder."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from tetron.errors import StorageError
from tetron.fs import write_text


def say(message: str) -> None:
    """One line of the run's story on the console (rank 0 or the launching process): `tetron: ...`; a
    progress bar on the terminal is cleared for it and drawn again below."""
    bar = ProgressBar.live
    if bar is not None and bar.bar is not None:
        bar.bar.clear()
    console_line(f"tetron: {message}")
    if bar is not None and bar.bar is not None:
        bar.bar.refresh()


def console_line(line: str) -> None:
    """`line` and its newline on stdout in one write, past Python's buffer: a rank forked (the launcher forks from
    one thread while its watcher prints from another) while the line sat in the buffer would print it again, with
    its own next line glued on ("...resuming from step_2tetron: resumed from ...")."""
    stream = sys.stdout
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (captured, redirected to text)
        print(line, file=stream, flush=True)
        return
    stream.flush()  # what was printed before stays before
    data = (line + "\n").encode(getattr(stream, "encoding", None) or "utf-8", "replace")
    while data:
        data = data[os.write(fd, data):]


def mfu(tokens_per_s: float, flops_per_token: float, *, peak_tflops: float | None, world_size: int) -> float | None:
    """Model FLOP utilisation: achieved training FLOP/s over the peak of all ranks, None when unknown."""
    if not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12 * world_size)


def duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class ProgressBar:
    """On a terminal, a tqdm bar redrawn in place (rate, elapsed, ETA, the fields); elsewhere (logs, CI) one
    plain line every `every` steps, and at the first and last, with the elapsed time and the ETA."""

    live: ProgressBar | None = None  # the bar on this process's terminal, which `say` clears and redraws

    def __init__(self, total: int, *, every: int = 1, first: int = 0, stream: TextIO = sys.stdout) -> None:
        self.total, self.every, self.first, self.stream = total, every, first, stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            # A thread lock, not tqdm's default multiprocessing one: a rank ended by os._exit would leak that
            # one's semaphore, and the resource tracker would say so after tetron's last line.
            tqdm.set_lock(threading.RLock())
            # initial: a resumed run's ETA comes from the steps this launch runs
            self.bar = tqdm(total=total, initial=first, file=stream, unit="step", dynamic_ncols=True, mininterval=0,
                            bar_format="{l_bar}{bar}| {n}/{total} [{elapsed}<{remaining}, {rate_fmt}]{postfix}")
            ProgressBar.live = self

    def update(self, step: int, fields: dict[str, Any]) -> None:
        """Step `step` (1-based) is done; `fields` (name -> text) describe it."""
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(step - self.bar.n)
            if step == self.total:
                self.close()
            return
        if not (step == self.total or step % self.every == 0 or step == self.first + 1):
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(step - self.first, 1) * (self.total - step)
        self.stream.write(f"step {step}/{self.total} {text} | {duration(elapsed)}, ETA {duration(eta)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if ProgressBar.live is self:
            ProgressBar.live = None


def check_log_file(path: Path) -> None:
    """OUT/metrics.jsonl is absent or a regular file (a folder or a FIFO there would fail rank 0 once the
    ranks have started, or block it): checked before any rank starts, and again where it is opened."""
    if (path.exists() or path.is_symlink()) and not path.is_file():
        kind = "a folder" if path.is_dir() else "a link to nothing" if not path.exists() else "not a regular file"
        raise StorageError(f"out: {path} is {kind}, where the run appends its log; move it aside or give another out")


class MetricsLog:
    """Appends one JSON object per step to OUT/metrics.jsonl, flushed so a killed run keeps its history."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        check_log_file(path)
        try:
            self.file = open(path, "a", encoding="utf-8")
        except OSError as err:
            raise StorageError(f"{path}: cannot open it to append ({err.strerror}); fix it or give another "
                               f"out") from None

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
    check_log_file(path)
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
