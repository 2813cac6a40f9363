"""What every multi-rank benchmark shares: forked ranks set up as `tetron train` sets up its ranks
(tetron.launch.setup_rank), interleaved timing with medians, and the allocator setting and resident set
that the memory figures rest on.

Forking after torch is imported starts ranks in milliseconds. Each implementation runs a few
steps in turn, round after round, so drift in machine load hits all of them alike; every timed
step starts after a barrier, and the median is reported, since timings here vary 20-60%.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from tetron.config import Config, from_dict
from tetron.launch import setup_rank
from tetron.models.llama import LlamaConfig


def add_timing_args(parser: argparse.ArgumentParser, *, ranks: int = 2) -> None:
    parser.add_argument("--ranks", type=int, default=ranks)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--per-round", type=int, default=2, help="consecutive steps per implementation per round")


def add_model_args(parser: argparse.ArgumentParser, *, layers: int = 4, vocab: int = 4096) -> None:
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--seq", type=int, default=128)


def model_config(args: argparse.Namespace) -> LlamaConfig:
    """The benchmarked Llama: GQA 8/4 heads, SwiGLU width 8/3 of hidden, as the flags give it."""
    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=args.seq)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def map_every_allocation() -> bool:
    """glibc: allocations of 64 KiB and more mapped on their own and unmapped when freed (no dynamic
    threshold), free heap top returned above 1 MiB. False where there is no glibc mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 20))
    except (OSError, AttributeError, TypeError):
        return False


def rss_mb() -> float:
    """This process's resident set now (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**10
    return float("nan")


def rank_config(ranks: int, *, zero: int = 0, device: str = "cpu", model: dict | str | None = None) -> Config:
    """The configuration whose rank setup (tetron.launch.setup_rank) a benchmark's ranks get when it has none
    of its own: `ranks` ranks on this machine, ZeRO stage `zero`, the model's section where it is tetron's
    (ZeRO-3's mmap threshold follows its layers' size)."""
    return from_dict({"parallel": {"dp": ranks, "zero": zero, "device": device},
                      **({"model": model} if model is not None else {})})


def launch(rank_main: Callable, args: argparse.Namespace, *, cfg: Config | None = None) -> None:
    """Run rank_main(rank, args) on args.ranks forked ranks of a gloo process group, each set up as `tetron
    train` sets up its ranks for `cfg` (default: rank_config(args.ranks)): threads, glibc's mmap threshold,
    signal handlers (tetron.launch.setup_rank)."""
    cfg = cfg or rank_config(args.ranks)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_entry, args=(rank_main, args, os.path.join(tmp, "init"), cfg), nprocs=args.ranks,
                           start_method="fork")


def _rank_entry(rank: int, rank_main: Callable, args: argparse.Namespace, init_file: str, cfg: Config) -> None:
    _, restore = setup_rank(cfg, ranks_per_node=args.ranks)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=600))
    try:
        rank_main(rank, args)
        # a rank done at once (no collective in rank_main) must not close its connections while another rank's
        # gloo is still making its own to it: "Connection closed by peer" in that rank's init (seen in the suite)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        restore()


def median_step_times(runs: dict[str, Callable[[], object]], *, steps: int, per_round: int) -> dict[str, float]:
    """Median seconds per call of each run, timed in interleaved rounds (call every run once first
    to warm up)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(max(1, steps // per_round)):
        for name, step in runs.items():
            for _ in range(per_round):
                dist.barrier()
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
