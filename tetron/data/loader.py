"""Data: token stores for the run and a layout-free sampler (sources: sources.py, tokenizers: tokenizer.py,
stores: token_store.py, mixtures: mixture.py).

data.path is a token store made by `tetron tokenize`, or any other spec, tokenized once into a store in
the cache (keyed by the files' sizes and mtimes, not their bytes). The store is one stream of tokens
cut into windows of `seq_len + 1`. The global batch of step s is a seeded list of windows that
depends only on (seed, step, sizes); each DP rank and each micro-batch then takes its
contiguous share of those rows, so any (dp, grad_acc, micro_batch) layout with the same global batch
sees the same data in the same order. data.sources mixes several stores by weight (mixture.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tetron.config import Config
from tetron.data.batch import MicroBatch
from tetron.data.documents import stream_ends, window_documents
from tetron.data.sources import data_fingerprint, source_of
from tetron.data.store_build import build_store
from tetron.data.token_store import TokenStore, is_store
from tetron.data.tokenizer import Tokenizer, load_tokenizer
from tetron.errors import ConfigError, DataError
from tetron.fs import find_latest

# Bump when the token store layout or the tokenization rules change, to invalidate caches.
_CACHE_VERSION = "tetron-tokens-2"


def default_cache_dir() -> Path:
    """Where trained tokenizers and token files are cached: $XDG_CACHE_HOME/tetron."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tetron"


def start_folder(cfg: Config) -> Path | None:
    """The checkpoint or local model folder the run starts from, if any."""
    ck = cfg.checkpoint
    if ck.resume == "auto":
        return find_latest(Path(cfg.out))
    if ck.resume is not None:
        return Path(ck.resume).expanduser()
    if ck.init_from is not None and Path(ck.init_from).expanduser().is_dir():
        return Path(ck.init_from).expanduser()
    return None


def _ships_tokenizer(folder: Path | None) -> bool:
    return folder is not None and any((folder / f).is_file() for f in ("tetron_tokenizer.json", "tokenizer.json"))


def tokenizer_spec(cfg: Config) -> str:
    """data.tokenizer, or when unset the tokenizer of the folder the run starts from, else bytes: the
    weights' token ids mean what that tokenizer says."""
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    folder = start_folder(cfg)
    if _ships_tokenizer(folder):
        return str(folder)
    first = data_specs(cfg)[0]
    saved = source_of(first).tokenizer_folder()
    if saved is None:  # text: bytes, unless data.tokenizer says otherwise
        return "bytes"
    if not (saved / "tetron_tokenizer.json").is_file():  # else it would be looked for on the hub
        where = "data.sources[0].path" if cfg.data.sources else "data.path"
        raise DataError(f"{where}={first}: the token store has no tokenizer/ folder (tetron tokenize writes one); "
                        f"set data.tokenizer to the one it was made with, or make the "
                        f"store again with tetron tokenize")
    return str(saved)


def data_specs(cfg: Config) -> list[str]:
    """What the run trains on: data.path, or each of data.sources' paths."""
    return [str(s["path"]) for s in cfg.data.sources] if cfg.data.sources else [cfg.data.path]


def brought_tokenizer(cfg: Config) -> tuple[str, str] | None:
    """The tokenizer the weights the run starts from (checkpoint.init_from, unless checkpoint.new_tokenizer) or
    its token store were made with, if any, and what was made with it: their token ids mean what it says. A
    resumed run is not asked: its config is the one it was trained with (a different tokenizer is refused)."""
    folder = start_folder(cfg) if cfg.checkpoint.resume is None else None
    if _ships_tokenizer(folder) and not cfg.checkpoint.new_tokenizer:
        return str(folder), "its weights were trained"
    saved = source_of(data_specs(cfg)[0]).tokenizer_folder()
    return (str(saved), "the data was tokenized") if saved is not None else None


