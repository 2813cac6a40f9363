"""Mixture-of-experts bookkeeping across ranks: the share of the objective each MoE block's balancing losses
get, and, after each step, the expert load counted over every rank that saw a share of the step's batch.

The MoE blocks (models/moe.py) add up, over a step's forwards, the assignments each expert was chosen
for, those dropped for capacity, and the per-sequence sums of the auxiliary and z losses. Once per step,
one all-reduce over dp*cp (and tp under sequence parallelism, where each tp rank routed its share of the
tokens) makes those global; then every rank moves the aux-loss-free routing biases by the
same global load (so they stay equal without being synchronized); under pp two more tiny all-reduces combine
the stages' figures; and the step's record gets:

    moe_aux_loss        the auxiliary loss, mean over the step's sequences and the MoE layers
    moe_z_loss          the router z-loss, likewise
    moe_dropped_frac    assignments dropped for capacity / all assignments (0 when dropless)
    moe_load_imbalance  max / mean assignments per expert, in the worst layer (1 is perfect balance)
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.mesh import Mesh
from tetron.models.moe import moe_blocks

FIGURES = ("moe_aux_loss", "moe_z_loss", "moe_dropped_frac", "moe_load_imbalance")


def scale_moe_losses(chunk: nn.Module, *, moe_layers: int, sequences: int, cp: int = 1,
                     pieces: dist.ProcessGroup | None = None) -> None:
    """Give each MoE block's summed per-sequence losses their share of a rank's objective: divided by the
    MoE layers and by the sequences of the rank's step (micro_batch * grad_acc), as the main loss is by its
    tokens, so that after averaging over dp*cp it is the mean over the global batch's sequences. `pieces`: the
    group of ranks holding the other pieces of this rank's sequences (cp's, tp's under sp, or both), over which
    each forward sums its assignment counts, so that each rank computes its piece's share of every sequence's
    losses (models/moe.py, sequence_balance_losses)."""
    for block in moe_blocks(chunk):
        # Times cp. Summed over all ranks, the shares are each sequence's losses once (a sequence's pieces lie on
        # the cp ranks of one dp coordinate), and a rank's S sequences are 1/dp of the global batch's, not
        # 1/(dp*cp); gradients are averaged over dp*cp: (1/(dp*cp)) * cp / (L*S) = 1 / (L * dp*S), the mean
        # over the global batch's sequences. tp under sp needs nothing: no averaging happens over tp (a tp
        # rank's share reaches its own tokens, and the mlp's weights through their gradients summed over tp).
        block.loss_scale = cp / (moe_layers * sequences)
        if pieces is not None and dist.get_world_size(pieces) > 1:
            block.pieces = dist.get_world_size(pieces)
            block.sum_pieces = functools.partial(_sum_counts, group=pieces)


@torch.compiler.disable  # a collective on counts: eager between compiled pieces of the layer
def _sum_counts(counts: Tensor, *, group: dist.ProcessGroup) -> Tensor:
    """[B, E] assignment counts summed over `group`, a constant for autograd (counts have no gradient)."""
    counts = counts.detach().clone()
    dist.all_reduce(counts, group=group)
    return counts


def sequence_pieces(mesh: Mesh, *, sequence_parallel: bool) -> dist.ProcessGroup | None:
    """The ranks of this rank's stage and dp coordinate that hold pieces of its sequences: cp's, and under
    sequence parallelism tp's too; None where every rank holds whole sequences."""
    axes = tuple(a for a in ("cp", "tp") if mesh.size(a) > 1 and (a == "cp" or sequence_parallel))
    if not axes:
        return None
    return mesh.group("cp_tp") if len(axes) == 2 else mesh.group(axes[0])


@torch.no_grad()
def finish_moe_step(chunks: list[nn.Module], group: dist.ProcessGroup | None, *, sequences: int,
                    moe_layers: int | None = None, stages: dist.ProcessGroup | None = None,
                    tp: dist.ProcessGroup | None = None) -> Tensor | None:
    """The step's MoE figures [4] (FIGURES, on the device), after updating the routing biases from the load
    summed over `group` (dp*cp); None for a model without MoE blocks. `sequences`: of the global batch;
    `moe_layers`: of the whole model (default: those here); `stages`: the pipeline's group, over which each
    stage's layers' figures are combined (sums added, the worst imbalance taken); `tp`: the tensor-parallel
    group under sequence parallelism, where each tp rank counted only its tokens (without it every tp rank
    counted them all: not summed)."""
    blocks = [b for chunk in chunks for b in moe_blocks(chunk)]
    if moe_layers is None and not blocks:
        return None
    device = next(p for chunk in chunks for p in chunk.parameters()).device
    counts = torch.stack([b.stats.counts if b.stats.counts is not None
                          else torch.zeros(b.num_experts, device=device) for b in blocks]) if blocks \
        else torch.zeros(0, 1, device=device)  # [L here, E]; a pipeline stage may hold no MoE layer
    totals = sum((b.stats.totals for b in blocks if b.stats.totals is not None), torch.zeros(4, device=device))
    packed = torch.cat([counts.flatten(), totals])
    for over in (group, tp):
        if over is not None and dist.get_world_size(over) > 1:
            dist.all_reduce(packed, group=over)
    counts = packed[:-4].view_as(counts)
    for block, load in zip(blocks, counts):
        block.update_bias(load)
        block.stats.reset()
    imbalance = (counts.max(1).values / counts.mean(1).clamp_min(1e-9)).max() if blocks \
        else torch.zeros((), device=device)
    totals = packed[-4:]
    if stages is not None and dist.get_world_size(stages) > 1:
        dist.all_reduce(totals, group=stages)
        dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=stages)
    aux, z, dropped, assigned = totals
    per_sequence = 1.0 / (sequences * (moe_layers or len(blocks)))
    return torch.stack([aux * per_sequence, z * per_sequence, dropped / assigned.clamp_min(1), imbalance])
