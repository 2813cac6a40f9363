"""Data parallelism: every rank holds the whole (stage of the) model and sees its own rows of the
batch; gradients are averaged over the dp*cp group before the optimizer step.

Two implementations of the same contract:
- `DataParallelNaive`: one blocking all-reduce per parameter, from a hook that fires once the
  parameter's gradient is fully accumulated. Simple, and slow: many small messages, no overlap.
- `DataParallelBucket`: the gradients live in fp32 buffers grouped into buckets of ~`bucket_mb`.
  A bucket's all-reduce starts asynchronously as soon as its last gradient is ready, so
  communication overlaps the rest of the backward pass; all are awaited at the end of backward.

Both skip communication inside `no_sync()`, so with gradient accumulation the micro-batches
before the last only accumulate locally and the sync happens once per optimizer step. Except under
ZeRO-2/3 with `parallel.zero_accumulate: sharded` (the default): there every micro-batch's buckets are
reduce-scattered as its backward goes, each added into this rank's fp32 slice, and the full buffers
are released in between, so what persists through accumulation is 1/N of the gradients (FSDP2's and
DeepSpeed's default), for N-1 more reduce-scatters a step than `full` (one reduction from whole buffers).
(Averages add up: the sum over micro-batches of each one's average over the ranks is the average of sums.)

HSDP (`parallel.dp_shard` < dp*cp): the reduce-scatter runs within the shard group, and the last
micro-batch's reduced slices (1/dp_shard of the data) are then averaged across the replicate group.

Under expert parallelism (expert_parallel.py) the expert shards' gradients are divided by ep as they are
reduced (expert_parallel.py says why) and averaged over `expert_group` (the edp ranks holding the same
experts) instead, in buckets of their own, each bucket knowing its group. Under ZeRO they are sharded over
`expert_shard_group` (edp; under HSDP its ranks in this rank's shard group, and averaged across the replicas
like the rest). Where that group is this rank alone, the expert buckets stay whole (nothing to shard) and
are reduced (divided, averaged across replicas) once a step, from their accumulated buffer.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from tetron.config import DpImpl, ZeroAccumulate
from tetron.parallel.comm import reduce_scatter_flat
from tetron.parallel.layout import layout_of
from tetron.parallel.timers import timer
from tetron.torch_private import queue_after_backward

# Gloo and NCCL both average natively; a sum followed by a division would cost an extra pass.
AVG = dist.ReduceOp.AVG



def weak_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (bound) as a parameter's gradient hook that does not keep its object alive. A tensor holds
    its hooks on its C++ side, where Python's collector does not look: a hook bound to the wrapper that
    holds the module that holds the tensor is a cycle never freed, and every run built in one process
    (a benchmark's cases, a notebook's second run) kept its whole model, gradients and buckets."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


class DataParallel(nn.Module):
    """Shared plumbing: the wrapped module, the group, the sync switch and a collective counter."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.expert_group = expert_group or group  # where expert shards' gradients are averaged
        self.world = dist.get_world_size(group)
        self.require_sync = True
        self.num_collectives = 0  # gradient reductions issued so far (what tests and benchmarks count per step)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the backward pass inside this block communicates nothing."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _group_of(self, param: nn.Parameter) -> dist.ProcessGroup:
        return self.group if layout_of(param).ep is None else self.expert_group

    def _all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, *,
                    async_op: bool = False) -> dist.Work | None:
        """Average `tensor` over `group`."""
        self.num_collectives += 1
        return dist.all_reduce(tensor, op=AVG, group=group, async_op=async_op)


