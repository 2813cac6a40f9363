"""Data: a cached flat token file and a layout-free sampler (sources: sources.py, tokenizers: tokenizer.py).

Text is tokenized once into a flat memory-mapped token file and cut into windows of
`seq_len + 1` tokens. The global batch of step s is a seeded list of windows that
depends only on (seed, step, sizes); each DP rank and each micro-batch then takes its
contiguous share of those rows, so any (dp, grad_acc, micro_batch) layout with the
same global batch sees the same data in the same order.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from tetron.checkpoint import find_latest
from tetron.config import Config
from tetron.errors import ConfigError, DataError
from tetron.fs import fsync_file, read_bounded, temp_name, write_json
from tetron.sources import BadRecords, data_fingerprint, iter_texts
from tetron.tokenizer import Tokenizer, load_tokenizer

# Bump when the token file layout or the tokenization rules change, to invalidate caches.
_CACHE_VERSION = "tetron-tokens-1"
_ENCODE_BATCH = 256  # documents per encode_batch call


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
    return str(folder) if _ships_tokenizer(folder) else "bytes"


def check_tokenizer_pairing(cfg: Config, tokenizer: Tokenizer) -> None:
    """Refuse an explicit tokenizer that differs from the one the starting weights were trained with."""
    folder = start_folder(cfg)
    if cfg.data.tokenizer is None or cfg.checkpoint.new_tokenizer or not _ships_tokenizer(folder):
        return
    theirs = load_tokenizer(str(folder), data_spec=None, cache_dir=folder)
    if theirs.fingerprint() != tokenizer.fingerprint():
        raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} is not the tokenizer of {folder}, whose weights "
                          f"learned that one's token ids: leave data.tokenizer unset to use it, or set "
                          f"checkpoint.new_tokenizer=true to train with another")


def prepare_data(cfg: Config, *, say: Callable[[str], None] | None = None) -> tuple[Tokenizer, Path]:
    """Tokenizer and flat token file for this config; both cached, so only the first call does work
    (and tells `say` about it)."""
    d = cfg.data
    cache = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
    skip_bad = d.on_bad_record == "skip"
    tokenizer = load_tokenizer(tokenizer_spec(cfg), data_spec=d.path, cache_dir=cache, text_field=d.text_field,
                               max_bytes=d.max_bytes, say=say, skip_bad=skip_bad)
    tokens = prepare_tokens(d.path, tokenizer, cache_dir=cache, text_field=d.text_field, max_bytes=d.max_bytes,
                            say=say, skip_bad=skip_bad)
    return tokenizer, tokens


# ----------------------------------------------------------------------------- token file


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def _encode_to(f: Any, tokenizer: Tokenizer, docs: Iterator[str], dtype: np.dtype) -> int:
    """Append the token ids of `docs` (EOS after each, where the tokenizer has one) to the open file
    `f`, in batches; returns how many were written."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]  # separates documents

    def flush(batch: list[str]) -> int:
        if tokenizer.backend is None:  # bytes: skip the Python lists
            arr = np.frombuffer("".join(batch).encode("utf-8"), dtype=np.uint8).astype(dtype)
        else:
            ids = tokenizer.encode_batch(batch)
            for doc_ids in ids:
                doc_ids.extend(eos)
            arr = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids)))
        arr.tofile(f)
        return arr.size

    num_tokens, batch = 0, []
    for doc in docs:
        batch.append(doc)
        if len(batch) == _ENCODE_BATCH:
            num_tokens += flush(batch)
            batch = []
    return num_tokens + (flush(batch) if batch else 0)


