"""Mixtures (data.sources): several token stores sampled by weight, with a layout-free global batch.

Row j of step s's global batch comes from source i with probability weight_i / (sum of the weights
of the sources not used up), drawn from a generator seeded by (seed, s); the source's k-th draw is
window k of its own stream of seeded epoch permutations. A source with `epochs` E leaves the mixture
once it has given E passes over its windows; the others fill its share. The global batch therefore
depends on (seed, step, each source's draws so far) and not on the layout: each DP rank takes its
rows, each micro-batch its share, as with one source. How many windows each source has given is the
loader's state, saved in checkpoints, so a resumed run (in any layout) continues exactly; the weights
may change on resume (the sources may not).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tetron.config import Config
from tetron.data.batch import MicroBatch
from tetron.data.documents import stream_ends, window_documents
from tetron.data.loader import load_tokens, micro_batches
from tetron.errors import DataError


class WindowOrder:
    """A source's windows in draw order: draw k is window perm_e[k mod n] of epoch e = k // n, each
    epoch a fresh permutation seeded by (seed, source, e)."""

    def __init__(self, num_windows: int, *, seed: int, source: int) -> None:
        self.num_windows, self.seed, self.source = num_windows, seed, source
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 4:  # a step's draws span few epochs: keep the memory bounded
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, self.source, epoch]).permutation(self.num_windows)
        return self._perms[epoch]

    def windows(self, draws: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(draws, self.num_windows)
        out = np.empty(len(draws), dtype=np.int64)
        for e in sorted(set(epochs.tolist())):  # not np.unique: it imports numpy.ma, 0.1-0.2 s in every rank
            mask = epochs == e
            out[mask] = self._perm(int(e))[offsets[mask]]
        return out


@dataclass
class WeightedTokens:
    """One token stream of a mixture (a data.sources entry, tokenized: sources.py made it a store), by weight."""

    tokens: Any  # a TokenStore or any 1-D token array: len() and slicing
    weight: float
    epochs: float | None = None  # passes over its windows before it leaves the mixture; None: no limit
    name: str = ""  # for messages


def mixture_sources(cfg: Config, paths: list[Path]) -> list[WeightedTokens]:
    """data.sources' entries as Sources over their token stores (`paths`, one each, from prepare_data)."""
    return [WeightedTokens(load_tokens(path), float(s.get("weight", 1.0)), s.get("epochs"), name=str(s["path"]))
            for path, s in zip(paths, cfg.data.sources)]


def check_mixture(cfg: Config, paths: list[Path], loader_state: Any) -> None:
    """Before any rank starts: a resumed run's sources are the checkpoint's (`loader_state`, None when starting
    afresh), and their epochs last the steps left."""
    sources, consumed, done, train = mixture_sources(cfg, paths), None, 0, cfg.train
    # each source gives a window: the loader's own check, here before start rather than on a rank
    MixtureLoader(sources, cfg.data.seq_len, micro_batch=train.micro_batch, grad_acc=train.grad_acc,
                  dp_size=cfg.parallel.dp, dp_rank=0, seed=train.seed)
    if isinstance(loader_state, dict):
        check_resumed_sources(loader_state.get("sources"), [s.name for s in sources], [len(s.tokens) for s in sources])
        consumed, done = [e["consumed"] for e in loader_state["sources"]], int(loader_state.get("step", 0))
    check_epochs_last(sources, seq_len=cfg.data.seq_len, global_batch=cfg.global_batch,
                      steps=cfg.train.steps - done, consumed=consumed)


