"""`tetron plan CONFIG --dry-run`: one real training step of each distinct rank, at full size, on fake tensors.

For each kind of pipeline rank (ranks that differ only by their dp, cp or tp index run the same code on the same
shapes; the pipeline's ranks differ by layers, embedding and head: distinct_ranks), in this process:
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
import json
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tetron.config import Config, from_dict
from tetron.data.batch import MicroBatch, mtp_shifted
from tetron.mesh import Mesh
from tetron.plan.dry_modes import CrossDeviceCopies, DryRunMode
from tetron.plan.memory import heaviest_ranks, predict_rank
from tetron.torch_private import grouped_mm_available, is_fake
from tetron.torch_private.fake import fake_store, fake_tensor_mode, flop_counter, memory_tracker, real_mode


@dataclass
class RankFigures:
    """What one simulated rank's step did, beside the planner's prediction."""

    rank: int  # the global rank simulated (dp, cp and tp index 0 of its pipeline rank)
    pp_rank: int
    peak_bytes: int  # MemTracker's peak over the step (parameters, gradients, optimizer state, activations, ...)
    build_bytes: int  # its peak while the rank builds its model (ZeRO over several ranks: a bucket whole at a time)
    flops: int  # FlopCounterMode's total over the step (recomputed forwards included)
    collective_bytes: dict[str, int] = field(default_factory=dict)  # per kind, over the step
    predicted_bytes: int = 0  # memory.predict_rank's peak
    predicted_flops: int = 0  # the model FLOPs of the global batch over the world's ranks
    cuda_forward: str = "not run"  # "ok", or what failed


def distinct_ranks(cfg: Config) -> list[int]:
    """One global rank per kind of pipeline rank (memory.heaviest_ranks: the first, the last, and of those holding
    the same kind of chunks the earliest, which has the most micro-batches in flight; a rank of a kind differs
    from its earliest by fewer in flight only): the grid is [pp, dp, cp, tp], tp innermost."""
    p = cfg.parallel
    return [stage * p.dp * p.cp * p.tp for stage in heaviest_ranks(cfg)]


def fake_batches(cfg: Config, run_positions: torch.Tensor, device: torch.device,
                 watch: DryRunMode | None = None) -> list[MicroBatch]:
    """The step's micro-batches as the loader would give this rank: token ids and targets [B, T/cp]; with
    multi-token prediction each depth's ids, targets and validity [B, D, 3, T/cp] (data/batch.py mtp_shifted),
    their validity known to `watch` (the positions a depth counts: all but its last k of the window)."""
    t, n = cfg.train, run_positions.numel()
    depth = getattr(cfg.model, "num_nextn_predict_layers", 0)

    def mtp() -> torch.Tensor | None:
        if not depth:
            return None
        positions = watch.shadow.get(run_positions, run_positions) if watch is not None else run_positions
        with real_mode():  # (under fake tensors the positions' values are their shadow's: dry_modes.HOST_INDICES)
            window = torch.zeros(t.micro_batch, cfg.data.seq_len, dtype=torch.long)
            real = mtp_shifted(window, window, None, depth)[..., positions.cpu()]
        out = torch.empty(real.shape, dtype=real.dtype, device=device)
        if watch is None or not is_fake(out):  # real tensors (the tests' reference step): the values themselves
            return real.to(device)
        watch.shadow[out] = real
        return out

    return [MicroBatch(torch.zeros(t.micro_batch, n, dtype=torch.long, device=device),
                       torch.zeros(t.micro_batch, n, dtype=torch.long, device=device), run_positions, None, mtp())
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


def simulate_rank(cfg: Config, rank: int, *, fake: bool = True) -> RankFigures:
    """One training step of global rank `rank` on fake CPU tensors: its peak memory, FLOPs and collectives.
    `fake=False` runs the same on real tensors (the reference the tests hold the fake figures to)."""
    from tetron.train import assemble_run, dispatch_step  # the loop's own functions; train imports plan

    device = torch.device("cpu")
    grouped_mm_available("cpu")  # probed on real tensors, once per process: under fake ones the probe would fail
    pp_rank = rank // (cfg.parallel.dp * cfg.parallel.cp * cfg.parallel.tp)  # the grid is [pp, dp, cp, tp]
    predicted = predict_rank(cfg, pp_rank).total  # before the fake group: the planner measures with its own
    with warnings.catch_warnings(), fake_rank(cfg, rank) as mesh, \
            fake_tensor_mode() if fake else contextlib.nullcontext(), DryRunMode() as watch:
        # data_parallel compares data pointers (a view or a copy?); fake ones are all 0: "a view", no copy
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        tracker = memory_tracker()
        with tracker:  # from the first parameter: the model's state counts toward the peak
            run = assemble_run(cfg, mesh, device, tokenizer=None, loader=None)
            build = _peak(tracker, device)
            tracker.restart_peak()  # the step's peak from the built model's state on, apart from the build's
            batch = fake_batches(cfg, run.device_positions, device, watch)
            with flop_counter() as flops:
                dispatch_step(run, 0, batch)
        peak = _peak(tracker, device)
    return RankFigures(rank=rank, pp_rank=pp_rank, peak_bytes=peak, build_bytes=build, flops=flops.get_total_flops(),
                       collective_bytes=dict(watch.collective_bytes),
                       predicted_bytes=predicted,
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


# Measured here (torch 2.13 CPU build): matmuls and attention run on fake cuda tensors, but a view (slicing, a
# gradient buffer's view_as) and copies between devices meet torch's device guard, which a CPU build lacks.
CPU_BUILD = "not run: a CPU build of torch (no cuda device guard: views of fake cuda tensors fail)"


def cuda_forwards(cfg: Config, ranks: list[int], *, timeout_s: float = 600.0) -> list[str]:
    """Each rank's forward on fake `cuda` tensors, in a child process (a CPU build of torch may abort in it):
    "ok", or the error (a tensor left on the CPU, say), per rank."""
    if torch.version.cuda is None:
        return [CPU_BUILD] * len(ranks)
    request = json.dumps({"config": cfg.to_dict(), "ranks": ranks})
    try:
        done = subprocess.run([sys.executable, "-m", "tetron.plan.dry_run"], input=request, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [f"timed out after {timeout_s:.0f} s"] * len(ranks)
    results = [line.split("\t", 1)[1] for line in done.stdout.splitlines() if line.startswith("cuda\t")]
    if len(results) < len(ranks):
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        results += [f"the process ended ({last[:200]})"] * (len(ranks) - len(results))
    return results


def cuda_forward(cfg: Config, rank: int) -> str:
    """The forward of every micro-batch of rank `rank` on fake `cuda` tensors, nothing kept for a backward."""
    from tetron.train import assemble_run

    device = torch.device("cuda")
    try:
        with warnings.catch_warnings(), fake_rank(cfg, rank) as mesh, fake_tensor_mode(), DryRunMode(), \
                CrossDeviceCopies(), torch.no_grad():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            run = assemble_run(cfg, mesh, device, tokenizer=None, loader=None)
            batch = fake_batches(cfg, run.device_positions, device)
            if run.pipeline is not None:
                run.pipeline.forward_only(batch)
            else:
                for mb in batch:
                    run.model.dp_chunks[0](mb.inputs, mb.positions, mb.docs, targets=mb.targets)
    except Exception as err:  # reported in the table: the CUDA path's placement is what this checks
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    return "ok"


def _main() -> None:
    """The child of cuda_forwards: a JSON request on stdin, a line "cuda\\t<result>" per rank on stdout."""
    request = json.loads(sys.stdin.read())
    cfg = from_dict(request["config"])
    for rank in request["ranks"]:
        print(f"cuda\t{cuda_forward(cfg, rank)}", flush=True)


if __name__ == "__main__":
    _main()


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _flops(n: float) -> str:
    return f"{n / 1e12:.1f} T" if n >= 1e12 else f"{n / 1e6:.1f} M"


def table(cfg: Config, figures: list[RankFigures]) -> str:
    """One row per simulated rank: peak memory and FLOPs, each beside the planner's and their ratio, then the
    bytes each kind of collective moved over the step, then the CUDA forward's result."""
    kinds = sorted({k for f in figures for k in f.collective_bytes})
    head = (f"{'rank':>5} {'pp':>3}  {'peak':>11} {'planner':>11} {'ratio':>6} {'build':>11}  {'FLOPs':>9} "
            f"{'planner':>9} {'ratio':>6}  " + " ".join(f"{k:>14}" for k in kinds))
    rows = [head]
    for f in figures:
        rows.append(f"{f.rank:>5} {f.pp_rank:>3}  {_size(f.peak_bytes):>11} {_size(f.predicted_bytes):>11} "
                    f"{f.peak_bytes / max(f.predicted_bytes, 1):>6.3f} {_size(f.build_bytes):>11}  "
                    f"{_flops(f.flops):>9} {_flops(f.predicted_flops):>9} {f.flops / max(f.predicted_flops, 1):>6.3f}  "
                    + " ".join(f"{_size(f.collective_bytes.get(k, 0)):>14}" for k in kinds))
    results = sorted({f.cuda_forward for f in figures})
    if len(results) == 1:
        rows.append(f"cuda forward: {results[0]}")
    else:
        rows += [f"cuda forward of rank {f.rank}: {f.cuda_forward}" for f in figures]
    return "\n".join(rows)


