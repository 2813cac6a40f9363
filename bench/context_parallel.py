"""Context parallelism, two benchmarks.

    python bench/context_parallel.py [--part balance|impl|window|both] [--cp 4] [--seq 2048] [--reps 5]
                                     [--impl-cps 2 4] [--impl-seqs 1024 2048 4096] [--kv-heads 8 2]

balance: each rank's ring-attention compute for the contiguous and zigzag layouts, next to
full-sequence attention in one process (PyTorch's own context parallel does not run on the CPU, so
single-process SDPA on the whole sequence is the peer). A rank's busy time is measured by running
exactly the blocks it computes in the ring (the same `_parts` and kernels, forward and backward) in
this process, one rank after another, so that waiting on the ring, which hides imbalance as idle
time, and the oversubscribed cores do not blur the figures. Prints per-rank medians, the max/min
ratio (about 2*cp-1 for contiguous chunks under a causal mask, about 1 for zigzag) and each rank's
count of scored query-key pairs.

window: a sliding-window layer's compute on the busiest rank for several windows at one sequence length (and
without a window): ring attention scores a windowed layer in tiles of the window against the keys in their reach
(`_pieces`), so the time and the scored pairs grow with the window, not the sequence.

impl: ring attention against Ulysses (all-to-all) attention on cp forked gloo ranks, zigzag layout,
for each cp, sequence length and number of key/value heads: the median time of one forward+backward
of the attention (interleaved rounds, bench/common.py) and the bytes each rank sends, computed from
the shapes (`sent_bytes`). Ring: k and v travel cp-1 hops forward and again backward, with their fp32
gradients cp hops; Ulysses: (cp-1)/cp of q, k, v (kv heads repeated up to cp where fewer) and of the
output, forward and backward.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import launch, median_step_times

from tetron.mesh import Mesh
from tetron.models.attention import causal_mask
from tetron.parallel.context_parallel import (
    _pieces,
    attention_work,
    block_attention,
    block_attention_backward,
    ring_attention,
    shard_indices,
)
from tetron.parallel.ulysses import kv_repeats, ulysses_attention

LAYOUTS = ("contiguous", "zigzag")


def rank_compute(q, k, v, *, cp: int, rank: int, layout: str, window: int | None = None) -> float:
    """Seconds of attention compute (forward + backward) that cp rank `rank` does in one ring pass: the pieces
    ring attention scores (`_pieces`: with a window, tiles against the keys in their reach, masked)."""
    seq = q.shape[2]
    mine = shard_indices(seq, cp, rank, layout=layout)
    ql = q[:, :, mine].contiguous()
    tl = ql.shape[2]
    start = time.perf_counter()
    for step in range(cp):
        src = (rank - step) % cp
        theirs = shard_indices(seq, cp, src, layout=layout)
        for qs, ks, causal in _pieces(step, rank, cp, layout, tl, window):
            kb, vb = k[:, :, theirs][:, :, ks].contiguous(), v[:, :, theirs][:, :, ks].contiguous()
            qb = ql[:, :, qs].contiguous()
            mask = None if window is None or window >= seq else causal_mask(mine[qs], theirs[ks], window)[None, None]
            out, lse = block_attention(qb, kb, vb, causal, mask=mask)
            block_attention_backward(torch.ones_like(out), qb, kb, vb, out, lse, causal, mask=mask)
    return time.perf_counter() - start


def balance(args: argparse.Namespace) -> None:
    """Per-rank ring-attention compute of the contiguous and zigzag layouts, in this process."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim, generator=g) for _ in range(3))

    def full_pass() -> float:
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        start = time.perf_counter()
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).sum().backward()
        return time.perf_counter() - start

    full_pass()
    single = statistics.median(full_pass() for _ in range(args.reps))
    print(f"ring attention compute per rank, cp={args.cp}, seq {args.seq}, {args.heads} heads x {args.head_dim}, "
          f"forward+backward, median of {args.reps}")
    print(f"  single-process SDPA on the whole sequence: {single * 1e3:.1f} ms")
    for layout in LAYOUTS:
        per_rank = []
        for rank in range(args.cp):
            rank_compute(q, k, v, cp=args.cp, rank=rank, layout=layout)  # warm-up
            per_rank.append(statistics.median(rank_compute(q, k, v, cp=args.cp, rank=rank, layout=layout)
                                              for _ in range(args.reps)))
        work = [attention_work(args.seq, args.cp, r, layout=layout) for r in range(args.cp)]
        ms = " ".join(f"{t * 1e3:7.1f}" for t in per_rank)
        print(f"  {layout:10s} per-rank ms [{ms}]  max/min time {max(per_rank) / min(per_rank):.2f}  "
              f"max/min work {max(work) / min(work):.2f}  sum {sum(per_rank) * 1e3:.1f} ms")


# ----------------------------------------------------------------------------- ring against Ulysses


