"""What a step reports, and rank 0's record of it: the figures read back from the device (every
logging.log_every steps, in one wait), the non-finite check, metrics.jsonl, TensorBoard/W&B and the
progress bar."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tetron import device as dev
from tetron.config import Config
from tetron.observe.metrics import MetricsLog, ProgressBar, check_log_file, mfu, trim_after
from tetron.observe.report import describe_layout
from tetron.observe.sinks import check_wandb, open_sinks
from tetron.parallel.moe_balance import FIGURES as MOE_FIGURES


@dataclass
class StepFigures:
    """What one step reports."""

    loss: float  # the global mean loss over every target token of the step
    grad_norm: float  # before clipping; nan when the step was skipped
    lr: float
    skipped: bool  # a non-finite loss under on_nonfinite=skip: no update
    time_s: float
    memory: dict[str, float] | None = None  # MiB this rank holds, by kind (measured on a launch's first step)
    stop: bool = False  # some rank was asked to stop: every rank saves after this step and returns
    moe: dict[str, float] | None = None  # an MoE model's balancing figures (parallel/moe_balance.py)
    max_attn_logit: float | None = None  # with optim.qk_clip_tau: the step's largest attention logit (qk_clip.py)
    mtp_loss: float | None = None  # with multi-token prediction: its mean loss, (1/D) sum over depths (models/mtp.py)


@dataclass
class StepValues:
    """A step's figures as the device holds them (fp32, 0-dim), until they are read back."""

    loss: Tensor  # the global mean loss over every target token of the step
    grad_norm: Tensor  # before clipping
    nonfinite: Tensor  # 1 when the loss or the gradient norm is not finite (the update was skipped), else 0
    stop: Tensor  # 1 when some rank was asked to stop, else 0
    moe: Tensor | None = None  # [len(moe_balance.FIGURES)] an MoE model's balancing figures
    max_attn_logit: Tensor | None = None  # with optim.qk_clip_tau: the largest logit over layers, heads, batch
    mtp_loss: Tensor | None = None  # with multi-token prediction: its global mean loss

    def packed(self) -> Tensor:
        """The fields in one tensor, in their order (read_back unpacks them): one copy to the host."""
        values = [self.loss, self.grad_norm, self.nonfinite, self.stop]
        if self.max_attn_logit is not None:
            values.append(self.max_attn_logit.to(self.loss.device, torch.float32))
        if self.mtp_loss is not None:
            values.append(self.mtp_loss.to(self.loss.device, torch.float32))
        values = torch.stack(values)
        return values if self.moe is None else torch.cat([values, self.moe])


@dataclass
class PendingStep:
    """One step as the device left it: its figures are read back (one wait for the device) when reported."""

    step: int  # 0-based
    values: StepValues
    lr: float
    start: float  # perf_counter when the step began
    memory: dict[str, float] | None = None
    aside_s: float = 0.0  # seconds after it spent on other things (a validation): not the step's time
    extra: dict[str, float] = dataclasses.field(default_factory=dict)  # for its record: the timers' maxima over
    # ranks, the validation loss
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # this rank's timers (logging.timers)


def read_back(pending: list[PendingStep]) -> list[StepFigures]:
    """The figures of the steps dispatched since the last read-back, in one wait for the device; each
    step's time is the interval's mean (dispatch runs ahead of the device, so only the interval is real)."""
    rows = torch.stack([p.values.packed() for p in pending]).tolist()
    each = (time.perf_counter() - pending[0].start - sum(p.aside_s for p in pending)) / len(pending)
    figures = []
    for p, (loss, norm, bad, stop, *rest) in zip(pending, rows):  # StepValues.packed's order
        logit = rest.pop(0) if p.values.max_attn_logit is not None else None
        mtp = rest.pop(0) if p.values.mtp_loss is not None else None
        figures.append(StepFigures(loss=loss, grad_norm=float("nan") if bad else norm, lr=p.lr, skipped=bool(bad),
                                   time_s=each, memory=p.memory, stop=stop > 0,
                                   moe=dict(zip(MOE_FIGURES, rest)) if rest else None, max_attn_logit=logit,
                                   mtp_loss=mtp))
    return figures


