"""The one module that touches CUDA: device choice, backend, synchronisation, memory and peak FLOP/s.

Everything else in tetron runs the same lines on cpu+gloo and cuda+nccl.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
import resource
import shutil
import sys
from typing import Any, Callable, Literal

import torch

# The kernel families of one block of attention with its log-sum-exp (parallel/block_attention.py).
AttentionKernel = Literal["cpu_flash", "flash", "efficient", "math"]

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
# Dense fp32 peak (CUDA cores, no tensor cores): what an fp32 matmul reaches with TF32 off.
_PEAK_TFLOPS_FP32 = {
    "H200": 67.0,
    "H100": 67.0,
    "H100 PCIe": 51.0,
    "H800": 67.0,
    "A100": 19.5,
    "A800": 19.5,
    "L40S": 91.6,
    "L4": 30.3,
    "A10G": 31.2,
    "RTX 4090": 82.6,
    "B200": 80.0,
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


def rank_start_method(kind: str) -> str:
    """How a launcher on this machine starts the ranks of parallel.device=`kind`: forked on the CPU, where a
    rank then inherits the imported torch and starts in a fraction of a second (spawning costs each rank
    seconds of imports); spawned for CUDA, which cannot be used in a forked child of a process that
    initialised it."""
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    return "spawn" if cuda else "fork"


def device_problem(kind: str, ranks_per_node: int | None) -> str | None:
    """Why parallel.device=`kind` cannot run `ranks_per_node` ranks on this machine (None: unknown, as
    under torchrun), or None when it can: checked before any rank starts."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return None
    if not torch.cuda.is_available():
        return "no CUDA device is available here; use parallel.device=cpu (or auto)"
    count = torch.cuda.device_count()
    if ranks_per_node is not None and ranks_per_node > count:
        return (f"{ranks_per_node} ranks on this machine but {count} CUDA device(s), and NCCL runs one rank per "
                f"GPU; use at most {count} ranks here, or parallel.device=cpu")
    return None


