"""The training step and loop, read top to bottom: data, model, parallelism, optimizer, steps, report."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tetron import device as dev
from tetron.checkpoint import clean_stale, find_latest, save_checkpoint, write_model_folder
from tetron.checkpoint_load import load_checkpoint, load_weights, resolve_init_from
from tetron.config import Config, TrainConfig, from_dict
from tetron.data import DataLoader, default_cache_dir, load_tokens, prepare_tokens
from tetron.tokenizer import Tokenizer, load_tokenizer
from tetron.init import init_weights_, materialize_
from tetron.mesh import Mesh
from tetron.metrics import MetricsLog, ProgressBar, mfu, trim_after
from tetron.model import Llama
from tetron.parallel.context_parallel import apply_context_parallel, shard_indices
from tetron.parallel.data_parallel import apply_data_parallel
from tetron.parallel.pipeline_parallel import (
    Pipeline,
    PipelineTrace,
    activation_shape,
    build_pipeline_chunks,
    layer_ranks,
    sync_tied_embedding_grads,
)
from tetron.parallel.tensor_parallel import (
    apply_tensor_parallel,
    padded_vocab_size,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine decay to lr*min_lr_ratio."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    low = t.lr * t.min_lr_ratio
    return low + 0.5 * (t.lr - low) * (1 + math.cos(math.pi * min(1.0, progress)))


def prepare_data(cfg: Config) -> tuple[Tokenizer, Path]:
    """Tokenizer and flat token file for this config; both cached, so only the first call does work."""
    d = cfg.data
    cache = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
    tokenizer = load_tokenizer(d.tokenizer, data_spec=d.path, cache_dir=cache, text_field=d.text_field,
                               max_bytes=d.max_bytes)
    tokens = prepare_tokens(d.path, tokenizer, cache_dir=cache, text_field=d.text_field, max_bytes=d.max_bytes)
    return tokenizer, tokens


def build_model(cfg: Config, device: torch.device, *, tp_group: dist.ProcessGroup | None = None) -> Llama:
    """The model as this rank holds it: built on the meta device, split for tensor parallelism,
    then given storage on `device` and filled from the run seed (each rank its own slices)."""
    with torch.device("meta"):
        model = Llama(cfg.model)
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group, sequence_parallel=cfg.parallel.sp,
                              vocab_pad_multiple=cfg.parallel.vocab_pad_multiple)
    materialize_(model, device)
    init_weights_(model, seed=cfg.train.seed, std=cfg.model.initializer_range)
    return model


def build_chunks(cfg: Config, device: torch.device, *, mesh: Mesh) -> list[Llama]:
    """This rank's model chunks: the whole model without pipeline parallelism, else its stage's chunk(s)
    (one per virtual stage), each built on meta, split for tp, then materialised and initialised."""
    if mesh.size("pp") == 1:
        return [build_model(cfg, device, tp_group=mesh.group("tp"))]
    chunks = build_pipeline_chunks(cfg, mesh)
    for chunk in chunks:
        materialize_(chunk, device)
        # Names stay Hugging Face names, so every layout starts from the same weights.
        init_weights_(chunk, seed=cfg.train.seed, std=cfg.model.initializer_range)
    return chunks


def make_loss_fn(cfg: Config, mesh: Mesh) -> Callable[[Tensor, Tensor], Tensor]:
    """Summed cross entropy over the target tokens: plain, or from vocab-sharded logits under tp."""
    tp = mesh.size("tp")
    if tp == 1:
        return lambda logits, targets: F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                       reduction="sum")
    padded = padded_vocab_size(cfg.model.vocab_size, tp, cfg.parallel.vocab_pad_multiple)
    start = mesh.local_rank("tp") * padded // tp
    return lambda logits, targets: vocab_parallel_cross_entropy(
        logits.float(), targets, mesh.group("tp"), vocab_start=start, vocab_size=cfg.model.vocab_size)


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm weights are scales, decaying them hurts)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, mesh: Mesh) -> float:
    """Clip by the global gradient norm; returns the norm before clipping.

    Each element counts once: squares of tensor-parallel shards (`param.shard` set) are summed over
    tp, replicated tensors are taken as they are, stages are summed over pp, and the last stage's
    copy of a tied embedding (`param.tied_copy`) is left out of the sum (the first stage counts it)."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p for p in params if p.grad is not None and not getattr(p, "tied_copy", False)]
    sharded = [p.grad for p in counted if getattr(p, "shard", None) is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), device=device, dtype=torch.float32)
    shard_sq = torch.zeros((), device=device, dtype=torch.float32)
    for p in counted:
        total += p.grad.float().pow(2).sum()
    for g in sharded:
        shard_sq += g.float().pow(2).sum()
    if mesh.size("tp") > 1:
        total -= shard_sq
        dist.all_reduce(shard_sq, group=mesh.group("tp"))
        total += shard_sq
    if mesh.size("pp") > 1:
        dist.all_reduce(total, group=mesh.group("pp"))
    norm = total.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    return float(norm)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # global mean loss of every step
    model: nn.Module | None = None  # the plain (unwrapped) model on this rank; under pp its first chunk
    chunks: list[nn.Module] = field(default_factory=list)  # this rank's chunks, virtual-stage order; [model] without pp
    pipeline_trace: PipelineTrace | None = None  # under pp: this rank's actions and held activations, last step
    dp_collectives: int = 0  # gradient all-reduces issued by data parallelism over the run


