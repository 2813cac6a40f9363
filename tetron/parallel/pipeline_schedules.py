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

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2024) split each backward in two:
B, the gradient of the stage's input, which the previous stage is waiting for, and W, the gradients of
the stage's weights, which only the optimizer needs. Only B is on the critical path, so W can fill
what would otherwise be bubble. With equal F, B and W times:
- zbh1 (ZB-H1): 1F1B's order of F and B, with rank r holding back its W's by r places, so every rank
  holds at most p micro-batches from F to W (1F1B's rank 0; 1F1B's memory), and the W's fill the drain:
  the bubble is (p-1)/(3m+p-1) once m >= p, a third of 1F1B's in time.
- zbv (ZB-V): two chunks per rank in a V: rank r holds virtual stage r (chunk 0) and 2p-1-r (chunk 1),
  so rank 0 holds the first and the last stage and rank p-1 hands its chunk 0's output to its own
  chunk 1. Warm-up forwards fill the V, then each rank alternates F, B, W on its two chunks: the bubble
  is p-1 chunk passes (half a forward each; 1F1B: 3(p-1) forwards) once m >= (3p-1)/2, with at most
  2p (chunk, micro-batch) pairs in flight, p micro-batches of a rank's layers like 1F1B's rank 0.

- dualpipev (DeepSeek's DualPipeV): zbv's V, its steady state pairing each forward with the whole backward of
  another micro-batch on the other chunk (DualPipe overlaps the two on a GPU: one's compute with the other's
  communication), its warm-up and drain zero-bubble. From 2p micro-batches on (it needs them) its bubble is
  zbv's, with one more (chunk, micro-batch) pair in flight at the peak.

Registered. A schedule is one function (the actions of one rank) and one `register_schedule(ScheduleSpec(...))`
that declares what the code around it needs to know: how many chunks per rank it runs, whether it splits
backwards into B and W, how it places stages, what it needs of pp and the micro-batches. The config's
allowed values, the checks before start (validate.py), the runner and the planner read those declarations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from tetron.overrides import one_of


@dataclass(frozen=True)
class Action:
    """One pass of micro-batch `micro` through local chunk `chunk`: a forward (backward=False) or a
    backward (backward=True). In the zero-bubble schedules a backward is split: B (backward=True) is the
    gradient of the chunk's input only, and W (backward=True, weight=True), later, its weights' gradients."""

    backward: bool
    chunk: int
    micro: int
    weight: bool = False

    @property
    def kind(self) -> str:
        return "W" if self.weight else "B" if self.backward else "F"

    def __repr__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.micro}"


def _f(chunk: int, micro: int) -> Action:
    return Action(False, chunk, micro)


def _b(chunk: int, micro: int) -> Action:
    return Action(True, chunk, micro)


def _w(chunk: int, micro: int) -> Action:
    return Action(True, chunk, micro, weight=True)


def style_of(name: str) -> str:
    """How a schedule places virtual stages on ranks: "v" for zbv, else "loop" (stage = chunk*p + rank)."""
    return SCHEDULES[name].style if name in SCHEDULES else "loop"


def stage_of(chunk: int, rank: int, *, pp: int, style: str = "loop") -> int:
    """The virtual stage that pipeline rank `rank` holds as its chunk `chunk`."""
    if style == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of(stage: int, *, pp: int, style: str = "loop") -> int:
    """The pipeline rank that holds virtual stage `stage`."""
    if style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


@dataclass(frozen=True)
class Message:
    """What travels between ranks: "act", the input of virtual stage `stage` for micro-batch `micro`,
    or "grad", the gradient of that stage's output."""

    kind: str
    stage: int
    micro: int


def receives(action: Action, *, pp: int, virtual: int, rank: int, style: str = "loop") -> tuple[Message, int] | None:
    """What `action` of pipeline rank `rank` needs from another rank, and which: None if nothing
    (the first virtual stage's forward reads tokens, the last one's backward starts from its loss,
    a W uses what its B left)."""
    s, last = stage_of(action.chunk, rank, pp=pp, style=style), pp * virtual - 1
    if action.weight:
        return None
    if action.backward:
        return None if s == last else (Message("grad", s, action.micro), rank_of(s + 1, pp=pp, style=style))
    return None if s == 0 else (Message("act", s, action.micro), rank_of(s - 1, pp=pp, style=style))


def sends(action: Action, *, pp: int, virtual: int, rank: int, style: str = "loop") -> tuple[Message, int] | None:
    """What `action` of pipeline rank `rank` produces for another rank, and which: None if nothing."""
    s, last = stage_of(action.chunk, rank, pp=pp, style=style), pp * virtual - 1
    if action.weight:
        return None
    if action.backward:
        return None if s == 0 else (Message("grad", s - 1, action.micro), rank_of(s - 1, pp=pp, style=style))
    return None if s == last else (Message("act", s + 1, action.micro), rank_of(s + 1, pp=pp, style=style))


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