class DataParallelNaive(DataParallel):
    """An all-reduce (average) hook on every parameter's gradient."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *,
                 expert_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(module, group, expert_group=expert_group)
        if self.world > 1:
            for p in self._params():
                p.register_post_accumulate_grad_hook(weak_hook(self._hook))

    def _hook(self, param: nn.Parameter) -> None:
        if self.require_sync:
            experts = layout_of(param).ep
            if experts is not None:  # the step's accumulated expert gradient: 1/ep of it (expert_parallel.py)
                param.grad.div_(experts.count)
            with timer("dp"):
                self._all_reduce(param.grad, self._group_of(param))


class _Bucket:
    """A flat fp32 buffer holding the gradients of some parameters, reduced as one message.

    The buffer is padded to a multiple of `shards`; with more than one shard (ZeRO), rank r's
    reduced gradients are its slice r, received by an in-place reduce-scatter, and kept in a
    `shard_grad` of their own when the full buffer is released after the reduction (ZeRO-2/3).
    The parameters lie one after another, cut by the slices wherever they fall; with `whole` (an optimizer
    that needs whole matrices) each lies whole in the slice of one owner rank instead, the slices as long
    as the fullest one (`owners`, balanced with the earlier whole buckets' `loads`), the rest of each padding. A
    bucket made from a unit (ZeRO-3: a decoder layer, or the rest of the chunk) knows its `module`. It is
    averaged (and sharded) over `group`, then under HSDP averaged over `replicate`."""

    def __init__(self, params: list[nn.Parameter], device: torch.device, *, shards: int, rank: int = 0,
                 separate_shard: bool = False, module: nn.Module | None = None, allocate: bool = True,
                 group: dist.ProcessGroup | None = None, replicate: dist.ProcessGroup | None = None,
                 whole: bool = False, loads: list[int] | None = None) -> None:
        self.params, self.module = params, module
        self.group, self.replicate = group, replicate
        self.world = dist.get_world_size(group) if group is not None else 1
        self.offsets: dict[nn.Parameter, int] = {}  # where each parameter starts in the buffer
        if whole and shards > 1:
            owner = owners([p.numel() for p in params], shards, loads)
            self.slice_size = max(sum(p.numel() for p, q in zip(params, owner) if q == r) for r in range(shards))
            filled = [r * self.slice_size for r in range(shards)]
            for p, q in zip(params, owner):
                self.offsets[p], filled[q] = filled[q], filled[q] + p.numel()
            self.padded = self.slice_size * shards
        else:
            numel = 0
            for p in params:
                self.offsets[p] = numel
                numel += p.numel()
            self.padded = -(-numel // shards) * shards
            self.slice_size = self.padded // shards
        self.mine = slice(rank * self.slice_size, (rank + 1) * self.slice_size)  # this rank's slice
        self.device = device
        self.buffer: torch.Tensor | None = (torch.zeros(self.padded, dtype=torch.float32, device=device)
                                            if allocate else None)
        self.shard_grad = (torch.zeros(self.slice_size, dtype=torch.float32, device=device)
                           if shards > 1 and separate_shard else None)
        self.shards, self.sharded = shards, shards > 1
        experts = layout_of(params[0]).ep if params else None
        self.scale = 1.0 / experts.count if experts is not None else 1.0  # expert shards: 1/ep, as reduced
        self.pending: set[nn.Parameter] = set(params)
        self.fresh = True  # no reduction yet this step: the next one writes the slice, later ones add to it
        self.reducing = False  # a reduction started and not yet completed
        self.handle: dist.Work | None = None
        self.after_wait: Callable[[], None] | None = None  # copies a lower-precision reduction back

    def reduced_grad(self) -> torch.Tensor:
        """The averaged gradients this rank keeps: its slice (ZeRO), else the whole buffer."""
        if self.shard_grad is not None:
            return self.shard_grad
        return self.buffer[self.mine] if self.sharded else self.buffer


def owners(numels: list[int], shards: int, loads: list[int] | None = None) -> list[int]:
    """The rank that holds each parameter whole: the largest first, each to the rank holding least of this
    bucket so far (its slices are as long as the fullest), of ranks holding equally the one that owns least of
    the earlier buckets (`loads`, elements per rank, which this adds the bucket's to): a run of one-matrix buckets
    goes round the ranks by size instead of all to rank 0, which would run every orthogonalisation. The same
    answer on every rank."""
    loads = loads if loads is not None else [0] * shards
    held, owner = [0] * shards, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner[i] = min(range(shards), key=lambda r: (held[r], loads[r]))
        held[owner[i]] += numels[i]
    for r in range(shards):
        loads[r] += held[r]
    return owner


class DataParallelBucket(DataParallel):
    """Gradients in fp32 buckets whose asynchronous reduction overlaps the backward pass.

    `zero` >= 1 reduce-scatters each bucket instead of all-reducing it (each rank keeps its slice of
    the averaged gradients, for the sharded optimizer in zero.py); `zero` >= 2 also releases each full
    buffer once reduced, and allocates it again when its first gradient of the next step arrives.
    `units` (ZeRO-3) makes one bucket per (module, parameters) pair, whose buffer is allocated only
    when its backward begins (`attach`). `reduce_dtype` is the dtype on the wire (the buffers stay fp32).
    `accumulate` (ZeRO-2/3): "sharded" reduces every micro-batch into the slices, "full" once a step.
    `shard_group` (HSDP; default `group`): the ranks ZeRO shards over; `replicate_group`: their replicas.
    `expert_group`: where expert-parallel shards are averaged, in buckets of their own (ZeRO-3: one more per
    unit); `expert_shard_group` (default `expert_group`): where ZeRO shards them. `whole`: which parameters lie
    whole in one rank's slice under ZeRO (those an optimizer needs whole: Muon's matrices), in buckets of their
    own (in ZeRO-3, one more per unit), so that the others are cut anywhere without padding."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *, bucket_mb: float = 25.0, zero: int = 0,
                 reduce_dtype: torch.dtype = torch.float32,
                 units: list[tuple[nn.Module, list[nn.Parameter]]] | None = None,
                 accumulate: ZeroAccumulate = "sharded",
                 shard_group: dist.ProcessGroup | None = None,
                 replicate_group: dist.ProcessGroup | None = None,
                 expert_group: dist.ProcessGroup | None = None,
                 expert_shard_group: dist.ProcessGroup | None = None,
                 whole: Callable[[nn.Parameter], bool] | None = None) -> None:
        super().__init__(module, group, expert_group=expert_group)
        params = self._params()
        device = params[0].device
        self.shard_group = group if shard_group is None else shard_group
        self.shards = dist.get_world_size(self.shard_group) if zero >= 1 else 1
        self.free_after_reduce = zero >= 2 and self.shards > 1
        self.reduce_every_micro_batch = self.free_after_reduce and accumulate == "sharded"
        # HSDP: the slices' average over the shard group is averaged again over the replicas, once a step
        self.replicate = replicate_group if self.shards > 1 else None
        self._replica_works: list[dist.Work] = []
        self.max_held_grad_bytes = 0  # the most gradient bytes alive at a forward's start: what accumulation holds
        shard = {"shards": self.shards, "rank": dist.get_rank(self.shard_group) if self.shards > 1 else 0,
                 "separate_shard": self.free_after_reduce, "replicate": self.replicate,
                 "group": self.shard_group if self.shards > 1 else group}
        expert_shard_group = expert_shard_group or self.expert_group
        expert_shards = dist.get_world_size(expert_shard_group) if zero >= 1 else 1
        expert_shard = {"shards": expert_shards, "rank": dist.get_rank(expert_shard_group) if expert_shards > 1 else 0,
                        "separate_shard": self.free_after_reduce, "replicate": self.replicate,
                        "group": expert_shard_group if zero >= 1 else self.expert_group}
        # ZeRO-2/3: a bucket's full buffer exists only from its first gradient of the step (or, ZeRO-3, from
        # its unit's backward) until its reduction, not through the forward pass
        self.lazy = self.free_after_reduce
        self.reduce_dtype = reduce_dtype
        keep_whole = whole or (lambda p: False)

        # the elements each rank owns of the whole buckets made so far, of each kind (expert shards or not)
        loads = {expert: [0] * options["shards"] for expert, options in ((False, shard), (True, expert_shard))}

        def kinds(ps: list[nn.Parameter]) -> list[tuple[list[nn.Parameter], dict]]:
            """`ps` by bucket kind: cut anywhere, kept whole; expert shards (sharded over their own group) apart"""
            return [([p for p in ps if (layout_of(p).ep is not None) == expert and keep_whole(p) == w],
                     {**(expert_shard if expert else shard), "whole": w, "loads": loads[expert] if w else None})
                    for expert in (False, True) for w in (False, True)]

        if units is not None:
            # Backward visits the units in reverse order: so are the buckets; a unit's expert shards in a bucket
            # of their own, after the rest of it
            self.buckets = [_Bucket(ps, device, module=m, allocate=False, **options) for m, unit in reversed(units)
                            for ps, options in kinds(unit) if ps]
        else:
            self.buckets = [b for ps, options in kinds(params) if ps
                            for b in self._size_buckets(ps, device, bucket_mb, options)]
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        # each parameter's fp32 gradient: a view into its bucket's buffer (Megatron's main_grad)
        self.main_grads: dict[nn.Parameter, torch.Tensor] = {}
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(weak_hook(self._hook))
        self._callback_queued = False
        self._in_flight: _Bucket | None = None  # the last bucket whose reduction was started
        if not self.lazy:
            self._attach_grads()

    def _size_buckets(self, params: list[nn.Parameter], device: torch.device, bucket_mb: float,
                      shard: dict) -> list[_Bucket]:
        # Backward visits parameters roughly in reverse order of definition: fill buckets that way,
        # so the first bucket is complete early and its reduction overlaps most of the backward.
        limit = max(1, int(bucket_mb * 2**20 / 4))
        buckets: list[_Bucket] = []
        group_params: list[nn.Parameter] = []
        for p in reversed(params):
            group_params.append(p)
            if sum(q.numel() for q in group_params) >= limit:
                buckets.append(_Bucket(group_params, device, allocate=not self.lazy, **shard))
                group_params = []
        if group_params:
            buckets.append(_Bucket(group_params, device, allocate=not self.lazy, **shard))
        return buckets

    def forward(self, *args, **kwargs):
        held = [t for b in self.buckets for t in (b.buffer, b.shard_grad) if t is not None]
        self.max_held_grad_bytes = max(self.max_held_grad_bytes, sum(t.numel() * t.element_size() for t in held))
        return self.module(*args, **kwargs)

    def attach(self, bucket: _Bucket) -> None:
        """Give `bucket` a zeroed buffer if it has none, and point its parameters' gradients into it."""
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(bucket.padded, dtype=torch.float32, device=bucket.device)
        for p in bucket.params:
            offset = bucket.offsets[p]
            self.main_grads[p] = bucket.buffer[offset:offset + p.numel()].view_as(p)
            # fp32 parameters: autograd accumulates in place; lower-precision ones are added in by the hook
            p.grad = self.main_grads[p] if p.dtype == torch.float32 else None

    def _attach_grads(self) -> None:
        for bucket in self.buckets:
            self.attach(bucket)

    def _release(self, bucket: _Bucket) -> None:
        """ZeRO-2/3: drop a reduced bucket's full buffer; only its slice (`shard_grad`) remains."""
        bucket.buffer = None
        for p in bucket.params:
            p.grad = None
            self.main_grads.pop(p, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the buckets (the gradients' storage); `set_to_none` is ignored, the views stay attached."""
        for bucket in self.buckets:
            if bucket.buffer is not None:
                bucket.buffer.zero_()
                self.attach(bucket)
            bucket.pending = set(bucket.params)
            bucket.fresh = True

    def _hook(self, param: nn.Parameter) -> None:
        if param not in self.main_grads:  # the bucket's first gradient of the step (ZeRO-2): its buffer now
            grad = param.grad
            self.attach(self.bucket_of[param])
            param.grad = grad  # added in below, like a lower-precision gradient
        main_grad = self.main_grads[param]
        if param.grad is not main_grad:
            # Lower-precision parameters (or a .grad reset by someone else): accumulate into the
            # fp32 buffer by hand, then point fp32 parameters back at their view.
            main_grad.add_(param.grad)
            param.grad = main_grad if param.dtype == torch.float32 else None
        bucket = self.bucket_of[param]
        if not self._reduces_now(bucket) or self.world == 1:
            return
        if not self._callback_queued:
            # Runs once the whole backward pass has finished: wait for every bucket there.
            queue_after_backward(self._finish)
            self._callback_queued = True
        bucket.pending.discard(param)
        if not bucket.pending:
            if self.shards > 1 and self._in_flight is not None:
                # at most two reductions in flight: a released buffer can go (ZeRO-2/3), and gloo's
                # reduce-scatter holds a copy of its input until it is waited on
                self._complete(self._in_flight)
            bucket.handle = self._reduce(bucket, async_op=True)
            self._in_flight = bucket

    def _reduces_now(self, bucket: _Bucket) -> bool:
        """Whether this backward reduces `bucket`: on the step's last micro-batch, or on every one under sharded
        accumulation, which a bucket left whole (expert shards on one rank of their shard group) does not take:
        its buffer accumulates the step, and is divided (and averaged across replicas) once."""
        return self.require_sync or (self.reduce_every_micro_batch and bucket.sharded)

    def _reduce(self, bucket: _Bucket, *, async_op: bool) -> dist.Work | None:
        """Average the bucket over its group: all-reduce in place, or reduce-scatter into its slice."""
        if bucket.buffer is None:  # a lazily allocated bucket whose parameters got no gradient
            self.attach(bucket)
        if bucket.scale != 1.0:  # expert shards: what this reduction adds in (the step's, or a micro-batch's)
            bucket.buffer.mul_(bucket.scale)
        bucket.reducing = True
        if bucket.world == 1:  # expert shards held by this rank alone: nothing to average
            bucket.handle = bucket.after_wait = None
            self._complete(bucket)
            return None
        self.num_collectives += 1
        wire = bucket.buffer if self.reduce_dtype == torch.float32 else bucket.buffer.to(self.reduce_dtype)
        if not bucket.sharded:
            work = dist.all_reduce(wire, op=AVG, group=bucket.group, async_op=async_op)
            target = bucket.buffer
        else:
            # In place: this rank's slice of the wire receives the average (NCCL and gloo allow it).
            target, full = bucket.reduced_grad(), wire
            wire = full[bucket.mine]
            work = reduce_scatter_flat(wire, full, op=AVG, group=bucket.group, async_op=async_op)
        if wire.data_ptr() == target.data_ptr():
            bucket.after_wait = None
        else:  # the step's first reduction writes the slice; under sharded accumulation later ones add to it
            bucket.after_wait = (lambda: target.copy_(wire)) if bucket.fresh else (lambda: target.add_(wire))
        bucket.handle = work if async_op else None
        if not async_op:
            self._complete(bucket)
        return work

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for the bucket's reduction, finish it (HSDP, the step's last: start the slice's average over
        the replicas), and under ZeRO-2/3 release its full buffer."""
        if not bucket.reducing:
            return
        if bucket.handle is not None:
            with timer("dp"):
                bucket.handle.wait()
            bucket.handle = None
        if bucket.after_wait is not None:
            bucket.after_wait()
            bucket.after_wait = None
        bucket.reducing, bucket.fresh = False, False
        if bucket.replicate is not None and self.require_sync:
            self.num_collectives += 1
            self._replica_works.append(dist.all_reduce(bucket.reduced_grad(), op=AVG, group=bucket.replicate,
                                                       async_op=True))
        if self.free_after_reduce and bucket.sharded and bucket.buffer is not None:
            self._release(bucket)

    def _finish(self) -> None:
        for bucket in self.buckets:
            if not self._reduces_now(bucket):
                continue  # left whole through accumulation (its hooks did not count it off either)
            if bucket.pending:
                # Parameters unused in this backward never fire their hook: reduce what is there.
                with timer("dp"):
                    self._reduce(bucket, async_op=False)
            else:
                self._complete(bucket)
            bucket.pending = set(bucket.params)
        if self._replica_works:
            with timer("dp"):
                for work in self._replica_works:
                    work.wait()
            self._replica_works = []
        self._callback_queued = False
        self._in_flight = None


def apply_data_parallel(model: nn.Module, group: dist.ProcessGroup, *, impl: DpImpl = "bucket",
                        expert_group: dist.ProcessGroup | None = None,
                        **bucket_options) -> DataParallel:
    """Wrap `model` so gradients are averaged over `group` ("naive" or "bucket"; ZeRO needs buckets, and
    `bucket_options` are DataParallelBucket's), those of expert-parallel shards over `expert_group` (default:
    `group`)."""
    if impl == "naive":
        return DataParallelNaive(model, group, expert_group=expert_group)
    return DataParallelBucket(model, group, expert_group=expert_group, **bucket_options)
