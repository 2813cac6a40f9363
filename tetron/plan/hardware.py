"""The machines a plan is for: memory, FLOP/s and links of one device, by name, or of this CPU.

A plan needs, per device: the bytes tensors may use, the dense peak FLOP/s and the fraction of it a
training step reaches, the bandwidth and latency of its links inside a node and across nodes, and a
fixed cost per decoder layer and micro-batch (kernel launches, or Python's dispatch on the CPU). GPU
figures come from the vendors' data sheets (memory as torch reports it, NVLink per direction, one
400 Gb/s InfiniBand port per GPU across nodes); the efficiency and overhead figures are the usual
ranges for eager PyTorch, and `tetron plan --measure` shows how far they are from a run. The CPU's
figures are measured where the plan runs (`cpu()`), gloo's link costs are fitted to runs here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One device type and the links between devices."""

    name: str
    memory: int  # bytes per device for tensors (GPU: the total torch reports; CPU: the machine's available
    # memory, shared by all ranks of a node)
    tflops: float  # dense bf16 peak per device, TFLOP/s (fp32 matmuls: half on GPUs, as TF32)
    efficiency: float  # fraction of the peak a step's matmuls reach
    intra_gbs: float  # GB/s per device to the others of its node, one direction (NVLink; CPU: memory copies)
    inter_gbs: float  # GB/s per device across nodes (network)
    latency_s: float  # fixed cost of one collective or P2P message
    overhead_s: float  # fixed cost per decoder layer and micro-batch, forward and backward together
    hbm_gbs: float  # memory bandwidth, GB/s: the optimizer step streams its state through it
    cpu: bool = False
    disk_gbs: float = 2.0  # GB/s one node writes checkpoints at, shared by its ranks
    host_gbs: float = 25.0  # GB/s of a copy from the device to pinned host memory (PCIe; CPU: a memory copy)
    fp32_slowdown: float = 2.0  # fp32 matmuls run this many times slower than bf16 (TF32 on GPUs)
    bf16_slowdown: float = 1.0  # bf16 matmuls run this many times slower than the bf16 peak

    def flops(self, dtype: str) -> float:
        """FLOP/s a matmul of this dtype reaches: the peak, its dtype's slowdown, the efficiency."""
        slow = self.bf16_slowdown if dtype == "bfloat16" else self.fp32_slowdown
        return self.tflops * 1e12 * self.efficiency / slow


def _gpu(name: str, memory_mib: int, tflops: float, nvlink: float, network: float, hbm: float) -> Hardware:
    return Hardware(name=name, memory=memory_mib * 2**20, tflops=tflops, efficiency=0.45, intra_gbs=nvlink,
                    inter_gbs=network, latency_s=2e-5, overhead_s=5e-4, hbm_gbs=hbm)


# Memory as torch.cuda reports it for the common SKU; NVLink GB/s per direction; network: one NIC per GPU.
GPUS = {
    "H200": _gpu("H200", 143_771, 989.0, 450.0, 50.0, 4800.0),
    "H100": _gpu("H100", 81_559, 989.0, 450.0, 50.0, 3350.0),
    "A100-80GB": _gpu("A100-80GB", 81_920, 312.0, 300.0, 25.0, 2039.0),
    "A100-40GB": _gpu("A100-40GB", 40_960, 312.0, 300.0, 25.0, 1555.0),
    "L40S": _gpu("L40S", 46_068, 362.0, 32.0, 25.0, 864.0),
    "B200": _gpu("B200", 183_359, 2250.0, 900.0, 50.0, 8000.0),
}


def gpu(name: str) -> Hardware:
    """A known GPU by name (case and dashes ignored, "A100" is the 80 GB card)."""
    key = name.upper().replace("_", "-")
    key = {"A100": "A100-80GB"}.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; use one of {', '.join(GPUS)} or give --memory-gb")
    return GPUS[key]


def available_memory() -> int:
    """Bytes this machine can still give to processes (MemAvailable), or the physical total without /proc."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _matmul_tflops(threads: int) -> float:
    """fp32 TFLOP/s of a 512 x 512 matmul on `threads` threads: what one CPU rank reaches."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(512, 512)
        a @ a  # warm-up
        start, reps = time.perf_counter(), 20
        for _ in range(reps):
            a @ a
        return 2 * 512**3 * reps / (time.perf_counter() - start) / 1e12
    finally:
        torch.set_num_threads(previous)


def cpu(ranks_per_node: int = 1) -> Hardware:
    """This CPU, measured: the fp32 matmul rate of one rank's share of the cores (tetron gives each rank
    cores/ranks threads), the memory available to all ranks together. gloo's figures (a memory copy
    through the loopback, ~0.2 ms a message) and Python's dispatch (~2 ms per layer and micro-batch) were
    fitted to `tetron plan --measure` runs of small models on 2 cores."""
    threads = max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))
    return Hardware(name="cpu", memory=available_memory(), tflops=_matmul_tflops(threads), efficiency=0.5,
                    intra_gbs=2.0, inter_gbs=1.0, latency_s=2e-4, overhead_s=2e-3, hbm_gbs=5.0, cpu=True,
                    fp32_slowdown=1.0, bf16_slowdown=100.0)


def with_memory(hw: Hardware, gib: float) -> Hardware:
    """The same device with `gib` GiB of memory (an explicit --memory-gb)."""
    return replace(hw, memory=int(gib * GiB))
