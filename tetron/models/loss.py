"""The training loss: the head's matmul and the cross entropy, summed over target tokens, chunk by chunk.

The `[tokens, vocab]` logits, in fp32 for the loss, are the largest activation of a step (SmolLM-1.7B at
micro-batch 8 x 2048: 10.5 GiB). `linear_cross_entropy` never holds more than one chunk of them (Liger's
fused linear cross entropy, in plain PyTorch): for each chunk of `chunk_tokens` tokens it computes the
logits, the loss, and at once the loss's gradient with respect to the hidden states and the head's
weight, then drops the chunk. The forward pass keeps only those two gradients ([tokens, hidden] and
[vocab, hidden] fp32); the backward pass multiplies them by the incoming gradient, a scalar (the loss
is a sum). The head's three matmuls are the ones an unchunked head and loss do, so nothing is recomputed.

Within a chunk the arithmetic is the unchunked one: the logits in the head's dtype, cast to fp32,
log_softmax, the gradient softmax - onehot (from exp of the log-probabilities, one pass), cast back to
the head's dtype for the two matmuls. Only sums over chunks change order (the loss; the weight's
gradient, accumulated in fp32 across chunks).

The loss of one chunk is pluggable: `chunk_cross_entropy` here, or under tensor parallelism the
vocabulary-parallel one over a shard of the vocabulary (parallel/tensor_parallel.py), whose collectives
then run once per chunk.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (fp32 logits [n, V], targets [n], with_grad) -> (summed loss, d loss / d logits [n, V] fp32, or None)
ChunkLoss = Callable[[Tensor, Tensor, bool], tuple[Tensor, Tensor | None]]


def chunk_cross_entropy(logits: Tensor, targets: Tensor, with_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Summed cross entropy of fp32 logits [n, vocab] against targets [n], and its gradient softmax - onehot."""
    logp = logits.log_softmax(-1)
    loss = -logp.gather(1, targets[:, None]).sum()
    if not with_grad:
        return loss, None
    dlogits = logp.exp_()  # the softmax, in the log-probabilities' buffer
    dlogits.scatter_add_(1, targets[:, None], dlogits.new_full((targets.numel(), 1), -1.0))
    return loss, dlogits


def _spans(n: int, chunk_tokens: int) -> list[tuple[int, int]]:
    step = n if chunk_tokens <= 0 else min(chunk_tokens, n)
    return [(s, min(s + step, n)) for s in range(0, n, max(step, 1))]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int,
                chunk_loss: ChunkLoss) -> Tensor:  # hidden [N, H], weight [V, H], targets [N]
        want_dh, want_dw = ctx.needs_input_grad[:2]
        dh = hidden.new_empty(hidden.shape) if want_dh else None  # contiguous: each chunk fills its rows
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_dw else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        spans = _spans(hidden.shape[0], chunk_tokens)
        for start, end in spans:
            h = hidden[start:end]
            loss, dlogits = chunk_loss(F.linear(h, weight).float(), targets[start:end], True)
            total += loss
            dlogits = dlogits.to(hidden.dtype)
            if dh is not None:
                torch.mm(dlogits, weight, out=dh[start:end])
            if dw is not None and len(spans) == 1:
                dw = dlogits.T @ h  # one chunk: the unchunked arithmetic exactly (and its dtype)
            elif dw is not None and dlogits.dtype == torch.float32:
                dw.addmm_(dlogits.T, h)
            elif dw is not None:  # bf16: each chunk's product rounded once, their sum kept in fp32
                dw += dlogits.T @ h
            del dlogits  # the chunk's [n, vocab] buffers go before the next chunk's
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(dh, dw)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        dh, dw = ctx.saved_tensors  # the gradients of the loss, computed in the forward pass
        # in fp32: the scale (1 / tokens) is not rounded to bf16
        return (None if dh is None else (dh.float() * grad).to(dh.dtype),
                None if dw is None else (dw * grad).to(ctx.weight_dtype), None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, chunk_tokens: int,
                         chunk_loss: ChunkLoss = chunk_cross_entropy) -> Tensor:
    """Sum over tokens of -log softmax(hidden @ weight.T)[target]: hidden [..., H], weight [V, H], targets [...],
    `chunk_tokens` tokens at a time (0: all at once). Without gradients (validation) only the loss is computed."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, chunk_loss)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, end in _spans(hidden.shape[0], chunk_tokens):
        total += chunk_loss(F.linear(hidden[start:end], weight).float(), targets[start:end], False)[0]
    return total


def head_cross_entropy(head: nn.Module, hidden: Tensor, targets: Tensor, *, chunk_tokens: int) -> Tensor:
    """The summed cross entropy of `head`'s logits for `hidden` [B, T, H] against `targets` [B, T], chunked:
    a plain head is an nn.Linear; a parallel head (a vocabulary shard) brings its own `cross_entropy`."""
    if isinstance(head, nn.Linear):
        return linear_cross_entropy(hidden, head.weight, targets, chunk_tokens=chunk_tokens)
    return head.cross_entropy(hidden, targets, chunk_tokens=chunk_tokens)


def head_cross_entropy_rows(head: nn.Module, hidden: Tensor, rows: Tensor, targets: Tensor, *,
                            chunk_tokens: int) -> Tensor:
    """head_cross_entropy over only the positions `rows` [B, T] (bool) selects, so that logits exist for those
    alone; a parallel head brings its own `cross_entropy_rows` (under sp its hidden states are a shard)."""
    if isinstance(head, nn.Linear):
        return linear_cross_entropy(hidden[rows], head.weight, targets[rows], chunk_tokens=chunk_tokens)
    return head.cross_entropy_rows(hidden, rows, targets, chunk_tokens=chunk_tokens)


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:  # logits [N, vocab] fp32, targets [N]
        loss, dlogits = chunk_cross_entropy(logits, targets, True)
        ctx.save_for_backward(dlogits)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (dlogits,) = ctx.saved_tensors
        return dlogits * grad, None


def cross_entropy_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross entropy of whole logits [..., vocab] (computed in fp32) against targets [...], summed: for
    logits that exist anyway (tests, benchmarks); training goes through `linear_cross_entropy`."""
    return _CrossEntropySum.apply(logits.float().flatten(0, -2), targets.flatten())
