"""Checkpoints written in the background (checkpoint.async_save): the step's state is copied off the
training tensors, training goes on, and a thread gathers and writes the copy.

What is copied is only this rank's own part of the state: its pieces of the fp32 master weights and of
the optimizer's state tensors (its ZeRO slices, or its whole tensor-parallel parts without ZeRO), into CPU buffers kept
from one save to the next (pinned on a GPU, so the copy runs at full speed). The thread then assembles each
whole tensor from every rank's copies over the mesh's checkpoint groups (Mesh.checkpoint_groups: the same
ranks as the training groups, on gloo), so that its collectives never interleave with the training
thread's on one group, and the device takes no part in them.

At most one save is in flight: the next one, the end of the run and a stop signal wait for it, and an error
it met (a full disk: the same one-line StorageError as a save in the foreground) is raised there.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron import device as dev
from tetron.checkpoint.shards import Pieces
from tetron.parallel.zero import ShardedOptimizer


class Snapshot:
    """This rank's pieces of the master weights (and optimizer state) of every parameter, copied to the CPU; the
    buffers stay allocated for the next save."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, str, int], Tensor] = {}
        self.parts: dict[tuple[int, str], list[tuple[int, Tensor]]] = {}
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}

    @torch.no_grad()
    def take(self, optimizer: ShardedOptimizer, params: list[nn.Parameter], *, moments: bool,
             group: dist.ProcessGroup) -> Pieces:
        """Copy this rank's pieces now (the caller's step is done); the Pieces a save in the background
        gathers from, over `group` (dp*cp's checkpoint group)."""
        self.parts, self.ranges = {}, {id(p): optimizer.piece_ranges(p) for p in params}
        device = None
        for param in params:
            for kind in ("master", *(optimizer.state_names_of(param) if moments else ())):
                copies = []
                for j, (start, values) in enumerate(optimizer.local_parts(param, kind)):
                    key = (id(param), kind, j)
                    buf = self.buffers.get(key)
                    if buf is None or buf.shape != values.shape:
                        buf = self.buffers[key] = torch.empty(values.shape, dtype=torch.float32,
                                                              pin_memory=values.device.type == "cuda")
                    buf.copy_(values, non_blocking=True)
                    copies.append((start, buf))
                    device = values.device
                self.parts[(id(param), kind)] = copies
        if device is not None:
            dev.synchronize(device)  # on a GPU, the copies are complete before training changes the values
        return Pieces(parts=lambda param, kind: self.parts[(id(param), kind)], ranges=lambda p: self.ranges[id(p)],
                      sharded=optimizer.shards > 1, group=group, device=torch.device("cpu"), shard=optimizer.shards)


class BackgroundSaver:
    """One checkpoint write at a time on a thread of its own; its error is raised by the next `wait`."""

    def __init__(self) -> None:
        self.snapshot = Snapshot()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self, work: Callable[[], None]) -> None:
        self.wait()

        def body() -> None:
            try:
                work()
            except BaseException as err:  # raised in the training thread at its next wait
                self.error = err

        self.thread = threading.Thread(target=body, name="tetron-checkpoint", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Until the save in flight (if any) is written; raises what it failed with."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def __enter__(self) -> BackgroundSaver:
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        """The end of a run waits for its last save; an error already on its way out goes first."""
        if kind is None:
            self.wait()
        elif self.thread is not None:
            self.thread.join()


# The savers of callers that keep none of their own (bench/checkpoint.py), one per mesh, dropped with it.
_SAVERS: weakref.WeakKeyDictionary[Any, BackgroundSaver] = weakref.WeakKeyDictionary()


def saver_of(mesh: Any) -> BackgroundSaver:
    """The background saver of `mesh`'s ranks, made on first use."""
    if mesh not in _SAVERS:
        _SAVERS[mesh] = BackgroundSaver()
    return _SAVERS[mesh]


def wait_for_save() -> None:
    """Until every save that save_checkpoint started in the background without a saver of its caller's is
    written; raises what one failed with."""
    for saver in list(_SAVERS.values()):
        saver.wait()
