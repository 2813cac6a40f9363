"""glibc's mmap threshold on CPU ranks: a tetron step's time and its peak resident set under each setting.

    python bench/allocator.py [--zero 0] [--dp 1] [--rounds 5] [--steps 2] [--hidden 256] [--layers 4] [--seq 256]
    python bench/allocator.py --model smollm-135m --zero 3 --dp 2 --seq 32 --micro-batch 1 --grad-acc 1

Each setting (`--settings`: `tetron`, as `tetron train` sets it for the ZeRO stage and model; `default`,
glibc untouched; `NMiB`/`NKiB`, a fixed threshold of that size, as `tetron.device.map_large_allocations`
sets it) trains in its own forked ranks, all set up as `tetron train` sets them up
(`tetron.launch.setup_rank`) except for the threshold. The parent runs them in turn, round
after round (`--steps` steps each), so load on the machine hits every setting alike; one setting computes
at a time. Printed per setting: the median step time and its ratio to the first setting's, and rank 0's
peak resident set per step (reset at each step's start), with steps 2 and later against step 2's (ZeRO-3's
"flat resident set", docs/memory.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tetron import device as dev  # noqa: E402
from tetron.config import from_dict  # noqa: E402
from tetron.data.loader import prepare_data  # noqa: E402
from tetron.launch import setup_rank  # noqa: E402
from tetron.mesh import Mesh  # noqa: E402
from tetron.train import build_run, train_step  # noqa: E402

CPU = torch.device("cpu")


def threshold_of(setting: str) -> int | None:
    """`default` -> None; `1MiB` -> 1048576; `512KiB` -> 524288 (`tetron`: as tetron train sets it)."""
    if setting in ("default", "tetron"):
        return None
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if setting.endswith(unit):
            return int(float(setting.removesuffix(unit)) * scale)
    raise ValueError(f"--settings: {setting!r} is not default, NMiB or NKiB")


def config(args: argparse.Namespace, out: str) -> dict:
    if args.model:
        model: dict | str = args.model
    else:
        model = {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.hidden * 8 // 3,
                 "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "max_position_embeddings": args.seq}
    return {"model": model,
            "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": args.seq, "max_bytes": 4_000_000,
                     "cache_dir": os.path.join(out, "cache")},
            "train": {"steps": 100_000, "micro_batch": args.micro_batch, "grad_acc": args.grad_acc, "lr": 1e-4,
                      "warmup_steps": 0, "schedule": "constant"},
            "parallel": {"dp": args.dp, "zero": args.zero, "device": "cpu"},
            "logging": {"progress": False, "sample_tokens": 0},
            "out": os.path.join(out, "run")}


def rank_main(rank: int, setting: str, raw: dict, init: str, orders, results) -> None:
    cfg = from_dict(raw)
    if setting == "tetron":  # as `tetron train` sets a rank up
        setup_rank(cfg, ranks_per_node=cfg.world_size)
    else:  # the same, but for the threshold: ZeRO-0's setup leaves glibc's own
        setup_rank(replace(cfg, parallel=replace(cfg.parallel, zero=0)), ranks_per_node=cfg.world_size)
        threshold = threshold_of(setting)
        if threshold is not None:
            dev.map_large_allocations(threshold)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=cfg.world_size,
                            timeout=timedelta(seconds=900))
    run = build_run(cfg, Mesh(dp=cfg.parallel.dp), CPU)
    step = 0
    while (count := orders.get()) > 0:
        times, peaks = [], []
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            train_step(run, step)  # resets the peak at its start
            times.append(time.perf_counter() - start)
            peaks.append(dev.peak_memory_mb(CPU))
            step += 1
        if rank == 0:
            results.put((times, peaks, torch.get_num_threads()))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["default", "1MiB"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per setting per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per setting first")
    parser.add_argument("--model", default=None, help="a named model (smollm-135m) instead of the flags below")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--grad-acc", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()
    for setting in args.settings:
        threshold_of(setting)
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        raw = config(args, tmp)
        prepare_data(from_dict(raw))
        groups = {}
        for i, setting in enumerate(args.settings):
            orders = [ctx.Queue() for _ in range(args.dp)]
            results = ctx.Queue()
            init = os.path.join(tmp, f"init-{i}")
            procs = [ctx.Process(target=rank_main, args=(r, setting, raw, init, orders[r], results))
                     for r in range(args.dp)]
            for p in procs:
                p.start()
            groups[setting] = (orders, results, procs)
        times: dict[str, list[float]] = {s: [] for s in args.settings}
        peaks: dict[str, list[float]] = {s: [] for s in args.settings}
        for round_no in range(args.rounds + 1):  # round 0: the warm-up steps, not timed
            for setting, (orders, results, _) in groups.items():
                count = args.warmup if round_no == 0 else args.steps
                for q in orders:
                    q.put(count)
                t, p, threads = results.get(timeout=3600)
                peaks[setting] += p
                if round_no > 0:
                    times[setting] += t
        for orders, _, procs in groups.values():
            for q in orders:
                q.put(0)
            for p in procs:
                p.join()
    base = statistics.median(times[args.settings[0]])
    shape = args.model or f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}"
    print(f"allocator: {shape}, seq {args.seq}, {args.micro_batch}x{args.grad_acc} micro-batches, dp {args.dp}, "
          f"ZeRO-{args.zero}, {threads} threads a rank; medians of {args.rounds} interleaved rounds "
          f"of {args.steps} steps")
    for setting in args.settings:
        median = statistics.median(times[setting])
        p = peaks[setting]
        flat = (f"steps 2-{len(p)} within {min(p[1:]) / p[1] - 1:+.1%} / {max(p[1:]) / p[1] - 1:+.1%} of step 2's"
                if len(p) > 2 else "")
        print(f"  {setting:>8s}  step {median * 1e3:8.1f} ms  ({median / base:.3f} of {args.settings[0]}'s)  "
              f"peak RSS step 2 {p[1] if len(p) > 1 else p[0]:,.0f} MiB, most {max(p[1:] or p):,.0f}; {flat}")


if __name__ == "__main__":
    main()
