"""Data: text sources, a cached flat token file, and a layout-free sampler (tokenizers: tokenizer.py).

Text is read from local files (.txt, .jsonl, .parquet, source code), the Python
standard library (`stdlib`) or a Hugging Face dataset (`hf:NAME[:CONFIG][:SPLIT]`),
tokenized once into a flat memory-mapped token file, and cut into windows of
`seq_len + 1` tokens. The global batch of step s is a seeded list of windows that
depends only on (seed, step, sizes); each DP rank and each micro-batch then takes its
contiguous share of those rows, so any (dp, grad_acc, micro_batch) layout with the
same global batch sees the same data in the same order.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import itertools
import json
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from tetron.tokenizer import Tokenizer

__all__ = [
    "DataError",
    "resolve_files",
    "iter_texts",
    "prepare_tokens",
    "load_tokens",
    "BatchSampler",
    "DataLoader",
    "default_cache_dir",
]

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".py", ".md")
# Bump when the token file layout or the tokenization rules change, to invalidate caches.
_CACHE_VERSION = "tetron-tokens-1"
_ENCODE_BATCH = 256  # documents per encode_batch call


class DataError(ValueError):
    """A data problem the user can fix; the message is one line naming it and a fix."""


def default_cache_dir() -> Path:
    """Where trained tokenizers and token files are cached: $XDG_CACHE_HOME/tetron."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tetron"


# ----------------------------------------------------------------------------- sources


def _stdlib_files() -> list[Path]:
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__"}  # third-party packages differ per machine
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(p for p in files if p.is_file())


def resolve_files(spec: str) -> list[Path]:
    """The sorted files a data spec names: a file, a folder (recursive), a glob, or `stdlib`."""
    if spec == "stdlib":
        files = _stdlib_files()
        if not files:
            raise DataError(f"data: no .py files in the standard library at {sysconfig.get_paths()['stdlib']}")
        return files
    if spec.startswith("hf:"):
        raise DataError(f"data: {spec} is a Hugging Face dataset, not files (read it with iter_texts)")
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data: no files match {spec} (give a file, a folder or a glob)")
        return files
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise DataError(
                f"data: no {'/'.join(TEXT_SUFFIXES)} files under {path} (give a file, a folder or a glob)"
            )
        return files
    raise DataError(f"data: {spec} does not exist (give a file, a folder, a glob, 'stdlib' or hf:NAME)")


