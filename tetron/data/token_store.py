"""Token stores: a folder of token shards and one JSON index, opened by reading the index alone.

    STORE/index.json        written last: its presence means the store is complete. The dtype (uint16 below
                            a vocabulary of 65,536, else uint32), the tokenizer's fingerprint, the source, and
                            per shard its name, token count and document count
    STORE/tokenizer/        the tokenizer the ids mean (Tokenizer.save), so a run can train on the store alone
    STORE/NAME.bin          a shard's token ids, EOS after each document where the tokenizer has one
    STORE/NAME.docs         int64: where each document that ends in this shard ends (shard-local, exclusive);
                            tokens after the last end continue a document into the next shard
    STORE/uNNNNN.done.json  a finished work unit's shards (tetron tokenize resumes from these)

Every shard is written under a temporary name and renamed when complete, its .docs first; a unit's
done record after its shards; the index after every unit. So a kill leaves complete shards and
temporaries, never a half-written file under a final name. Opening reads the index and checks each
shard's size (stat), never the contents: start-up costs the same for 30 MB and 3 TB.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from tetron.errors import DataError
from tetron.fs import fsync_file, read_bounded, temp_name, write_json

FORMAT = "tetron-token-store-1"
INDEX = "index.json"
MAX_INDEX_BYTES = 256 << 20  # a million shards' entries fit well below this


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def is_store(path: str | Path) -> bool:
    """Whether `path` is a token store folder (it has an index.json)."""
    return Path(path).expanduser().is_dir() and (Path(path).expanduser() / INDEX).is_file()


# ----------------------------------------------------------------------------- writing


class ShardWriter:
    """One work unit's shards: tokens appended in batches, a new shard once `shard_tokens` are written
    (between batches, so a shard ends where a batch ends)."""

    def __init__(self, folder: Path, unit: int, *, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.unit, self.dtype, self.shard_tokens = folder, unit, dtype, max(1, shard_tokens)
        self.shards: list[dict[str, Any]] = []  # the finished ones
        self._file: Any = None
        self._tmp: Path | None = None
        self._count = 0
        self._ends: list[np.ndarray] = []

    def _name(self) -> str:
        return f"u{self.unit:05d}-{len(self.shards):03d}"

    def add(self, tokens: np.ndarray, doc_ends: np.ndarray) -> None:
        """Append `tokens`; `doc_ends` are the ends of the documents completed in them (relative to them).
        A shard ends once it holds `shard_tokens` (a document may continue in the next)."""
        ends, pos = np.asarray(doc_ends, dtype=np.int64), 0
        while pos < tokens.size:
            if self._file is None:
                self._tmp = temp_name(self.folder / f"{self._name()}.bin")
                self._file = open(self._tmp, "wb")
            take = min(self.shard_tokens - self._count, tokens.size - pos)
            # file.write, not ndarray.tofile: a full disk is then an OSError with its errno (ENOSPC), which says
            # "no space"; tofile's says "N requested and M written"
            self._file.write(np.ascontiguousarray(tokens[pos: pos + take], dtype=self.dtype))
            mine = ends[(ends <= pos + take) & ((ends > pos) | (pos == 0))]  # pos 0: empty documents too
            self._ends.append(mine - pos + self._count)
            self._count += take
            pos += take
            if self._count >= self.shard_tokens:
                self._finish_shard()

    def _finish_shard(self) -> None:
        name, tmp = self._name(), self._tmp
        self._file.close()
        self._file = None
        ends = np.concatenate(self._ends) if self._ends else np.zeros(0, np.int64)
        docs_tmp = temp_name(self.folder / f"{name}.docs")
        with open(docs_tmp, "wb") as f:
            f.write(np.ascontiguousarray(ends))
        fsync_file(docs_tmp)
        os.replace(docs_tmp, self.folder / f"{name}.docs")
        fsync_file(tmp)
        os.replace(tmp, self.folder / f"{name}.bin")  # the .bin last: it existing means both are whole
        self.shards.append({"name": name, "num_tokens": self._count, "num_docs": int(ends.size)})
        self._count, self._ends, self._tmp = 0, [], None

    def close(self, record: dict[str, Any]) -> dict[str, Any]:
        """Finish the last shard and write the unit's done record (`record` plus the shard list)."""
        if self._file is not None and self._count:
            self._finish_shard()
        elif self._file is not None:  # opened, nothing written
            self._file.close()
            self._tmp.unlink(missing_ok=True)
        done = {**record, "unit": self.unit, "shards": self.shards}
        write_json(self.folder / f"u{self.unit:05d}.done.json", done)
        return done

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tmp.unlink(missing_ok=True)