def check_finite(cfg: Config, step: int, f: StepFigures) -> None:
    """Under on_nonfinite=stop, a step whose loss or gradient norm is not finite ends the run (its update
    and every later one were skipped on the device)."""
    if f.skipped and cfg.train.on_nonfinite == "stop":
        what = f"loss is {f.loss}" if not math.isfinite(f.loss) else "the gradient norm is not finite"
        raise FloatingPointError(f"step {step + 1}: {what}; stopping before the weights are updated "
                                 f"(train.on_nonfinite=skip skips such steps)")


def check_outputs(cfg: Config) -> None:
    """Before any rank starts (in the launching process, or rank 0 under torchrun): what rank 0's Reporter
    opens can be opened, OUT/metrics.jsonl and W&B."""
    check_log_file(Path(cfg.out) / "metrics.jsonl")
    check_wandb(cfg)


class Reporter:
    """Rank 0's record of the run: a line per step in OUT/metrics.jsonl (and TensorBoard, W&B: sinks.py)
    and the progress bar."""

    def __init__(self, cfg: Config, *, device: torch.device, world_size: int, first_step: int) -> None:
        out = Path(cfg.out)
        if cfg.checkpoint.resume is not None:  # continuing this run folder (from step 0 if nothing was saved)
            trim_after(out / "metrics.jsonl", first_step)
        self.log = MetricsLog(out / "metrics.jsonl")
        self.sinks = open_sinks(cfg, first_step=first_step + 1)
        self.bar = ProgressBar(cfg.train.steps, every=cfg.logging.log_every,
                               first=first_step) if cfg.logging.progress else None
        self.tokens_per_step = cfg.global_batch * cfg.data.seq_len
        self.flops_per_token = cfg.model.flops_per_token(cfg.data.seq_len)
        dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
        self.peak = cfg.logging.peak_tflops or dev.peak_tflops(device, dtype)
        self.world_size, self.device = world_size, device
        # written on this launch's first record: `tetron report` marks resumes, and layouts changed by them
        self.layout: str | None = describe_layout(dataclasses.asdict(cfg.parallel))

    def step(self, step: int, f: StepFigures, extra: dict[str, float] | None = None) -> None:
        """Step `step` (0-based) done: its figures, and `extra` ones (validation, timers) on its record."""
        tokens_per_s = self.tokens_per_step / f.time_s
        record: dict[str, Any] = {
            "step": step + 1,
            "loss": f.loss,
            "lr": f.lr,
            "grad_norm": f.grad_norm,
            "tokens": (step + 1) * self.tokens_per_step,
            "tokens_per_s": tokens_per_s,
            "step_time_s": f.time_s,
            "peak_mem_mb": dev.peak_memory_mb(self.device),
            "mfu": mfu(tokens_per_s, self.flops_per_token, peak_tflops=self.peak, world_size=self.world_size),
        }
        if f.skipped:
            record["skipped"] = True
        if f.max_attn_logit is not None:
            record["max_attn_logit"] = f.max_attn_logit
        if f.mtp_loss is not None:
            record["mtp_loss"] = f.mtp_loss
        if f.memory is not None:
            record.update(f.memory)
        record.update(f.moe or {})
        record.update(extra or {})
        if self.layout is not None:
            record["layout"], self.layout = self.layout, None
        self.log.write(record)
        for sink in self.sinks:
            sink.write(step + 1, record)
        if self.bar:
            fields = {"loss": f"{f.loss:.4f}", "lr": f"{f.lr:.2e}", "tok/s": f"{tokens_per_s:,.0f}"}
            if "val_loss" in record:
                fields["val_loss"] = f"{record['val_loss']:.4f}"
            self.bar.update(step + 1, fields)

    def close(self) -> None:
        self.log.close()
        if self.bar:
            self.bar.close()
        for sink in self.sinks:
            sink.close()
