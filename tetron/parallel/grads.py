"""Gradient clipping over the mesh: the global norm of gradients that are split, replicated and tied."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tetron.mesh import Mesh
from tetron.parallel.layout import layout_of


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, mesh: Mesh) -> float:
    """Clip by the global gradient norm; returns the norm before clipping.

    Each element counts once: squares of tensor-parallel shards (layout `tp` set) are summed over
    tp, replicated tensors are taken as they are, stages are summed over pp, and the last stage's
    copy of a tied embedding (layout `tied_copy`) is left out of the sum (the first stage counts it)."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p for p in params if p.grad is not None and not layout_of(p).tied_copy]
    sharded = [p.grad for p in counted if layout_of(p).tp is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), device=device, dtype=torch.float32)
    shard_sq = torch.zeros((), device=device, dtype=torch.float32)
    for p in counted:
        total += p.grad.float().pow(2).sum()
    for g in sharded:
        shard_sq += g.float().pow(2).sum()
    if mesh.size("tp") > 1:
        total -= shard_sq
        dist.all_reduce(shard_sq, group=mesh.group("tp"))
        total += shard_sq
    if mesh.size("pp") > 1:
        dist.all_reduce(total, group=mesh.group("pp"))
    norm = total.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    return float(norm)
