"""Data parallelism, side by side: tetron's naive DP, tetron's bucketed DP and PyTorch's
DistributedDataParallel training the same model on the same batches, in one invocation.

    python bench/data_parallel.py [--ranks 2] [--steps 20] [--hidden 256] [--layers 4]

Each rank runs every implementation in turn, in interleaved rounds (so machine noise hits all
of them alike), and rank 0 prints the median step time of each and the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tetron.init import init_weights_
from tetron.model import Llama, LlamaConfig
from tetron.parallel.data_parallel import apply_data_parallel

IMPLS = ("naive", "bucket", "ddp")


def make(impl: str, config: LlamaConfig, bucket_mb: float):
    model = Llama(config)
    init_weights_(model, seed=0, std=0.02)
    if impl == "ddp":
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    else:
        wrapped = apply_data_parallel(model, dist.group.WORLD, impl=impl, bucket_mb=bucket_mb)
    return wrapped, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, optimizer, inputs, targets) -> None:
    logits = model(inputs)  # [B, T, vocab]
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)


def rank_main(rank: int, args, init_file: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=300))
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=args.seq)
    g = torch.Generator().manual_seed(rank)
    inputs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    runs = {impl: make(impl, config, args.bucket_mb) for impl in IMPLS}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for impl in IMPLS:  # warm-up: allocator, autograd graph caches
        for _ in range(2):
            step(*runs[impl], inputs, targets)
    rounds = max(1, args.steps // args.per_round)
    for _ in range(rounds):
        for impl in IMPLS:
            for _ in range(args.per_round):
                dist.barrier()
                start = time.perf_counter()
                step(*runs[impl], inputs, targets)
                times[impl].append(time.perf_counter() - start)
    if rank == 0:
        n_params = sum(p.numel() for p in runs["ddp"][0].module.parameters())
        med = {impl: statistics.median(t) for impl, t in times.items()}
        print(f"data parallel, {args.ranks} ranks (gloo), {n_params / 1e6:.1f}M params, "
              f"batch {args.batch}x{args.seq} per rank, {len(times['ddp'])} steps each, bucket {args.bucket_mb} MB")
        for impl in IMPLS:
            label = {"naive": "tetron naive", "bucket": "tetron bucket", "ddp": "torch DDP"}[impl]
            print(f"  {label:14s} median step {med[impl] * 1e3:8.1f} ms")
        print(f"  bucket / naive = {med['bucket'] / med['naive']:.3f}   (below 1: bucketed is faster)")
        print(f"  bucket / DDP   = {med['bucket'] / med['ddp']:.3f}   (1.05 or below: within 5% of DDP)")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per implementation")
    parser.add_argument("--per-round", type=int, default=2, help="consecutive steps per implementation per round")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        # fork: the children share this process's imported torch, so they start in milliseconds
        mp.start_processes(rank_main, args=(args, os.path.join(tmp, "init")), nprocs=args.ranks,
                           start_method="fork")


if __name__ == "__main__":
    main()
