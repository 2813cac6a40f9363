"""The head and the loss, whole against chunked (train.loss_chunk_tokens): peak memory and time.

    python bench/loss.py [--hidden 576] [--vocab 49152] [--tokens 2048] [--chunks 0,256,512,1024] [--dtype float32]

Defaults: SmolLM-135M's head (hidden 576, vocab 49152) on one micro-batch of 2048 tokens, one process,
the forward and backward of `head(hidden) -> summed cross entropy`, as training runs it:
- whole (`--chunks 0` is tetron's head before chunking): `cross_entropy_sum(F.linear(hidden, weight))`,
  the [tokens, vocab] logits whole, then their fp32 log-probabilities;
- chunked: `linear_cross_entropy(hidden, weight, targets, chunk_tokens=c)` (models/loss.py).
Peak: the most bytes of tensors alive at once during one forward + backward, counted over every tensor an
op returns (a TorchDispatchMode: storages counted once, released when freed), the inputs and the weight's
gradient included. Time: the median of 5 forward + backward passes after one warm-up, the chunk sizes
interleaved, and the median of the 5 paired ratios to the first (whole).
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from tetron.models.loss import cross_entropy_sum, linear_cross_entropy


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops inside the block returned and that are still alive; `peak`, the most."""

    def __init__(self, inputs: tuple[Tensor, ...]) -> None:
        super().__init__()
        # the inputs count from the start, and views of them (the weight's transpose) are no new storage
        self.seen = {t.untyped_storage().data_ptr() for t in inputs}
        self.live = self.peak = sum(t.untyped_storage().nbytes() for t in inputs)

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def run(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> None:
    if chunk == 0:
        loss = cross_entropy_sum(F.linear(hidden, weight), targets)
    else:
        loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=chunk)
    (loss / targets.numel()).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunks", default="0,256,512,1024")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(dtype).requires_grad_()
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    print(f"head {args.hidden} x {args.vocab}, {args.tokens} tokens, {args.dtype}, {torch.get_num_threads()} threads")
    chunks = [int(c) for c in args.chunks.split(",")]
    peaks = {}
    for chunk in chunks:
        weight.grad = hidden.grad = None
        with LiveBytes((weight, hidden, targets)) as meter:
            run(hidden, weight, targets, chunk)
        peaks[chunk] = meter.peak
    times: dict[int, list[float]] = {chunk: [] for chunk in chunks}
    for _ in range(args.repeats + 1):  # the first: warm-up; interleaved, so that every chunk meets the same load
        for chunk in chunks:
            weight.grad = hidden.grad = None
            start = time.perf_counter()
            run(hidden, weight, targets, chunk)
            times[chunk].append(time.perf_counter() - start)
    first = chunks[0]
    for chunk in chunks:
        median = statistics.median(times[chunk][1:])
        ratio = statistics.median(a / b for a, b in zip(times[first][1:], times[chunk][1:]))
        peak = f"{peaks[chunk] / 2**20:8.1f} MiB ({peaks[chunk] / peaks[first]:.2f}x)"
        print(f"chunk {chunk or 'whole':>6}: peak {peak}, "
              f"{median * 1e3:7.1f} ms median of {args.repeats}, time ratio {first or 'whole'} / this {ratio:.3f} "
              f"(median of the {args.repeats} paired runs)")

if __name__ == "__main__":
    main()