def prepare_tokens(
    data_spec: str,
    tokenizer: Tokenizer,
    *,
    cache_dir: Path,
    text_field: str = "text",
    max_bytes: int | None = None,
    say: Callable[[str], None] | None = None,
    skip_bad: bool = False,
) -> Path:
    """Tokenize the data once into a flat token file (EOS after each document); cached by content.
    `say` is told when tokenizing starts, of a damaged cache entry, and of records skipped (`skip_bad`)."""
    data_fp = data_fingerprint(data_spec, text_field=text_field, max_bytes=max_bytes, skip_bad=skip_bad)
    key = hashlib.sha256(f"{_CACHE_VERSION}:{tokenizer.fingerprint()}:{data_fp}".encode()).hexdigest()
    folder = Path(cache_dir) / "tokens"
    path = folder / f"{key[:24]}.bin"
    if path.exists() or path.with_suffix(".json").exists():
        problem = token_file_problem(path, vocab_size=tokenizer.vocab_size)
        if problem is None:
            return path
        if say is not None:
            say(f"the token cache {problem}; tokenizing again")
    if say is not None:
        say(f"tokenizing {data_spec} (once; cached in {folder})")
    folder.mkdir(parents=True, exist_ok=True)
    dtype = _token_dtype(tokenizer.vocab_size)
    tmp = temp_name(path)
    skip = BadRecords() if skip_bad else None
    try:
        with open(tmp, "wb") as f:
            texts = iter_texts(data_spec, text_field=text_field, max_bytes=max_bytes, skip=skip)
            num_tokens = _encode_to(f, tokenizer, texts, dtype)
        if skip is not None and skip.count and say is not None:
            say(f"skipped {skip.count} bad records (data.on_bad_record=skip), the first at {skip.first}")
        if num_tokens == 0:
            raise DataError(f"data: {data_spec} gave no tokens (is it empty, or is text_field={text_field!r} empty?)")
        # Sidecar first, token file renamed last: the .bin existing means both are complete.
        write_json(path.with_suffix(".json"), {
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "source": data_spec,
            "text_field": text_field,
            "max_bytes": max_bytes,
        }, indent=2)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _token_meta(path: Path) -> dict[str, Any]:
    """The sidecar of token file `path`, checked against the file: a DataError naming what is wrong."""
    sidecar = path.with_suffix(".json")
    try:
        meta = json.loads(read_bounded(sidecar, 1 << 20))
    except (OSError, ValueError, RecursionError) as err:
        raise DataError(f"{sidecar} is unreadable ({getattr(err, 'strerror', None) or type(err).__name__})") from None
    ok = isinstance(meta, dict) and meta.get("dtype") in ("uint16", "uint32") and type(meta.get("num_tokens")) is int \
        and meta["num_tokens"] > 0 and type(meta.get("vocab_size")) is int
    if not ok:
        raise DataError(f"{sidecar} is damaged (needs dtype uint16/uint32, positive num_tokens, vocab_size)")
    try:
        size = path.stat().st_size if path.is_file() else None
    except OSError:
        size = None
    want = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    if size != want:
        raise DataError(f"{path} is truncated or missing ({size} bytes; its sidecar says {want})")
    return meta


def token_file_problem(path: Path, *, vocab_size: int | None = None) -> str | None:
    """What is wrong with a cached token file and its sidecar (None: nothing)."""
    try:
        meta = _token_meta(Path(path))
    except DataError as err:
        return str(err)
    if vocab_size is not None and meta["vocab_size"] != vocab_size:
        return f"{path} was made for a vocabulary of {meta['vocab_size']}, not {vocab_size}"
    return None


def load_tokens(path: Path) -> np.ndarray:
    """The token file as a read-only memory map (nothing is loaded until it is indexed)."""
    path = Path(path)
    meta = _token_meta(path)
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["num_tokens"],))


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
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(int(e))[offsets[mask]]
        return out


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
        self.step = 0

    def batch_for_step(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`grad_acc` pairs (input_ids, targets), each int64 [micro_batch, seq_len], for one step."""
        per_rank = self.micro_batch * self.grad_acc
        rows = self.sampler.indices(step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        T = self.seq_len
        windows = np.stack([np.asarray(self.tokens[i * T : i * T + T + 1], dtype=np.int64) for i in rows])
        windows = torch.from_numpy(windows)  # [micro_batch * grad_acc, T + 1]
        out = []
        for k in range(self.grad_acc):
            w = windows[k * self.micro_batch : (k + 1) * self.micro_batch]
            out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
        return out

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
