"""The one module that touches CUDA: device choice, backend, synchronisation, memory and peak FLOP/s.

Everything else in tetron runs the same lines on cpu+gloo and cuda+nccl.
"""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16 tensor-core peak per GPU, TFLOP/s, from the vendors' data sheets (no sparsity).
_PEAK_TFLOPS_BF16 = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe card is lower, see below
    "H100 PCIe": 756.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 125.0,
    "RTX 4090": 165.0,
    "B200": 2250.0,
}


def pick_device(kind: str, local_rank: int) -> torch.device:
    """"cpu", "cuda" or "auto" (CUDA when available) -> this rank's device."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.device=cuda but no CUDA device is available; use cpu")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock step times are real; nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated tensor memory on a GPU; on the CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak TFLOP/s for `dtype` where known (GPUs by name), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    match = max((k for k in _PEAK_TFLOPS_BF16 if k in name), key=len, default=None)
    if match is None:
        return None
    bf16 = _PEAK_TFLOPS_BF16[match]
    # fp32 matmuls run on TF32 tensor cores at half the bf16 rate when allowed; count that.
    return bf16 if dtype in (torch.bfloat16, torch.float16) else bf16 / 2
