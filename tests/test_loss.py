"""tetron's summed cross entropy against torch's: the same value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tetron.models.loss import cross_entropy_sum


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
