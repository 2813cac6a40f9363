"""Data parallelism: every rank holds the whole (stage of the) model and sees its own rows of the
batch; gradients are averaged over the dp*cp group before the optimizer step.

Two implementations of the same contract:
- `DataParallelNaive`: one blocking all-reduce per parameter, from a hook that fires once the
  parameter's gradient is fully accumulated. Simple, and slow: many small messages, no overlap.
- `DataParallelBucket`: the gradients live in fp32 buffers grouped into buckets of ~`bucket_mb`.
  A bucket's all-reduce starts asynchronously as soon as its last gradient is ready, so
  communication overlaps the rest of the backward pass; all are awaited at the end of backward.

Both skip communication inside `no_sync()`, so with gradient accumulation the micro-batches
before the last only accumulate locally and the sync happens once per optimizer step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from tetron.config import DpImpl

# Gloo and NCCL both average natively; a sum followed by a division would cost an extra pass.
AVG = dist.ReduceOp.AVG


class DataParallel(nn.Module):
    """Shared plumbing: the wrapped module, the group, the sync switch and a collective counter."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *, count_collectives: bool = False) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.world = dist.get_world_size(group)
        self.require_sync = True
        # all-reduce calls issued so far, kept only when asked (tests count syncs per step)
        self.num_collectives: int | None = 0 if count_collectives else None

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

    def _all_reduce(self, tensor: torch.Tensor, *, async_op: bool = False) -> dist.Work | None:
        """Average `tensor` over the group."""
        if self.num_collectives is not None:
            self.num_collectives += 1
        return dist.all_reduce(tensor, op=AVG, group=self.group, async_op=async_op)


class DataParallelNaive(DataParallel):
    """An all-reduce (average) hook on every parameter's gradient."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *, count_collectives: bool = False) -> None:
        super().__init__(module, group, count_collectives=count_collectives)
        if self.world > 1:
            for p in self._params():
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, param: nn.Parameter) -> None:
        if self.require_sync:
            self._all_reduce(param.grad)


class _Bucket:
    """A flat fp32 buffer holding the gradients of some parameters, reduced as one message."""

    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        self.pending: set[nn.Parameter] = set(params)
        self.handle: dist.Work | None = None


class DataParallelBucket(DataParallel):
    """Gradients in fp32 buckets whose asynchronous all-reduce overlaps the backward pass."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, *, bucket_mb: float = 25.0,
                 count_collectives: bool = False) -> None:
        super().__init__(module, group, count_collectives=count_collectives)
        params = self._params()
        device = params[0].device
        # Backward visits parameters roughly in reverse order of definition: fill buckets that way,
        # so the first bucket is complete early and its all-reduce overlaps most of the backward.
        limit = max(1, int(bucket_mb * 2**20 / 4))
        self.buckets: list[_Bucket] = []
        group_params: list[nn.Parameter] = []
        for p in reversed(params):
            group_params.append(p)
            if sum(q.numel() for q in group_params) >= limit:
                self.buckets.append(_Bucket(group_params, device))
                group_params = []
        if group_params:
            self.buckets.append(_Bucket(group_params, device))
        self.bucket_of: dict[nn.Parameter, _Bucket] = {}
        # each parameter's fp32 gradient: a view into its bucket's buffer (Megatron's main_grad)
        self.main_grads: dict[nn.Parameter, torch.Tensor] = {}
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                self.main_grads[p] = bucket.buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                self.bucket_of[p] = bucket
                p.register_post_accumulate_grad_hook(self._hook)
        self._callback_queued = False
        self._attach_grads()

    def _attach_grads(self) -> None:
        """Point fp32 parameters' .grad at their bucket views, so autograd accumulates in place."""
        for p, main_grad in self.main_grads.items():
            p.grad = main_grad if p.dtype == torch.float32 else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the buckets (the gradients' storage); `set_to_none` is ignored, the views stay attached."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.pending = set(bucket.params)
        self._attach_grads()

    def _hook(self, param: nn.Parameter) -> None:
        main_grad = self.main_grads[param]
        if param.grad is not main_grad:
            # Lower-precision parameters (or a .grad reset by someone else): accumulate into the
            # fp32 buffer by hand, then point fp32 parameters back at their view.
            main_grad.add_(param.grad)
            param.grad = main_grad if param.dtype == torch.float32 else None
        if not self.require_sync or self.world == 1:
            return
        if not self._callback_queued:
            # Runs once the whole backward pass has finished: wait for every bucket there.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._callback_queued = True
        bucket = self.bucket_of[param]
        bucket.pending.discard(param)
        if not bucket.pending:
            bucket.handle = self._all_reduce(bucket.buffer, async_op=True)

    def _finish(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is None:
                # Parameters unused in this backward never fire their hook: reduce what is there.
                self._all_reduce(bucket.buffer)
            else:
                bucket.handle.wait()
            bucket.handle = None
            bucket.pending = set(bucket.params)
        self._callback_queued = False
        for p, main_grad in self.main_grads.items():
            if p.dtype != torch.float32:
                p.grad = main_grad.to(p.dtype)


def apply_data_parallel(model: nn.Module, group: dist.ProcessGroup, *, impl: DpImpl = "bucket",
                        bucket_mb: float = 25.0, count_collectives: bool = False) -> DataParallel:
    """Wrap `model` so gradients are averaged over `group` ("naive" or "bucket")."""
    if impl == "naive":
        return DataParallelNaive(model, group, count_collectives=count_collectives)
    return DataParallelBucket(model, group, bucket_mb=bucket_mb, count_collectives=count_collectives)
