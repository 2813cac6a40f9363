"""Learning-rate schedules, a function of the optimizer step alone, so a run can be extended.

Every schedule warms up linearly from lr/warmup_steps to lr over `warmup_steps`; then
- cosine: decays along a half cosine to lr * min_lr_ratio at `decay_steps` and stays there;
- wsd (warmup-stable-decay, as SmolLM was trained): holds lr, then decays linearly to
  lr * min_lr_ratio over the last `decay_fraction` of `decay_steps`, and stays there;
- constant: holds lr.
The horizon is `train.decay_steps`, not `train.steps` (its default): a run continued to more steps
with the same horizon gets exactly the learning rates of a run planned that long from the start.
"""

from __future__ import annotations

import math

from tetron.config import TrainConfig


def horizon(t: TrainConfig) -> int:
    """The step at which the decay ends."""
    return t.decay_steps if t.decay_steps is not None else t.steps


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    low = t.lr * t.min_lr_ratio
    end = horizon(t)
    if t.schedule == "constant":
        return t.lr
    if t.schedule == "wsd":
        decay = max(1, round(t.decay_fraction * end))
        start = max(t.warmup_steps, end - decay)
        if step < start:
            return t.lr
        return t.lr - (t.lr - low) * min(1.0, (step - start + 1) / max(1, end - start))
    progress = (step - t.warmup_steps) / max(1, end - t.warmup_steps)
    return low + 0.5 * (t.lr - low) * (1 + math.cos(math.pi * min(1.0, progress)))


def schedule_change(before: TrainConfig, now: TrainConfig, steps_taken: int) -> str | None:
    """One line saying how `now` changes the learning rate of steps a checkpoint already took with
    `before`, or None when it gives every one of them the same rate."""
    for step in range(steps_taken):
        old, new = lr_at(step, before), lr_at(step, now)
        if not math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-15):
            return (f"the learning-rate schedule now gives step {step + 1} lr {new:.3e}, where the checkpoint's "
                    f"run used {old:.3e} (train.schedule={before.schedule}, decay_steps={horizon(before)} "
                    f"then; {now.schedule}, {horizon(now)} now): set train.decay_steps={horizon(before)} "
                    f"to continue that schedule")
    return None
