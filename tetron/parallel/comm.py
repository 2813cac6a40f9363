"""Autograd-aware collectives: each is a pair of a forward and a backward communication.

Every function takes its process group as an argument and is the identity when the group has
one rank, so the same model code runs with and without tensor parallelism.

In Megatron's vocabulary, for tensor parallelism over a group of t ranks:
- f = `copy_to_group`: forward identity, backward all-reduce. It sits where a replicated
  activation enters column-parallel layers: each rank's input gradient is only its share.
- g = `reduce_from_group`: forward all-reduce, backward identity. It sits where row-parallel
  partial outputs leave: their sum is the true output.
With sequence parallelism the activations between those regions are split along the sequence,
and f and g become `gather_from_sequence` (all-gather forward, reduce-scatter backward) and
`reduce_scatter_to_sequence` (reduce-scatter forward, all-gather backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tetron.parallel.timers import timer

# One collective into (or from) a flat tensor cut into equal parts; torch 2.13 renamed them and
# deprecated the old names, which older versions (2.11 on the GPU machines) still need.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_gather_dim(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's `x` along `dim` (no autograd), into one contiguous tensor."""
    world = _size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()  # the collective works on dim 0
    out = torch.empty((world * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    with timer(group):
        dist.all_gather_single(out, front, group=group)
    # Contiguous once here, not once per consumer: a strided view would be copied by each matmul that
    # reads it (q, k and v; gate and up under sequence parallelism), and each copy saved for its backward.
    return out.movedim(0, dim).contiguous()


def reduce_scatter_dim(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Sum `x` over ranks and keep this rank's equal part along `dim` (no autograd)."""
    world = _size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // world, *front.shape[1:]), dtype=x.dtype, device=x.device)
    with timer(group):
        dist.reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


class _CopyToGroup(torch.autograd.Function):
    """forward: identity; backward: all-reduce (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        with timer(ctx.group):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """forward: all-reduce; backward: identity (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        with timer(group):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """forward: all-gather along `dim`; backward: reduce-scatter along `dim`."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """forward: reduce-scatter along `dim`; backward: all-gather along `dim`."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_group(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """f: forward identity, backward all-reduce."""
    return x if _size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """g: forward all-reduce, backward identity."""
    return x if _size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_sequence(x: Tensor, group: dist.ProcessGroup, *, dim: int = 1) -> Tensor:
    """Sequence-parallel f: forward all-gather along dim, backward reduce-scatter."""
    return x if _size(group) == 1 else _GatherFromSequence.apply(x, dim, group)


def reduce_scatter_to_sequence(x: Tensor, group: dist.ProcessGroup, *, dim: int = 1) -> Tensor:
    """Sequence-parallel g: forward reduce-scatter along dim, backward all-gather."""
    return x if _size(group) == 1 else _ReduceScatterToSequence.apply(x, dim, group)


class _AllReduceBothWays(torch.autograd.Function):
    """forward: all-reduce; backward: all-reduce. For a sum that every rank goes on to use for its own part (a
    norm's statistic over a projection split by tp): the gradient of any rank's share is the sum of every
    rank's gradient of the total."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        with timer(group):
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        with timer(ctx.group):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_both_ways(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of every rank's `x` on every rank of `group`, differentiable (_AllReduceBothWays); the identity
    on one rank."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllReduceBothWays.apply(x, group)
