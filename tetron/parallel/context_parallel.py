"""Context parallelism: each cp rank holds a share of every sequence; attention is ring attention.

Sharding. With a causal mask, contiguous chunks give rank cp-1 cp times the attention work of
rank 0. The zigzag layout cuts the sequence into 2*cp chunks and gives rank i chunks i and
2*cp-1-i, so every rank does the same work. Token ids, targets and RoPE position ids are all
sharded with the same indices (`shard_indices`), so the model sees true positions.

Ring attention. Queries stay; key/value blocks travel around the cp ring by P2P, the next block's
transfer overlapping the current block's compute. Blocks are merged with the online-softmax rule
(running log-sum-exp). The backward pass recomputes each block's gradients from the final output
and log-sum-exp, and sends the key/value gradients around the ring with the blocks, so after a full
turn every rank holds the gradients of its own keys and values.

The attention options (models/attention.py) go to each block: the scale and soft-capping (soft-capped blocks
run on the math path, which alone sees the scores). Learned sinks (gpt-oss) are one more logit per head in
the softmax's denominator, a key without a value: they enter once, after the blocks are merged, as one more
log-sum-exp term (lse' = logaddexp(lse, sink), out' = out * exp(lse - lse')). The backward of each block then
needs nothing new: its probabilities come from the final lse', and the usual delta = sum(dout * out') already
holds the sink's share (its value is zero); the sink's own gradient is -sum over queries of exp(sink - lse') *
delta.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.device import tensor_cache
from tetron.mesh import Mesh
from tetron.models.attention import Documents, causal_mask, document_mask, sdpa_attention
from tetron.models.core_recompute import active as recompute_active
from tetron.models.core_recompute import recomputed
from tetron.parallel.block_attention import (  # noqa: F401  (the block kernels, also imported from here)
    _math_block,
    _math_block_backward,
    block_attention,
    block_attention_backward,
)
from tetron.parallel.timers import timer
from tetron.parallel.ulysses import ulysses_attention

# ----------------------------------------------------------------------------- which tokens a rank holds


def shard_indices(seq_len: int, cp: int, rank: int, *, layout: str = "zigzag",
                  device: torch.device | None = None) -> Tensor:
    """Positions of the sequence that cp rank `rank` holds, in increasing order."""
    if layout == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    n = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * n, (rank + 1) * n, device=device),
                      torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n, device=device)])


@tensor_cache(maxsize=256)
def _shard_positions(seq_len: int, cp: int, rank: int, layout: str, device: torch.device) -> Tensor:
    # made on the device: a copy from the host would wait for the device's queue at every layer
    return shard_indices(seq_len, cp, rank, layout=layout, device=device)


def _block_mask(q: Tensor, docs: Documents | None, window: int | None, src: int, ring: _Ring, layout: str,
                qs: slice, ks: slice) -> Tensor | None:
    """The mask (models/attention.py: documents, sliding window) of this rank's queries `qs` on the keys `ks`
    of the block that started on cp rank `src`; None without either. `q` is this rank's [B, H, T/cp, D]."""
    cp, rank = dist.get_world_size(ring.group), dist.get_rank(ring.group)
    seq_len = q.shape[2] * cp
    if docs is None and (window is None or window >= seq_len):
        return None
    q_pos = _shard_positions(seq_len, cp, rank, layout, q.device)[qs]
    k_pos = _shard_positions(seq_len, cp, src, layout, q.device)[ks]
    if docs is None:
        return causal_mask(q_pos, k_pos, window)[None, None]  # [1, 1, Tq, Tk]
    return document_mask(docs.ids, q_pos, k_pos, window)


# ----------------------------------------------------------------------------- the ring


class _Ring:
    """Send to the next cp rank and receive from the previous one, asynchronously."""

    def __init__(self, group: dist.ProcessGroup, next_rank: int, prev_rank: int) -> None:
        self.group, self.next, self.prev = group, next_rank, prev_rank

    def start(self, tensors: list[Tensor]) -> tuple[list[Tensor], list[dist.Work]]:
        """Post the sends of `tensors` and the receives of the previous rank's; returns the receive
        buffers and the pending work, to wait on once the overlapped compute is done."""
        tensors = [t.contiguous() for t in tensors]  # P2P sends and receives flat memory
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work]) -> None:
    with timer("cp"):
        for work in works:
            work.wait()


def _parts(step: int, rank: int, cp: int, layout: str, tq: int) -> tuple[slice, slice, bool] | None:
    """Which queries attend to which keys of the block that started on rank (rank - step) % cp:
    (query slice, key slice, causal), or None when the block is entirely masked."""
    full, src = slice(0, tq), (rank - step) % cp
    if src == rank:
        return full, full, True  # local positions are increasing, so index order = position order
    if layout == "contiguous":
        return (full, full, False) if src < rank else None
    half = tq // 2
    if src < rank:
        return full, slice(0, half), False  # only the block's first chunk lies before all our queries
    return slice(half, tq), full, False  # only our second chunk lies after the whole block


