"""Around each training step, what watches it without changing it: the per-axis timers (timers.py), the
profiler (profiling.py) and the validation loss (evaluate.py). Every rank runs this; it adds figures to
rank 0's step record."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor, nn

from tetron.config import Config
from tetron.data.tokenizer import Tokenizer
from tetron.mesh import Mesh
from tetron.observe.evaluate import build_evaluator
from tetron.observe.profiling import StepProfiler
from tetron.parallel.timers import StepTimers


class StepObservers:
    """The run's observers, each present only when its setting asks for it."""

    def __init__(self, cfg: Config, mesh: Mesh, chunks: list[nn.Module], tokenizer: Tokenizer, *,
                 device: torch.device, dtype: torch.dtype, positions: Tensor) -> None:
        self.cfg = cfg
        self.timers = StepTimers(mesh, device) if cfg.logging.timers else None
        self.profiler = StepProfiler(cfg.logging.profile, out=Path(cfg.out), rank=mesh.rank, device=device)
        self.evaluator = build_evaluator(cfg, mesh, chunks, tokenizer, device=device, dtype=dtype,
                                         positions=positions)
        self.seconds: dict[str, float] = {}  # the last step's timers on this rank (before the max over ranks)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around optimizer step `step` (0-based): its profile and its timers."""
        with self.profiler.step(step), self.timers.step() if self.timers else contextlib.nullcontext():
            yield
        if self.timers:
            self.seconds = dict(self.timers.seconds)

    def figures(self, step: int) -> dict[str, float]:
        """After step `step`: the timers' maximum over ranks, and on evaluation steps the validation loss
        (every eval_every steps, and the last). Every rank calls this: both are collectives."""
        out: dict[str, float] = {}
        if self.timers:
            out.update(self.timers.figures())
        every, steps = self.cfg.train.eval_every, self.cfg.train.steps
        if self.evaluator is not None and ((step + 1) % every == 0 or step + 1 == steps):
            loss = self.evaluator()
            out["val_loss"] = loss
            out["val_ppl"] = math.exp(min(loss, 700.0))  # exp overflows past ~709
        return out