def _parse_hf(spec: str) -> tuple[str, str | None, str]:
    """`hf:NAME`, `hf:NAME:SPLIT` or `hf:NAME:CONFIG:SPLIT` -> (name, config, split)."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(f"data: cannot parse {spec} (use hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT)")
    if len(parts) == 1:
        return parts[0], None, "train"
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def _load_hf(spec: str, text_field: str) -> Any:
    import datasets  # slow to import; only needed for hf: specs

    name, config, split = _parse_hf(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types; all mean "cannot load this"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data: cannot load {spec}: {msg} (give a local dataset folder or a cached hub name)") from e
    if text_field not in ds.column_names:
        columns = ", ".join(ds.column_names)
        raise DataError(f"data: {spec} has no column {text_field!r} (columns: {columns}; set text_field)")
    return ds


def _iter_hf(spec: str, text_field: str) -> Iterator[str]:
    ds = _load_hf(spec, text_field)
    for batch in ds.select_columns([text_field]).iter(batch_size=1000):
        for text in batch[text_field]:
            yield text or ""


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"data: {path} line {lineno} is not JSON ({e.msg}); expected one object per line"
                ) from e
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise DataError(f"data: {path} line {lineno} has no string field {text_field!r} (set text_field)")
            yield obj[text_field]


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise DataError(
            f"data: {path} has no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}; set text_field)"
        )
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text or ""


def _read_text(path: Path, limit: int | None) -> str:
    """A whole file as one document; not all files are UTF-8, so undecodable bytes become U+FFFD."""
    with open(path, "rb") as f:
        raw = f.read() if limit is None else f.read(limit)
    # final=False drops a multi-byte character cut in half by the limit instead of replacing it.
    final = limit is None or len(raw) < limit
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=final)


def iter_texts(spec: str, *, text_field: str = "text", max_bytes: int | None = None) -> Iterator[str]:
    """Yield the documents of a data spec, in a fixed order; stop after about max_bytes of UTF-8 text."""
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"data: max_bytes={max_bytes} must be positive (or None for all the data)")

    def docs() -> Iterator[str]:
        if spec.startswith("hf:"):
            yield from _iter_hf(spec, text_field)
            return
        for path in resolve_files(spec):
            if path.suffix == ".jsonl":
                yield from _iter_jsonl(path, text_field)
            elif path.suffix == ".parquet":
                yield from _iter_parquet(path, text_field)
            else:
                # Read no more than needed: a prefix of a huge file is enough.
                yield _read_text(path, None if max_bytes is None else max_bytes - total)

    total = 0
    for doc in docs():
        if max_bytes is None:
            yield doc
            continue
        raw = doc.encode("utf-8")
        if total + len(raw) >= max_bytes:
            cut = raw[: max_bytes - total].decode("utf-8", errors="ignore")
            if cut:
                yield cut
            return
        total += len(raw)
        yield doc


def _data_fingerprint(spec: str, *, text_field: str, max_bytes: int | None) -> str:
    """A hash of the documents a spec yields, for cache keys; does not depend on where the data lies."""
    h = hashlib.sha256(json.dumps({"text_field": text_field, "max_bytes": max_bytes}).encode())
    if spec.startswith("hf:"):
        fp = getattr(_load_hf(spec, text_field), "_fingerprint", None)
        if fp:
            h.update(f"hf-fingerprint:{fp}".encode())
            return h.hexdigest()
    elif max_bytes is None:
        # Whole files: hashing their bytes is cheaper than parsing them.
        files = resolve_files(spec)
        root = Path(os.path.commonpath([str(p.parent) for p in files]))
        for p in files:
            h.update(f"\0file:{p.relative_to(root).as_posix()}:{p.stat().st_size}\0".encode())
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        return h.hexdigest()
    # A prefix (or a dataset without a fingerprint): hash exactly the text that will be used.
    for doc in iter_texts(spec, text_field=text_field, max_bytes=max_bytes):
        raw = doc.encode("utf-8")
        h.update(f"\0doc:{len(raw)}\0".encode())
        h.update(raw)
    return h.hexdigest()


# ----------------------------------------------------------------------------- token file


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def prepare_tokens(
    data_spec: str,
    tokenizer: Tokenizer,
    *,
    cache_dir: Path,
    text_field: str = "text",
    max_bytes: int | None = None,
) -> Path:
    """Tokenize the data once into a flat token file (EOS after each document); cached by content."""
    data_fp = _data_fingerprint(data_spec, text_field=text_field, max_bytes=max_bytes)
    key = hashlib.sha256(f"{_CACHE_VERSION}:{tokenizer.fingerprint()}:{data_fp}".encode()).hexdigest()
    folder = Path(cache_dir) / "tokens"
    path = folder / f"{key[:24]}.bin"
    if path.exists() and path.with_suffix(".json").exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    dtype = _token_dtype(tokenizer.vocab_size)
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]  # separates documents
    tmp = folder / f"{path.name}.tmp-{os.getpid()}"
    num_tokens = 0

    def flush(f: Any, batch: list[str]) -> int:
        if tokenizer.backend is None:  # bytes: skip the Python lists
            arr = np.frombuffer("".join(batch).encode("utf-8"), dtype=np.uint8).astype(dtype)
        else:
            ids = tokenizer.encode_batch(batch)
            for doc_ids in ids:
                doc_ids.extend(eos)
            arr = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=sum(map(len, ids)))
        arr.tofile(f)
        return arr.size

    try:
        with open(tmp, "wb") as f:
            batch: list[str] = []
            for doc in iter_texts(data_spec, text_field=text_field, max_bytes=max_bytes):
                batch.append(doc)
                if len(batch) == _ENCODE_BATCH:
                    num_tokens += flush(f, batch)
                    batch = []
            if batch:
                num_tokens += flush(f, batch)
        if num_tokens == 0:
            raise DataError(f"data: {data_spec} gave no tokens (is it empty, or is text_field={text_field!r} empty?)")
        # Sidecar first, token file renamed last: the .bin existing means both are complete.
        _write_json(path.with_suffix(".json"), {
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "source": data_spec,
            "text_field": text_field,
            "max_bytes": max_bytes,
        })
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_tokens(path: Path) -> np.ndarray:
    """The token file as a read-only memory map (nothing is loaded until it is indexed)."""
    path = Path(path)
    sidecar = path.with_suffix(".json")
    if not path.exists() or not sidecar.exists():
        raise DataError(f"data: token file {path} or its sidecar {sidecar.name} is missing (run prepare_tokens)")
    meta = json.loads(sidecar.read_text())
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