@functools.lru_cache(maxsize=1024)
def _pieces(step: int, rank: int, cp: int, layout: str, tl: int,
            window: int | None) -> tuple[tuple[slice, slice, bool], ...]:
    """The (query slice, key slice, causal) pieces this rank scores of the block that started on rank
    (rank - step) % cp: `_parts`' one piece, or with a sliding `window` shorter than the sequence, the queries in
    tiles of `window` consecutive positions, each against only the keys in its reach ([first - window + 1, last]:
    a contiguous run of the block's sorted positions). Blocks and tiles the window leaves nothing of are not
    scored, so a windowed layer's compute grows with the window, not the sequence; the mask still drops the
    pairs a tile's rectangle holds outside the window."""
    part = _parts(step, rank, cp, layout, tl)
    if part is None or window is None or window >= tl * cp:
        return () if part is None else (part,)
    qs, ks, _ = part
    q_index, k_index = range(tl)[qs], range(tl)[ks]
    q_pos = shard_indices(tl * cp, cp, rank, layout=layout)[qs].tolist()
    k_pos = shard_indices(tl * cp, cp, (rank - step) % cp, layout=layout)[ks]
    pieces, start = [], 0
    while start < len(q_pos):  # a tile: up to `window` queries of consecutive positions (zigzag's chunks apart)
        end = start + 1
        while end < len(q_pos) and end - start < window and q_pos[end] == q_pos[end - 1] + 1:
            end += 1
        lo = int(torch.searchsorted(k_pos, q_pos[start] - window + 1))
        hi = int(torch.searchsorted(k_pos, q_pos[end - 1], right=True))
        if lo < hi:
            pieces.append((slice(q_index[start], q_index[end - 1] + 1), slice(k_index[lo], k_index[hi - 1] + 1),
                           False))
        start = end
    return tuple(pieces)


def attention_work(seq_len: int, cp: int, rank: int, *, layout: str = "zigzag", window: int | None = None) -> int:
    """Query-key pairs this rank scores in one ring-attention pass (causal blocks count half; with a `window`,
    its tiles' rectangles): the measure of its attention FLOPs, for comparing layouts and windows."""
    tl = seq_len // cp
    work = 0
    for step in range(cp):
        for qs, ks, causal in _pieces(step, rank, cp, layout, tl, window):
            pairs = len(range(tl)[qs]) * len(range(tl)[ks])
            work += pairs // 2 if causal else pairs
    return work


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online softmax: combine two partial attentions by their log-sum-exps."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * (lse - new_lse).exp().unsqueeze(-1) + block_out.float() * (block_lse - new_lse).exp().unsqueeze(-1)
    return out, new_lse


