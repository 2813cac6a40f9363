"""Measuring a layout on the machine at hand: per-rank peak memory and step time, to set beside the plan.

The measured memory is the same quantity the memory model predicts: the bytes of tensors a rank has
allocated since it started (parameters, gradients, optimizer state, activations, temporaries: everything
torch allocates), at the worst moment of a steady-state step. On a GPU that is the caching allocator's
`max_memory_allocated` (tetron.device.peak_memory_mb). On the CPU, `LiveTensorBytes` counts it: every
storage an operator creates is remembered (through a dispatch mode), its death noticed (through a weak
reference, on whatever thread frees it, so gloo's worker threads do not skew it), and after each
operator the live storages' current sizes are added up (ZeRO-3 resizes flat buffers in place). The
profiler's allocation counter would be cheaper but misses frees on gloo's threads; the resident set
(peak_mem_mb in metrics.jsonl) also holds the interpreter, libraries and allocator caches.

`measure_rank` runs on each rank of an existing process group (the tests' forked ranks); `measure`
starts the ranks through torch's elastic launcher, as `tetron train` does, and collects their results.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import tempfile
import time
import uuid
import weakref
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from tetron import device as dev
from tetron.config import Config, from_dict
from tetron.mesh import Mesh
from tetron.torch_private import TorchDispatchMode, tree_leaves
from tetron.train import build_run, train_step


class LiveTensorBytes(TorchDispatchMode):
    """Inside `with`: the bytes of the tensor storages created since entering and still alive (`live`),
    and their most at any operator boundary since the last `reset_peak` (`peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self._alive: dict[int, weakref.ref] = {}  # id of a storage -> a weak reference to it
        self.live = 0
        self.peak = 0

    def _dead(self, key: int, _ref: weakref.ref) -> None:
        self._alive.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._alive:  # a Python storage object lives as long as its memory
                    self._alive[key] = weakref.ref(storage, functools.partial(self._dead, key))
        live = 0
        for ref in list(self._alive.values()):  # a snapshot: another thread may free meanwhile
            storage = ref()
            if storage is not None:
                live += storage.nbytes()
        self.live = live
        self.peak = max(self.peak, live)
        return out

    def reset_peak(self) -> None:
        self.peak = self.live


def _quiet(cfg: Config, out: str) -> Config:
    """The run as measured: no progress bar, no sample, its own run folder, no checkpoint to resume."""
    return replace(cfg, out=out, logging=replace(cfg.logging, progress=False, sample_tokens=0),
                   checkpoint=replace(cfg.checkpoint, resume=None, save_every=0))


def measure_rank(raw: dict[str, Any], *, steps: int = 3, timed_steps: int = 3, local_rank: int = 0) -> dict[str, Any]:
    """On one rank of a process group: build the run, train `steps` steps measuring memory (the peak over
    all but the first, which has no optimizer state yet), then `timed_steps` more, timed. Returns this
    rank's coordinates, peak tensor bytes, the median step time and this rank's state figures (mem_*)."""
    cfg = from_dict(raw)
    p = cfg.parallel
    device = dev.pick_device(p.device, local_rank)
    mesh = Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, dp_shard=p.dp_shard, device_type=device.type)
    tracker = LiveTensorBytes() if device.type == "cpu" else None
    with tracker or contextlib.nullcontext():
        run = build_run(cfg, mesh, device)
        peak, state = 0, None
        for step in range(steps):
            if tracker:
                tracker.reset_peak()
            dev.reset_peak_memory(device)
            figures = train_step(run, step, measure_memory=step == 1)
            state = figures.memory or state
            if step >= 1:
                peak = max(peak, tracker.peak if tracker else int(dev.peak_memory_mb(device) * 2**20))
    times = []
    for step in range(steps, steps + timed_steps):
        start = time.perf_counter()
        train_step(run, step)
        times.append(time.perf_counter() - start)
    coords = {axis: mesh.local_rank(axis) for axis in ("pp", "dp", "cp", "tp")}
    return {"rank": mesh.rank, **coords, "peak_bytes": peak, "step_s": statistics.median(times), "state": state}


def _launched(raw: dict[str, Any], steps: int, timed_steps: int) -> dict[str, Any]:
    """Entry point of a rank started by the elastic launcher: like launch.run_rank, the start-up reads
    the launcher's environment, sizes the CPU threads and joins the group."""
    from tetron.launch import init_process_group, setup_rank_process

    cfg = from_dict(raw)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = dev.pick_device(cfg.parallel.device, local_rank)
    # threads and glibc's allocator as under `tetron train`, so the step times are its
    setup_rank_process(cfg, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    init_process_group(device, timeout_s=cfg.parallel.timeout_s, restart=0)
    try:
        return measure_rank(raw, steps=steps, timed_steps=timed_steps, local_rank=local_rank)
    finally:
        dist.destroy_process_group()


def measure(cfg: Config, *, steps: int = 3, timed_steps: int = 3) -> list[dict[str, Any]]:
    """Run `cfg` on its world size on this machine (ranks started by torch's elastic launcher; forked
    on the CPU, where that starts them in a fraction of a second) and return every rank's figures."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="tetron-measure-") as out:
        raw = _quiet(cfg, out).to_dict()
        # the ranks' own lines (model size, data) go to files: what `tetron plan` prints is its table
        logs = DefaultLogsSpecs(log_dir=os.path.join(out, "logs"), redirects=Std.ALL)
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.world_size, run_id=str(uuid.uuid4()),
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                              monitor_interval=0.1, start_method=dev.rank_start_method(cfg.parallel.device),
                              logs_specs=logs)
        results = elastic_launch(config, _launched)(raw, steps, timed_steps)
    return [results[r] for r in sorted(results)]
