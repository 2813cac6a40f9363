"""Training, in phases: build the run once, then for each step dispatch it, report, and save.

    build_run      data (rank 0 tokenizes first), the parallel model (parallel/parallelize.py), the
                   optimizer, the restored state of a checkpoint or model folder, the pipeline schedule
    dispatch_step  forward/backward over the micro-batches (or the pipeline schedule), the gradients
                   finished over the mesh, the global loss, clipping, the optimizer step: all launched
                   without the host waiting for the device (a non-finite step is skipped on the device)
    report         every logging.log_every steps (and at saves, validations, the end): the pending
                   steps' figures read back in one wait, checked, and written by rank 0's Reporter
                   (step_report.py: metrics.jsonl, TensorBoard, the progress bar)
    save           a checkpoint; at the end also OUT/model

The loop (train_steps) reads top to bottom: fetch the step's batch (the one place; the device is still
computing the step before), dispatch the step, its observers' figures, validation when due, and every
logging.log_every steps the report, then a save when due. A stop request (stop.py) rides on each step's loss
all-reduce and is seen at the next report: every rank saves, `train` returns early.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from tetron import device as dev
from tetron.checkpoint.background import BackgroundSaver
from tetron.checkpoint.load import load_checkpoint, load_weights, resolve_init_from
from tetron.checkpoint.save import clean_stale, save_checkpoint, write_model_folder
from tetron.config import Config
from tetron.data.batch import MicroBatch, mtp_kwargs, rank_micro_batch
from tetron.data.hf_source import share_hub_commits
from tetron.data.loader import DataLoader, check_token_ids, load_tokens, prepare_data, tokenizer_spec
from tetron.data.mixture import MixtureLoader, mixture_sources
from tetron.data.tokenizer import Tokenizer
from tetron.errors import ConfigError
from tetron.fs import find_latest
from tetron.mesh import Mesh
from tetron.models.llama import Llama
from tetron.models.mtp import take_mtp_sum
from tetron.observe.evaluate import build_evaluator, training_tokens
from tetron.observe.memory import ActivationMeter, memory_figures
from tetron.observe.metrics import say
from tetron.observe.step_report import PendingStep, Reporter, StepFigures, StepValues, check_finite, read_back
from tetron.observe.watchers import StepObservers
from tetron.parallel.grads import clip_grads_
from tetron.parallel.moe_balance import finish_moe_step
from tetron.parallel.parallelize import (
    ParallelModel,
    build_optimizer,
    finish_gradients,
    parallelize,
    sequence_positions,
)
from tetron.parallel.pipeline_parallel import Pipeline, activation_shape, layer_ranks
from tetron.parallel.zero import ShardedOptimizer
from tetron.schedule import lr_at
from tetron.stop import StopRequest


@dataclass
class Run:
    """What one rank trains with, built once by build_run and used by every step."""

    cfg: Config
    mesh: Mesh
    device: torch.device
    tokenizer: Tokenizer
    loader: DataLoader  # this dp rank's micro-batches of each step; its position is the run's step
    model: ParallelModel  # this rank's chunks, bare and wrapped for data parallelism
    optimizer: ShardedOptimizer  # optim.name over the fp32 master weights (this rank's pieces under ZeRO)
    dtype: torch.dtype  # the parameters' and activations' dtype
    loss_fn: Callable[[Tensor], Tensor]  # the loss summed over tokens (the last chunk's output) -> per token
    positions: Tensor  # [T/cp] the positions of each sequence this rank holds (indexes the loader's CPU batches)
    device_positions: Tensor  # the same on the device: the RoPE position ids
    pipeline: Pipeline | None  # the schedule runner under pp, else None
    layer_ranks: list[int]  # the pipeline rank of each decoder layer, for checkpoints
    stop: StopRequest | None = None  # set by a signal: finish the step, save, return
    background: BackgroundSaver | None = None  # with checkpoint.async_save: the thread checkpoints are written on
    halted: Tensor | None = None  # on the device, under on_nonfinite=stop: 1 once a step was not finite


def load_data(cfg: Config, mesh: Mesh, device: torch.device) -> tuple[Tokenizer, DataLoader | MixtureLoader]:
    """Rank 0 tokenizes (or finds the cache) while the others wait, then every rank opens the token stores."""
    if mesh.rank == 0:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        clean_stale(out)  # what a save killed mid-write left behind
        prepare_data(cfg)
    share_hub_commits(mesh.rank, mesh.world_size, device)  # a collective: also the wait for rank 0
    tokenizer, token_path = prepare_data(cfg)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"data.tokenizer={tokenizer_spec(cfg)} has {tokenizer.vocab_size} tokens, more than "
                         f"model.vocab_size={cfg.model.vocab_size}")
    t, d = cfg.train, cfg.data
    shape = dict(micro_batch=t.micro_batch, grad_acc=t.grad_acc, dp_size=mesh.size("dp"),
                 dp_rank=mesh.local_rank("dp"), seed=t.seed, documents=d.mask_documents or d.reset_positions)
    if isinstance(token_path, list):  # data.sources: a weighted mixture of stores
        # validate refuses val_fraction here
        return tokenizer, MixtureLoader(mixture_sources(cfg, token_path), d.seq_len, **shape)
    tokens = training_tokens(load_tokens(token_path), cfg)  # data.val_fraction's held-out tail cut off
    return tokenizer, DataLoader(tokens, d.seq_len, **shape)


def restore(run: Run) -> None:
    """Start from a checkpoint (weights, optimizer, data position, RNG), else from a model folder's
    weights; else the seeded init stands. Each rank reads only its own slices."""
    cfg, ck = run.cfg, run.cfg.checkpoint
    resume_from = None
    if ck.resume is not None:
        resume_from = find_latest(Path(cfg.out)) if ck.resume == "auto" else Path(ck.resume)
    rank0 = run.mesh.rank == 0
    if resume_from is not None:
        load_checkpoint(resume_from, chunks=run.model.chunks, optimizer=run.optimizer, loader=run.loader,
                        mesh=run.mesh, cfg=cfg)
        if rank0:
            say(f"resumed from {resume_from} at step {run.loader.step}")
    elif ck.init_from is not None:
        if not rank0:
            dist.barrier()  # rank 0 downloads a hub model first, the others find it cached
        load_weights(run.model.chunks, resolve_init_from(ck.init_from), run.optimizer)
        if rank0:
            dist.barrier()
            say(f"initialised from {ck.init_from}")


def describe(run: Run) -> None:
    """Rank 0's opening lines: the model's size and this rank's part of it, the data and the plan."""
    cfg, t = run.cfg, run.cfg.train
    total, mine = cfg.model.num_params(), sum(p.numel() for p in run.model.params)
    shards = run.mesh.size("dp_shard")
    sharded = f" (ZeRO-3: a 1/{shards} slice of it between uses)" if cfg.parallel.zero == 3 and shards > 1 else ""
    say(f"model: {total:,} parameters, {mine:,} on rank 0{sharded}")
    tokens_per_step = cfg.global_batch * cfg.data.seq_len
    windows = sum(run.loader.num_windows) if cfg.data.sources else run.loader.sampler.num_windows
    epochs = t.steps * cfg.global_batch / windows
    say(f"data: {len(run.loader.tokens):,} tokens; {tokens_per_step:,} tokens per step; {t.steps} steps = "
        f"{t.steps * tokens_per_step:,} tokens, {epochs:.2f} epochs")


