"""Ulysses context parallelism: attention over the whole sequence by trading sequence shards for heads.

Each cp rank holds q, k, v for its share of the positions and all of its heads ([B, H, T/cp, D]; H is
already this tp rank's heads). One all-to-all turns that into all positions of 1/cp of the heads
([B, H/cp, T, D]); attention then needs nothing from other ranks, so the ordinary fused causal kernel runs
locally, and a second all-to-all turns the output back into this rank's positions with every head
(Jacobs et al., "DeepSpeed Ulysses", 2023). Each rank sends (cp-1)/cp of its q, k, v and output per
layer, and as much again backward: about constant in cp, where ring attention sends its k and v cp-1
hops. But the heads must divide: query heads by cp; key/value heads too, or they are repeated until
they do. The all-to-alls block: nothing overlaps them.

Positions. After the all-to-all the sequence is every rank's shard in rank order; under the zigzag
layout (context_parallel.shard_indices, passed in as `shards`) that is not position order, so the
gathered sequence is permuted into position order before the causal kernel and back after it.

Options (models/attention.py's AttentionOptions). The local attention is sdpa_attention itself, so the
scale, soft-capping and a v of another width than q and k are its business (such a v travels in an all-to-all
of its own); learned sinks are one per head, so they split with the heads: this rank keeps its heads' sinks.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from tetron.device import tensor_cache
from tetron.mesh import Mesh
from tetron.models.attention import Documents, sdpa_attention
from tetron.parallel.timers import timer

# (seq_len, cp, rank) -> the positions cp rank `rank` holds, increasing: context_parallel.shard_indices
Shards = Callable[[int, int, int], Tensor]


def _all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Cut x into cp parts along scatter_dim, send part j to rank j, concatenate the parts received
    (in rank order) along gather_dim."""
    cp = dist.get_world_size(group)
    # [cp, ...]: part j goes to rank j (no copy where the parts already lie one after another)
    send = x.unflatten(scatter_dim, (cp, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    with timer("cp"):
        dist.all_to_all_single(received, send, group=group)
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)  # the sources' parts in rank order


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all from scatter_dim to gather_dim; backward: the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: Tensor, group: dist.ProcessGroup, *, scatter_dim: int, gather_dim: int) -> Tensor:
    """Autograd-aware all-to-all over `group`; the identity on one rank."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def kv_repeats(heads: int, kv_heads: int, cp: int) -> int:
    """How many times each key/value head is repeated so that cp divides them: 1 when it already does.
    Repeating each head r times (r dividing the GQA group size) keeps query head h on its key/value head:
    with `heads` divisible by cp, r = cp / gcd(kv_heads, cp) always divides heads / kv_heads."""
    if heads % cp:
        raise ValueError(f"Ulysses needs query heads ({heads}) divisible by cp ({cp})")
    return cp // math.gcd(kv_heads, cp)


@tensor_cache(maxsize=64)
def _orders(shards: Shards, seq_len: int, cp: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """(gathered, to_positions): the positions of the sequence after the all-to-all (every rank's shard,
    in rank order) and the permutation that sorts it; None when it is already in position order."""
    gathered = torch.cat([shards(seq_len, cp, r) for r in range(cp)])
    if torch.equal(gathered, torch.arange(seq_len)):
        return None
    return gathered.to(device), torch.argsort(gathered).to(device)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None, window: int | None = None,
                      *, mesh: Mesh, shards: Shards, scale: float | None = None, softcap: float | None = None,
                      sinks: Tensor | None = None) -> Tensor:
    """Causal attention over the whole sequence from this cp rank's share of q [B, H, T/cp, D],
    k [B, KVH, T/cp, D] and v [B, KVH, T/cp, Dv] (the positions `shards` gives); returns this rank's share of
    the output, [B, H, T/cp, Dv]. With `docs` (the whole window's documents) attention stays within each, with
    `window` within the `window` latest positions: the local kernel sees the whole sequence in order, so it
    masks both. `scale`, `softcap` and `sinks` [H] as models/attention.py's AttentionOptions."""
    cp = mesh.size("cp")
    options = {"scale": scale, "softcap": softcap}
    if cp == 1:
        return sdpa_attention(q, k, v, docs, window, sinks=sinks, **options)
    group, heads, tl = mesh.group("cp"), q.shape[1], q.shape[2]
    r = kv_repeats(heads, k.shape[1], cp)
    if r > 1:  # too few kv heads for cp: each rank needs the kv heads of its query heads (autograd sums back)
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # [B, KVH*r, Tl, D]
    kvh = k.shape[1]
    # One all-to-all for q, k and v: per destination rank, its query heads, then its k and v heads (v in one of
    # its own where its width is not theirs).
    together = (q, k, v) if v.shape[-1] == q.shape[-1] else (q, k)
    parts = [t.unflatten(1, (cp, -1)) for t in together]  # [B, cp, heads/cp, Tl, D]
    qkv = torch.cat(parts, dim=2).flatten(1, 2)  # [B, H+2*KVH, Tl, D], grouped by destination rank
    qkv = all_to_all(qkv, group, scatter_dim=1, gather_dim=2)  # [B, (H+2*KVH)/cp, T, D]
    if len(together) == 3:
        q, k, v = qkv.split([heads // cp, kvh // cp, kvh // cp], dim=1)
    else:
        q, k = qkv.split([heads // cp, kvh // cp], dim=1)
        v = all_to_all(v, group, scatter_dim=1, gather_dim=2)  # [B, KVH/cp, T, Dv]
    if sinks is not None:  # this rank's heads' sinks (autograd leaves the other heads' gradient zero here)
        sinks = sinks.unflatten(0, (cp, -1))[dist.get_rank(group)]  # [H/cp]
    orders = _orders(shards, tl * cp, cp, q.device)
    if orders is not None:  # rank order is not position order (zigzag): sort for the causal mask, and back
        q, k, v = (t.index_select(2, orders[1]) for t in (q, k, v))
    out = sdpa_attention(q, k, v, docs, window, sinks=sinks, **options)  # [B, H/cp, T, Dv], positions in order
    if orders is not None:
        out = out.index_select(2, orders[0])
    return all_to_all(out, group, scatter_dim=2, gather_dim=1)  # [B, H, T/cp, Dv]
