"""Gradient clipping over the mesh: the global norm of gradients that are split, replicated and tied."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.mesh import Mesh
from tetron.parallel.layout import layout_of


@torch.no_grad()
def clip_grads_(grads: list[tuple[Tensor, nn.Parameter]], max_norm: float, mesh: Mesh, *,
                sharded_over_dp: bool = False) -> float:
    """Clip `grads` (each with its parameter) by their global norm; returns the norm before clipping.

    Each element counts once: squares of tensor-parallel shards (layout `tp` set) are summed over
    tp, replicated tensors are taken as they are, stages are summed over pp, and the last stage's
    copy of a tied embedding (layout `tied_copy`) is left out of the sum (the first stage counts it).
    With ZeRO each rank holds different pieces of every gradient (`sharded_over_dp`): the sums of
    both kinds are also summed over dp*cp."""
    counted = [(g, p) for g, p in grads if not layout_of(p).tied_copy]
    device = grads[0][0].device if grads else torch.device("cpu")
    total = torch.zeros((), device=device, dtype=torch.float32)
    shard_sq = torch.zeros((), device=device, dtype=torch.float32)
    for g, _ in counted:
        total += g.float().pow(2).sum()
    for g, p in counted:
        if layout_of(p).tp is not None:
            shard_sq += g.float().pow(2).sum()
    if sharded_over_dp and mesh.size("dp_cp") > 1:
        both = torch.stack([total, shard_sq])
        dist.all_reduce(both, group=mesh.group("dp_cp"))
        total, shard_sq = both[0], both[1]
    if mesh.size("tp") > 1:
        total -= shard_sq
        dist.all_reduce(shard_sq, group=mesh.group("tp"))
        total += shard_sq
    if mesh.size("pp") > 1:
        dist.all_reduce(total, group=mesh.group("pp"))
    norm = total.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([g for g, _ in grads], coef)
    return float(norm)


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, mesh: Mesh) -> float:
    """clip_grads_ over the parameters' .grad (those that have one)."""
    return clip_grads_([(p.grad, p) for p in params if p.grad is not None], max_norm, mesh)