def yield_tokenizer(cfg: Config, *, explicit: bool) -> tuple[Config, str | None]:
    """A data.tokenizer from a config file gives way to the one the store or starting weights bring, with a
    note: the file may have been written for other data (configs/demo.yaml's bpe:4096 for the stdlib). One
    given on the command line (`explicit`) stands, and a conflict with them is refused later, naming both."""
    brought = None if explicit or cfg.data.tokenizer is None else brought_tokenizer(cfg)
    if brought is None or cfg.data.tokenizer == brought[0]:
        return cfg, None
    note = (f"data.tokenizer={cfg.data.tokenizer} (from the config) gives way to {brought[0]}, the tokenizer "
            f"{brought[1]} with")
    return replace(cfg, data=replace(cfg.data, tokenizer=None)), note


def fit_vocab(cfg: Config) -> tuple[Config, str | None]:
    """A model built here (no checkpoint.init_from weights) gets as many embedding rows as a bytes or bpe:N
    tokenizer has ids, with a note: `--model demo --tokenizer bytes` trains 256 rows, not the demo's 4096,
    of which 3840 would never see a token (and only dilute the sampler). Every rank computes the same."""
    spec = tokenizer_spec(cfg)
    bpe = re.fullmatch(r"bpe:(\d+)", spec)
    size = 256 if spec == "bytes" else int(bpe.group(1)) if bpe else None
    m = cfg.model
    if m is None or size is None or size < 256 or cfg.checkpoint.init_from is not None or m.vocab_size <= size:
        return cfg, None
    note = f"model.vocab_size={m.vocab_size} -> {size}: data.tokenizer={spec} has {size} token ids"
    return replace(cfg, model=replace(m, vocab_size=size)), note


def check_tokenizer_pairing(cfg: Config, tokenizer: Tokenizer) -> None:
    """Refuse an explicit tokenizer that differs from the one the starting weights were trained with."""
    folder = start_folder(cfg)
    if cfg.data.tokenizer is None or cfg.checkpoint.new_tokenizer or not _ships_tokenizer(folder):
        return
    theirs = load_tokenizer(str(folder), data_spec=None, cache_dir=folder)
    if theirs.fingerprint() != tokenizer.fingerprint():
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} is not the tokenizer of {folder}, whose weights "
                          f"learned that one's token ids: leave data.tokenizer unset (--data.tokenizer=null) to use "
                          f"it, or set checkpoint.new_tokenizer=true to train with another")


def prepare_data(cfg: Config, *, say: Callable[[str], None] | None = None) -> tuple[Tokenizer, Path | list[Path]]:
    """The tokenizer and the token store of data.path (a list of stores, one per source, with
    data.sources); cached, so only the first call does work (and tells `say` about it)."""
    d = cfg.data
    cache = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
    skip_bad = d.on_bad_record == "skip"
    tokenizer = load_tokenizer(tokenizer_spec(cfg), data_spec=d.path, cache_dir=cache, text_field=d.text_field,
                               max_bytes=d.max_bytes, say=say, skip_bad=skip_bad)
    paths = []
    for spec in data_specs(cfg):
        if source_of(spec).tokenized:  # a token store: checked against the run's tokenizer
            paths.append(open_store(Path(spec).expanduser(), tokenizer,
                                    unset_means=None if d.tokenizer is not None else tokenizer_spec(cfg)))
        else:  # text: tokenized once into a store in the cache
            paths.append(prepare_tokens(spec, tokenizer, cache_dir=cache, text_field=d.text_field, say=say,
                                        max_bytes=None if d.sources else d.max_bytes, skip_bad=skip_bad,
                                        hash_contents=d.hash_contents))
    return tokenizer, paths if d.sources else paths[0]