def sent_bytes(impl: str, *, cp: int, seq: int, heads: int, kv_heads: int, head_dim: int, batch: int = 1,
               elem: int = 4) -> int:
    """Bytes one rank sends in one forward+backward of one attention layer, from the shapes (the code
    paths of context_parallel.py and ulysses.py; `elem` bytes per element of q, k, v)."""
    local = batch * (seq // cp) * head_dim  # elements per head of this rank's positions
    if impl == "ring":
        # k, v: cp-1 hops forward, cp-1 again backward; their fp32 gradients: a hop after each of cp steps
        return 2 * kv_heads * local * (2 * (cp - 1) * elem + cp * 4)
    kv = kv_heads * kv_repeats(heads, kv_heads, cp)
    # q, k, v to heads and the output back, forward; the same volumes backward
    return 2 * (cp - 1) * (heads + 2 * kv + heads) * local * elem // cp


def _forward_backward(attention, q, k, v, dout) -> None:
    attention(q, k, v).backward(dout)


def _impl_rank(rank: int, args: argparse.Namespace) -> None:
    """On each of cp ranks: time both implementations on this rank's share of each shape; rank 0 prints."""
    cp = args.ranks
    mesh = Mesh(cp=cp)
    attention = {"ring": functools.partial(ring_attention, mesh=mesh, layout="zigzag"),
                 "ulysses": functools.partial(ulysses_attention, mesh=mesh,
                                              shards=functools.partial(shard_indices, layout="zigzag"))}
    for kv_heads in args.kv_heads:
        for seq in args.impl_seqs:
            g = torch.Generator().manual_seed(rank)
            shape = (1, args.impl_heads, seq // cp, args.head_dim)
            q = torch.randn(shape, generator=g).requires_grad_(True)
            k, v = (torch.randn(1, kv_heads, seq // cp, args.head_dim, generator=g).requires_grad_(True)
                    for _ in range(2))
            dout = torch.randn(shape, generator=g)
            runs = {name: functools.partial(_forward_backward, fn, q, k, v, dout) for name, fn in attention.items()}
            for run in runs.values():
                run()  # warm-up
            times = median_step_times(runs, steps=args.steps, per_round=args.per_round)
            if rank == 0:
                sizes = dict(cp=cp, seq=seq, heads=args.impl_heads, kv_heads=kv_heads, head_dim=args.head_dim)
                ring_b, uly_b = sent_bytes("ring", **sizes), sent_bytes("ulysses", **sizes)
                print(f"  cp {cp}  seq {seq:6d}  kv heads {kv_heads:2d}   ring {times['ring'] * 1e3:8.1f} ms  "
                      f"ulysses {times['ulysses'] * 1e3:8.1f} ms  ring/ulysses {times['ring'] / times['ulysses']:5.2f}"
                      f"   sent per rank: ring {ring_b / 2**20:7.2f} MiB  ulysses {uly_b / 2**20:7.2f} MiB  "
                      f"ring/ulysses {ring_b / uly_b:5.2f}", flush=True)
            dist.barrier()


def windows(args: argparse.Namespace) -> None:
    """A sliding-window layer's ring-attention compute on the busiest rank, window by window: it grows with the
    window, not the sequence (the tiles of `_pieces`), against the same rank without a window."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.window_seq, args.head_dim, generator=g) for _ in range(3))
    print(f"windowed ring attention, cp={args.cp}, seq {args.window_seq}, zigzag, the busiest rank's forward+backward "
          f"compute, median of {args.reps}")
    for window in [*args.windows, None]:
        times, work = [], []
        for rank in range(args.cp):
            rank_compute(q, k, v, cp=args.cp, rank=rank, layout="zigzag", window=window)  # warm-up
            times.append(statistics.median(rank_compute(q, k, v, cp=args.cp, rank=rank, layout="zigzag",
                                                        window=window) for _ in range(args.reps)))
            work.append(attention_work(args.window_seq, args.cp, rank, layout="zigzag", window=window))
        shown = window or args.window_seq
        print(f"  window {shown:6d}  {max(times) * 1e3:8.1f} ms  pairs {max(work):11,d}", flush=True)


def compare_impls(args: argparse.Namespace) -> None:
    print(f"ring vs Ulysses attention, {args.impl_heads} query heads x {args.head_dim}, batch 1, fp32, zigzag; "
          f"forward+backward, median of {args.steps} steps in interleaved rounds (gloo, forked ranks)", flush=True)
    for cp in args.impl_cps:
        launch(_impl_rank, argparse.Namespace(**{**vars(args), "ranks": cp}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("balance", "impl", "window", "both"), default="both",
                        help="both: balance and impl")
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--window-seq", type=int, default=8192, help="sequence of the window part")
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 256, 512, 1024], help="window part's windows")
    parser.add_argument("--impl-cps", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--impl-seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--impl-heads", type=int, default=8, help="query heads of the impl comparison")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2], help="key/value heads, each a row")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation (impl)")
    parser.add_argument("--per-round", type=int, default=2, help="consecutive steps per implementation per round")
    args = parser.parse_args()
    if args.part in ("balance", "both"):
        balance(args)
    if args.part in ("impl", "both"):
        compare_impls(args)
    if args.part == "window":
        windows(args)


if __name__ == "__main__":
    main()
