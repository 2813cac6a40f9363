"""tetron's summed cross entropy against torch's, and the chunked head + loss against the unchunked one:
the same values and gradients, and never more than one chunk of the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from tetron.models.loss import cross_entropy_sum, linear_cross_entropy
from tetron.observe.memory import ActivationMeter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_sum_equals_torchs(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 17, 50, generator=g) * 4).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (3, 17), generator=g)
    ours = cross_entropy_sum(logits, targets)
    (ours * 0.37).backward()  # a scale from above (the per-token mean), as training applies
    ours_grad, logits.grad = logits.grad, None
    ref = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    (ref * 0.37).backward()
    # fp32 arithmetic on both sides, one exp(log_softmax) against torch's softmax: last-bit differences
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    # bf16: both round fp32 gradients that differ in the last bits; where they straddle a rounding boundary
    # they land one bf16 step apart (2^-9 ~ 2e-3 for values up to the 0.37 scale)
    torch.testing.assert_close(ours_grad.float(), logits.grad.float(), rtol=0,
                               atol=1e-6 if dtype == torch.float32 else 2**-9)
    assert ours_grad.dtype == dtype


# ----------------------------------------------------------------------------- chunked head and loss


def _head_grads(chunk_tokens: int, dtype: torch.dtype, *, tied: bool) -> tuple[Tensor, ...]:
    """Loss and gradients (hidden, head weight) of the head + loss over 3 x 21 tokens, 16 wide, vocab 50;
    `tied`: the head's weight is also the embedding that made the hidden states (one Parameter)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, 50, (3, 21), generator=g)
    noise = torch.randn(3, 21, 16, generator=g).to(dtype).requires_grad_()
    hidden = noise + F.embedding(ids, weight) if tied else noise
    targets = torch.randint(0, 50, (3, 21), generator=g)
    if chunk_tokens < 0:  # today's: whole logits, then the loss
        loss = cross_entropy_sum(F.linear(hidden, weight), targets)
    else:
        loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=chunk_tokens)
    (loss * 0.37).backward()  # a scale from above (the per-token mean), as training applies
    with torch.no_grad():  # validation's path: the loss alone
        assert linear_cross_entropy(hidden, weight, targets, chunk_tokens=max(chunk_tokens, 0)) == loss
    return loss.detach(), noise.grad, weight.grad


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_tokens", [0, 1, 8, 20, 63, 1000])  # one token; ragged last chunk; exact; beyond
def test_chunked_linear_cross_entropy_equals_unchunked(chunk_tokens, tied):
    ref, ours = _head_grads(-1, torch.float32, tied=tied), _head_grads(chunk_tokens, torch.float32, tied=tied)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0)  # sums in another order only
    for mine, want in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6)


def test_chunked_linear_cross_entropy_in_bf16():
    ref, ours = _head_grads(-1, torch.bfloat16, tied=True), _head_grads(8, torch.bfloat16, tied=True)
    assert all(t.dtype == torch.bfloat16 for t in ours[1:])
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=0)  # the same bf16 logits, then fp32
    # the weight's gradient: each chunk's bf16 product rounded, then summed in fp32 and rounded once more
    # (one bf16 step, 2^-8 relative, on the largest); the hidden states' the same rows, scaled after rounding
    for mine, want in zip(ours[1:], ref[1:]):
        torch.testing.assert_close(mine.float(), want.float(), rtol=2**-7, atol=2**-7 * want.abs().max().item())


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("chunk_tokens", [0, 16])
def test_no_logits_beyond_one_chunk(chunk_tokens):
    tokens, vocab, width = 128, 512, 8
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    with _LargestTensor() as largest, ActivationMeter([weight]) as meter:
        linear_cross_entropy(hidden, weight, targets, chunk_tokens=chunk_tokens).backward()
    assert largest.most == (chunk_tokens or tokens) * vocab  # a chunk's logits, nothing larger
    # saved for the backward: the two gradients (fp32), never the logits
    assert meter.peak_bytes == 4 * (tokens + vocab) * width