def open_store(folder: Path, tokenizer: Tokenizer, *, unset_means: str | None = None) -> Path:
    """A store named in the config, checked (its index, its shards' sizes) against the run's tokenizer.
    `unset_means`: the tokenizer the run took because data.tokenizer is unset (None: it is set)."""
    store = TokenStore(folder)
    if store.index.get("tokenizer") != tokenizer.fingerprint():
        if unset_means is None:
            raise DataError(f"data: {folder} was tokenized with another tokenizer than this run's ({tokenizer!r}); "
                            f"leave data.tokenizer unset (--data.tokenizer=null) to train with the store's own "
                            f"({folder / 'tokenizer'})")
        raise DataError(f"data: {folder} was tokenized with another tokenizer than this run's ({tokenizer!r}, "
                        f"which data.tokenizer unset takes from {unset_means}); tokenize the data with that one "
                        f"(tetron tokenize SOURCE --tokenizer {unset_means}), or set data.tokenizer="
                        f"{folder / 'tokenizer'}")
    return folder


# ----------------------------------------------------------------------------- token stores in the cache


def prepare_tokens(
    data_spec: str,
    tokenizer: Tokenizer,
    *,
    cache_dir: Path,
    text_field: str = "text",
    max_bytes: int | None = None,
    say: Callable[[str], None] | None = None,
    skip_bad: bool = False,
    hash_contents: bool = False,
) -> Path:
    """Tokenize the data once into a token store in the cache (EOS after each document), keyed by the
    tokenizer and the data (local files and hf: dataset folders: sizes and mtimes, or their bytes with
    `hash_contents`; a hub dataset: its commit). `say` is told when tokenizing starts, of a damaged cache
    entry, and of records skipped (`skip_bad`)."""
    data_fp = data_fingerprint(data_spec, text_field=text_field, max_bytes=max_bytes, skip_bad=skip_bad,
                               hash_contents=hash_contents)
    key = hashlib.sha256(f"{_CACHE_VERSION}:{tokenizer.fingerprint()}:{data_fp}".encode()).hexdigest()
    folder = Path(cache_dir) / "tokens" / key[:24]
    if is_store(folder):
        problem = store_problem(folder, vocab_size=tokenizer.vocab_size)
        if problem is None:
            return folder
        if say is not None:
            say(f"the token cache {problem}; tokenizing again")
        shutil.rmtree(folder, ignore_errors=True)
    if say is not None:
        say(f"tokenizing {data_spec} (once; cached in {folder.parent})")
    # in units where the source can be cut (hf: a local folder or a hub dataset of known commit, streamed);
    # else read in order (hf: offline, the cached copy loaded whole)
    index = build_store(data_spec, tokenizer, folder, text_field=text_field, skip_bad=skip_bad, max_bytes=max_bytes,
                        stream=source_of(data_spec).streams(), say=say, wait=True)
    if index["num_tokens"] == 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise DataError(f"data: {data_spec} gave no tokens (is it empty, or is text_field={text_field!r} empty?)")
    return folder


def store_problem(folder: Path, *, vocab_size: int | None = None) -> str | None:
    """What is wrong with a token store (None: nothing)."""
    try:
        store = TokenStore(Path(folder))
    except DataError as err:
        return str(err)
    if vocab_size is not None and store.vocab_size != vocab_size:
        return f"{folder} was made for a vocabulary of {store.vocab_size}, not {vocab_size}"
    return None


def load_tokens(path: Path | list[Path]) -> TokenStore:
    """A token store (or several, as one stream), opened by reading its index (its shards are
    memory-mapped as they are used)."""
    return TokenStore(path)


# ----------------------------------------------------------------------------- sampling


class BatchSampler:
    """Window indices of each step's global batch: a fresh seeded permutation per epoch."""

    def __init__(self, num_tokens: int, seq_len: int, *, global_batch: int, seed: int) -> None:
        if seq_len < 1 or global_batch < 1 or seed < 0:
            raise DataError(
                f"data: need seq_len >= 1, global_batch >= 1, seed >= 0 (got {seq_len}, {global_batch}, {seed})"
            )
        self.num_tokens = num_tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        # Window i is tokens[i*seq_len : i*seq_len + seq_len + 1]; neighbours share one token.
        self.num_windows = max(num_tokens - 1, 0) // seq_len
        if self.num_windows < global_batch:
            raise DataError(
                f"data: {num_tokens} tokens give {self.num_windows} windows of seq_len+1={seq_len + 1}, fewer than "
                f"the global batch {global_batch}; use more data or a shorter seq_len"
            )
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most two epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """The global batch of a step: positions step*B .. step*B+B-1 of the epoch-permuted stream."""
        pos = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.num_windows)
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in sorted(set(epochs.tolist())):  # not np.unique: it imports numpy.ma, 0.1-0.2 s in every rank
            mask = epochs == e
            out[mask] = self._perm(int(e))[offsets[mask]]
        return out


