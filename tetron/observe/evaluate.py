"""Validation: the mean loss over a fixed set of held-out windows, computed in whatever layout trains.

Held-out data. Either `data.val_path`, a separate source tokenized with the run's tokenizer, or
`data.val_fraction`: the last fraction of the token file's windows, cut off before the training
sampler sees the file, so no training window shares a token with them. The windows evaluated are
`train.eval_batches` global batches of them, spread evenly over the held-out part and fixed for the
whole run: they depend on neither the layout nor the loader's position, so a resumed run and every
layout evaluate the same tokens. Small data holds out fewer windows than that: then as many whole global
batches as they fill are evaluated, or none (the run trains without validation); `tetron train` says so
in one line. The held-out part itself never grows to fill a batch: the training data does not depend on
the batch or the layout.

Evaluation. Each global batch is cut like a training batch (each dp rank its rows, micro-batches of
`train.micro_batch`, each cp rank its positions) and run forward only, under `torch.no_grad`: through
this rank's chunk, or under pipeline parallelism through the stages by the training's own runner,
`Pipeline.forward_only` (parallel/pipeline_parallel.py). The summed token losses travel in one all-reduce.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.config import Config
from tetron.data.batch import MicroBatch, rank_micro_batch
from tetron.data.documents import stream_ends, window_documents
from tetron.data.hf_source import share_hub_commits
from tetron.data.loader import default_cache_dir, load_tokens, micro_batches, open_store, prepare_data, prepare_tokens
from tetron.data.sources import source_of
from tetron.data.tokenizer import Tokenizer
from tetron.mesh import Mesh
from tetron.parallel.pipeline_parallel import Pipeline, activation_shape

Batch = list[MicroBatch]  # one global batch's micro-batches on this rank, whole windows (cut when used)


# ------------------------------------------------------------------------------------ the held-out windows


def held_out_windows(num_tokens: int, cfg: Config) -> int:
    """How many of the token file's `seq_len`-token windows data.val_fraction holds out (its last ones)."""
    d = cfg.data
    if d.val_path is not None or d.val_fraction <= 0:
        return 0
    windows = max(num_tokens - 1, 0) // d.seq_len
    return min(windows, math.ceil(windows * d.val_fraction))


def training_tokens(tokens: np.ndarray, cfg: Config) -> np.ndarray:
    """The part of the token file training samples from: all of it, or the windows before the held-out
    ones (window i is tokens[i*T : i*T+T+1], so the last training window ends at token kept*T)."""
    held = held_out_windows(len(tokens), cfg)
    if held == 0:
        return tokens
    kept = (len(tokens) - 1) // cfg.data.seq_len - held
    return tokens[: kept * cfg.data.seq_len + 1]


def held_out_tokens(tokens: np.ndarray, cfg: Config) -> np.ndarray:
    """The tokens after the training part (val_fraction): they share none with any training window."""
    return tokens[len(training_tokens(tokens, cfg)):]


def prepare_val_tokens(cfg: Config, tokenizer: Tokenizer, token_path: Path | None = None) -> np.ndarray:
    """The held-out token stream: data.val_path tokenized with the run's tokenizer (cached like the
    training data), or the tail of the training token file (`token_path`, else found in the cache)."""
    d = cfg.data
    if d.val_path is None:
        return held_out_tokens(load_tokens(token_path or prepare_data(cfg)[1]), cfg)
    if source_of(d.val_path).tokenized:  # made by tetron tokenize: checked against the run's tokenizer
        return load_tokens(open_store(Path(d.val_path).expanduser(), tokenizer))
    cache = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
    path = prepare_tokens(d.val_path, tokenizer, cache_dir=cache, text_field=d.text_field,
                          skip_bad=d.on_bad_record == "skip")
    return load_tokens(path)


def held_out_count(val_tokens: np.ndarray, cfg: Config) -> int:
    """How many whole windows of seq_len+1 tokens the held-out stream holds."""
    return max(len(val_tokens) - 1, 0) // cfg.data.seq_len