def build_run(cfg: Config, mesh: Mesh, device: torch.device, *, stop: StopRequest | None = None) -> Run:
    """Everything a rank needs before its first step."""
    tokenizer, loader = load_data(cfg, mesh, device)
    run = assemble_run(cfg, mesh, device, tokenizer=tokenizer, loader=loader, stop=stop)
    restore(run)
    if mesh.rank == 0:
        describe(run)
    return run


def assemble_run(cfg: Config, mesh: Mesh, device: torch.device, *, tokenizer: Tokenizer | None,
                 loader: DataLoader | MixtureLoader | None, stop: StopRequest | None = None) -> Run:
    """The model, optimizer and schedule of a run at its seeded start, around the data given (the dry run,
    plan/dry_run.py, gives none: it feeds dispatch_step its own batches)."""
    model = parallelize(cfg, mesh, device)
    t = cfg.train
    # Sum over tokens, divided by this rank's tokens per step: after averaging over dp*cp the
    # gradient is that of the mean over every target token of the global batch.
    local_tokens = t.micro_batch * t.grad_acc * cfg.data.seq_len // mesh.size("cp")
    positions = sequence_positions(cfg, mesh)
    run = Run(cfg=cfg, mesh=mesh, device=device, tokenizer=tokenizer, loader=loader, model=model,
              optimizer=build_optimizer(model, cfg, mesh),
              dtype=torch.bfloat16 if t.dtype == "bfloat16" else torch.float32,
              loss_fn=lambda summed: summed / local_tokens,
              positions=positions, device_positions=positions.to(device), pipeline=None,
              layer_ranks=layer_ranks(cfg), stop=stop,
              background=BackgroundSaver() if cfg.checkpoint.async_save else None)
    if mesh.size("pp") > 1:
        run.pipeline = Pipeline(model.dp_chunks, mesh, schedule_name=cfg.parallel.pp_schedule,
                                micro_batches=t.grad_acc, shape=activation_shape(cfg),
                                positions=run.device_positions, dtype=run.dtype, device=device,
                                loss_fn=run.loss_fn)
    return run


