"""`--profile A:B`: torch.profiler traces of steps A to B (1-based, as in metrics.jsonl), one file per step
and rank, OUT/profile/step_N/rank_R.json: Chrome trace JSON, which Perfetto (ui.perfetto.dev) and
chrome://tracing open. Other steps run without a profiler."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

# Kineto, torch's profiler backend, prints this line on standard error at every profiler start and stop
# (`USDT:<date> <time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start`): above the ERROR
# level torch sets it to, and only its environment variable, read once, would lower it
_KINETO_USDT = re.compile(r"USDT:[^\n]*\] profiler_(?:start|stop)\n?")


def parse_steps(spec: str) -> tuple[int, int]:
    """"5:7" -> (5, 7), "5" -> (5, 5); a ValueError for anything else."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", spec)
    if match is None:
        raise ValueError("give steps as A:B (steps A to B) or A, counted from 1")
    first, last = int(match.group(1)), int(match.group(2) or match.group(1))
    if first < 1 or last < first:
        raise ValueError("give steps A:B with 1 <= A <= B")
    return first, last


def trace_path(out: Path, step: int, rank: int) -> Path:
    return Path(out) / "profile" / f"step_{step}" / f"rank_{rank}.json"


class StepProfiler:
    """Profiles the steps of `spec` (None: none) on this rank."""

    def __init__(self, spec: str | None, *, out: Path, rank: int, device: torch.device) -> None:
        self.steps = parse_steps(spec) if spec else None
        self.out, self.rank = Path(out), rank
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around optimizer step `step` (0-based, as the loop counts): a trace if it is one of the steps."""
        if self.steps is None or not self.steps[0] <= step + 1 <= self.steps[1]:
            yield
            return
        prof = profile(activities=self.activities, record_shapes=True)
        with _without_kineto_marks():
            prof.__enter__()
        try:
            yield
        finally:
            with _without_kineto_marks():
                prof.__exit__(None, None, None)
        path = trace_path(self.out, step + 1, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))


@contextlib.contextmanager
def _without_kineto_marks() -> Iterator[None]:
    """Standard error (the file descriptor, which C++ writes to) caught while the profiler starts or stops,
    then passed on without Kineto's profiler_start/profiler_stop lines: one per rank and step, noise among
    the run's lines. Anything else printed there, a real error included, still reaches standard error."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = _KINETO_USDT.sub("", caught.read().decode("utf-8", errors="replace"))
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()
