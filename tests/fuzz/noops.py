"""No silent no-ops: an option a draw switches on must change what it exists to change, measured by running the
same layout again with the option off (the layout fuzzer's second half, tests/fuzz_layouts.py).

Each check names the option, when a draw has it on (and it should act), how to switch it off, and the measure
that must move: the activation meter's peak (mem_activations_mb of the first step, rank 0) for recomputation and
sequence parallelism; the optimizer state a rank holds for ZeRO; the losses for document masking and position
resets (the fuzzer's documents are several to a window, so both change every step). Not here: the chunked loss,
whose logits live only inside its forward (never saved for the backward, so the meter cannot see them either way;
tests/test_loss.py's test_no_logits_beyond_one_chunk bounds them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable


def _first_memory(written: dict, key: str) -> float:
    return next(m[key] for m in written["metrics"] if key in m)


def _losses(written: dict) -> list[float]:
    return [m["loss"] for m in written["metrics"]]


@dataclass(frozen=True)
class NoOpCheck:
    option: str  # what the user set: "train.recompute"
    active: Callable[[dict], bool]  # whether the draw's sections have it on where it should act
    off: Callable[[dict], None]  # switches it off in the sections (in place)
    measure: Callable[[dict], object]  # from what the run wrote (run_parallel's `written`)
    lower: bool  # True: the measure must be lower with the option on; False: it must differ

    def verdict(self, on: dict, off: dict) -> tuple[bool, str]:
        """(whether the option did what it is for, what was measured) given the runs with it on and off."""
        a, b = self.measure(on), self.measure(off)
        if self.lower:
            return a < b, f"{self.option}: {a:.4g} with it, {b:.4g} without (must be lower)"
        return a != b, f"{self.option}: {'the same' if a == b else 'other'} losses with it and without"


def _p(s: dict) -> dict:
    return s["parallel"]


CHECKS = (
    NoOpCheck("train.recompute", lambda s: s["train"].get("recompute", "none") != "none",
              lambda s: s["train"].update(recompute="none"),
              lambda w: _first_memory(w, "mem_activations_mb"), lower=True),
    NoOpCheck("parallel.sp", lambda s: _p(s).get("sp") and _p(s).get("tp", 1) > 1,
              lambda s: _p(s).update(sp=False), lambda w: _first_memory(w, "mem_activations_mb"), lower=True),
    NoOpCheck("parallel.zero", lambda s: _p(s).get("zero", 0) >= 1 and _p(s).get("dp_impl", "bucket") == "bucket"
              and (_p(s).get("dp_shard") or _p(s).get("dp", 1) * _p(s).get("cp", 1)) > 1,
              lambda s: [_p(s).update(zero=0), _p(s).pop("dp_shard", None)],
              lambda w: _first_memory(w, "mem_optimizer_mb"), lower=True),
    # (not with a mixture: its rows may all come from the one-document text, where neither has anything to do)
    NoOpCheck("data.mask_documents", lambda s: s["data"].get("mask_documents", False) and not s["data"].get("sources"),
              lambda s: s["data"].update(mask_documents=False), _losses, lower=False),
    NoOpCheck("data.reset_positions",
              lambda s: s["data"].get("reset_positions", False) and not s["data"].get("sources"),
              lambda s: s["data"].update(reset_positions=False), _losses, lower=False),
)


def checks_for(sections: dict) -> list[NoOpCheck]:
    """The checks whose option the draw has on."""
    return [c for c in CHECKS if c.active(sections)]


def switched_off(sections: dict, check: NoOpCheck) -> dict:
    """A copy of the draw's sections with the check's option off."""
    off = copy.deepcopy(sections)
    check.off(off)
    return off