def micro_batches(windows: list, micro_batch: int, docs: np.ndarray | None = None) -> list[MicroBatch]:
    """Windows of seq_len+1 tokens (a rank's rows of a step) as micro-batches of `micro_batch` rows: input
    ids and targets int64 [micro_batch, seq_len], and `docs` ([rows, seq_len], documents.window_documents)
    cut alike."""
    rows = torch.from_numpy(np.stack([np.asarray(w, dtype=np.int64) for w in windows]))  # [rows, T + 1]
    batches = [MicroBatch(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in rows.split(micro_batch)]
    if docs is not None:
        batches = [b._replace(docs=d) for b, d in zip(batches, torch.from_numpy(docs).split(micro_batch))]
    return batches


def check_token_ids(batch: list[MicroBatch], cfg: Config, *, step: int) -> None:
    """Every id of a step's batch indexes the embedding: a store is opened without reading its tokens, so a
    damaged one, or one made for a larger vocabulary, shows here, as one line rather than an index error
    inside the model (a max over the batch, on the host)."""
    vocab = cfg.model.vocab_size
    top = max((int(max(mb.inputs.max(), mb.targets.max())) for mb in batch), default=0)
    if top >= vocab:
        raise DataError(f"data: step {step}'s batch holds token id {top}, not below model.vocab_size={vocab}: "
                        f"{', '.join(data_specs(cfg))} holds ids of another vocabulary, or is damaged; make the "
                        f"store again with tetron tokenize (or raise model.vocab_size)")


class DataLoader:
    """This DP rank's micro-batches of each step, cut from a layout-independent global batch."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        *,
        micro_batch: int,
        grad_acc: int,
        dp_size: int,
        dp_rank: int,
        seed: int,
        documents: bool = False,
    ) -> None:
        if min(micro_batch, grad_acc, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(
                f"data: need micro_batch, grad_acc, dp_size >= 1 and 0 <= dp_rank < dp_size "
                f"(got {micro_batch}, {grad_acc}, {dp_size}, {dp_rank})"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.grad_acc = grad_acc
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.global_batch = micro_batch * grad_acc * dp_size
        self.sampler = BatchSampler(len(tokens), seq_len, global_batch=self.global_batch, seed=seed)
        # `documents`: each micro-batch also numbers its windows' documents (read once from the store)
        self.doc_ends = stream_ends(tokens) if documents else None
        self.step = 0

    def batch_for_step(self, step: int) -> list[MicroBatch]:
        """`grad_acc` micro-batches, each int64 [micro_batch, seq_len], for one step."""
        per_rank = self.micro_batch * self.grad_acc
        rows = self.sampler.indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        T = self.seq_len
        docs = None if self.doc_ends is None else window_documents(self.doc_ends, rows * T, T)
        return micro_batches([self.tokens[i * T : i * T + T + 1] for i in rows], self.micro_batch, docs)

    def next_batch(self) -> list[MicroBatch]:
        """The current step's micro-batches; then move to the next step."""
        batch = self.batch_for_step(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """The loader's position and what it depends on (JSON-serialisable, for checkpoints)."""
        return {
            "step": self.step,
            "seed": self.sampler.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "num_tokens": self.sampler.num_tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the sampling must match (same seq_len, global batch, seed)."""
        mine = self.state_dict()
        for field in ("seq_len", "global_batch", "seed"):
            if state[field] != mine[field]:
                raise DataError(
                    f"data: cannot resume: checkpoint has {field}={state[field]}, this run has {mine[field]} "
                    f"(use the same {field} to continue the same data order)"
                )
        self.step = int(state["step"])
