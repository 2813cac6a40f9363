"""Context parallelism: each cp rank's ring-attention compute for the contiguous and zigzag layouts,
next to full-sequence attention in one process (PyTorch's own context parallel does not run on
the CPU, so single-process SDPA on the whole sequence is the peer).

    python bench/context_parallel.py [--cp 4] [--seq 2048] [--reps 5]

A rank's busy time is measured by running exactly the blocks it computes in the ring (the same
`_parts` and kernels, forward and backward) in this process, one rank after another, so that
waiting on the ring, which hides imbalance as idle time, and the oversubscribed cores do not blur
the figures. Prints per-rank medians, the max/min ratio (about 2*cp-1 for contiguous chunks under
a causal mask, about 1 for zigzag) and each rank's count of scored query-key pairs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tetron.parallel.context_parallel import (
    _parts,
    attention_work,
    block_attention,
    block_attention_backward,
    shard_indices,
)

LAYOUTS = ("contiguous", "zigzag")


def rank_compute(q, k, v, *, cp: int, rank: int, layout: str) -> float:
    """Seconds of attention compute (forward + backward) that cp rank `rank` does in one ring pass."""
    seq = q.shape[2]
    mine = shard_indices(seq, cp, rank, layout=layout)
    ql = q[:, :, mine].contiguous()
    tl = ql.shape[2]
    start = time.perf_counter()
    for step in range(cp):
        src = (rank - step) % cp
        part = _parts(step, rank, cp, layout, tl)
        if part is None:
            continue
        qs, ks, causal = part
        theirs = shard_indices(seq, cp, src, layout=layout)
        kb, vb = k[:, :, theirs][:, :, ks].contiguous(), v[:, :, theirs][:, :, ks].contiguous()
        qb = ql[:, :, qs].contiguous()
        out, lse = block_attention(qb, kb, vb, causal)
        block_attention_backward(torch.ones_like(out), qb, kb, vb, out, lse, causal)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