def read_done(folder: Path, unit: int, dtype: np.dtype) -> dict[str, Any] | None:
    """A unit's done record, if it is there and every shard it lists is whole; else None (redo the unit)."""
    try:
        done = json.loads(read_bounded(folder / f"u{unit:05d}.done.json", 64 << 20))
        for s in done["shards"]:
            if (folder / f"{s['name']}.bin").stat().st_size != s["num_tokens"] * dtype.itemsize:
                return None
            if (folder / f"{s['name']}.docs").stat().st_size != s["num_docs"] * 8:
                return None
        return done
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def clear_unit(folder: Path, unit: int) -> None:
    """Remove whatever an unfinished unit left (its shards and temporaries)."""
    for p in folder.glob(f"u{unit:05d}[-.]*"):
        p.unlink(missing_ok=True)


def write_index(folder: Path, dones: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The store's index from its units' done records, in unit order; written atomically, last."""
    shards = [s for d in sorted(dones, key=lambda d: d["unit"]) for s in d["shards"]]
    index = {"format": FORMAT, **meta, "num_tokens": sum(s["num_tokens"] for s in shards),
             "num_docs": sum(s["num_docs"] for s in shards),
             "skipped_records": sum(d.get("skipped", 0) for d in dones), "shards": shards}
    write_json(folder / INDEX, index)
    return index


# ----------------------------------------------------------------------------- reading


def read_index(folder: Path) -> dict[str, Any]:
    """The index of a store, checked: a DataError naming the file and what is wrong."""
    path = Path(folder) / INDEX
    try:
        index = json.loads(read_bounded(path, MAX_INDEX_BYTES))
    except (OSError, ValueError, RecursionError) as err:
        raise DataError(f"{path} is unreadable ({getattr(err, 'strerror', None) or type(err).__name__}); "
                        f"make the store again with tetron tokenize") from None
    ok = isinstance(index, dict) and index.get("format") == FORMAT and index.get("dtype") in ("uint16", "uint32") \
        and type(index.get("vocab_size")) is int and isinstance(index.get("shards"), list) \
        and all(isinstance(s, dict) and isinstance(s.get("name"), str) and Path(s["name"]).name == s["name"]
                and type(s.get("num_tokens")) is int and s["num_tokens"] > 0
                and type(s.get("num_docs")) is int and s["num_docs"] >= 0 for s in index["shards"])
    if not ok:
        raise DataError(f"{path} is damaged (not a {FORMAT} index with dtype, vocab_size and shards); "
                        f"make the store again with tetron tokenize")
    return index


class TokenStore:
    """A store's shards as one stream of tokens: len() and slicing (a window may span two shards). Each
    shard is memory-mapped on first use; nothing is read at opening but the index. Several stores (a
    list of folders, one vocabulary) open as their concatenation."""

    def __init__(self, folder: Path | list[Path]) -> None:
        folders = [Path(f) for f in folder] if isinstance(folder, list) else [Path(folder)]
        self.folder = folders[0]
        indexes = [read_index(f) for f in folders]
        self.index = indexes[0]
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size: int = self.index["vocab_size"]
        if any(i["dtype"] != self.index["dtype"] or i["vocab_size"] != self.vocab_size for i in indexes):
            raise DataError(f"data: the stores {', '.join(map(str, folders))} have different vocabularies")
        self.shards = [{**s, "path": f / f"{s['name']}.bin"} for f, i in zip(folders, indexes) for s in i["shards"]]
        sizes = np.array([s["num_tokens"] for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # shard k holds tokens starts[k]:starts[k+1]
        self.num_tokens = int(self.starts[-1])
        if self.num_tokens == 0:
            raise DataError(f"{self.folder / INDEX}: the store holds no tokens (was its source empty?)")
        for s in self.shards:  # sizes only (a stat each): the .docs too, which a document mask reads later
            _check_size(s["path"], s["num_tokens"] * self.dtype.itemsize)
            _check_size(s["path"].with_suffix(".docs"), s["num_docs"] * 8)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_tokens

    def shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            s = self.shards[k]
            self._maps[k] = np.memmap(s["path"], dtype=self.dtype, mode="r",
                                      shape=(s["num_tokens"],))
        return self._maps[k]

    def read(self, start: int, stop: int) -> np.ndarray:
        """tokens[start:stop] of the whole stream, as an array (a window may span two shards)."""
        parts, pos = [], start
        while pos < stop:
            k = int(np.searchsorted(self.starts, pos, side="right")) - 1
            end = min(stop, int(self.starts[k + 1]))
            parts.append(self.shard(k)[pos - self.starts[k]: end - self.starts[k]])
            pos = end
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def __getitem__(self, item: slice) -> TokenSlice:
        return TokenSlice(self, 0, self.num_tokens)[item]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.read(0, self.num_tokens), dtype=dtype)

    def tolist(self) -> list[int]:
        return self.read(0, self.num_tokens).tolist()

    def doc_ends(self) -> np.ndarray:
        """Where every document ends in the whole stream (exclusive): read from the .docs files, on request."""
        ends = [_shard_ends(s["path"].with_suffix(".docs"), s["num_tokens"]) + self.starts[k]
                for k, s in enumerate(self.shards)]
        return np.concatenate(ends) if ends else np.zeros(0, np.int64)


def _check_size(path: Path, expected: int) -> None:
    """A shard's file must hold what the index says: a DataError naming it otherwise."""
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        raise DataError(f"{path} is truncated or missing ({size} bytes; the index says {expected}); "
                        f"make the store again with tetron tokenize")


def _shard_ends(path: Path, num_tokens: int) -> np.ndarray:
    """A shard's document ends, checked: increasing offsets inside the shard (garbage of the right size
    would otherwise mask documents silently wrong)."""
    ends = np.fromfile(path, dtype=np.int64)
    if ends.size and (ends[0] < 0 or ends[-1] > num_tokens or np.any(np.diff(ends) < 0)):
        raise DataError(f"{path} is damaged (its document ends are not increasing offsets within the shard's "
                        f"{num_tokens} tokens); make the store again with tetron tokenize")
    return ends


class TokenSlice:
    """store[a:b]: a lazy view (len, slicing); its tokens are read when it becomes an array (np.asarray),
    so cutting a held-out tail off a terabyte store reads nothing."""

    def __init__(self, store: TokenStore, start: int, stop: int) -> None:
        self.store, self.start, self.stop = store, start, stop
        self.dtype = store.dtype

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, item: slice) -> TokenSlice:
        if not isinstance(item, slice):
            raise TypeError("a token store is indexed with slices (store[a:b])")
        start, stop, step = item.indices(len(self))
        if step != 1:
            raise IndexError("a token store is sliced with step 1 only")
        return TokenSlice(self.store, self.start + start, self.start + max(stop, start))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.store.read(self.start, self.stop), dtype=dtype)

    def tolist(self) -> list[int]:
        return self.store.read(self.start, self.stop).tolist()

    def doc_ends(self) -> np.ndarray:
        """The ends of the documents that end inside the slice, relative to its start."""
        ends = self.store.doc_ends()
        return ends[(ends > self.start) & (ends <= self.stop)] - self.start