def train(cfg: Config, mesh: Mesh, *, device: torch.device | None = None) -> TrainResult:
    """Train `cfg` on the ranks of `mesh`; every rank calls this."""
    t, d = cfg.train, cfg.data
    device = device or torch.device("cpu")
    rank0 = mesh.rank == 0
    out = Path(cfg.out)

    # Data: rank 0 tokenizes (or finds the cache) while the others wait, then everyone maps the file.
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        clean_stale(out)  # what a save killed mid-write left behind
        prepare_data(cfg)
    dist.barrier()
    tokenizer, token_path = prepare_data(cfg)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"data.tokenizer={d.tokenizer} has {tokenizer.vocab_size} tokens, more than "
                         f"model.vocab_size={cfg.model.vocab_size}")
    loader = DataLoader(load_tokens(token_path), d.seq_len, micro_batch=t.micro_batch, grad_acc=t.grad_acc,
                        dp_size=mesh.size("dp"), dp_rank=mesh.local_rank("dp"), seed=t.seed)

    # Model: this rank's part (all of it without pp), identical to the same part of a single-process
    # run, each chunk wrapped for gradient averaging over dp*cp.
    chunks = build_chunks(cfg, device, mesh=mesh)
    wrapped = [apply_data_parallel(chunk, mesh.group("dp_cp"), impl=cfg.parallel.dp_impl,
                                   bucket_mb=cfg.parallel.bucket_mb) for chunk in chunks]
    plain, model = chunks[0], wrapped[0]
    loss_fn = make_loss_fn(cfg, mesh)
    optimizer = build_optimizer(plain if len(chunks) == 1 else nn.ModuleList(chunks), t)
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    # Start from a checkpoint (weights, optimizer, data position, RNG), else from a model folder, else
    # from the seed (build_chunks). Each rank reads only its own slices.
    ck, resume_from = cfg.checkpoint, None
    if ck.resume is not None:
        resume_from = find_latest(out) if ck.resume == "auto" else Path(ck.resume)
    if resume_from is not None:
        load_checkpoint(resume_from, chunks=chunks, optimizer=optimizer, loader=loader, mesh=mesh, cfg=cfg)
    elif ck.init_from is not None:
        if not rank0:
            dist.barrier()  # rank 0 downloads a hub model first, the others find it cached
        load_weights(chunks, resolve_init_from(ck.init_from))
        if rank0:
            dist.barrier()
    layers = layer_ranks(cfg)

    def save(step: int) -> None:
        state = {"step": step, "tokens": step * cfg.global_batch * d.seq_len, "loader": loader.state_dict(),
                 "config": cfg.to_dict(), "layout": {**{a: mesh.size(a) for a in ("dp", "tp", "pp", "cp")},
                                                     "pp_virtual": cfg.parallel.pp_virtual,
                                                     "world_size": mesh.world_size}}
        save_checkpoint(out, chunks, mesh, cfg=cfg, optimizer=optimizer, trainer_state=state, layer_ranks=layers,
                        tokenizer=tokenizer)

    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if t.dtype == "bfloat16"
                else contextlib.nullcontext())

    # Context parallelism: this rank keeps its share of every sequence's positions (token ids,
    # targets and RoPE positions alike) and attends to the rest through the ring.
    cp = mesh.size("cp")
    mine = (shard_indices(d.seq_len, cp, mesh.local_rank("cp"), layout=cfg.parallel.cp_layout)
            if cp > 1 else torch.arange(d.seq_len))  # [T/cp], indexes the loader's CPU batches
    positions = mine.to(device)
    for chunk in chunks:
        apply_context_parallel(chunk, mesh, layout=cfg.parallel.cp_layout)

    tokens_per_step = cfg.global_batch * d.seq_len
    local_tokens = t.micro_batch * t.grad_acc * d.seq_len // cp
    pipeline = None
    if mesh.size("pp") > 1:
        # The same scaling as below: each micro-batch's summed loss over this rank's tokens per step.
        pipeline = Pipeline(wrapped, mesh, schedule_name=cfg.parallel.pp_schedule, micro_batches=t.grad_acc,
                            shape=activation_shape(cfg), positions=positions, device=device, autocast=autocast,
                            loss_fn=lambda logits, targets: loss_fn(logits, targets) / local_tokens)
    flops_per_token = cfg.model.flops_per_token(d.seq_len)
    peak = cfg.logging.peak_tflops or dev.peak_tflops(device, torch.bfloat16 if t.dtype == "bfloat16" else torch.float32)
    if rank0 and ck.resume is not None:  # continuing this run folder (from step 0 if nothing was saved)
        trim_after(out / "metrics.jsonl", loader.step)
    log = MetricsLog(out / "metrics.jsonl") if rank0 else None
    bar = ProgressBar(t.steps, every=cfg.logging.log_every) if rank0 and cfg.logging.progress else None
    result = TrainResult(model=plain, chunks=chunks)

    for step in range(loader.step, t.steps):
        dev.reset_peak_memory(device)
        start = time.perf_counter()
        lr = lr_at(step, t)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        micro_batches = [(inputs[:, mine], targets[:, mine]) for inputs, targets in loader.next_batch()]
        if pipeline is None:
            for k, (inputs, targets) in enumerate(micro_batches):
                inputs, targets = inputs.to(device), targets.to(device)
                last = k == len(micro_batches) - 1
                with (contextlib.nullcontext() if last else model.no_sync()):
                    with autocast:
                        logits = model(inputs, positions)  # [B, T/cp, vocab]
                    # Sum over tokens, divided by this rank's tokens per step: after averaging over
                    # dp*cp the gradient is that of the mean over every target token of the global batch.
                    loss = loss_fn(logits, targets) / local_tokens
                    loss.backward()
                loss_sum += loss.detach()
        else:
            # The schedule runs every micro-batch through the stages; each chunk's gradients are
            # averaged over dp*cp during its last backward. The loss lives on the last stage.
            loss_sum = pipeline.step(micro_batches)
            sync_tied_embedding_grads(chunks, mesh)
        sync_sequence_parallel_grads(params, mesh.group("tp"))
        if mesh.size("dp_cp") > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG, group=mesh.group("dp_cp"))
        if mesh.size("pp") > 1:
            # Zero on every stage but the last: the sum hands every rank (rank 0, which logs, too)
            # the last stage's mean.
            dist.all_reduce(loss_sum, group=mesh.group("pp"))
        loss_value = float(loss_sum)  # the global loss: every rank takes the same branch below
        skipped = not math.isfinite(loss_value)
        if skipped and t.on_nonfinite == "stop":
            raise FloatingPointError(f"step {step + 1}: loss is {loss_value}; stopping before the weights are updated "
                                     f"(train.on_nonfinite=skip skips such steps)")
        grad_norm = clip_grad_norm_(params, t.grad_clip, mesh) if not skipped else float("nan")
        if not skipped:
            optimizer.step()
        for chunk in wrapped:
            chunk.zero_grad(set_to_none=True)
        dev.synchronize(device)
        step_time = time.perf_counter() - start
        result.losses.append(loss_value)

        if rank0:
            tokens_per_s = tokens_per_step / step_time
            record: dict[str, Any] = {
                "step": step + 1,
                "loss": loss_value,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens": (step + 1) * tokens_per_step,
                "tokens_per_s": tokens_per_s,
                "step_time_s": step_time,
                "peak_mem_mb": dev.peak_memory_mb(device),
                "mfu": mfu(tokens_per_s, flops_per_token, peak_tflops=peak, world_size=mesh.world_size),
            }
            if skipped:
                record["skipped"] = True
            log.write(record)
            if bar:
                bar.update(step + 1, {"loss": f"{loss_value:.4f}", "lr": f"{lr:.2e}",
                                      "tok/s": f"{tokens_per_s:,.0f}"})
        if ck.save_every and (step + 1) % ck.save_every == 0 and step + 1 < t.steps:
            save(step + 1)
    if log:
        log.close()
    result.dp_collectives = sum(chunk.num_collectives for chunk in wrapped)
    result.pipeline_trace = pipeline.trace if pipeline is not None else None

    # The final checkpoint, and OUT/model (the model alone, for `tetron generate`): both streamed to rank 0.
    save(t.steps)
    write_model_folder(out / "model", chunks, mesh, config=cfg.model, layer_ranks=layers, tokenizer=tokenizer,
                       shard_mb=ck.shard_mb)
    return result


