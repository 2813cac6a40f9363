"""Mixture-of-experts bookkeeping across ranks: the share of the objective each MoE block's balancing losses
get, and, after each step, the expert load counted over every rank that saw a share of the step's batch.

The MoE blocks (models/moe.py) add up, over a step's forwards, the assignments each expert was chosen
for, those dropped for capacity, and the per-sequence sums of the auxiliary and z losses. Once per step,
one all-reduce over dp*cp makes those global; then every rank moves the aux-loss-free routing biases by the
same global load (so they stay equal without being synchronized); under pp two more tiny all-reduces combine
the stages' figures; and the step's record gets:

    moe_aux_loss        the auxiliary loss, mean over the step's sequences and the MoE layers
    moe_z_loss          the router z-loss, likewise
    moe_dropped_frac    assignments dropped for capacity / all assignments (0 when dropless)
    moe_load_imbalance  max / mean assignments per expert, in the worst layer (1 is perfect balance)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.models.moe import moe_blocks

FIGURES = ("moe_aux_loss", "moe_z_loss", "moe_dropped_frac", "moe_load_imbalance")


def scale_moe_losses(chunk: nn.Module, *, moe_layers: int, sequences: int) -> None:
    """Give each MoE block's summed per-sequence losses their share of a rank's objective: divided by the
    MoE layers and by the sequences of the rank's step (micro_batch * grad_acc), as the main loss is by its
    tokens, so that after averaging over dp*cp it is the mean over the global batch's sequences."""
    for block in moe_blocks(chunk):
        block.loss_scale = 1.0 / (moe_layers * sequences)


@torch.no_grad()
def finish_moe_step(chunks: list[nn.Module], group: dist.ProcessGroup | None, *, sequences: int,
                    moe_layers: int | None = None, stages: dist.ProcessGroup | None = None) -> Tensor | None:
    """The step's MoE figures [4] (FIGURES, on the device), after updating the routing biases from the load
    summed over `group` (dp*cp); None for a model without MoE blocks. `sequences`: of the global batch;
    `moe_layers`: of the whole model (default: those here); `stages`: the pipeline's group, over which each
    stage's layers' figures are combined (sums added, the worst imbalance taken)."""
    blocks = [b for chunk in chunks for b in moe_blocks(chunk)]
    if moe_layers is None and not blocks:
        return None
    device = next(p for chunk in chunks for p in chunk.parameters()).device
    counts = torch.stack([b.stats.counts if b.stats.counts is not None
                          else torch.zeros(b.num_experts, device=device) for b in blocks]) if blocks \
        else torch.zeros(0, 1, device=device)  # [L here, E]; a pipeline stage may hold no MoE layer
    totals = sum((b.stats.totals for b in blocks if b.stats.totals is not None), torch.zeros(4, device=device))
    packed = torch.cat([counts.flatten(), totals])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
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