def zbh1(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """ZB-H1: 1F1B's forwards and B's, each B followed by the W of the micro-batch `rank` places
    earlier; the W's held back run once the B's are done, where 1F1B would wait for gradients."""
    m = micro_batches
    warmup = min(pp - rank - 1, m)
    delay = rank  # rank r holds p - r micro-batches to their B in 1F1B: r more to their W makes p
    order = [_f(0, i) for i in range(warmup)]
    for i in range(m):
        order += [_f(0, warmup + i)] if warmup + i < m else []
        order += [_b(0, i)] + ([_w(0, i - delay)] if i >= delay else [])
    return order + [_w(0, i) for i in range(max(0, m - delay), m)]


def zbv(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """ZB-V (two chunks in a V; torch's ScheduleZBVZeroBubble has the same order). Warm-up: chunk 0
    forwards to fill the way down, then chunk 1 and chunk 0 in turn, then chunk 1's F, B, W as the
    first gradients turn at rank p-1; steady state F, B, W on chunk 0, then on chunk 1; the drain
    runs the B's first and the W's they leave behind after. Built for at least 2p-1 micro-batches
    (what fills the V), then the missing ones are left out, which keeps every dependency."""
    p, n = pp, max(2 * pp - 1, micro_batches)
    order: list[Action] = []
    count = {kind: [0, 0] for kind in "FBW"}

    def add(kind: str, chunk: int) -> None:
        order.append(Action(kind != "F", chunk, count[kind][chunk], weight=kind == "W"))
        count[kind][chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        add("F", 0)
    for _ in range(rank):
        add("F", 1), add("F", 0)
    for _ in range(p - rank):
        add("F", 1), add("B", 1), add("W", 1)
    while count["F"][1] < count["F"][0] or count["F"][0] < n:
        if count["F"][0] < n:
            add("F", 0)
        for kind in ("B", "W"):
            add(kind, 0)
        for kind in ("F", "B", "W"):
            add(kind, 1)
    for _ in range(rank):
        add("B", 0), add("B", 1)
    for _ in range(p - rank):
        add("B", 0), add("W", 0)
    for chunk in (1, 0):
        while count["W"][chunk] < count["B"][chunk]:
            add("W", chunk)
    return [a for a in order if a.micro < micro_batches]


def dualpipev(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half; torch's ScheduleDualPipeV has the same order): zbv's V of two
    chunks, its steady state pairing the forward of one micro-batch on one chunk with the whole backward (B and
    then W) of another on the other chunk (F0 with B1, then F1 with B0), where DualPipe overlaps one's compute
    with the other's communication; the warm-up (B1 W F1) and the drain (the second half of the B's split, their
    W's last) are zero-bubble. It needs at least 2p micro-batches (what fills the V; torch's refuses fewer too)."""
    if micro_batches < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2*pp={2 * pp} micro-batches, not {micro_batches}")
    p, n = pp, micro_batches
    order: list[Action] = []
    count = {kind: [0, 0] for kind in "FBW"}
    pending: list[int] = []  # chunks of the B's whose W is still to come, oldest first

    def add(kind: str, chunk: int, *, whole: bool = False) -> None:  # whole: a backward as B then W at once
        if kind == "W":
            chunk = pending.pop(0) if pending else -1
            if chunk < 0:
                return
        order.append(Action(kind != "F", chunk, count[kind][chunk], weight=kind == "W"))
        count[kind][chunk] += 1
        if kind == "B":
            if whole:
                order.append(Action(True, chunk, count["W"][chunk], weight=True))
                count["W"][chunk] += 1
            else:
                pending.append(chunk)

    for _ in range(2 * (p - rank - 1)):
        add("F", 0)
    for _ in range(rank + 1):
        add("F", 0), add("F", 1)
    for _ in range(p - rank - 1):
        add("B", 1), add("W", -1), add("F", 1)
    for _ in range(n - 2 * p + rank + 1):  # the main step: F0 with B1, F1 with B0
        add("F", 0), add("B", 1, whole=True), add("F", 1), add("B", 0, whole=True)
    for _ in range(p - rank - 1):
        add("B", 1, whole=True), add("F", 1), add("B", 0, whole=True)
    split = False
    for i in range(rank + 1):  # B1 B0, the second half split into B and W
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add("B", 1, whole=not split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add("B", 0, whole=not split)
    for _ in range(p - rank - 1):
        add("W", -1), add("B", 0, whole=not split)
    while pending:
        add("W", -1)
    return order


@dataclass(frozen=True)
class ScheduleSpec:
    """A pipeline schedule: its actions, and what the runner, the checks before start and the planner need to
    know of it. `order` gives one rank's actions: order(pp, micro_batches, rank) for a schedule with a fixed
    number of chunks per rank (`virtual`), order(pp, virtual, micro_batches, rank) for one that takes any
    number (virtual None: parallel.pp_virtual chooses)."""

    name: str
    order: Callable[..., list[Action]]
    virtual: int | None = 1  # chunks (virtual stages) per rank; None: any number
    splits_backward: bool = False  # each backward is B, then W later (weight_grad.py)
    style: str = "loop"  # how stages sit on ranks: "loop" (stage = chunk*p + rank) or "v" (zbv's V)
    min_pp: int = 1  # the fewest pipeline ranks it runs on
    micro_batches_per_pp: bool = False  # needs micro_batches to be a multiple of pp
    min_micro_batches_per_pp: int = 0  # needs at least this many micro-batches per pipeline rank
    holds_every_micro_batch: bool = False  # a rank holds all m micro-batches at once (afab): the planner walks all m
    # the idle fraction of a step with equal stages and free communication (pp, virtual, micro_batches);
    # None: (p-1)/(v*m+p-1), 1F1B's and the interleaved schedule's
    bubble: Callable[[int, int, int], float] | None = None

    def actions(self, *, pp: int, virtual: int, micro_batches: int, rank: int) -> list[Action]:
        """The actions of pipeline rank `rank`; raises ValueError for a number of chunks it does not run."""
        if self.virtual is None:
            return self.order(pp, virtual, micro_batches, rank)
        if virtual != self.virtual:
            if self.style == "v":
                raise ValueError(f"schedule {self.name!r} runs exactly two chunks per rank (a V), not {virtual}")
            runs = "one chunk" if self.virtual == 1 else f"{self.virtual} chunks"
            raise ValueError(f"schedule {self.name!r} runs {runs} per rank, not {virtual}; use interleaved")
        return self.order(pp, micro_batches, rank)


SCHEDULES: dict[str, ScheduleSpec] = {}  # name -> schedule; filled by register_schedule()


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Make `spec` a schedule parallel.pp_schedule can name."""
    if spec.style not in ("loop", "v"):
        raise ValueError(f"schedule {spec.name!r}: style {spec.style!r} is not 'loop' or 'v'")
    SCHEDULES[spec.name] = spec
    return spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule `name`; ValueError naming the registered ones for another name."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; use {one_of(tuple(SCHEDULES))}")
    return SCHEDULES[name]


def forward_only(virtual: int, micro_batches: int) -> list[Action]:
    """Every rank's actions of a forward-only pass (validation): (micro-batch, chunk) pairs in that order, which
    every stage's inputs follow (each needs only an earlier micro-batch or an earlier stage), so no rank waits
    on one that waits on it, whatever the placement."""
    return [Action(False, c, i) for i in range(micro_batches) for c in range(virtual)]


def schedule(name: str, *, pp: int, virtual: int, micro_batches: int, rank: int) -> list[Action]:
    """The actions of pipeline rank `rank` under schedule `name` (afab, 1f1b, interleaved, zbh1, zbv, ...)."""
    return schedule_spec(name).actions(pp=pp, virtual=virtual, micro_batches=micro_batches, rank=rank)


def splits_backward(name: str) -> bool:
    """Whether schedule `name` runs each backward as a B and a later W (the zero-bubble schedules)."""
    return name in SCHEDULES and SCHEDULES[name].splits_backward


def _zbh1_bubble(pp: int, virtual: int, micro_batches: int) -> float:
    """ZB-H1 idles p-1 forward times once m >= p (1F1B: 3(p-1)), p-m more with fewer micro-batches (too few
    W's to fill the drain)."""
    idle = 2 * pp - 1 - min(micro_batches, pp)  # forward times
    return idle / (3 * micro_batches + idle)


def _zbv_bubble(pp: int, virtual: int, micro_batches: int) -> float:
    """ZB-V idles p-1 chunk passes (half a forward each) once m >= (3p-1)/2, and 4p-2-2m with fewer
    micro-batches (the V is not full)."""
    idle = max(pp - 1, 4 * pp - 2 - 2 * micro_batches)  # chunk passes; a rank does 6 per micro-batch
    return idle / (6 * micro_batches + idle)


register_schedule(ScheduleSpec("afab", afab, holds_every_micro_batch=True))
register_schedule(ScheduleSpec("1f1b", one_f_one_b))
register_schedule(ScheduleSpec("interleaved", interleaved, virtual=None, min_pp=2, micro_batches_per_pp=True))
register_schedule(ScheduleSpec("zbh1", zbh1, splits_backward=True, bubble=_zbh1_bubble))
register_schedule(ScheduleSpec("zbv", zbv, virtual=2, splits_backward=True, style="v", min_pp=2, bubble=_zbv_bubble))
# the V full from 2p micro-batches on: zbv's p-1 chunk passes
register_schedule(ScheduleSpec("dualpipev", dualpipev, virtual=2, splits_backward=True, style="v", min_pp=2,
                               min_micro_batches_per_pp=2, bubble=_zbv_bubble))


def theoretical_bubble(name: str, *, pp: int, virtual: int, micro_batches: int) -> float:
    """Fraction of a step a rank idles with equal stages and no communication cost, a backward taking
    twice a forward (B and W one forward each): (p-1)/(v*m+p-1) for afab, 1f1b and interleaved; a
    schedule's own `bubble` where it declares one (the zero-bubble schedules)."""
    spec = schedule_spec(name)
    if spec.bubble is not None:
        return spec.bubble(pp, virtual, micro_batches)
    v = virtual if spec.virtual is None else spec.virtual
    return (pp - 1) / (v * micro_batches + pp - 1)


def peak_in_flight(actions: list[Action]) -> int:
    """The most (chunk, micro-batch) pairs whose forward has run and whose backward has not finished
    (its W in the zero-bubble schedules: what B leaves for W is held until then)."""
    split = any(a.weight for a in actions)
    held, peak = 0, 0
    for action in actions:
        if not action.backward:
            held += 1
        elif action.weight or not split:
            held -= 1
        peak = max(peak, held)
    return peak


def replay(name: str, *, pp: int, virtual: int, micro_batches: int,
           duration: Callable[[int, int, Action], float]) -> list[list[tuple[float, float]]]:
    """Play every rank's actions against each other with free communication: action k of rank r
    takes duration(r, k, action) and starts once its rank is free and its input has been sent.
    Returns the (start, end) of each rank's actions; raises if some rank waits forever (a deadlock)."""
    orders, needs, outs = _messages(name, pp, virtual, micro_batches)
    ready: dict[tuple, float] = {}  # message -> when it was sent
    times: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while len(times[r]) < len(orders[r]):
                k = len(times[r])
                action = orders[r][k]
                need = needs[r][k]
                if need is not None and need not in ready:
                    break
                start = max(clock[r], ready[need] if need else 0.0)
                clock[r] = start + duration(r, k, action)
                times[r].append((start, clock[r]))
                out = outs[r][k]
                if out is not None:
                    ready[out] = clock[r]
                moved = True
    if [len(t) for t in times] != [len(order) for order in orders]:
        raise RuntimeError(f"schedule {name} (pp={pp}, virtual={virtual}, micro_batches={micro_batches}) deadlocks")
    return times


@functools.lru_cache(maxsize=4096)  # the planner replays each shape with many durations
def _messages(name: str, pp: int, virtual: int, micro_batches: int) -> tuple[tuple, tuple, tuple]:
    """Every rank's actions, and each action's input and output message as a (kind, stage, micro) tuple (or None):
    found once, as a blocked action is looked at again on every pass of `replay`."""
    orders = tuple(tuple(schedule(name, pp=pp, virtual=virtual, micro_batches=micro_batches, rank=r))
                   for r in range(pp))
    style = style_of(name)

    def message(found: tuple[Message, int] | None) -> tuple | None:
        return None if found is None else (found[0].kind, found[0].stage, found[0].micro)

    needs = tuple(tuple(message(receives(a, pp=pp, virtual=virtual, rank=r, style=style)) for a in o)
                  for r, o in enumerate(orders))
    outs = tuple(tuple(message(sends(a, pp=pp, virtual=virtual, rank=r, style=style)) for a in o)
                 for r, o in enumerate(orders))
    return orders, needs, outs


def simulate(name: str, *, pp: int, virtual: int, micro_batches: int,
             duration: Callable[[int, int, Action], float]) -> list[float]:
    """`replay`'s idle fraction of each rank over the whole span; raises on a deadlock."""
    times = replay(name, pp=pp, virtual=virtual, micro_batches=micro_batches, duration=duration)
    span = max(t[-1][1] for t in times if t)
    return [1 - sum(end - start for start, end in t) / span for t in times]


def unit_duration(name: str, virtual: int) -> Callable[[int, int, Action], float]:
    """The textbook costs: a forward 1/v, a backward 2/v (B and W 1/v each where the schedule splits it)."""
    backward = 1.0 if splits_backward(name) else 2.0
    return lambda rank, index, action: (backward if action.backward else 1.0) / virtual