def eval_windows(val_tokens: np.ndarray, cfg: Config) -> np.ndarray:
    """Start offsets (in tokens) of the windows evaluated: train.eval_batches global batches of them, or as
    many whole ones as the held-out windows fill (none: no validation), evenly spread over the held-out part."""
    available = held_out_count(val_tokens, cfg)
    needed = min(cfg.train.eval_batches, available // cfg.global_batch) * cfg.global_batch
    return (np.arange(needed, dtype=np.int64) * available // max(needed, 1)) * cfg.data.seq_len


def rank_batches(val_tokens: np.ndarray, cfg: Config, *, dp_rank: int) -> list[Batch]:
    """This rank's share of every evaluated global batch: its dp rows, cut into micro-batches (whole
    windows, with their documents where data.mask_documents or data.reset_positions needs them)."""
    t, d, T = cfg.train, cfg.data, cfg.data.seq_len
    starts = eval_windows(val_tokens, cfg).reshape(-1, cfg.global_batch)  # [batches, global batch]
    per_rank = t.micro_batch * t.grad_acc
    ends = stream_ends(val_tokens) if d.mask_documents or d.reset_positions else None
    batches = []
    for rows in starts[:, dp_rank * per_rank:(dp_rank + 1) * per_rank]:
        docs = None if ends is None else window_documents(ends, rows, T)
        batches.append(micro_batches([val_tokens[s:s + T + 1] for s in rows], t.micro_batch, docs))
    return batches


# ------------------------------------------------------------------------------------ the forward passes


class Evaluator:
    """This rank's fixed held-out micro-batches and the forward-only pass over them; every rank calls it."""

    def __init__(self, cfg: Config, mesh: Mesh, chunks: list[nn.Module], val_tokens: np.ndarray, *,
                 device: torch.device, dtype: torch.dtype, positions: Tensor) -> None:
        self.cfg, self.mesh, self.chunks, self.device, self.dtype = cfg, mesh, chunks, device, dtype
        self.mine = positions  # [T/cp] the positions of each window this rank holds
        self.positions = positions.to(device)  # the same on the device: RoPE positions
        self.batches = rank_batches(val_tokens, cfg, dp_rank=mesh.local_rank("dp"))
        self.tokens = len(eval_windows(val_tokens, cfg)) * cfg.data.seq_len  # target tokens in all
        self.pipeline = None  # under pp: the stages run by the training's runner, forward only
        if mesh.size("pp") > 1:
            self.pipeline = Pipeline(chunks, mesh, schedule_name=cfg.parallel.pp_schedule,
                                     micro_batches=cfg.train.grad_acc, shape=activation_shape(cfg),
                                     loss_fn=lambda summed: summed, positions=positions, dtype=dtype, device=device)

    def due(self, step: int) -> bool:
        """Whether validation follows optimizer step `step` (0-based): every train.eval_every steps, and the last."""
        t = self.cfg.train
        return (step + 1) % t.eval_every == 0 or step + 1 == t.steps

    def figures(self) -> dict[str, float]:
        """The validation loss and perplexity, for the step's record; every rank calls this (a collective)."""
        loss = self()
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}  # exp overflows past ~709

    @torch.no_grad()
    def __call__(self) -> float:
        """The mean loss over every evaluated target token, the same on every rank."""
        modes = [m.training for chunk in self.chunks for m in chunk.modules()]
        for chunk in self.chunks:
            chunk.eval()
        try:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for batch in self.batches:
                if self.pipeline is not None:  # the last stage's sum, zero on the others
                    total += self.pipeline.forward_only([self._cut(mb) for mb in batch],
                                                        loss_fn=lambda summed: summed.double())
                else:
                    total += self._local(batch)
        finally:  # training goes on in the modes it had
            for m, mode in zip((m for chunk in self.chunks for m in chunk.modules()), modes):
                m.training = mode
        # tp ranks hold the same sum, stages before the last hold zero: a world sum of sum/tp adds each
        # dp*cp share once
        total /= self.mesh.size("tp")
        if self.mesh.world_size > 1:
            dist.all_reduce(total)
        return float(total) / self.tokens

    def _local(self, batch: Batch) -> Tensor:
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in map(self._cut, batch):
            # summed over tokens (whole over the vocabulary, from its shards under tp), chunk by chunk
            loss += self.chunks[0](mb.inputs, mb.positions, mb.docs, targets=mb.targets).double()
        return loss

    def _cut(self, mb: MicroBatch) -> MicroBatch:
        return rank_micro_batch(mb, self.mine, self.positions, self.cfg.data, self.device)


def build_evaluator(cfg: Config, mesh: Mesh, chunks: list[nn.Module], tokenizer: Tokenizer, *,
                    device: torch.device, dtype: torch.dtype, positions: Tensor) -> Evaluator | None:
    """The run's evaluator, None without train.eval_every or without a global batch of held-out windows.
    Rank 0 tokenizes data.val_path first (or finds it cached) while the others wait."""
    if cfg.train.eval_every <= 0:
        return None
    if cfg.data.val_path is not None and mesh.rank == 0:
        prepare_val_tokens(cfg, tokenizer)
    share_hub_commits(mesh.rank, mesh.world_size, device)  # rank 0's answers for hf: data; the wait for it
    val_tokens = prepare_val_tokens(cfg, tokenizer)
    if len(eval_windows(val_tokens, cfg)) == 0:
        return None
    return Evaluator(cfg, mesh, chunks, val_tokens, device=device, dtype=dtype, positions=positions)


def check_held_out(cfg: Config, tokenizer: Tokenizer, token_path: Path) -> str | None:
    """Before any rank starts: tokenize data.val_path (cached for the ranks); a note when the held-out part
    fills fewer than train.eval_batches global batches (small data), saying what validation does then."""
    if cfg.train.eval_every <= 0:
        return None
    val_tokens = prepare_val_tokens(cfg, tokenizer, token_path)
    available, batches = held_out_count(val_tokens, cfg), len(eval_windows(val_tokens, cfg)) // cfg.global_batch
    if batches == cfg.train.eval_batches:
        return None
    d = cfg.data
    source = f"data.val_path={d.val_path}" if d.val_path else f"data.val_fraction={d.val_fraction:g}"
    held = f"{source} holds out {available:,} windows of {d.seq_len + 1} tokens"
    if batches == 0:
        return (f"{held}, fewer than one global batch of {cfg.global_batch}: training without validation "
                f"(for val_loss, hold out more: a larger data.val_fraction, or data.val_path)")
    return (f"{held}: validating on {batches} global batch{'es' if batches > 1 else ''} of {cfg.global_batch}, "
            f"not train.eval_batches={cfg.train.eval_batches}")
