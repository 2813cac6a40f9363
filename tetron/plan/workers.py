"""A large search's layouts predicted in forked processes, one group of them per process.

Each layout's prediction is independent of the others', and the walk over its schedule and the measurement of its
layer shapes (probe.py) take a few milliseconds each: Llama-3-8B on 8 x 8 H100 has 37,548 layouts. The layouts are
grouped by what decides their layer's measurement (tp, cp; the probe's cache is per process) and the groups dealt
to the processes, largest first, so that no two measure the same shape. What comes back through each pipe is the
predictions, not the configs (the parent rebuilds those from the layouts): a few hundred bytes a layout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Hashable
from multiprocessing.connection import wait
from typing import Any

MIN_LAYOUTS = 4096  # fewer are quicker in this process than the processes' start (a search of 8 ranks: ~1,800)


def workers_for(layouts: int) -> int:
    """How many processes a search of `layouts` layouts takes: this machine's usable cores, or 1 where few."""
    if layouts < MIN_LAYOUTS:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, layouts // (MIN_LAYOUTS // 4)))


def deal(keys: list[Hashable], workers: int) -> list[list[int]]:
    """The indices of `keys` in `workers` lists, those of one key in one list, each group to the list holding the
    fewest so far (the largest group first); each list in increasing order."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    dealt: list[list[int]] = [[] for _ in range(workers)]
    for group in sorted(groups.values(), key=len, reverse=True):
        min(dealt, key=len).extend(group)
    return [sorted(d) for d in dealt if d]


def run_dealt(fn: Callable[[int], Any], keys: list[Hashable], workers: int, *,
              tick: Callable[[int, int], None] | None = None, every_s: float = 5.0) -> list[Any]:
    """[fn(i) for i in range(len(keys))], computed in `workers` forked processes (see deal; 1: in this one), in
    order. `tick(done, valid)` is called every `every_s` seconds while they run, `valid` counting the results that
    are not str."""
    if workers <= 1:
        return _in_this_process(fn, len(keys), tick, every_s)
    ctx = mp.get_context("fork")
    done, valid = ctx.Value("q", 0), ctx.Value("q", 0)
    procs, conns = [], []
    for indices in deal(keys, workers):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_work, args=(fn, indices, child, done, valid), daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    results: list[Any] = [None] * len(keys)
    pending, last = list(conns), time.monotonic()
    try:
        while pending:
            for conn in wait(pending, timeout=every_s):
                try:
                    status, payload = conn.recv()
                except EOFError:  # killed before it could say (out of memory, a signal)
                    proc = procs[conns.index(conn)]
                    proc.join()
                    status, payload = "error", f"it ended with exit code {proc.exitcode}"
                if status == "error":  # the process's own exception where it could be sent (a ConfigError stays one)
                    raise payload if isinstance(payload, Exception) else RuntimeError(f"a search process failed: "
                                                                                       f"{payload}")
                for i, result in payload:
                    results[i] = result
                pending.remove(conn)
            if tick is not None and time.monotonic() - last >= every_s:
                last = time.monotonic()
                tick(done.value, valid.value)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    return results


def _in_this_process(fn: Callable[[int], Any], n: int, tick: Callable[[int, int], None] | None,
                     every_s: float) -> list[Any]:
    results, valid, last = [], 0, time.monotonic()
    for i in range(n):
        if tick is not None and time.monotonic() - last >= every_s:
            last = time.monotonic()
            tick(i, valid)
        results.append(fn(i))
        valid += not isinstance(results[-1], str)
    return results


def _work(fn: Callable[[int], Any], indices: list[int], conn, done, valid) -> None:
    try:
        out = []
        for i in indices:
            out.append((i, fn(i)))
            with done.get_lock():
                done.value += 1
            if not isinstance(out[-1][1], str):
                with valid.get_lock():
                    valid.value += 1
        conn.send(("ok", out))
    except BaseException as err:  # the parent raises it and stops; a traceback here would interleave with its
        try:
            conn.send(("error", err))
        except Exception:  # not picklable: its name and message
            conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()
