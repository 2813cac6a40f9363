"""A grouped matmul (MoE experts: each group of rows times its own matrix): torch._grouped_mm, or a loop."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from tetron.torch_private.version import torch_at_least

_CUDA_FROM = (2, 8)  # the torch whose torch._grouped_mm(x, w, offs=) runs on CUDA in bf16


@functools.cache
def _cpu_works() -> bool:
    """Whether this torch's CPU torch._grouped_mm runs forward and backward (tried once, on a tiny case)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:  # on the CPU whatever device a model is being built on (meta, say), with grad whatever the mode
        with torch.enable_grad():
            w = torch.ones(2, 4, 8, device="cpu", requires_grad=True)
            torch._grouped_mm(torch.ones(5, 4, device="cpu"), w,
                              offs=torch.tensor([2, 5], dtype=torch.int32, device="cpu")).backward(
                torch.ones(5, 8, device="cpu"))
        return w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_available(device_type: str) -> bool:
    """Whether torch._grouped_mm runs here: on CUDA from torch 2.8; on the CPU where a tiny forward and
    backward run (asked once per process; ask before recording a forward, whose ops the probe's would join)."""
    if device_type == "cuda":
        return hasattr(torch, "_grouped_mm") and torch_at_least(*_CUDA_FROM)
    return device_type == "cpu" and _cpu_works()


def grouped_mm(x: Tensor, w: Tensor, ends: Tensor, *, fallback: bool = False) -> Tensor:
    """x [M, K] @ w[g] for the rows of each group g: x [M, K], w [G, K, N], `ends` [G] int32, the row after
    each group's last -> [M, N]. Public path (`fallback`, or no grouped kernel here): one matmul per group
    (reading `ends` on the host); rows past the last group get zeros."""
    if not fallback and grouped_mm_available(x.device.type):
        return torch._grouped_mm(x, w, offs=ends)
    bounds = [0, *ends.tolist()]
    outs = [x[start:end] @ w[g] for g, (start, end) in enumerate(zip(bounds, bounds[1:]))]
    outs.append(x.new_zeros(x.shape[0] - bounds[-1], w.shape[-1]))
    return torch.cat(outs)
