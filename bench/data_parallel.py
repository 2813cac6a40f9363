"""Data parallelism, side by side: tetron's naive DP, tetron's bucketed DP and PyTorch's
DistributedDataParallel training the same model on the same batches, in one invocation.

    python bench/data_parallel.py [--ranks 2] [--steps 20] [--hidden 256] [--layers 4]

Each rank runs every implementation in turn, in interleaved rounds (so machine noise hits all
of them alike), and rank 0 prints the median step time of each and the ratios.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import add_model_args, add_timing_args, launch, median_step_times, model_config
from torch.nn.parallel import DistributedDataParallel

from tetron.models.llama import Llama, LlamaConfig
from tetron.parallel.data_parallel import apply_data_parallel
from tetron.parallel.init import init_weights_

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


def rank_main(rank: int, args) -> None:
    config = model_config(args)
    g = torch.Generator().manual_seed(rank)
    inputs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    runs = {impl: make(impl, config, args.bucket_mb) for impl in IMPLS}
    for impl in IMPLS:  # warm-up: allocator, autograd graph caches
        for _ in range(2):
            step(*runs[impl], inputs, targets)
    med = median_step_times({impl: lambda impl=impl: step(*runs[impl], inputs, targets) for impl in IMPLS},
                            steps=args.steps, per_round=args.per_round)
    if rank == 0:
        n_params = sum(p.numel() for p in runs["ddp"][0].module.parameters())
        print(f"data parallel, {args.ranks} ranks (gloo), {n_params / 1e6:.1f}M params, "
              f"batch {args.batch}x{args.seq} per rank, {args.steps} steps each, bucket {args.bucket_mb} MB")
        for impl in IMPLS:
            label = {"naive": "tetron naive", "bucket": "tetron bucket", "ddp": "torch DDP"}[impl]
            print(f"  {label:14s} median step {med[impl] * 1e3:8.1f} ms")
        print(f"  bucket / naive = {med['bucket'] / med['naive']:.3f}   (below 1: bucketed is faster)")
        print(f"  bucket / DDP   = {med['bucket'] / med['ddp']:.3f}   (1.05 or below: within 5% of DDP)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(parser)
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    args = parser.parse_args()
    launch(rank_main, args)

if __name__ == "__main__":
    main()
