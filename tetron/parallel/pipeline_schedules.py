"""Pipeline schedules as plain lists of actions: which forward or backward each rank runs, in order.

A schedule here is arithmetic on (pp, virtual, micro_batches, rank), with no tensors and no
processes, so it can be printed, checked and simulated on its own; `pipeline_parallel.py` runs it.

Vocabulary: p pipeline ranks, m micro-batches, v chunks (virtual stages) per rank. Virtual stage
`s = chunk*p + rank` holds the s-th block of layers, so activations go round the ranks v times:
rank p-1's chunk c feeds rank 0's chunk c+1. Stage 0 embeds the tokens, stage p*v-1 computes the loss.

- afab (GPipe): every forward, then every backward. A rank holds the activations of all m
  micro-batches at once.
- 1f1b (PipeDream-Flush): rank r runs p-r-1 warm-up forwards, then alternates one forward and one
  backward, then drains the backwards. At most p-r micro-batches are in flight on rank r; the idle
  time (the bubble) is the same as afab's, (p-1)/(m+p-1) of the step with m micro-batches.
- interleaved (Megatron's interleaved 1F1B): the same pattern over p*v virtual stages, micro-batches
  taken in groups of p per chunk. Each virtual stage is 1/v of a rank's work, so the bubble shrinks
  to (p-1)/(v*m+p-1), at the price of v times the P2P messages and a longer warm-up: rank r holds up
  to (v-1)*p + 2*(p-r-1) + 1 (chunk, micro-batch) pairs, each 1/v of its layers, so rank 0 holds
  about p + (p-1)/v micro-batches' worth of activations (1F1B: p).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, get_args

from tetron.config import PpSchedule, one_of


@dataclass(frozen=True)
class Action:
    """One forward (backward=False) or backward pass of micro-batch `micro` through local chunk `chunk`."""

    backward: bool
    chunk: int
    micro: int

    def __repr__(self) -> str:
        return f"{'B' if self.backward else 'F'}{self.chunk}.{self.micro}"


@dataclass(frozen=True)
class Message:
    """What travels between ranks: "act", the input of virtual stage `stage` for micro-batch `micro`,
    or "grad", the gradient of that stage's output."""

    kind: str
    stage: int
    micro: int


def receives(action: Action, *, pp: int, virtual: int, rank: int) -> tuple[Message, int] | None:
    """What `action` of pipeline rank `rank` needs from another rank, and which: None if nothing
    (the first virtual stage's forward reads tokens, the last one's backward starts from its loss)."""
    s, last = action.chunk * pp + rank, pp * virtual - 1
    if action.backward:
        return None if s == last else (Message("grad", s, action.micro), (s + 1) % pp)
    return None if s == 0 else (Message("act", s, action.micro), (s - 1) % pp)


def sends(action: Action, *, pp: int, virtual: int, rank: int) -> tuple[Message, int] | None:
    """What `action` of pipeline rank `rank` produces for another rank, and which: None if nothing."""
    s, last = action.chunk * pp + rank, pp * virtual - 1
    if action.backward:
        return None if s == 0 else (Message("grad", s - 1, action.micro), (s - 1) % pp)
    return None if s == last else (Message("act", s + 1, action.micro), (s + 1) % pp)


def afab(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """All forward, all backward (one chunk per rank); `pp` and `rank` do not change the order."""
    m = micro_batches
    return [Action(False, 0, i) for i in range(m)] + [Action(True, 0, i) for i in range(m)]


def one_f_one_b(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    m = micro_batches
    warmup = min(pp - rank - 1, m)  # forwards in flight before the first gradient can come back
    order = [Action(False, 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action(False, 0, warmup + i), Action(True, 0, i)]
    return order + [Action(True, 0, i) for i in range(m - warmup, m)]


def interleaved(pp: int, virtual: int, micro_batches: int, rank: int) -> list[Action]:
    """1F1B over p*v virtual stages (Megatron's order); needs micro_batches % pp == 0.

    The k-th forward of every rank is micro-batch (k // (p*v))*p + k % p of chunk (k % (p*v)) // p:
    p micro-batches through chunk 0, the same p through chunk 1, ..., then the next group of p.
    Backwards go through the chunks in reverse. The warm-up is twice the distance to the last rank
    (a gradient needs a round trip) plus one group of p for each extra chunk."""
    p, v, m = pp, virtual, micro_batches
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro_batches ({m}) to be a multiple of pp ({p})")
    total = m * v

    def nth(k: int, backward: bool) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action(backward, v - 1 - chunk if backward else chunk, group * p + within % p)

    warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)
    order = [nth(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        order += [nth(warmup + k, False), nth(k, True)]
    return order + [nth(k, True) for k in range(total - warmup, total)]


def schedule(name: str, *, pp: int, virtual: int, micro_batches: int, rank: int) -> list[Action]:
    """The actions of pipeline rank `rank` under schedule `name` ("afab", "1f1b" or "interleaved")."""
    if name == "interleaved":
        return interleaved(pp, virtual, micro_batches, rank)
    if virtual != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, not {virtual}; use interleaved")
    if name == "afab":
        return afab(pp, micro_batches, rank)
    if name == "1f1b":
        return one_f_one_b(pp, micro_batches, rank)
    raise ValueError(f"unknown pipeline schedule {name!r}; use {one_of(get_args(PpSchedule))}")


def theoretical_bubble(name: str, *, pp: int, virtual: int, micro_batches: int) -> float:
    """Fraction of a step a rank idles with equal stages and no communication cost: (p-1)/(v*m+p-1)."""
    v = virtual if name == "interleaved" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """The most (chunk, micro-batch) pairs whose forward has run and whose backward has not."""
    held, peak = 0, 0
    for action in actions:
        held += -1 if action.backward else 1
        peak = max(peak, held)
    return peak


def simulate(name: str, *, pp: int, virtual: int, micro_batches: int,
             duration: Callable[[int, int, Action], float]) -> list[float]:
    """Play every rank's actions against each other with free communication: action k of rank r
    takes duration(r, k, action) and starts once its rank is free and its input has been sent.
    Returns each rank's idle fraction of the whole; raises if some rank waits forever (a deadlock)."""
    orders = [schedule(name, pp=pp, virtual=virtual, micro_batches=micro_batches, rank=r) for r in range(pp)]
    ready: dict[Message, float] = {}  # message -> when it was sent
    clock, busy, done = [0.0] * pp, [0.0] * pp, [0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while done[r] < len(orders[r]):
                action = orders[r][done[r]]
                need = receives(action, pp=pp, virtual=virtual, rank=r)
                if need is not None and need[0] not in ready:
                    break
                cost = duration(r, done[r], action)
                clock[r] = max(clock[r], ready[need[0]] if need else 0.0) + cost
                busy[r] += cost
                out = sends(action, pp=pp, virtual=virtual, rank=r)
                if out is not None:
                    ready[out[0]] = clock[r]
                done[r] += 1
                moved = True
    if done != [len(order) for order in orders]:
        raise RuntimeError(f"schedule {name} (pp={pp}, virtual={virtual}, micro_batches={micro_batches}) deadlocks")
    return [1 - b / max(clock) for b in busy]
