"""Per-step timers: where a step's time goes, compute or waiting on each axis' communication.

`with timer("dp"):` (or `timer(group)`, naming the axis by its process group) wraps a blocking wait
in the parallel code. While a step is timed (`StepTimers.step()`), every moment of it counts for
exactly one category: the innermost open section, else compute. So the categories add up to the
step's time, and a wait nested in another (a tp collective inside a pipeline stage) is not counted
twice. Off (`logging.timers: false`) `timer` returns one shared null context: an attribute read, no
clock, no synchronisation. On CUDA, collectives run on their own streams, so a timed section first
synchronizes (the work queued before it is compute) and again at its end (the wait is over when the
transfer is).

The active timers are a module-level reference rather than an argument: the waits live in autograd
functions and gradient hooks, called by the autograd engine (on CUDA from its own threads), where no
argument reaches; like torch.profiler's record_function, it observes the computation and never
changes it.
"""

from __future__ import annotations

import contextlib
import time
from typing import ContextManager, Iterator

import torch
import torch.distributed as dist

from tetron import device as dev
from tetron.mesh import Mesh

AXES = ("dp", "tp", "pp", "cp", "ep")
CATEGORIES = ("compute", *AXES)  # compute: whatever is not a timed wait (the loss all-reduce included)
_OFF = contextlib.nullcontext()
_active: StepTimers | None = None  # the timers of the step in progress in this process, None when off


def timer(key: str | dist.ProcessGroup | None) -> ContextManager:
    """A section of the current step spent waiting on `key`'s communication: an axis name ("dp", "tp",
    "pp", "cp") or the process group of one. A null context when no step is timed."""
    timers = _active
    if timers is None:
        return _OFF
    axis = key if isinstance(key, str) else timers.axis_of.get(id(key))
    return _OFF if axis is None else _Section(timers, axis)


class _Section:
    def __init__(self, timers: StepTimers, axis: str) -> None:
        self.timers, self.axis = timers, axis

    def __enter__(self) -> None:
        self.timers.switch(self.axis)

    def __exit__(self, *exc: object) -> None:
        self.timers.switch(None)


class StepTimers:
    """Seconds per category of the step being timed, on this rank."""

    def __init__(self, mesh: Mesh, device: torch.device) -> None:
        self.mesh = mesh
        self.sync = device.type == "cuda"
        self.device = device
        # the groups of the axes; dp*cp (gradients), HSDP's shard and replicate groups and the expert shards'
        # gradient groups (edp, edp_shard) count as dp, the tied-embedding pair as pp; ep is the tokens' all-to-all
        named = {**{axis: axis for axis in AXES}, "dp_cp": "dp", "dp_shard": "dp", "dp_replicate": "dp",
                 "edp": "dp", "edp_shard": "dp", "embed": "pp"}
        self.axis_of = {id(mesh.group(name)): axis for name, axis in named.items() if mesh.group(name) is not None}
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.stack: list[str] = []
        self.current, self.mark = "compute", 0.0

    def switch(self, axis: str | None) -> None:
        """Close the running category's interval and open `axis`'s (None: back to the enclosing one)."""
        if self.sync:
            dev.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[self.current] += now - self.mark
        if axis is None:
            self.current = self.stack.pop()
        else:
            self.stack.append(self.current)
            self.current = axis
        self.mark = now

    @contextlib.contextmanager
    def step(self) -> Iterator[StepTimers]:
        """Time the block as one step; `seconds` then holds its breakdown on this rank."""
        global _active
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.stack, self.current, self.mark = [], "compute", time.perf_counter()
        _active = self
        try:
            yield self
        finally:
            _active = None
            self.seconds[self.current] += time.perf_counter() - self.mark

    def figures(self) -> dict[str, float]:
        """The last step's seconds per category, the maximum over all ranks (one all-reduce of a few
        floats), named time_<category>_s, for compute and the axes this run has (every rank calls it)."""
        values = torch.tensor([self.seconds[c] for c in CATEGORIES], dtype=torch.float64, device=self.device)
        if self.mesh.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        # gradients are averaged over dp*cp: that sync is dp's time wherever dp*cp > 1
        used = {"compute", *(a for a in AXES if self.mesh.size("dp_cp" if a == "dp" else a) > 1)}
        return {f"time_{c}_s": float(v) for c, v in zip(CATEGORIES, values.tolist()) if c in used}
