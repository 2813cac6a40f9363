"""When each pipeline rank posts each send and receive, so that no schedule can deadlock on NCCL.

NCCL runs a process group's P2P batches one after another on one stream, and a large message's send
finishes only while its receive runs on the peer. A receive posted early therefore holds up every later
send of its rank until its message arrives; if that message's sender waits, directly or through other
ranks, for one of those held sends, every rank waits forever (gloo, whose sends and receives progress
independently, never shows this). Posting each receive just before its action is not enough either:
interleaved and zero-bubble schedules then still form such cycles.

The rule used here cannot deadlock. Every message gets one global key, the same on every rank: the time
it is sent in a replay of all ranks' schedules (a forward takes 1, a backward 2, or B and W 1 each;
ties broken by sender and message), and every rank posts its sends and receives in increasing key
order, each send right after the action that produces it, each receive at the latest just before the
action that needs it. Then the unfinished message with the smallest key is at the head of both its
sender's and its receiver's stream (everything posted before it on either rank has a smaller key, so
is done), and so it completes; by induction, every message does. A receive also goes out as early as
that order allows, so data still arrives while its rank computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetron.parallel.pipeline_schedules import Action, Message, receives, schedule, sends, splits_backward, style_of


@dataclass(frozen=True)
class Op:
    """One send or receive of `message` with pipeline rank `peer`."""

    kind: str  # "send" or "recv"
    message: Message
    peer: int
    key: tuple  # (send time, sender, kind, stage, micro): the same on both ends


def _send_times(orders: list[list[Action]], *, pp: int, virtual: int, style: str,
                split: bool) -> dict[Message, tuple[float, int]]:
    """Each message's (send time, sender rank) in a replay of every rank's actions with free communication."""
    sent: dict[Message, tuple[float, int]] = {}
    clock, done, moved = [0.0] * pp, [0] * pp, True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while done[r] < len(order):
                action = order[done[r]]
                need = receives(action, pp=pp, virtual=virtual, rank=r, style=style)
                if need is not None and need[0] not in sent:
                    break
                cost = (1.0 if split else 2.0) if action.backward else 1.0
                clock[r] = max(clock[r], sent[need[0]][0] if need else 0.0) + cost
                out = sends(action, pp=pp, virtual=virtual, rank=r, style=style)
                if out is not None:
                    sent[out[0]] = (clock[r], r)
                done[r] += 1
                moved = True
    if done != [len(order) for order in orders]:
        raise RuntimeError(f"pipeline actions (pp={pp}, virtual={virtual}) deadlock: {orders}")
    return sent


def posting_plan(name: str, *, pp: int, virtual: int, micro_batches: int, rank: int) -> list[list[Op]]:
    """The P2P operations pipeline rank `rank` posts, as one batch each, at each point of its step: point 0
    before its first action, point k+1 right after action k. Messages to itself (zbv's turn) are no P2P."""
    orders = [schedule(name, pp=pp, virtual=virtual, micro_batches=micro_batches, rank=r) for r in range(pp)]
    return orders_posting_plan(orders, pp=pp, virtual=virtual, rank=rank, style=style_of(name),
                               split=splits_backward(name))


def orders_posting_plan(orders: list[list[Action]], *, pp: int, virtual: int, rank: int, style: str,
                        split: bool) -> list[list[Op]]:
    """posting_plan for given actions of every rank (`orders[r]`: rank r's), such as a forward-only pass."""
    times = _send_times(orders, pp=pp, virtual=virtual, style=style, split=split)
    actions = orders[rank]
    name = f"pipeline rank {rank}"
    key = lambda m: (*times[m], m.kind, m.stage, m.micro)  # noqa: E731
    pending: list[Op] = []  # every op of this rank, in key order
    for action in actions:
        need = receives(action, pp=pp, virtual=virtual, rank=rank, style=style)
        out = sends(action, pp=pp, virtual=virtual, rank=rank, style=style)
        if need is not None and need[1] != rank:
            pending.append(Op("recv", need[0], need[1], key(need[0])))
        if out is not None and out[1] != rank:
            pending.append(Op("send", out[0], out[1], key(out[0])))
    pending.sort(key=lambda op: op.key)
    plan: list[list[Op]] = []
    for point in range(len(actions) + 1):
        # everything up to the send of the action just run, and the receive of the next action
        bounds = []
        if point > 0:
            out = sends(actions[point - 1], pp=pp, virtual=virtual, rank=rank, style=style)
            bounds += [key(out[0])] if out is not None and out[1] != rank else []
        if point < len(actions):
            need = receives(actions[point], pp=pp, virtual=virtual, rank=rank, style=style)
            bounds += [key(need[0])] if need is not None and need[1] != rank else []
        upto = max(bounds, default=None)
        batch = [op for op in pending if upto is not None and op.key <= upto]
        pending = pending[len(batch):]
        plan.append(batch)
    assert not pending, f"{name}: ops left after the last action: {pending}"
    return plan