def dry_run(cfg: Config) -> str:
    """Simulate each distinct rank of `cfg`'s layout (simulate_rank), then check the CUDA forward; the report."""
    start = time.perf_counter()
    ranks = distinct_ranks(cfg)
    figures, failed = [], []
    for rank in ranks:
        try:
            figures.append(simulate_rank(cfg, rank))
        except Exception as err:  # a rank's step that fails under fake tensors: said, and the others still run
            failed.append(f"rank {rank}: the step failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    ranks = [f.rank for f in figures]
    for f, result in zip(figures, cuda_forwards(cfg, ranks)):
        f.cuda_forward = result
    p = cfg.parallel
    layout = (f"dp{p.dp} tp{p.tp} pp{p.pp}" + (f"({p.pp_schedule}x{p.pp_virtual})" if p.pp > 1 else "")
              + f" cp{p.cp} ep{p.ep} zero{p.zero} {cfg.train.recompute} mb{cfg.train.micro_batch}x{cfg.train.grad_acc}")
    head = (f"tetron dry run: {cfg.model.num_params():,} parameters, {cfg.world_size} ranks ({layout}), seq "
            f"{cfg.data.seq_len}, {cfg.train.dtype}: one step of each kind of pipeline rank on fake tensors "
            f"({time.perf_counter() - start:.0f} s)")
    note = ("planner: peak = plan.memory.predict_rank, the step's (from the built model on); build = the peak while "
            "the rank builds its model (in fp32; under ZeRO over several ranks one bucket at a time as it is "
            "sharded), which the planner does not predict; FLOPs = the model FLOPs (6N + attention a "
            "token, as MFU counts them) of the global batch over the ranks. MoE routing taken as even.")
    return "\n".join([head, table(cfg, figures), *failed, *optimizer_lines(cfg, figures), note])


def optimizer_lines(cfg: Config, figures: list[RankFigures]) -> list[str]:
    """Under Muon, the planner's figures of each simulated rank's optimizer step (plan/muon.py, plan/state.py):
    its state, its Newton-Schulz FLOPs (within the FLOPs measured above) and its gathers over tp (within the
    all_gather bytes)."""
    from tetron.plan.muon import muon_work
    from tetron.plan.state import state

    if cfg.optim.name != "muon":
        return []
    lines = []
    for f in figures:
        work, held = muon_work(cfg, f.pp_rank), state(cfg, f.pp_rank)
        lines.append(f"muon, rank {f.rank} (planner): optimizer state {_size(held.optimizer)} (momentum on the "
                     f"matrices, AdamW's moments on the rest); Newton-Schulz {work.ns_flops / 1e9:,.1f} GFLOP on "
                     f"{work.matrices} whole matrices; tp all-gathers {_size(work.tp_gather_bytes)}")
    return lines