class MixtureLoader:
    """This DP rank's micro-batches of each step, drawn from weighted sources (see the module's doc)."""

    def __init__(self, sources: Sequence[WeightedTokens], seq_len: int, *, micro_batch: int, grad_acc: int,
                 dp_size: int, dp_rank: int, seed: int, documents: bool = False) -> None:
        if not sources or any(not s.weight > 0 for s in sources):
            raise DataError("data.sources: give at least one source, each with a positive weight")
        self.sources, self.seq_len, self.seed = list(sources), seq_len, seed
        self.micro_batch, self.grad_acc, self.dp_size, self.dp_rank = micro_batch, grad_acc, dp_size, dp_rank
        self.global_batch = micro_batch * grad_acc * dp_size
        self.num_windows = []
        for i, s in enumerate(self.sources):
            n = max(len(s.tokens) - 1, 0) // seq_len
            if n < 1:
                raise DataError(f"data.sources[{i}] ({s.name}): {len(s.tokens)} tokens give no training window of "
                                f"data.seq_len+1={seq_len + 1} tokens; use more data or a shorter seq_len")
            self.num_windows.append(n)
        self.orders = [WindowOrder(n, seed=seed, source=i) for i, n in enumerate(self.num_windows)]
        # `documents`: each micro-batch also numbers its windows' documents (read once from each store)
        self.doc_ends = [stream_ends(s.tokens) for s in self.sources] if documents else None
        self.consumed = [0] * len(self.sources)  # windows drawn from each source so far
        self.step = 0
        self.tokens = _Total(sum(len(s.tokens) for s in self.sources))  # for len() in reports

    def _limits(self) -> np.ndarray:
        return np.array([np.inf if s.epochs is None else int(s.epochs * n)
                         for s, n in zip(self.sources, self.num_windows)])

    def _draw(self, step: int, consumed: list[int]) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The (source, draw number) of each row of step `step`'s global batch, given the draws before it."""
        B = self.global_batch
        u = np.random.default_rng([self.seed, 0x6D6978, step]).random(B)
        weights, limits = np.array([s.weight for s in self.sources]), self._limits()
        left = limits - np.array(consumed)
        src = np.empty(B, dtype=np.int64)
        if np.all(left[np.isfinite(left)] >= B):  # nothing runs out during this step: all at once
            src[:] = np.searchsorted(np.cumsum(weights / weights.sum()), u, side="right")
        else:
            for j in range(B):
                alive = left > 0
                if not alive.any():
                    names = describe_sources([s.name for s in self.sources], [len(s.tokens) for s in self.sources])
                    raise DataError(f"data.sources: every source has given its epochs by step {step + 1} ({names}); "
                                    f"raise their epochs, leave one without a limit, or train fewer steps")
                w = np.where(alive, weights, 0.0)
                src[j] = np.searchsorted(np.cumsum(w / w.sum()), u[j], side="right")
                left[src[j]] -= 1
        src = np.minimum(src, len(self.sources) - 1)  # u just below 1 against a rounded cumulative sum
        draws, after = np.empty(B, dtype=np.int64), list(consumed)
        for i in range(len(self.sources)):
            mask = src == i
            draws[mask] = after[i] + np.arange(int(mask.sum()))
            after[i] += int(mask.sum())
        return src, draws, after

    def global_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of every row of a step at or after the loader's position."""
        if step < self.step:
            raise DataError(f"data.sources: step {step} is behind the loader's position {self.step}")
        consumed = self.consumed
        for s in range(self.step, step):
            consumed = self._draw(s, consumed)[2]
        src, draws, _ = self._draw(step, consumed)
        windows = np.empty_like(draws)
        for i, order in enumerate(self.orders):
            mask = src == i
            windows[mask] = order.windows(draws[mask])
        return src, windows

    def batch_for_step(self, step: int) -> list[MicroBatch]:
        """`grad_acc` micro-batches, each int64 [micro_batch, seq_len], for one step."""
        src, windows = self.global_rows(step)
        per_rank, T = self.micro_batch * self.grad_acc, self.seq_len
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        rows = list(zip(src[mine], windows[mine]))
        docs = None if self.doc_ends is None else np.concatenate(
            [window_documents(self.doc_ends[i], np.array([w * T]), T) for i, w in rows])
        return micro_batches([self.sources[i].tokens[w * T: w * T + T + 1] for i, w in rows], self.micro_batch, docs)

    def next_batch(self) -> list[MicroBatch]:
        batch = self.batch_for_step(self.step)
        self.consumed = self._draw(self.step, self.consumed)[2]
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position (steps, and windows drawn from each source) and what it depends on, for checkpoints."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len,
                "num_tokens": len(self.tokens),
                "sources": [{"path": s.name, "num_tokens": len(s.tokens), "consumed": c}
                            for s, c in zip(self.sources, self.consumed)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the same sampling (seq_len, global batch, seed) and sources (their token counts, in order);
        their weights and epochs may differ."""
        mine = self.state_dict()
        for field in ("seq_len", "global_batch", "seed"):
            if state.get(field) != mine[field]:
                raise DataError(f"data: cannot resume: checkpoint has {field}={state.get(field)}, this run has "
                                f"{mine[field]} (use the same {field} to continue the same data order)")
        check_resumed_sources(state.get("sources"), [s.name for s in self.sources],
                              [len(s.tokens) for s in self.sources])
        self.consumed = [t["consumed"] for t in state["sources"]]
        self.step = int(state["step"])


def describe_sources(names: list[Any], sizes: list[Any]) -> str:
    """`a (1,000 tokens), b (20 tokens)`: the sources as messages name them."""
    return ", ".join(f"{name} ({size:,} tokens)" if type(size) is int else f"{name} (? tokens)"
                     for name, size in zip(names, sizes))


def check_resumed_sources(theirs: Any, names: list[str], sizes: list[int]) -> None:
    """The checkpoint's sources (a loader state's "sources") against this run's `names` and token `sizes`:
    the same token counts in the same order (a source's draws count its own windows), and where the
    checkpoint names them (paths may move), none swapped. A DataError naming both lists otherwise."""
    if not isinstance(theirs, list):
        raise DataError(f"data.sources: the checkpoint was trained on data.path, not data.sources; this run's sources "
                        f"are {describe_sources(names, sizes)}")
    entries = [t if isinstance(t, dict) else {} for t in theirs]
    paths = [t.get("path") for t in entries]
    counts = [t.get("num_tokens") for t in entries]
    same = counts == sizes and all(type(t.get("consumed")) is int and t["consumed"] >= 0 for t in entries)
    moved = set(paths) != set(names)  # stores copied elsewhere (or a checkpoint that names none): counts decide
    if same and (moved or paths == names):
        return
    reordered = (paths != names and not moved) or sorted(map(str, counts)) == sorted(map(str, sizes))
    old = describe_sources([p if isinstance(p, str) else f"source {i}" for i, p in enumerate(paths)], counts)
    raise DataError(f"data.sources: {'in another order: ' if reordered else ''}the checkpoint was trained on {old}; "
                    f"this run gives {describe_sources(names, sizes)}: give the same sources in the same order "
                    f"(their weights and epochs may change)")


def check_epochs_last(sources: list[WeightedTokens], *, seq_len: int, global_batch: int, steps: int,
                      consumed: list[int] | None = None) -> None:
    """When every source has `epochs`, the mixture runs dry once their windows are drawn: refuse, before any
    rank starts, a run whose remaining steps need more rows than that (each row takes one window)."""
    if any(s.epochs is None for s in sources):
        return
    limits = [int(s.epochs * (max(len(s.tokens) - 1, 0) // seq_len)) for s in sources]
    left = sum(limits) - sum(consumed or [0] * len(sources))
    need = steps * global_batch
    if need > left:
        names = [s.name for s in sources]
        raise DataError(f"data.sources: the epochs of {describe_sources(names, [len(s.tokens) for s in sources])} "
                        f"give {left:,} more windows of data.seq_len+1={seq_len + 1}, fewer than the {need:,} that "
                        f"{steps} steps of {global_batch} rows need; train at most {left // global_batch} steps, "
                        f"raise their epochs, or leave one without epochs")


class _Total:
    """len() of all the sources together (what reports and the resume check count)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n
