"""Would these P2P batches deadlock on NCCL? Record what each rank posts and waits for (on gloo), then replay
it under NCCL's rules.

NCCL's rules, as ProcessGroupNCCL applies them to `batch_isend_irecv`: each batch is one NCCL group on the
process group's one communicator, run in order on its one stream (a later batch starts only once the
earlier ones have finished); a send completes only while the matching receive runs on its peer (true of
any message larger than NCCL's buffers: activations, key/value blocks), the k-th send from a to b matching
the k-th receive on b from a; a batch's kernels wait for the compute queued before it was posted, and
compute queued after a `work.wait()` waits for that batch. gloo has none of these couplings, which is why
an order that runs on gloo can still hang on NCCL.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch.distributed as dist

# One rank's program: ("post", comm, [(kind, peer), ...]) and ("wait", batch index on that rank).
Event = tuple


class Recorder:
    """Patches dist.batch_isend_irecv in this rank's process to log its batches and their waits."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.batches = 0

    def install(self) -> None:
        """In a forked rank only: the patch lasts as long as the process."""
        real = dist.batch_isend_irecv
        recorder = self

        class _Work:
            def __init__(self, work: Any, index: int) -> None:
                self.work, self.index = work, index

            def wait(self, *args: Any) -> Any:
                recorder.events.append(("wait", self.index))
                return self.work.wait(*args)

            def is_completed(self) -> bool:
                return self.work.is_completed()

        def batch(ops: list[dist.P2POp]) -> list[_Work]:
            comm = tuple(dist.get_process_group_ranks(ops[0].group))
            kinds = [("send" if op.op in (dist.isend, dist.send) else "recv", op.peer) for op in ops]
            index = recorder.batches
            recorder.batches += 1
            recorder.events.append(("post", comm, kinds))
            return [_Work(w, index) for w in real(ops)]

        dist.batch_isend_irecv = batch


def deadlocked(programs: dict[int, list[Event]]) -> list[str]:
    """Replay every rank's program under NCCL's rules; the batches that never finish (empty: no deadlock)."""
    batches: dict[tuple[int, int], dict] = {}  # (rank, index) -> {comm, ops, after: waits before the post}
    for rank, events in programs.items():
        waited: list[int] = []
        index = 0
        for event in events:
            if event[0] == "wait":
                waited.append(event[1])
            else:
                batches[(rank, index)] = {"comm": event[1], "ops": event[2], "after": list(waited)}
                index += 1
    # match the k-th send a->b with the k-th receive on b from a, per communicator
    counts: dict[tuple, int] = defaultdict(int)
    where: dict[tuple, tuple[int, int]] = {}
    for (rank, index), b in sorted(batches.items()):
        for kind, peer in b["ops"]:
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            key = (b["comm"], src, dst, kind)
            where[(key, counts[key])] = (rank, index)
            counts[key] += 1
    partners: dict[tuple[int, int], set] = defaultdict(set)
    for (key, k), (rank, index) in where.items():
        comm, src, dst, kind = key
        other = where.get(((comm, src, dst, "recv" if kind == "send" else "send"), k))
        partners[(rank, index)].add(other)  # None: a message nobody receives, which never finishes
    return _replay(batches, partners)


def _replay(batches: dict, partners: dict) -> list[str]:
    started, done = set(), set()
    order = defaultdict(list)  # (rank, comm) -> its batches in posting order: one stream each
    for (rank, index), b in sorted(batches.items()):
        order[(rank, b["comm"])].append((rank, index))
    progress = True
    while progress:
        progress = False
        for queue in order.values():
            head = next((x for x in queue if x not in done), None)
            if head is None:
                continue
            if head not in started and all((head[0], w) in done for w in batches[head]["after"]):
                started.add(head)
                progress = True
            if head in started and all(p is not None and p in started for p in partners[head]):
                done.add(head)
                progress = True
    return [f"rank {r} batch {i} {batches[(r, i)]['ops']}" for (r, i) in sorted(set(batches) - done)]
