"""ZeRO-3 (`parallel.zero: 3`): parameters sharded like the optimizer state (zero.py), gathered whole only
while their unit (a decoder layer, or the rest of a chunk) runs forward or backward, then freed.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch import Tensor, nn

from tetron.models.spec import spec_of
from tetron.parallel.comm import all_gather_flat
from tetron.parallel.data_parallel import DataParallelBucket, _Bucket, weak_hook
from tetron.parallel.storage_pool import StoragePool
from tetron.parallel.timers import timer


def units_of(chunk: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """ZeRO-3's units of one model chunk, in forward order: the chunk itself with the parameters
    outside its decoder layers (embedding, final norm, head: used first and last), then each decoder
    layer with its own. A unit's parameters are gathered whole only while it runs (FSDP2's choice
    of one unit per transformer block)."""
    layers = list(spec_of(chunk.config).plan.layers_of(chunk).values())
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in chunk.parameters() if p.requires_grad and id(p) not in in_layers]
    return [(chunk, root)] + [(layer, [p for p in layer.parameters() if p.requires_grad]) for layer in layers]


class _Unit:
    """One ZeRO-3 unit: its bucket (gradients, the flat parameter buffer, this rank's slice of it)."""

    def __init__(self, bucket: _Bucket, dp: DataParallelBucket, sharding: ParameterSharding) -> None:
        self.bucket, self.dp, self.sharding = bucket, dp, sharding
        self.flat: Tensor = bucket.params_flat  # its storage is empty except while gathered
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.gathered = False
        self.work: dist.Work | None = None  # a prefetch in flight
        self.waiting = 0  # parameters whose gradient this backward has not produced yet

    def accumulated(self, param: nn.Parameter) -> None:
        """A parameter's gradient is complete: once all of them are, the gathered unit is freed."""
        self.waiting -= 1
        if self.waiting == 0:
            self.sharding.free(self)


class ParameterSharding:
    """ZeRO-3: between uses a rank keeps only its slice of each unit's parameters.

    Forward: a unit's pre-hook gathers its parameters (all-gather of the slices into the flat buffer
    the parameters view) and starts gathering the next unit's, so that transfer overlaps this unit's
    compute; its post-hook frees them (the buffer's storage is resized to nothing: the parameters
    keep their shapes, autograd keeps its references; its memory goes to a pool, storage_pool.py, for
    the next gather of a unit that size) and hooks the unit's output. Backward: that
    hook gathers the unit again (and prefetches the unit before it) just before its backward begins,
    and gives it its gradient buffer; once every parameter of the unit has its gradient, the
    parameters are freed again, and data parallelism reduce-scatters the gradients. A backward split
    into B and W (zbh1, zbv) accumulates nothing in B: the pipeline, finding this as the chunk's
    `sharding`, frees the chunk after B; W reads no parameter (dW = dY^T X), so runs on the slices.

    Each bucket is gathered over its own group: the shard group, or for a unit's expert shards (a bucket, and
    so a unit, of their own on the same module, whose hooks run beside the rest's) the ranks sharing their
    experts; where that is this rank alone, "gathering" copies its slice, the whole, into the buffer."""

    def __init__(self, dp_chunks: list[DataParallelBucket]) -> None:
        self.pool = StoragePool(dp_chunks[0].buckets[0].device)
        self.order: list[list[_Unit]] = []  # per chunk, the units in forward order
        for dp in dp_chunks:
            units = [_Unit(bucket, dp, self) for bucket in reversed(dp.buckets)]  # buckets are in backward order
            self.order.append(units)
            dp.sharding = self
            for i, unit in enumerate(units):
                after = units[i + 1] if i + 1 < len(units) else None
                # Backward prefetches the unit before, but never the chunk's own (units[0]): the hook
                # on the chunk's output gathers it first thing, and a pipeline stage's last use of it
                # (its head) comes first, so a prefetch then would outlive the step.
                before = units[i - 1] if i > 1 else None
                unit.bucket.module.register_forward_pre_hook(self._pre_forward(unit, after))
                unit.bucket.module.register_forward_hook(self._post_forward(unit, before))
                for p in unit.bucket.params:
                    p.register_post_accumulate_grad_hook(weak_hook(unit.accumulated))
                unit.flat.untyped_storage().resize_(0)  # the whole model's memory: released, not pooled

    def gather(self, unit: _Unit, *, async_op: bool = False) -> None:
        if unit.gathered or unit.work is not None:
            if unit.work is not None and not async_op:
                with timer("dp"):  # the gathers ride on dp*cp's groups: waiting for one is that axis' time
                    unit.work.wait()
                unit.work, unit.gathered = None, True
            return
        self.pool.fill(unit.flat.untyped_storage(), unit.nbytes)
        with timer("dp") if not async_op else contextlib.nullcontext():
            work = all_gather_flat(unit.flat, unit.bucket.params_slice, group=unit.bucket.group, async_op=async_op)
        if async_op:
            unit.work = work
        else:
            unit.gathered = True

    def free_all(self) -> None:
        """Every unit back to its slice (before the optimizer updates the slices)."""
        for units in self.order:
            for unit in units:
                self.free(unit)

    def release(self, chunk: DataParallelBucket) -> None:
        """Every unit of `chunk` back to its slice."""
        for unit in next(units for units in self.order if units and units[0].dp is chunk):
            self.free(unit)

    def free(self, unit: _Unit) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        self.pool.empty(unit.flat.untyped_storage())
        unit.gathered = False

    def _pre_forward(self, unit: _Unit, after: _Unit | None):
        def hook(module: nn.Module, args: tuple) -> None:
            self.gather(unit)
            if after is not None:
                self.gather(after, async_op=True)
        return hook

    def _post_forward(self, unit: _Unit, before: _Unit | None):
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            if isinstance(output, Tensor) and output.requires_grad:
                output.register_hook(self._pre_backward(unit, before))
            self.free(unit)
        return hook

    def _pre_backward(self, unit: _Unit, before: _Unit | None):
        def hook(grad: Tensor) -> None:
            self.gather(unit)
            unit.dp.attach(unit.bucket)
            unit.waiting = len(unit.bucket.params)
            if before is not None:
                self.gather(before, async_op=True)
        return hook
