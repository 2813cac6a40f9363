"""`tetron plan CONFIG --dry-run`: one real training step of each distinct rank, at full size, on fake tensors.

For each pipeline rank (ranks that differ only by their dp, cp or tp index run the same code on the same
shapes; the pipeline's ranks differ by layers, embedding and head), in this process:
  - torch's `fake` process group of the run's world size, as that rank (collectives return at once);
  - under FakeTensorMode (shapes, dtypes and devices; no storage), the rank's real model, optimizer and
    schedule, built by train.assemble_run (parallelize, ZeRO, expert parallelism, the pipeline);
  - one step of train.dispatch_step (the schedule, the gradients' reduction, clipping, AdamW) on fake token
    batches of the run's shape, watched by MemTracker (peak bytes), FlopCounterMode (FLOPs) and
    dry_modes.DryRunMode (bytes per collective kind; balanced MoE routing);
then beside each figure the planner's: memory.predict_rank's peak, and the model FLOPs (6N + attention per
token, as MFU counts them) of the global batch's tokens shared by the world's ranks.

The step runs on fake CPU tensors: in a CPU build of torch a backward over fake `cuda` tensors aborts the
process. The forward alone then runs again on fake `cuda` tensors, in a child process (an abort there is
reported, not fatal): the check of the CUDA path's device placement.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from tetron.config import Config
from tetron.data.batch import MicroBatch
from tetron.mesh import Mesh
from tetron.plan.dry_modes import DryRunMode
from tetron.plan.memory import predict_rank
from tetron.torch_private import grouped_mm_available
from tetron.torch_private.fake import fake_store, fake_tensor_mode, memory_tracker


@dataclass
class RankFigures:
    """What one simulated rank's step did, beside the planner's prediction."""

    rank: int  # the global rank simulated (dp, cp and tp index 0 of its pipeline rank)
    pp_rank: int
    peak_bytes: int  # MemTracker's peak over the step (parameters, gradients, optimizer state, activations, ...)
    flops: int  # FlopCounterMode's total over the step (recomputed forwards included)
    collective_bytes: dict[str, int] = field(default_factory=dict)  # per kind, over the step
    predicted_bytes: int = 0  # memory.predict_rank's peak
    predicted_flops: int = 0  # the model FLOPs of the global batch over the world's ranks
    cuda_forward: str = "not run"  # "ok", or what failed


def distinct_ranks(cfg: Config) -> list[int]:
    """One global rank per pipeline rank: the grid is [pp, dp, cp, tp], tp innermost."""
    p = cfg.parallel
    return [stage * p.dp * p.cp * p.tp for stage in range(p.pp)]


def fake_batches(cfg: Config, run_positions: torch.Tensor, device: torch.device) -> list[MicroBatch]:
    """The step's micro-batches as the loader would give this rank: token ids and targets [B, T/cp]."""
    t, n = cfg.train, run_positions.numel()
    return [MicroBatch(torch.zeros(t.micro_batch, n, dtype=torch.long, device=device),
                       torch.zeros(t.micro_batch, n, dtype=torch.long, device=device), run_positions, None)
            for _ in range(t.grad_acc)]


@contextlib.contextmanager
def fake_rank(cfg: Config, rank: int):
    """Rank `rank` of a fake process group of the run's world size, and its Mesh; destroyed on leaving."""
    p = cfg.parallel
    dist.init_process_group("fake", rank=rank, world_size=cfg.world_size, store=fake_store())
    try:
        yield Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, dp_shard=p.dp_shard)
    finally:
        dist.destroy_process_group()


def simulate_rank(cfg: Config, rank: int) -> RankFigures:
    """One training step of global rank `rank` on fake CPU tensors: its peak memory, FLOPs and collectives."""
    from tetron.train import assemble_run, dispatch_step  # the loop's own functions; train imports plan

    device = torch.device("cpu")
    grouped_mm_available("cpu")  # probed on real tensors, once per process: under fake ones the probe would fail
    with warnings.catch_warnings(), fake_rank(cfg, rank) as mesh, fake_tensor_mode(), DryRunMode() as watch:
        # data_parallel compares data pointers (a view or a copy?); fake ones are all 0: "a view", no copy
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        tracker = memory_tracker()
        with tracker:  # from the first parameter: the model's state counts toward the peak
            run = assemble_run(cfg, mesh, device, tokenizer=None, loader=None)
            batch = fake_batches(cfg, run.device_positions, device)
            with FlopCounterMode(display=False) as flops:
                dispatch_step(run, 0, batch)
        peak = _peak(tracker, device)
        pp_rank = mesh.local_rank("pp")
    return RankFigures(rank=rank, pp_rank=pp_rank, peak_bytes=peak, flops=flops.get_total_flops(),
                       collective_bytes=dict(watch.collective_bytes),
                       predicted_bytes=predict_rank(cfg, pp_rank).total,
                       predicted_flops=model_flops_per_rank(cfg))


def _peak(tracker, device: torch.device) -> int:
    """MemTracker's peak on `device`: its "Total" category (every category at the moment of the peak)."""
    snapshot = tracker.get_tracker_snapshot("peak")
    per_device = snapshot.get(device) or next(iter(snapshot.values()), {})
    return int(max((v for k, v in per_device.items() if str(k).endswith("Total")), default=0)) if any(
        str(k).endswith("Total") for k in per_device) else int(sum(per_device.values()))


def model_flops_per_rank(cfg: Config) -> int:
    """The planner's FLOPs of a step on one rank: the model FLOPs per token (6N + attention, as MFU counts them)
    of the global batch's tokens, shared by the world's ranks."""
    tokens = cfg.global_batch * cfg.data.seq_len
    return int(cfg.model.flops_per_token(cfg.data.seq_len) * tokens / cfg.world_size)
