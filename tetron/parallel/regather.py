"""Sequence parallelism's block input, kept as this rank's shard for the backward (Megatron's way).

Under sp a tensor-parallel block (attention, MLP) all-gathers its input along the sequence once, and its column-
parallel linears (q, k, v; gate, up) read the whole [B, T, h]. Their weight gradients need that whole input in
the backward, and autograd would keep it: t times the shard, on every tp rank, per block. Here the linears keep
the shard instead (one per block, shared by its linears) and the first of them to run its backward all-gathers it
again, for its siblings too; the last to use it lets it go. So a block holds h/t per token where it held h, for
one more all-gather per block in the backward (`parallel.sp_regather: false` keeps the whole input instead).

- `SequenceGather`: the block's forward pre-hook (the all-gather, comm.gather_from_sequence) and the record of
  which gathered tensor came from which shard, for the linears to find.
- `linear_on_shard`: F.linear(x, W, b) for a gathered x that keeps the shard, not x.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tetron.models.fused import wanted
from tetron.parallel.comm import all_gather_dim, gather_from_sequence


class _Regathered:
    """The whole input again in one block's backward: all-gathered by the first linear that asks, handed to the
    others, released when each of the `users` linears has taken it (in every backward pass over them: a split
    backward, B then W, gathers once in each)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.users, self.taken, self.whole = group, 0, 0, None

    def take(self, shard: Tensor) -> Tensor:
        if self.whole is None:
            self.whole = all_gather_dim(shard, 1, self.group)  # [B, T/t, h] -> [B, T, h]
        whole = self.whole
        self.taken += 1
        if self.taken >= self.users:
            self.whole, self.taken = None, 0
        return whole


class SequenceGather:
    """One sp block's input: as a forward pre-hook, all-gathers it (backward: reduce-scatter) and remembers, for
    this forward, the gathered tensor and its shard, which the block's column-parallel linears then keep."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._last: tuple[weakref.ref, weakref.ref, _Regathered] | None = None

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        shard = args[0]
        whole = gather_from_sequence(shard, self.group)  # [B, T/t, h] -> [B, T, h]
        # Compiled, the linears take the whole input as plain F.linear (AOTAutograd chooses what to save).
        # Weakly: this object outlives the step; the linears' saved tensors hold what the backward needs.
        if not torch.compiler.is_compiling():
            self._last = (weakref.ref(whole), weakref.ref(shard), _Regathered(self.group))
        return (whole, *args[1:])

    def shard_of(self, x: Tensor) -> tuple[Tensor, _Regathered] | None:
        """(the shard x was gathered from, the block's regather) if this hook gathered x in this forward."""
        if self._last is None or self._last[0]() is not x:
            return None
        shard = self._last[1]()
        return None if shard is None else (shard, self._last[2])


class _LinearOnShard(torch.autograd.Function):
    """y = x @ W.T + b for x all-gathered from `shard`: keeps the shard (and W), gathers x again in the backward
    for W's gradient; x's own gradient needs only W."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, shard: Tensor,
                regathered: _Regathered) -> Tensor:
        regathered.users += 1
        ctx.regathered, ctx.has_bias = regathered, bias is not None
        ctx.save_for_backward(weight, shard.detach())
        # grad mode on, nothing requiring grad: recompute.py's selective policy keeps this matmul's output, as it
        # keeps a column-parallel linear's outside the Function
        with torch.enable_grad():
            return F.linear(x.detach(), weight.detach(), None if bias is None else bias.detach())  # [B, T, out/t]

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple:
        weight, shard = ctx.saved_tensors
        want_x, want_w, want_b = wanted(ctx, (True, True, ctx.has_bias))
        flat_dy = dy.reshape(-1, dy.shape[-1])  # [B*T, out/t]
        dx = dw = db = None
        if want_w:
            x = ctx.regathered.take(shard)  # [B, T, h]
            dw = x.reshape(-1, x.shape[-1]).t().mm(flat_dy).t()  # as F.linear's backward: (x^T @ dy)^T
        if want_b:
            db = flat_dy.sum(0)
        if want_x:
            dx = dy.matmul(weight)  # [B, T, h]
        return dx, dw, db, None, None


def linear_on_shard(x: Tensor, weight: Tensor, bias: Tensor | None, gather: SequenceGather) -> Tensor:
    """F.linear(x, weight, bias), keeping for the backward the shard `gather` made x from where it did (else x)."""
    found = None if torch.compiler.is_compiling() else gather.shard_of(x)
    if found is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _LinearOnShard.apply(x, weight, bias, *found)
