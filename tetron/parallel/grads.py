"""Gradient clipping over the mesh: the global norm of gradients that are split, replicated and tied."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.mesh import Mesh
from tetron.parallel.layout import layout_of
from tetron.torch_private import foreach_norm, foreach_scale_


def _sum_of_squares(grads: list[Tensor], device: torch.device) -> Tensor:
    """The sum of the squares of every element of `grads`, in fp32: one batched norm per call."""
    if not grads:
        return torch.zeros((), device=device, dtype=torch.float32)
    return torch.stack(foreach_norm(grads, dtype=torch.float32)).square().sum()


@torch.no_grad()
def clip_grads_(grads: list[tuple[Tensor, nn.Parameter]], max_norm: float, mesh: Mesh, *,
                sharded_over_dp: bool = False) -> Tensor:
    """Clip `grads` (each with its parameter) by their global norm; returns the norm before clipping,
    a device scalar (reading it is the caller's choice: it waits for the device).

    Each element counts once: squares of tensor-parallel shards (layout `tp` set) are summed over
    tp, replicated tensors are taken as they are, stages are summed over pp, and the last stage's
    copy of a tied embedding (layout `tied_copy`) is left out of the sum (the first stage counts it).
    With ZeRO each rank holds different pieces of every gradient (`sharded_over_dp`): the sums of
    both kinds are also summed over the shard group (dp*cp, or HSDP's dp_shard: its replicas hold the same).
    Expert-parallel shards (layout `ep`) are summed over ep; with ZeRO each of their elements is on one rank of
    the shard group (its ep groups, each holding slices over edp_shard: under HSDP ep divides dp_shard), so the
    shard group's sum counts them once too."""
    device = grads[0][0].device if grads else torch.device("cpu")
    replicated, sharded, experts = [], [], []
    for g, p in grads:
        layout = layout_of(p)
        if not layout.tied_copy:
            (experts if layout.ep is not None else sharded if layout.tp is not None else replicated).append(g)
    sums = torch.stack([_sum_of_squares(replicated, device), _sum_of_squares(sharded, device),
                        _sum_of_squares(experts, device)])
    if sharded_over_dp and mesh.size("dp_shard") > 1:
        dist.all_reduce(sums, group=mesh.group("dp_shard"))
    elif mesh.size("ep") > 1:
        dist.all_reduce(sums[2:], group=mesh.group("ep"))
    if mesh.size("tp") > 1:
        dist.all_reduce(sums[1:2], group=mesh.group("tp"))  # the shards' squares; replicated ones count once
    total = sums.sum()
    if mesh.size("pp") > 1:
        dist.all_reduce(total, group=mesh.group("pp"))
    norm = total.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        foreach_scale_([g for g, _ in grads], coef)
    return norm


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, mesh: Mesh) -> float:
    """clip_grads_ over the parameters' .grad (those that have one); the norm read back."""
    return float(clip_grads_([(p.grad, p) for p in params if p.grad is not None], max_norm, mesh))
