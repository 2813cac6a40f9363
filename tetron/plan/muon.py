"""What Muon's step costs a rank beyond its state (which plan/state.py counts by role: one fp32 momentum per element
of a matrix, AdamW's two moments and step counters for the rest): the Newton-Schulz iteration's FLOPs and tensor
parallelism's gathers of whole matrices (optim/muon.py).

Newton-Schulz. Per [A, B] matrix (m = min, n = max) each of optim.muon_ns_steps iterations is three matmuls: the
Gram matrix X X^T (2 m^2 n), b G + c G G (2 m^3) and its product with X (2 m^2 n). A rank runs it on the matrices it
updates: every matrix of its stage without ZeRO (each dp rank repeats them, as it repeats AdamW's step); under ZeRO
only those whose owner it is (data_parallel.owners over each bucket of whole matrices, as plan/state.py lays them out);
each expert's on its own; under tp on the whole matrix, on every tp rank alike.

Tensor parallelism. A matrix tp cuts is all-gathered over tp (its fp32 update) before the iteration: the gathered
output is tp times the rank's part (what the dry run counts), of which (tp-1)/tp arrives over the wire. ZeRO moves no
more messages for Muon, only its buckets' padding (whole matrices pad each slice to the fullest owner's), which
plan/state.py's Bucket.padded already counts in every ZeRO term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tetron.config import Config
from tetron.optim import optimizer_class
from tetron.plan.state import F32, Chunk, _layer_params, chunk_buckets, rank_chunks


@dataclass(frozen=True)
class MuonWork:
    """One rank's Newton-Schulz work and tensor-parallel gathers in one optimizer step."""

    ns_flops: int  # Newton-Schulz FLOPs
    matrices: int  # whole matrices it orthogonalises (an expert's each)
    tp_gather_bytes: int  # the gathered outputs of its all-gathers over tp (fp32 updates of the matrices tp cuts)


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    """Newton-Schulz FLOPs of each [rows, cols] matrix of a tensor of `shape` ([..., rows, cols])."""
    a, b = shape[-2:]
    m, n = min(a, b), max(a, b)
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m ** 3)


def _items(cfg: Config, chunk: Chunk, *, experts: bool) -> list[list[tuple[int, bool, int, int, int]]]:
    """Per unit of plan/state.py's chunk_units (root, then each layer): (elements on the rank, kept whole, NS
    FLOPs, matrices, tp-gathered bytes) of each parameter. `experts`: with the routed experts' tensors."""
    kind, p = optimizer_class(cfg.optim.name), cfg.parallel
    steps = cfg.optim.muon_ns_steps

    def layer(moe: bool) -> list[tuple[int, bool, int, int, int]]:
        found = []
        for n, what, _, role, shape in _layer_params(cfg, moe):
            if what == "expert" and not experts:
                continue
            whole = kind.whole(role)
            count = math.prod(shape[:-2]) // (p.ep if what == "expert" else 1) if whole else 0
            flops = ns_flops(shape, steps) // (p.ep if what == "expert" else 1) if whole else 0
            cut = what != "expert" and n != math.prod(shape)  # tp's part of the matrix
            found.append((n, whole, flops, count, F32 * n * p.tp if whole and cut else 0))
        return found

    root = [(0, False, 0, 0, 0)] * ((1 if chunk.first else 0) + (1 if chunk.last else 0))  # AdamW's: embedding,
    if chunk.last and not (cfg.model.tie_word_embeddings and chunk.first):  # final norm and head
        root.append((0, False, 0, 0, 0))
    dense, moe = layer(False), (layer(True) if chunk.moe else [])
    return [root] + [dense] * (chunk.layers - chunk.moe) + [moe] * chunk.moe


def _expert_items(cfg: Config, chunk: Chunk) -> list[list[tuple[int, bool, int, int, int]]]:
    """The routed experts' tensors of each MoE layer, under ep in buckets of their own (plan/state.py's order)."""
    kind, p, steps = optimizer_class(cfg.optim.name), cfg.parallel, cfg.optim.muon_ns_steps
    per_layer = [(n, kind.whole(role), ns_flops(shape, steps) // p.ep if kind.whole(role) else 0,
                  math.prod(shape[:-2]) // p.ep if kind.whole(role) else 0, 0)
                 for n, what, _, role, shape in _layer_params(cfg, True) if what == "expert"]
    return [[]] + [per_layer] * chunk.moe


def _in_bucket_order(units: list[list[tuple]], first: bool, per_unit: bool) -> list[tuple]:
    """The whole parameters' items in the order plan/state.py's _buckets puts them in their buckets."""
    if per_unit:
        return [x for u in reversed(units) for x in u if x[1]]
    root, *layers = units
    embed = root[:1] if first else []
    ordered = [*embed, *(x for layer in layers for x in layer), *root[len(embed):]]
    return [x for x in reversed(ordered) if x[1]]


def muon_work(cfg: Config, pp_rank: int = 0, *, dp_rank: int = 0) -> MuonWork:
    """Pipeline rank `pp_rank`'s (and dp*cp rank `dp_rank`'s) Muon work in one step; zero for another optimizer."""
    p = cfg.parallel
    if not optimizer_class(cfg.optim.name).needs_whole_matrices:
        return MuonWork(0, 0, 0)
    flops = matrices = gathered = 0
    for chunk in rank_chunks(cfg, pp_rank):
        apart = p.ep > 1 and chunk.moe > 0
        buckets = chunk_buckets(cfg, chunk)
        groups = [(_in_bucket_order(_items(cfg, chunk, experts=not apart), chunk.first, p.zero == 3), False)]
        if apart:
            groups.append((_in_bucket_order(_expert_items(cfg, chunk), False, p.zero == 3), True))
        for items, expert in groups:
            mine = (dp_rank // p.ep if expert else dp_rank)
            at = 0
            for bucket in (b for b in buckets if b.whole and b.expert == expert):
                held = items[at:at + len(bucket.numels)]
                at += len(bucket.numels)
                if tuple(x[0] for x in held) != bucket.numels:
                    raise AssertionError("plan/muon.py's order of whole matrices is not plan/state.py's buckets'")
                owner = bucket.owners if bucket.shards > 1 else [0] * len(held)
                for (_, _, f, count, g), q in zip(held, owner):
                    if q == mine % bucket.shards:
                        flops, matrices, gathered = flops + f, matrices + count, gathered + g
    return MuonWork(flops, matrices, gathered)
