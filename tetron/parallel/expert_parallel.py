"""Expert parallelism: each MoE layer's experts split over the `ep` ranks of an expert-parallel group,
carved out of dp*cp (mesh.py: `ep`, consecutive ranks of a dp*cp group; `edp`, the ranks holding the
same experts).

Parameters. Rank r of the ep group keeps experts [r*E/ep, (r+1)*E/ep) of every fused expert tensor (dim 0,
layout `ep`, parallel/layout.py): initialised, saved and loaded as slices of the whole tensors.

Dispatch, through MoEBlock's `experts_fn(tokens, counts)` seam (tokens already grouped by expert):

    counts [E] -> all_to_all -> what each rank sends this rank, per local expert [ep, E/ep]
    tokens     -> all_to_all with variable splits (each rank's rows go to the rank of their experts)
               -> sorted by local expert -> the local experts -> back into arrival order
               -> all_to_all with the splits reversed -> [M, H] in the order the block sent them

Each all-to-all is an autograd function whose backward is the reverse all-to-all.

Gradients. Rank r's loss is the mean over its own share of the global batch, and data parallelism averages
the gradients over the N = dp*cp ranks, so the whole gradient is (1/N) sum_s dL_s. An expert's gradient on
rank r already sums the contributions of every rank s of its ep group (their tokens came to it), so the
whole gradient is (1/N) * the sum over the edp group of those = (1/ep) * their average over edp. Data
parallelism divides the expert parameters' buckets by ep as it reduces them, and averages them over edp
(data_parallel.py puts expert parameters in buckets of their own, on that group). Not a gradient hook on the
parameters: the zero-bubble schedules' W (weight_grad.py) computes the weight gradients and then accumulates
them, and a parameter's tensor hook runs at both, which would divide twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.mesh import Mesh
from tetron.models.moe import MoEBlock, moe_blocks
from tetron.parallel.layout import Shard, set_layout
from tetron.parallel.timers import timer


class _AllToAll(torch.autograd.Function):
    """forward: rows of `x` sent by `send` split sizes, `recv` rows received; backward: the reverse."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return all_to_all_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return all_to_all_rows(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> Tensor:
    """Rows of `x` to the group's ranks, `send[j]` of them to rank j; `recv[j]` rows come from rank j."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    with timer("ep"):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class ExpertExchange:
    """A block's `experts_fn` under expert parallelism: tokens to their experts' ranks and back."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup, ep: int) -> None:
        self.experts, self.group, self.ep = experts, group, ep

    def __call__(self, tokens: Tensor, counts: Tensor) -> Tensor:
        local = counts.numel() // self.ep
        received = torch.empty_like(counts)
        with timer("ep"):  # [ep * local]: from each rank, the rows for each of this rank's experts
            dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        received = received.view(self.ep, local)
        send = counts.view(self.ep, local).sum(1).tolist()  # one host read of both per layer
        recv = received.sum(1).tolist()
        x = _AllToAll.apply(tokens, send, recv, self.group)  # by source rank, then local expert
        expert = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(self.ep), received.flatten(),
                                         output_size=x.shape[0])
        order = torch.argsort(expert, stable=True)  # by local expert, source rank within
        y = self.experts(x[order], received.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(y[back], recv, send, self.group)


def apply_expert_parallel(chunk: nn.Module, mesh: Mesh) -> None:
    """Keep this rank's experts of every MoE block of `chunk` (on meta, before storage exists) and set the
    block's exchange. A no-op without expert parallelism."""
    ep = mesh.size("ep")
    if ep == 1:
        return
    rank, group = mesh.local_rank("ep"), mesh.group("ep")
    for block in moe_blocks(chunk):
        _shard_experts(block, rank, ep)
        block.experts_fn = ExpertExchange(block.experts, group, ep)


def _shard_experts(block: MoEBlock, rank: int, ep: int) -> None:
    for name, param in list(block.experts.named_parameters(recurse=False)):
        local = param.shape[0] // ep
        shard = nn.Parameter(param[rank * local:(rank + 1) * local].detach().clone(),
                             requires_grad=param.requires_grad)
        set_layout(shard, inherit=param, ep=Shard("ep", 0, rank, ep))
        setattr(block.experts, name, shard)