class _RingAttention(torch.autograd.Function):
    """forward: ring attention of local queries over every rank's keys/values; backward: the
    same ring, with key/value gradients travelling alongside their blocks back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ring, layout, docs, window, scale, softcap):
        # q [B, H, Tl, D]; k [B, KVH, Tl, D], v [B, KVH, Tl, Dv]: GQA heads are repeated per block, not sent
        # repeated; docs (or None): the documents of the whole window, for the mask of each pair of shards (with
        # the sliding window, where there is one); sinks [H] or None
        cp, rank = dist.get_world_size(ring.group), dist.get_rank(ring.group)
        rep, tl = q.shape[1] // k.shape[1], q.shape[2]
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        k, v = k.contiguous(), v.contiguous()  # once, not at every hop
        own_k, own_v = k, v
        for step in range(cp):
            if step < cp - 1:
                (k_next, v_next), works = ring.start([k, v])  # overlaps this block's compute
            for qs, ks, causal in _pieces(step, rank, cp, layout, tl, window):
                kb = k[:, :, ks].repeat_interleave(rep, dim=1)  # [B, H, Tk, D]
                vb = v[:, :, ks].repeat_interleave(rep, dim=1)
                mask = _block_mask(q, docs, window, (rank - step) % cp, ring, layout, qs, ks)
                # the mask is causal by true positions too; `causal` (the diagonal block, whose local
                # order is position order) lets the kernel skip the blocks above the diagonal
                block_out, block_lse = block_attention(q[:, :, qs], kb, vb, causal, mask=mask, scale=scale,
                                                       softcap=softcap)
                out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if step < cp - 1:
                _wait(works)
                k, v = k_next, v_next
        if sinks is not None:  # one more term of the denominator, with no value: out shrinks by its share
            with_sink = torch.logaddexp(lse, sinks.float().view(1, -1, 1))  # [B, H, Tl]
            out, lse = out * (lse - with_sink).exp().unsqueeze(-1), with_sink
        out = out.to(q.dtype)
        ctx.save_for_backward(q, own_k, own_v, out, lse, sinks)
        ctx.ring, ctx.layout, ctx.docs, ctx.window, ctx.scale, ctx.softcap = ring, layout, docs, window, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors  # k, v: this rank's own block; the ring restarts from it
        ring, layout, docs, window = ctx.ring, ctx.layout, ctx.docs, ctx.window
        options = {"scale": ctx.scale, "softcap": ctx.softcap}
        cp, rank = dist.get_world_size(ring.group), dist.get_rank(ring.group)
        rep, tl, kv_heads = q.shape[1] // k.shape[1], q.shape[2], k.shape[1]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # gradients of the block held now; they travel with it and are home after a full turn
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(cp):
            if step < cp - 1:
                (k_next, v_next), kv_works = ring.start([k, v])
            for qs, ks, causal in _pieces(step, rank, cp, layout, tl, window):
                kb = k[:, :, ks].repeat_interleave(rep, dim=1)
                vb = v[:, :, ks].repeat_interleave(rep, dim=1)
                mask = _block_mask(q, docs, window, (rank - step) % cp, ring, layout, qs, ks)
                dqb, dkb, dvb = block_attention_backward(dout[:, :, qs], q[:, :, qs], kb, vb, out[:, :, qs],
                                                         lse[:, :, qs], causal, mask=mask, **options)
                dq[:, :, qs] += dqb.float()
                dk[:, :, ks] += dkb.float().unflatten(1, (kv_heads, rep)).sum(2)  # [B, KVH, Tk, D(v)]
                dv[:, :, ks] += dvb.float().unflatten(1, (kv_heads, rep)).sum(2)
            if cp > 1:
                (dk, dv), dkv_works = ring.start([dk, dv])
                _wait(dkv_works)
            if step < cp - 1:
                _wait(kv_works)
                k, v = k_next, v_next
        dsinks = None
        if sinks is not None:  # d(loss)/d(sink) = -sum over queries of p(sink) * delta, p(sink) = exp(sink - lse)
            delta = (dout.float() * out.float()).sum(-1)  # [B, H, Tl]
            dsinks = -((sinks.float().view(1, -1, 1) - lse).exp() * delta).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, None, None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None, window: int | None = None, *,
                   mesh: Mesh, layout: str = "zigzag", scale: float | None = None, softcap: float | None = None,
                   sinks: Tensor | None = None) -> Tensor:
    """Causal attention over the whole sequence, from this cp rank's share of q, k, v
    ([B, heads, T/cp, head_dim], positions as `shard_indices` gives them); with `docs` (the whole window's
    documents) each position attends only within its document, with `window` only to the `window` latest
    positions: each block's queries in tiles of the window, each tile scored against the keys in its reach only
    (`_pieces`; the ring still passes every block on). `scale`, `softcap` and `sinks` [H] as models/attention.py's
    AttentionOptions."""
    if mesh.size("cp") == 1:
        return sdpa_attention(q, k, v, docs, window, scale=scale, softcap=softcap, sinks=sinks)
    if sinks is None and recompute_active() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # recompute: selective keeps q, k, v only, not the ring's output and log-sum-exp; the backward runs the
        # ring's forward again (its P2P too, in the same order on every cp rank: each recomputes the same layer)
        core = functools.partial(ring_attention, docs=docs, window=window, mesh=mesh, layout=layout, scale=scale,
                                 softcap=softcap)
        return recomputed(core, q, k, v)
    ring = _Ring(mesh.group("cp"), mesh.cp_next, mesh.cp_prev)
    return _RingAttention.apply(q, k, v, sinks, ring, layout, docs, window, scale, softcap)


def apply_context_parallel(model: nn.Module, mesh: Mesh, *, layout: str = "zigzag", impl: str = "ring") -> nn.Module:
    """Swap every attention module's attention function for ring attention (impl="ring") or Ulysses
    all-to-all attention (impl="ulysses", parallel/ulysses.py) over the cp group."""
    if mesh.size("cp") == 1:
        return model
    if impl == "ulysses":
        shards = functools.partial(shard_indices, layout=layout)
        attention = functools.partial(ulysses_attention, mesh=mesh, shards=shards)
    else:
        attention = functools.partial(ring_attention, mesh=mesh, layout=layout)
    for module in model.modules():
        if hasattr(module, "attn_fn"):
            module.attn_fn = attention
    return model