def compile_problem(kind: str) -> str | None:
    """Why torch.compile cannot run on parallel.device=`kind` here, or None: Inductor builds its CPU kernels
    with a C++ compiler and its GPU kernels with Triton."""
    cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if cuda:
        if importlib.util.find_spec("triton") is None:
            return "torch.compile's GPU backend needs Triton, which is not installed (pip install triton)"
        return None
    if not any(shutil.which(cc) for cc in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return "torch.compile's CPU backend needs a C++ compiler (g++ or clang++), and none is on PATH"
    return None


def cuda_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so wall-clock step times are real; nothing to do on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`: to a GPU from pinned memory, asynchronously (the copy queues
    behind the kernels already launched instead of waiting for them)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


# Linux: the kernel's high-water mark of this process's resident set (VmHWM), and the file that resets it.
_PROC_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def reset_peak_memory(device: torch.device) -> bool:
    """Start `peak_memory_mb`'s peak again from the memory in use now (e.g. before each step).

    GPU: resets the caching allocator's peak. CPU: writes "5" to /proc/self/clear_refs, which sets
    the kernel's VmHWM to the current resident set (Linux 4.0 and later; a process may write its own
    file, root or not). Returns False where that cannot be done (no /proc, as on macOS, or a sandbox
    refusing the write): the CPU peak is then the peak since the process started.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        fd = os.open(_CLEAR_REFS, os.O_WRONLY)  # never created: only the kernel's file means anything
    except OSError:
        return False
    try:
        os.write(fd, b"5")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
CPU_MMAP_THRESHOLD = 1 << 20  # bytes: the lowest threshold ZeRO-3's CPU ranks set
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's own threshold rises no higher, and refuses a fixed one above it


def runs_on_cpu(kind: str) -> bool:
    """Whether parallel.device=`kind` puts this machine's ranks on the CPU."""
    return kind == "cpu" or (kind == "auto" and not torch.cuda.is_available())


def cpu_threads(ranks_per_node: int) -> int:
    """Threads for each of `ranks_per_node` CPU ranks sharing this machine's cores: more threads than cores
    only adds contention."""
    return max(1, (os.cpu_count() or 1) // ranks_per_node)


def cpu_mmap_threshold(zero: int, *, layer_grad_bytes: int) -> int | None:
    """The fixed glibc mmap threshold a CPU rank of ZeRO stage `zero` sets (map_large_allocations), or None
    to leave glibc's own; `layer_grad_bytes`: the fp32 gradient of the smallest decoder layer on this rank.

    Only ZeRO-3 pays for it. There, blocks of a layer's size with different lifetimes (its gradient buffer,
    gloo's copy of it) leave free space in the heap that stays resident, and the peak resident set wanders
    up by 10-15% over 20 steps (docs/memory.md); mapped on their own, it stays flat. So blocks of half a
    layer and more are mapped, and the smaller ones that churn (one matrix's weight gradient, activations
    of short sequences) keep the heap's speed: every mapping is faulted in and zeroed page by page at each
    allocation. At a 1 MiB threshold a ZeRO-3 step at 135M took 1.22x as long as at 8 MiB, and a ZeRO-0
    step, whose resident set is flat without any, 1.4x as long as under glibc's own (issue 40)."""
    if zero < 3:
        return None
    return min(max(layer_grad_bytes // 2, CPU_MMAP_THRESHOLD), GLIBC_MMAP_THRESHOLD_MAX)


def _mallopt(param: int, value: int) -> bool:
    """glibc's mallopt(param, value); False where there is no glibc (macOS, musl) or it refuses."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(param, value))
    except (OSError, AttributeError, TypeError):
        return False


def map_large_allocations(threshold: int = CPU_MMAP_THRESHOLD) -> bool:
    """glibc serves every block of `threshold` bytes or more with a mapping of its own, returned to the
    system when freed, so the resident set follows the live tensors (ZeRO-3's CPU ranks: cpu_mmap_threshold).

    glibc's default threshold moves: freeing a mapped block raises it to that block's size (up to
    32 MB), and from then on blocks of a training step's sizes (gradient buffers, ZeRO-3's gathered
    layers, gloo's copies, weight gradients: a few to tens of MB, allocated and freed in every step)
    come from the heap, which keeps the free space between them resident. Measured on SmolLM-135M at
    dp2 (docs/memory.md): ZeRO-3's peak resident set wandered up to 10% above step 2's, to ZeRO-0's;
    with this threshold it is flat from step 2, at 0.72x. The price: each such block is a fresh mapping,
    whose pages the kernel faults in and zeroes. Returns False where there is no glibc (macOS, musl):
    nothing changes there."""
    return _mallopt(_M_MMAP_THRESHOLD, threshold)


def _vm_hwm_kib() -> int | None:
    """VmHWM ("VmHWM:   123456 kB") from /proc/self/status, in KiB; None without /proc."""
    try:
        with open(_PROC_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak memory in MiB since the last `reset_peak_memory` (or the process's start).

    GPU: the most bytes the caching allocator had handed to tensors at once on `device`
    (max_memory_allocated: live tensors, each rounded up to the allocator's blocks). Not included:
    memory it keeps reserved for reuse, the CUDA context, and workspaces allocated outside it (NCCL).

    CPU: the peak resident set of the whole process (VmHWM): every page of it in RAM, that is the
    Python interpreter and its objects, torch's libraries, the model, gradients, optimizer state,
    activations, allocator caches, and the pages of memory-mapped files it has touched (the data
    loader's token files). Pages shared with other processes (a forked rank's pages still shared with
    its parent, shared libraries) count in each of them, so ranks' values do not add up to the
    machine's use; swapped-out pages do not count. Without /proc (macOS) this is ru_maxrss: the peak
    since the process started, which no reset lowers.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    hwm_kib = _vm_hwm_kib()
    if hwm_kib is not None:
        return hwm_kib / 2**10
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA may run on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32, which
    torch.set_float32_matmul_precision("high"/"medium") also turns on); off by default."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The device's dense peak TFLOP/s for matmuls in `dtype` where known (GPUs by name), else None.

    bf16/fp16: the tensor-core peak. fp32: TF32 tensor cores (half the bf16 rate on Hopper, Ampere and
    Ada) only when TF32 is enabled, else the fp32 CUDA-core peak: MFU is measured against what the
    matmuls could reach as configured."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    match = max((k for k in _PEAK_TFLOPS_BF16 if k in name), key=len, default=None)
    if match is None:
        return None
    return _peak_for(match, dtype, tf32=tf32_matmuls())


def _peak_for(gpu: str, dtype: torch.dtype, *, tf32: bool) -> float:
    """The table's peak for one GPU name and dtype (split out so it is tested without a GPU)."""
    bf16 = _PEAK_TFLOPS_BF16[gpu]
    if dtype in (torch.bfloat16, torch.float16):
        return bf16
    return bf16 / 2 if tf32 else _PEAK_TFLOPS_FP32[gpu]


def attention_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernel:
    """Which kernel computes one block of attention with its log-sum-exp here (parallel/block_attention.py).

    CPU: the fused flash kernel for CPUs. CUDA: FlashAttention-2 for fp16/bf16 on sm80+ (Ampere, Hopper)
    with head_dim a multiple of 8 up to 256; otherwise the memory-efficient kernel (fp32 too, any sm50+)
    with head_dim a multiple of 8; "math" (fp32 matmuls, [Tq, Tk] scores in memory) for the rest and
    for other devices."""
    if device.type == "cpu":
        return "cpu_flash"
    if device.type != "cuda" or head_dim % 8 != 0:
        return "math"
    backends = torch.backends.cuda
    flash_built = getattr(backends, "is_flash_attention_available", lambda: True)()
    if (dtype in (torch.float16, torch.bfloat16) and head_dim <= 256 and flash_built
            and torch.cuda.get_device_capability(device) >= (8, 0)):
        return "flash"
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return "math"


def rng_state(device: torch.device) -> torch.Tensor | None:
    """This rank's generator state on `device` (a uint8 tensor), None on the CPU: the CPU generator is
    saved separately and always."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    """Restore what `rng_state(device)` returned."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)


def device_name(device: torch.device) -> str:
    """"NVIDIA H200", or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def empty_cache(device: torch.device) -> None:
    """Hand cached GPU blocks back (between benchmark runs, so one run's cache does not count in the next)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


_TENSOR_CACHES: list[Any] = []


def tensor_cache(maxsize: int) -> Callable[[Callable], Callable]:
    """functools.lru_cache for a function that makes a tensor once per shape (a mask, a position order), kept where
    clear_tensor_caches finds it: the planner's and the dry run's fake-tensor runs start and end with such caches
    empty. A tensor cached under fake tensors would be a fake one in the real run that follows in the same process
    (or in the ranks it forks), and one cached before would escape the measurement's count."""
    def wrap(fn: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _TENSOR_CACHES.append(cached)
        return cached
    return wrap


def clear_tensor_caches() -> None:
    for cached in _TENSOR_CACHES:
        cached.cache_clear()
