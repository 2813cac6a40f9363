"""The GPU check's table (bench/gpu_check.py): its rows, their verdicts, and the sizes each check runs at (real
ones on a GPU, tiny ones on the CPU)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Row:
    section: str
    check: str
    value: str = ""
    limit: str = ""
    status: str = ""  # ok, FAIL, error, skipped, info
    note: str = ""


@dataclass
class Table:
    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"  [{row.status:>7}] {row.section}: {row.check} {row.value} {row.note}", file=sys.stderr, flush=True)

    def guarded(self, section: str, check: str, fn: Callable[[], list[Row]]) -> None:
        """Run one check; its exception becomes an error row, and the next check runs."""
        try:
            for row in fn():
                self.add(row)
        except Exception as err:  # noqa: BLE001  (any failure is a row, not the end of the check)
            first = (str(err).strip().splitlines() or [""])[0][:160]
            self.add(Row(section, check, status="error", note=f"{type(err).__name__}: {first}"))

    def render(self) -> str:
        head = Row("section", "check", "value", "limit", "status", "note")
        cols = ("section", "check", "value", "limit", "status", "note")
        widths = {c: max(len(getattr(r, c)) for r in [head, *self.rows]) for c in cols}
        line = lambda r: " | ".join(getattr(r, c).ljust(widths[c]) for c in cols).rstrip()  # noqa: E731
        rule = "-+-".join("-" * widths[c] for c in cols)
        return "\n".join([line(head), rule, *map(line, self.rows)])


def verdict(value: float, limit: float) -> str:
    return "ok" if value <= limit else "FAIL"


@dataclass
class Sizes:
    """What each check runs at: real sizes on a GPU, tiny ones on the CPU."""

    gpu: bool
    logits_model: dict  # LlamaConfig fields for the transformers comparison
    attention: tuple[int, int, int, int]  # B, H, T, D of the block-attention checks
    small_model: dict  # the bf16-vs-fp32 training run
    small_steps: int
    seq: int  # the speed rows' sequence length
    speed_models: list[str]  # configs/ names (GPU) or "tiny"
    warmup: int  # steps before timing (the first compiles)
    timed: int
    compiled_modes: tuple[str, ...] = ("none", "selective", "full")  # recompute modes also run compiled


def sizes(gpu: bool) -> Sizes:
    if gpu:
        return Sizes(gpu=True,
                     logits_model=dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512),
                     attention=(2, 8, 1000, 64),  # 1000: not a multiple of the efficient kernel's lse padding
                     small_model=dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
                     small_steps=30, seq=2048, speed_models=["smollm-360m", "smollm-1.7b"], warmup=3, timed=5)
    return Sizes(gpu=False,
                 logits_model=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                 attention=(1, 2, 40, 16),
                 small_model=dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32),
                 small_steps=6, seq=32, speed_models=["tiny"], warmup=1, timed=2,
                 compiled_modes=("selective",))  # one cold compile costs ~20 s on a CPU: the hardest case only


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))
