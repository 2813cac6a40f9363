"""Around each training step, what watches it without changing it: the per-axis timers (timers.py) and the
profiler (profiling.py). Every rank runs this; it adds figures to rank 0's step record. (Validation is a
line of the loop of its own: evaluate.py.)"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from tetron.config import Config
from tetron.mesh import Mesh
from tetron.observe.profiling import StepProfiler
from tetron.parallel.timers import StepTimers


class StepObservers:
    """The run's observers, each present only when its setting asks for it."""

    def __init__(self, cfg: Config, mesh: Mesh, *, device: torch.device) -> None:
        self.timers = StepTimers(mesh, device) if cfg.logging.timers else None
        self.profiler = StepProfiler(cfg.logging.profile, out=Path(cfg.out), rank=mesh.rank, device=device)
        self.seconds: dict[str, float] = {}  # the last step's timers on this rank (before the max over ranks)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around optimizer step `step` (0-based): its profile and its timers."""
        with self.profiler.step(step), self.timers.step() if self.timers else contextlib.nullcontext():
            yield
        if self.timers:
            self.seconds = dict(self.timers.seconds)

    def figures(self) -> dict[str, float]:
        """After a step: the timers' maximum over ranks. Every rank calls this: it is a collective."""
        return dict(self.timers.figures()) if self.timers else {}
