"""The pipeline schedule as the memory model walks it (plan/memory.py): each pipeline rank's forwards and
backwards in order, and the stage-to-stage buffers P2P holds meanwhile."""

from __future__ import annotations

import functools

from tetron.config import Config
from tetron.parallel.pipeline_schedules import (
    Action,
    receives,
    replay,
    schedule,
    schedule_spec,
    sends,
    splits_backward,
    style_of,
)


def actions(cfg: Config, pp_rank: int) -> tuple[Action, ...]:
    """This rank's forwards and backwards in order: the pipeline schedule, or without pp one micro-batch
    after another (train.forward_backward), each forward followed by its backward. Walking it gives the
    micro-batches in flight that Megatron's theoretical memory takes as a formula (the first stage: all m
    under all-forward-all-backward, p under 1F1B, p + (p-1)/v micro-batches' worth interleaved). 1F1B and interleaved
    reach their most micro-batches in flight within 2*pp of them and then repeat: a longer step is
    represented by its first 2*pp (all-forward-all-backward holds every one, so it keeps them all)."""
    p = cfg.parallel
    return _schedule(p.pp_schedule if p.pp > 1 else "", p.pp, p.pp_virtual, walked_micro_batches(cfg), pp_rank)


def walked_micro_batches(cfg: Config) -> int:
    """The micro-batches the walk takes: all of them without pp or where the schedule holds every one at once
    (afab), else the first 2*pp, within which a schedule reaches its most in flight."""
    p, m = cfg.parallel, cfg.train.grad_acc
    return m if p.pp == 1 or schedule_spec(p.pp_schedule).holds_every_micro_batch else min(m, 2 * p.pp)


# A search revisits each (schedule, pp, virtual, micro-batches) shape once per ZeRO stage, recomputation and ep
# it tries, with other shapes between: caches large enough to hold a whole search's (a few thousand entries)
# compute each once (a smaller one was evicted between the visits and rebuilt it every time).
@functools.lru_cache(maxsize=16384)
def _schedule(name: str, pp: int, virtual: int, micro_batches: int, rank: int) -> tuple[Action, ...]:
    if not name:  # the second micro-batch on are alike but for the last, which reduces: those stand for all
        kept = sorted({0, 1, micro_batches - 1} & set(range(micro_batches)))
        return tuple(Action(backward, 0, k) for k in kept for backward in (False, True))
    return tuple(schedule(name, pp=pp, virtual=virtual, micro_batches=micro_batches, rank=rank))


@functools.lru_cache(maxsize=4096)
def _timeline(name: str, pp: int, virtual: int, micro_batches: int, backward_cost: float) -> tuple:
    """(start, end) of every action of every pipeline rank, replayed with free communication: a forward
    takes 1, a backward `backward_cost`, each starts once its rank is free and its input has been sent
    (pipeline_schedules.replay)."""
    # the zero-bubble schedules' B and W take half a backward each
    cost = backward_cost / 2 if splits_backward(name) else backward_cost
    times = replay(name, pp=pp, virtual=virtual, micro_batches=micro_batches,
                   duration=lambda r, k, a: cost if a.backward else 1.0)
    return tuple(tuple(t) for t in times)


def pipeline_buffers(cfg: Config, pp_rank: int) -> list[int]:
    """For each action of `pp_rank`, how many [micro_batch, seq, hidden] buffers P2P holds meanwhile: the
    receive in use or posted ahead (one while any receiving action remains), and the tensors it has sent
    that are still held (pipeline_parallel keeps a send's tensor until the send is complete and its next
    `_post` drops it). A send completes once the receiver has posted the matching receive, which it does
    one at a time, in order, at the end of its previous receiving action (or at the start of the step)."""
    p = cfg.parallel
    if p.pp == 1:
        return [0] * len(actions(cfg, pp_rank))
    return list(_buffers(p.pp_schedule, p.pp, p.pp_virtual, walked_micro_batches(cfg),
                         3.0 if cfg.train.recompute == "full" else 2.0)[pp_rank])


@functools.lru_cache(maxsize=4096)
def _buffers(name: str, pp: int, virtual: int, micro_batches: int, backward_cost: float) -> tuple:
    """pipeline_buffers of every rank of one schedule."""
    times = _timeline(name, pp, virtual, micro_batches, backward_cost)
    orders = [_schedule(name, pp, virtual, micro_batches, r) for r in range(pp)]
    style = style_of(name)
    needs = [[receives(a, pp=pp, virtual=virtual, rank=r, style=style) for a in o] for r, o in enumerate(orders)]
    posted = {}  # message -> when its receive was posted
    for r in range(pp):
        previous = 0.0
        for k, need in enumerate(needs[r]):
            if need is not None:
                posted[need[0]] = previous
                previous = times[r][k][1]
    result = []
    for r, order in enumerate(orders):
        ends = [end for _, end in times[r]]
        last = max((k for k, need in enumerate(needs[r]) if need), default=-1)
        held = [int(k <= last) for k in range(len(order))]
        for k, action in enumerate(order):
            out = sends(action, pp=pp, virtual=virtual, rank=r, style=style)
            if out is None:
                continue
            done = max(ends[k], posted[out[0]])
            drop = next((j for j in range(k + 1, len(ends)) if ends[j] >= done), len(ends))
            for j in range(k + 1, min(drop + 1, len(ends))):
                held[j] += 1
        result.append(tuple(held))
    return tuple(result)
