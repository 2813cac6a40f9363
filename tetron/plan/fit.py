"""Refusing what will not fit: `tetron train` weighs the memory model's per-rank peak against the device
before any rank allocates, and stops with one line instead of an out-of-memory kill minutes later.

On a GPU the limit is the device's memory less a reserve (the CUDA context, NCCL's buffers); on the
CPU every rank of the node shares the machine's available memory, and each rank's process also holds
the interpreter and torch. `parallel.ignore_memory_limit` (`--force`) starts anyway.
"""

from __future__ import annotations

import torch

from tetron.config import Config
from tetron.errors import ConfigError
from tetron.observe.metrics import say
from tetron.plan.hardware import GiB, available_memory
from tetron.plan.memory import MemoryEstimate, floor, predict
from tetron.plan.search import CPU_PROCESS_BYTES, GPU_RESERVE


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:.0f} MiB"


def _uses_cuda(cfg: Config) -> bool:
    return cfg.parallel.device == "cuda" or (cfg.parallel.device == "auto" and torch.cuda.is_available())


def gpu_memory(local_rank: int) -> tuple[int, str]:
    """(bytes, name) of this rank's GPU. Reading its properties initialises no context on it, so the
    launching process can ask before it starts the ranks."""
    props = torch.cuda.get_device_properties(local_rank % torch.cuda.device_count())
    return props.total_memory, props.name


def breakdown(estimate: MemoryEstimate) -> str:
    """"activations 61.2 GiB, optimizer 18.0 GiB, params 9.0 GiB" (the three largest terms)."""
    return ", ".join(f"{name} {_gib(n)}" for name, n in estimate.largest(3))


def check_fits(cfg: Config, *, ranks_on_node: int, local_rank: int = 0) -> MemoryEstimate | None:
    """Raise ConfigError (one line) when `cfg`'s predicted per-rank peak exceeds what this node gives a rank;
    else return the prediction (None under --force: nothing is predicted). `ranks_on_node`: how many of the
    run's ranks share this machine. The arithmetic lower bound (memory.floor) is weighed first, so a model
    far too large is refused before the memory model builds a layer or walks the schedule for it."""
    if cfg.parallel.ignore_memory_limit:
        return None
    limit = _limit(cfg, ranks_on_node=ranks_on_node, local_rank=local_rank)
    _refuse_over(cfg, floor(cfg), limit, ranks_on_node=ranks_on_node)
    try:
        estimate = predict(cfg)
    except Exception as err:  # the planner measures the family's layer on fake tensors (plan/probe.py): where that
        # fails, the run is not the planner's to stop; the arithmetic floor above was weighed
        say(f"the memory model could not measure this model's layer ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160] if str(err) else ''}); the fit is checked only against its lower bound")
        return None
    _refuse_over(cfg, estimate, limit, ranks_on_node=ranks_on_node)
    return estimate


def _limit(cfg: Config, *, ranks_on_node: int, local_rank: int) -> tuple[int, str]:
    """(bytes one rank may hold, what they are): the GPU's memory less the reserve, or the machine's
    available memory shared by the node's ranks, less each one's interpreter and torch."""
    if _uses_cuda(cfg):
        total, name = gpu_memory(local_rank)
        return total - GPU_RESERVE, (f"the {_gib(total)} of the {name} less {_gib(GPU_RESERVE)} for the CUDA "
                                     f"context and NCCL")
    available = available_memory()
    return available // ranks_on_node - CPU_PROCESS_BYTES, f"the {_gib(available)} this machine has available"


def _refuse_over(cfg: Config, estimate: MemoryEstimate, limit: tuple[int, str], *, ranks_on_node: int) -> None:
    """Raise the one-line ConfigError when `estimate` is over `limit` (from _limit)."""
    per_rank, what = limit
    if estimate.total <= per_rank:
        return
    where = (f"at the {estimate.moment}" + (f" of pipeline rank {estimate.pp_rank}" if cfg.parallel.pp > 1 else "")
             if estimate.moment else "at least, from the sizes alone")
    advice = ("use `tetron plan` to find a layout that fits (more --zero, --recompute selective or full, a smaller "
              "--micro-batch, more ranks), or --force to start anyway")
    if _uses_cuda(cfg):
        raise ConfigError(f"predicted peak memory per rank {_gib(estimate.total)} ({breakdown(estimate)}; {where}) "
                          f"exceeds {what}; {advice}")
    need = ranks_on_node * (estimate.total + CPU_PROCESS_BYTES)
    raise ConfigError(f"predicted memory {ranks_on_node} ranks x ({_gib(estimate.total)} of tensors "
                      f"[{breakdown(estimate)}; {where}] + {_gib(CPU_PROCESS_BYTES)} of interpreter and torch) "
                      f"= {_gib(need)} exceeds {what}; {advice}")