# ------------------------------------------------------------------------------------ one step


def forward_backward(run: Run, micro_batches: list[MicroBatch]) -> Tensor:
    """Every micro-batch forward and backward through this rank's chunks; gradients accumulate and are
    averaged over dp*cp once, during the last backward. Returns this rank's summed loss (under pp: the
    last stage's, zero elsewhere)."""
    if run.pipeline is not None:
        # The schedule runs every micro-batch through the stages; each chunk's gradients are
        # averaged over dp*cp during its last backward. The loss lives on the last stage.
        return run.pipeline.step(micro_batches)
    wrapped = run.model.dp_chunks[0]
    loss_sum = torch.zeros((), device=run.device)
    for k, mb in enumerate(micro_batches):  # on the device already (next_batch)
        last = k == len(micro_batches) - 1
        with contextlib.nullcontext() if last else wrapped.no_sync():
            loss = run.loss_fn(wrapped(mb.inputs, mb.positions, mb.docs, targets=mb.targets,
                                       **mtp_kwargs(mb)))  # head and loss, chunked
            loss.backward()
        loss_sum += loss.detach()
    return loss_sum


def global_loss(run: Run, loss_sum: Tensor, mtp_sum: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(the step's mean loss over the global batch, whether any rank has been asked to stop: 1/0), the
    same on every rank, on the device (nothing waits for them), and with multi-token prediction its mean loss
    likewise (`mtp_sum`: this rank's, per token as loss_sum is). They travel in one all-reduce over the world,
    which replaces the loss's own over dp*cp and pp: the stop request costs one float more (under tp alone,
    this is the one tiny collective a step gains)."""
    mesh = run.mesh
    stop = float(run.stop is not None and run.stop.requested)
    extra = [] if mtp_sum is None else [mtp_sum.float()]
    if mesh.world_size == 1:
        both = torch.stack([loss_sum.float(), torch.full((), stop, device=loss_sum.device), *extra])
        return both[0], both[1], both[2] if extra else None
    # Each rank adds loss / (dp*cp*tp): the tp ranks of a stage hold the same loss, every stage but the last
    # holds zero, so the sum is the mean over dp*cp of the last stage's loss, on every rank.
    ranks = mesh.size("dp_cp") * mesh.size("tp")
    share = loss_sum.float() / ranks
    # torch.full writes the flag by a kernel: a host-to-device copy would wait for the queued work
    both = torch.stack([share, torch.full((), stop, device=share.device), *(e / ranks for e in extra)])
    dist.all_reduce(both)
    return both[0], both[1], both[2] if extra else None


def next_batch(run: Run) -> list[MicroBatch]:
    """The loader's next step: this rank's positions of each micro-batch, on the device (on a GPU copied
    asynchronously, so that the batch of step s+1 travels while step s computes)."""
    batch = run.loader.next_batch()
    check_token_ids(batch, run.cfg, step=run.loader.step)
    depth = getattr(run.cfg.model, "num_nextn_predict_layers", 0)
    return [rank_micro_batch(mb, run.positions, run.device_positions, run.cfg.data, run.device, mtp_depth=depth)
            for mb in batch]


def dispatch_step(run: Run, step: int, batch: list[MicroBatch], *,
                  measure_memory: bool = False) -> PendingStep:
    """Optimizer step `step` (0-based) on `batch`, without waiting for the device: a non-finite loss or
    gradient norm makes the optimizer skip the update (the fused AdamW on the device's word, found_inf); under
    on_nonfinite=stop every later update is skipped too, so the weights stay those before the bad step
    until the host reads it back and stops."""
    t = run.cfg.train
    start = time.perf_counter()
    lr = lr_at(step, t)
    run.optimizer.set_lr(lr)
    meter = ActivationMeter(run.model.params) if measure_memory else None
    with meter or contextlib.nullcontext():
        loss_sum = forward_backward(run, batch)
    finish_gradients(run.model, run.mesh, run.optimizer)
    moe = finish_moe_step(run.model.chunks, run.mesh.group("dp_cp"), sequences=run.cfg.global_batch,
                          moe_layers=run.model.moe_layers or None, stages=run.mesh.group("pp"),
                          tp=run.mesh.group("tp") if run.cfg.parallel.sp else None)
    mtp = take_mtp_sum(run.model.chunks, run.device)  # MTP modules' loss: logged apart (models/mtp.py)
    loss, stop, mtp = global_loss(run, loss_sum, None if mtp is None else run.loss_fn(mtp))
    grad_norm = clip_grads_(run.optimizer.grads(), t.grad_clip, run.mesh, sharded_over_dp=run.cfg.parallel.zero >= 1)
    bad = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()
    found_inf = bad
    if t.on_nonfinite == "stop":
        found_inf = run.halted = bad if run.halted is None else torch.maximum(bad, run.halted)
    run.optimizer.step(found_inf)
    # after the step: the optimizer's moments exist
    memory = memory_figures(run.model, run.optimizer.tensors(), meter) if meter is not None else None
    run.model.zero_grad()
    clip = run.optimizer.qk_clip  # optim.qk_clip_tau: the step's largest attention logit, clipped after the step
    values = StepValues(loss=loss, grad_norm=grad_norm, nonfinite=bad, stop=stop, moe=moe, mtp_loss=mtp,
                        max_attn_logit=clip.max_logit if clip is not None else None)
    return PendingStep(step, values, lr, start, memory)


def train_step(run: Run, step: int, *, measure_memory: bool = False) -> StepFigures:
    """Optimizer step `step` (0-based) on the loader's next batch, read back at once (not every log_every)."""
    dev.reset_peak_memory(run.device)
    pending = dispatch_step(run, step, next_batch(run), measure_memory=measure_memory)
    figures = read_back([pending])[0]
    check_finite(run.cfg, step, figures)
    return figures


# ------------------------------------------------------------------------------------ report and save


def save(run: Run) -> None:
    """OUT/checkpoints/step_N for the steps taken (N is the loader's position: a checkpoint's name and
    content always agree); every rank calls this and writes its share (with async_save, on run.background)."""
    cfg, mesh, step = run.cfg, run.mesh, run.loader.step
    layout = {**{a: mesh.size(a) for a in ("dp", "tp", "pp", "cp")}, "pp_virtual": cfg.parallel.pp_virtual,
              "world_size": mesh.world_size}
    state = {"step": step, "tokens": step * cfg.global_batch * cfg.data.seq_len, "loader": run.loader.state_dict(),
             "config": cfg.to_dict(), "layout": layout}
    start = time.perf_counter()

    def saved(folder: Path) -> None:  # on rank 0, once the folder is complete (with async_save, on its thread)
        mib = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        say(f"saved {folder} ({mib:,.1f} MiB, {time.perf_counter() - start:.1f} s)")

    save_checkpoint(Path(cfg.out), run.model.chunks, mesh, cfg=cfg, optimizer=run.optimizer, trainer_state=state,
                    layer_ranks=run.layer_ranks, tokenizer=run.tokenizer, background=run.background, on_saved=saved)


def write_model(run: Run) -> None:
    """OUT/model: the trained model alone, in the compute dtype, for `tetron generate` and transformers."""
    cfg = run.cfg
    write_model_folder(Path(cfg.out) / "model", run.model.chunks, run.mesh, config=cfg.model,
                       weights=lambda p: run.optimizer.full_tensor(p, "master"), dtype=run.dtype,
                       layer_ranks=run.layer_ranks, tokenizer=run.tokenizer, shard_mb=cfg.checkpoint.shard_mb)


# ------------------------------------------------------------------------------------ the loop


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # global mean loss of every step run
    chunks: list[Llama] = field(default_factory=list)  # this rank's bare chunks, virtual-stage order
    stopped_at: int | None = None  # the step saved when a stop request ended the run early, else None
    timings: list[dict[str, float]] = field(default_factory=list)  # with logging.timers: this rank's seconds
    # per category of each step, and the step's own step_time_s

    @property
    def model(self) -> Llama:
        """The bare model on this rank (under pp: its first chunk)."""
        return self.chunks[0]


def report(run: Run, reporter: Reporter | None, result: TrainResult, pending: list[PendingStep]) -> bool:
    """Read back the steps dispatched since the last report and record each (rank 0 writes them); a
    non-finite one under on_nonfinite=stop raises once the steps before it are recorded. Returns whether
    any rank was asked to stop."""
    stop = False
    for dispatched, figures in zip(pending, read_back(pending)):
        check_finite(run.cfg, dispatched.step, figures)
        result.losses.append(figures.loss)
        if dispatched.seconds:
            result.timings.append({**dispatched.seconds, "step_time_s": figures.time_s})
        if reporter:
            reporter.step(dispatched.step, figures, dispatched.extra)
        stop = stop or figures.stop
    return stop


def train(cfg: Config, mesh: Mesh, *, device: torch.device | None = None,
          stop: StopRequest | None = None) -> TrainResult:
    """Train `cfg` on the ranks of `mesh`; every rank calls this. A `stop` request (a signal) makes every
    rank save after the current step and return (result.stopped_at), without writing OUT/model. With
    checkpoint.async_save, the run ends once its last checkpoint is written."""
    return train_steps(build_run(cfg, mesh, device or torch.device("cpu"), stop=stop))


def train_steps(run: Run) -> TrainResult:
    """The loop of `train`, from the run's first step (a resumed run's next) to train.steps or a stop."""
    cfg, mesh, t = run.cfg, run.mesh, run.cfg.train
    first = run.loader.step
    if first > t.steps:  # validate refuses this before start; a checkpoint named step_{steps} must hold that step
        raise ConfigError(f"train.steps={t.steps} is below the step the run resumes at ({first}); "
                          f"use train.steps >= {first}")
    reporter = Reporter(cfg, device=run.device, world_size=mesh.world_size,
                        first_step=first) if mesh.rank == 0 else None
    result = TrainResult(chunks=run.model.chunks)
    observers = StepObservers(cfg, mesh, device=run.device)
    evaluator = build_evaluator(cfg, mesh, run.model.chunks, run.tokenizer, device=run.device, dtype=run.dtype,
                                positions=run.positions)
    pending: list[PendingStep] = []  # dispatched, not yet read back
    dev.reset_peak_memory(run.device)
    with run.background or contextlib.nullcontext():
        for step in range(first, t.steps):
            batch = next_batch(run)  # while the device still computes the step before
            with observers.step(step):
                dispatched = dispatch_step(run, step, batch, measure_memory=step == first)
                aside = time.perf_counter()
            dispatched.extra = observers.figures()  # every rank: the timers' max is a collective
            if evaluator is not None and evaluator.due(step):
                dispatched.extra.update(evaluator.figures())  # val_loss, val_ppl: a collective too
            dispatched.aside_s = time.perf_counter() - aside  # the observers' own work (a profile's export too)
            dispatched.seconds = dict(observers.seconds)
            pending.append(dispatched)
            last = step + 1 == t.steps
            saving = bool(cfg.checkpoint.save_every) and (step + 1) % cfg.checkpoint.save_every == 0 and not last
            if not (last or saving or dispatched.extra or (step + 1) % cfg.logging.log_every == 0):
                continue
            stop = report(run, reporter, result, pending)  # the one wait for the device in log_every steps
            pending = []
            dev.reset_peak_memory(run.device)
            if (saving or stop) and not last:
                save(run)
            if stop and not last:
                result.stopped_at = step + 1
                break
        if reporter:
            reporter.close()
        if result.stopped_at is None:  # the final checkpoint, and OUT/model: both streamed to rank 0
            save(run)
            write_model(run)
    return result