def _is_timeout(err: BaseException) -> bool:
    """Whether a torch.distributed error is a collective (or rendezvous) that ran out of time."""
    text = str(err).lower()
    return isinstance(err, (dist.DistBackendError, dist.DistStoreError, RuntimeError)) and (
        "timed out" in text or "timeout" in text)


def run_rank(raw_config: dict[str, Any]) -> None:
    """Entry point of one launched rank (elastic launcher or torchrun): group, mesh, train, sample."""
    cfg = from_dict(raw_config)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # The elastic launcher counts restarts; a restarted rank continues from OUT's latest checkpoint.
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restart > 0 and cfg.checkpoint.resume is None:
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, resume="auto"))
    device = dev.pick_device(cfg.parallel.device, local_rank)
    if device.type == "cpu":
        # Ranks share the cores: more threads than cores per rank only adds contention.
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    timeout = timedelta(seconds=cfg.parallel.timeout_s)
    device_id = device if device.type == "cuda" else None
    rank = int(os.environ.get("RANK", 0))
    try:
        if restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The agent's store outlives a restart, and with it the previous attempt's gloo addresses:
            # a prefix per attempt keeps the new ranks from connecting to the dead ones.
            store = dist.PrefixStore(f"tetron/attempt_{restart}", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout))
            dist.init_process_group(dev.backend_for(device), store=store, rank=rank,
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout, device_id=device_id)
        elif "RANK" in os.environ:
            dist.init_process_group(dev.backend_for(device), timeout=timeout, device_id=device_id)
        else:  # a single process started without a launcher: a group of one, no rendezvous needed
            dist.init_process_group(dev.backend_for(device), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout, device_id=device_id)
        p = cfg.parallel
        mesh = Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, device_type=device.type)
        train(cfg, mesh, device=device)
        if mesh.rank == 0 and cfg.logging.sample_tokens > 0:
            from tetron.generate import sample_from_run

            text = sample_from_run(Path(cfg.out), prompt=cfg.logging.sample_prompt,
                                   max_new_tokens=cfg.logging.sample_tokens, device=device, seed=cfg.train.seed)
            print(f"\n--- sample from {cfg.out}/model ---\n{text}\n---", flush=True)
    except Exception as err:
        if not _is_timeout(err):
            raise
        # One line instead of a C++ stack: the usual cause is another rank, not this one.
        print(f"tetron: rank {rank}: a collective did not finish within parallel.timeout_s={cfg.parallel.timeout_s:g} s "
              f"(a rank died or hangs)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
