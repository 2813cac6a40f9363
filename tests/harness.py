"""Run a function on N ranks of a gloo process group, forked from this process.

Forking after torch is imported starts ranks in a fraction of a second (spawn or
torchrun cost 10-20 s), which keeps the parity matrix fast. Each rank returns a value
through a pipe; an exception or a hang in any rank fails the caller with its message.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.distributed as dist

# torch imports torch._dynamo (and sympy) the first time a process builds an optimizer or an empty_like on
# the meta device: 1.5-2 s of CPU. Imported here, before any fork, every forked rank inherits it instead of
# paying for it (tests/test_layouts.py alone: 93 s -> 42 s on 2 cores).


def _rank_main(fn: Callable, rank: int, world: int, init_file: str, conn, args: tuple, kwargs: dict) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=90))
        result = fn(*args, **kwargs)
        # Plain pickle to bytes: multiprocessing's pickler would pass tensors as shared-memory
        # handles, which vanish when this process exits right after sending. In-memory only.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()
        os._exit(0)


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """fn(*args, **kwargs) on each of `world` ranks; returns the per-rank results in rank order."""
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs, conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(fn, rank, world, init_file, child, args, kwargs))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        results, errors = [None] * world, []
        for rank, conn in enumerate(conns):
            if not conn.poll(timeout):
                errors.append(f"rank {rank}: no result within {timeout} s")
                continue
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                errors.append(f"rank {rank}: died without a result")
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        if errors:
            raise RuntimeError("\n".join(errors))
        return results


@contextlib.contextmanager
def saved_bytes(model: torch.nn.Module, *, by_storage: bool = False) -> Iterator[dict[int, int]]:
    """Storage bytes of what autograd saves for the backward inside the block, the model's weights left
    out: the activation memory held from the forward to the backward pass. Keyed by each tensor's data
    pointer, or with `by_storage` by its storage's, so that views into one buffer at other offsets (q, k, v
    of one all-to-all buffer; an expert's slice of its layer's fused weight) count it once."""
    where = (lambda t: t.untyped_storage().data_ptr()) if by_storage else (lambda t: t.data_ptr())
    params = {where(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if where(t) not in params:
            saved[where(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
