"""Data: text sources, tokenizers, a cached flat token file, and a layout-free sampler.

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
from typing import Any, Iterator

import numpy as np
import torch

__all__ = [
    "DataError",
    "resolve_files",
    "iter_texts",
    "Tokenizer",
    "load_tokenizer",
    "prepare_tokens",
    "load_tokens",
    "BatchSampler",
    "DataLoader",
    "default_cache_dir",
]

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".py", ".md")
EOS_TOKEN = "<|endoftext|>"
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


# ----------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """Plain bytes (backend None) or a Hugging Face `tokenizers.Tokenizer`, with its EOS id."""

    def __init__(self, backend: Any | None = None, eos_id: int | None = None, *, vocab_size: int | None = None) -> None:
        self.backend = backend  # tokenizers.Tokenizer, or None for bytes
        if backend is not None:  # documents are encoded whole, never cut or padded
            backend.no_truncation()
            backend.no_padding()
        self._fingerprint: str | None = None
        self.eos_id = eos_id
        if vocab_size is None:
            vocab_size = 256 if backend is None else backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        kind = "bytes" if self.backend is None else "hf"
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    def encode(self, text: str) -> list[int]:
        """Token ids of a text, without BOS/EOS (documents are separated by EOS when packed)."""
        if self.backend is None:
            return list(text.encode("utf-8"))
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once; the HF encoder runs them in parallel threads."""
        if self.backend is None:
            return [list(t.encode("utf-8")) for t in texts]
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids; invalid byte sequences become U+FFFD."""
        if self.backend is None:
            return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
        return self.backend.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        """A stable hash of the vocabulary and rules, used in cache keys for token files."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"eos={self.eos_id};vocab={self.vocab_size};".encode())
            if self.backend is None:
                h.update(b"bytes")
            else:
                # Only what changes ids without special tokens counts: transformers adds a
                # no-op post-processor on load, which must not invalidate the token cache.
                spec = json.loads(self.backend.to_str())
                for key in ("post_processor", "truncation", "padding"):
                    spec.pop(key, None)
                h.update(json.dumps(spec, sort_keys=True).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def save(self, folder: Path) -> None:
        """Write the tokenizer to a folder that load_tokenizer (and transformers, for HF ones) can read."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta: dict[str, Any] = {"type": "bytes" if self.backend is None else "hf",
                                "vocab_size": self.vocab_size, "eos_id": self.eos_id}
        if self.backend is not None:
            self.backend.save(str(folder / "tokenizer.json"))
            config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
            if self.eos_id is not None:
                config["eos_token"] = self.backend.id_to_token(self.eos_id)
            _write_json(folder / "tokenizer_config.json", config)
        _write_json(folder / "tetron_tokenizer.json", meta)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _bpe_vocab_size(spec: str) -> int:
    try:
        n = int(spec[len("bpe:"):])
    except ValueError:
        n = 0
    if n < 257:
        raise DataError(
            f"data: tokenizer {spec!r} needs an integer vocabulary size >= 257 (256 bytes + EOS), e.g. bpe:4096"
        )
    return n


def _train_bpe(vocab_size: int, texts: Iterator[str]) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(backend, backend.token_to_id(EOS_TOKEN))


def _load_saved(folder: Path) -> Tokenizer:
    """A folder written by Tokenizer.save."""
    meta = json.loads((folder / "tetron_tokenizer.json").read_text())
    if meta["type"] == "bytes":
        return Tokenizer(None, None)
    from tokenizers import Tokenizer as HFTokenizer

    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    return Tokenizer(backend, meta["eos_id"], vocab_size=meta["vocab_size"])


def _load_pretrained(spec: str) -> Tokenizer:
    """A Hugging Face tokenizer folder, tokenizer.json file, or hub name, through transformers."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(spec).expanduser()
    try:
        if path.is_file():
            if (path.parent / "tokenizer_config.json").exists():
                tok = AutoTokenizer.from_pretrained(str(path.parent))
            else:
                tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else spec)
    except Exception as e:  # OSError, ValueError, hub errors: all mean "cannot load this"
        raise DataError(
            f"data: cannot load tokenizer {spec!r} (use 'bytes', 'bpe:N', a tokenizer folder or "
            f"tokenizer.json, or a hub name that is cached): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"data: tokenizer {spec!r} has no fast (tokenizers) backend; give one with a tokenizer.json")
    return Tokenizer(backend, tok.eos_token_id, vocab_size=len(tok))


def load_tokenizer(
    spec: str,
    *,
    data_spec: str | None,
    cache_dir: Path,
    text_field: str = "text",
    max_bytes: int | None = None,
) -> Tokenizer:
    """`bytes`, `bpe:N` (trained on the data once, then cached), or a Hugging Face tokenizer."""
    if spec == "bytes":
        return Tokenizer(None, None)
    if spec.startswith("bpe:"):
        vocab_size = _bpe_vocab_size(spec)
        if data_spec is None:
            raise DataError(f"data: tokenizer {spec!r} is trained on the data; give a data spec to train it on")
        data_fp = _data_fingerprint(data_spec, text_field=text_field, max_bytes=max_bytes)
        key = hashlib.sha256(f"bpe:{vocab_size}:{data_fp}".encode()).hexdigest()
        folder = Path(cache_dir) / "tokenizers" / f"bpe{vocab_size}-{key[:20]}"
        if (folder / "tetron_tokenizer.json").exists():
            return _load_saved(folder)
        tok = _train_bpe(vocab_size, iter_texts(data_spec, text_field=text_field, max_bytes=max_bytes))
        # Save under a temporary name and rename, so a crash never leaves a partial cache entry.
        tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
        tok.save(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: use its copy
            if not (folder / "tetron_tokenizer.json").exists():
                raise
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
        return _load_saved(folder)
    path = Path(spec).expanduser()
    if (path / "tetron_tokenizer.json").exists():
        return _load_saved(path)
    looks_like_path = spec.startswith(("/", "./", "../", "~")) or spec.endswith(".json")
    if looks_like_path and not path.exists():
        raise DataError(
            f"data: tokenizer path {spec} does not exist (use 'bytes', 'bpe:N', a tokenizer folder or tokenizer.json)"
        )
    return _load_pretrained(spec)


# ----------------------------------------------------------------------------- token file


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
