"""Building a token store (token_store.py) from a data source, in parallel and resumable: what
`tetron tokenize` runs, and the automatic tokenization of data.path (one worker, in the cache).

The source is cut into work units (units.py), each a contiguous range of its documents; worker
processes (spawned: each loads the store's saved tokenizer) tokenize one unit at a time, streaming it,
and write its shards themselves. The store's token order is the source's, whatever the number of
workers. A unit whose done record is there is kept when the command runs again; any other unit's files
are removed and the unit is redone, so a killed run resumes where it was. STORE/plan.json holds what
the store is made of (source, tokenizer, units): another run into the same folder must match it.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import multiprocessing as mp
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tetron.data.sources import BadRecords, plan_units, read_unit, source_of
from tetron.data.token_store import (
    FORMAT,
    INDEX,
    ShardWriter,
    clear_unit,
    read_done,
    read_index,
    token_dtype,
    write_index,
)
from tetron.data.tokenizer import Tokenizer, load_tokenizer
from tetron.errors import DataError, StorageError
from tetron.folder_lock import FolderLock
from tetron.fs import (
    describe_size,
    read_bounded,
    recover_temps,
    replace_folder,
    temp_name,
    write_failure,
    write_json,
)

STORE_LOCK = "tokenize.lock"  # in the store while a build writes it (FolderLock)
ENCODE_DOCS = 256  # documents per encode_batch call
ENCODE_CHARS = 4 << 20  # or fewer, when they are long: a batch's text stays a few MB


def encode_batch(tokenizer: Tokenizer, texts: list[str], ends: list[bool], dtype: np.dtype
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The ids of `texts` in one array (EOS after each piece that ends a document, where the tokenizer
    has one), and where those documents end in it."""
    if tokenizer.backend is None:  # bytes: skip the Python lists
        raws = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, raws), np.int64, len(raws))
        arr = np.frombuffer(b"".join(raws), dtype=np.uint8).astype(dtype)
    else:
        ids = tokenizer.encode_batch(texts)
        if tokenizer.eos_id is not None:
            for doc_ids, end in zip(ids, ends):
                if end:
                    doc_ids.append(tokenizer.eos_id)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        arr = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return arr, np.cumsum(lengths)[np.asarray(ends, dtype=bool)]


def encode_unit(unit: dict[str, Any], unit_id: int, *, folder: Path, tokenizer: Tokenizer, shard_tokens: int,
                text_field: str, skip_bad: bool, progress: Callable[[int], None]) -> dict[str, Any]:
    """Tokenize one unit into its shards and write its done record (returned). `progress` is told the
    characters read, batch by batch. On any error the unit's unfinished shard is removed."""
    dtype = token_dtype(tokenizer.vocab_size)
    skip = BadRecords() if skip_bad else None
    writer = ShardWriter(folder, unit_id, dtype=dtype, shard_tokens=shard_tokens)
    try:
        texts: list[str] = []
        ends: list[bool] = []
        chars = 0
        for text, end in itertools.chain(read_unit(unit, text_field=text_field, skip=skip), [(None, True)]):
            if text is not None:
                texts.append(text)
                ends.append(end)
                chars += len(text)
            if texts and (text is None or len(texts) >= ENCODE_DOCS or chars >= ENCODE_CHARS):
                writer.add(*encode_batch(tokenizer, texts, ends, dtype))
                progress(chars)
                texts, ends, chars = [], [], 0
        return writer.close({"skipped": skip.count if skip else 0, "first_skipped": skip.first if skip else None})
    except BaseException:
        writer.abort()
        raise


# ----------------------------------------------------------------------------- worker processes

_WORKER: dict[str, Any] = {}  # in a worker process only: its progress counter (set by its initializer)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends this process when its parent dies


def _init_worker(counter: Any, parent: int) -> None:
    """A worker leaves stopping to its parent, which kills it on SIGINT or SIGTERM (Ctrl-C reaches every
    process of the terminal's group: the workers must not stop, each with a traceback, on their own), and
    dies with it: a parent killed outright must not leave workers writing into a store it no longer locks."""
    _WORKER["counter"] = counter
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's clean-up below still ends the workers
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _end_workers(workers: list[Any]) -> None:
    """Kill the workers and wait until each is gone: only then may the store's lock be released."""
    for proc in workers:
        proc.kill()
    for proc in workers:
        proc.join()


@lru_cache(maxsize=2)
def _worker_tokenizer(folder: str) -> Tokenizer:
    return load_tokenizer(folder, data_spec=None, cache_dir=Path(folder))


def _count(n: int) -> None:
    with _WORKER["counter"].get_lock():
        _WORKER["counter"].value += n


def _work(unit: dict[str, Any], unit_id: int, folder: str, shard_tokens: int, text_field: str,
          skip_bad: bool) -> dict[str, Any]:
    tokenizer = _worker_tokenizer(str(Path(folder) / "tokenizer"))
    return encode_unit(unit, unit_id, folder=Path(folder), tokenizer=tokenizer, shard_tokens=shard_tokens,
                       text_field=text_field, skip_bad=skip_bad, progress=_count)


class Progress:
    """Lines on stderr every `every` seconds: how much is done, the rate and the time left."""

    def __init__(self, total_bytes: int, total_units: int, *, every: float, say: Callable[[str], None]) -> None:
        self.total_bytes, self.total_units, self.every, self.say = total_bytes, total_units, every, say
        self.start = self.last = time.monotonic()
        self.shown = False

    def show(self, chars: int, units: int, tokens: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every:
            return
        self.last, elapsed, self.shown = now, max(now - self.start, 1e-9), True
        if self.total_bytes:
            frac = min(chars / self.total_bytes, 1.0)
            eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
            where = f"{100 * frac:5.1f}% of {describe_size(self.total_bytes)}, {describe_size(chars / elapsed)}/s"
        else:
            frac = units / max(self.total_units, 1)
            eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
            where = f"{units}/{self.total_units} units"
        left = "?" if eta != eta else f"{int(eta) // 60}m{int(eta) % 60:02d}s"
        self.say(f"tokenize: {where}, {tokens:,} tokens in finished units, {elapsed:.0f} s, ETA {left}")


def _run_pool(pending: list[int], units: list[dict[str, Any]], *, folder: Path, workers: int, shard_tokens: int,
              text_field: str, skip_bad: bool, progress: Progress, done: dict[int, Any]) -> None:
    """The pending units over `workers` spawned processes; each finished one lands in `done`."""
    ctx = mp.get_context("spawn")  # fresh interpreters: no inherited threads (tokenizers' pool, torch's)
    counter = ctx.Value("q", 0)
    tokens = sum(s["num_tokens"] for d in done.values() if d for s in d["shards"])
    others = set(mp.active_children())
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(counter, os.getpid()))
    try:
        futures: dict[Future, int] = {pool.submit(_work, units[i], i, str(folder), shard_tokens, text_field,
                                                  skip_bad): i for i in pending}
        while futures:
            finished, _ = wait(futures, timeout=1.0, return_when=FIRST_COMPLETED)
            for f in finished:
                record = f.result()
                done[futures.pop(f)] = record
                tokens += sum(s["num_tokens"] for s in record["shards"])
            progress.show(counter.value, sum(1 for d in done.values() if d), tokens)
    except BrokenProcessPool:
        _end_workers([p for p in mp.active_children() if p not in others])
        raise DataError(f"tokenize: a worker process died (killed, or out of memory); run the same command "
                        f"again to resume: the {sum(1 for d in done.values() if d)} finished units in "
                        f"{folder} are kept") from None
    except BaseException:  # an error in a unit, Ctrl-C, SIGTERM (tokenize.py): no unit goes on
        _end_workers([p for p in mp.active_children() if p not in others])
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- the store


def _save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    if (folder / "tetron_tokenizer.json").is_file():
        return
    tmp = temp_name(folder)
    tokenizer.save(tmp)
    replace_folder(tmp, folder)


def check_store_folder(folder: Path) -> None:
    """A store is built only into a new or empty folder, or a store's own (its plan.json, then checked against
    this store's): building clears temporaries, unfinished units' `u*` files and tokenizer/, so any other
    folder (a run's, the current one) is refused with every file kept."""
    folder = Path(folder).expanduser()
    if not (folder.exists() or folder.is_symlink()):
        return
    if not folder.is_dir():
        raise DataError(f"--out={folder}: exists and is not a folder; give a new or empty folder for the store")
    names = {p.name for p in folder.iterdir()}
    if names <= {STORE_LOCK} or "plan.json" in names:  # a lock alone: a build killed before it wrote its plan
        return
    raise DataError(f"--out={folder}: a folder that is neither empty nor a token store (it has no plan.json); "
                    f"give a new or empty folder for the store")


def _check_plan(folder: Path, plan: dict[str, Any]) -> None:
    """Write STORE/plan.json, or check that the one there describes the same store."""
    path = folder / "plan.json"
    if not path.exists():
        write_json(path, plan)
        return
    try:
        old = json.loads(read_bounded(path, 256 << 20))
    except (OSError, ValueError, RecursionError):
        old = None
    if old != plan:
        what = [k for k in plan if not isinstance(old, dict) or old.get(k) != plan[k]]
        raise DataError(f"{folder} holds another tokenization (its {', '.join(what) or 'plan'} differs: other data, "
                        f"tokenizer or shard size); give another --out, or delete {folder} to start over")


def build_store(spec: str, tokenizer: Tokenizer, folder: Path, *, workers: int = 1, shard_mb: float = 256,
                text_field: str = "text", skip_bad: bool = False, max_bytes: int | None = None,
                stream: bool = True, say: Callable[[str], None] | None = None,
                progress_every: float = 5.0, say_done: bool = False, wait: bool = False) -> dict[str, Any]:
    """Tokenize `spec` into the store `folder` (resuming what is there), return its index. `shard_mb`:
    input per unit and tokens per shard, in MB. `stream`: cut the source into its own units (else one unit
    reads it in order, as a dataset loaded whole is). With one worker everything runs in this process. `say` is
    told the progress every `progress_every` s (and at the end, with `say_done`). `wait`:
    when another process is building this store, wait for it (else a DataError)."""
    folder = Path(folder).expanduser()
    check_store_folder(folder)
    lock = FolderLock(folder, STORE_LOCK)
    while True:
        try:
            lock.acquire()
            break
        except BlockingIOError as err:
            if not wait:
                raise DataError(f"{folder}: {err.strerror}; wait for it, or give another --out") from None
            time.sleep(0.5)  # another run makes the same cache entry: use it once it is done
    try:
        return _build_locked(spec, tokenizer, folder, workers=workers, shard_mb=shard_mb, text_field=text_field,
                             skip_bad=skip_bad, max_bytes=max_bytes, stream=stream,
                             say=say or (lambda _: None), progress_every=progress_every, say_done=say_done)
    except OSError as err:
        raise _write_error(err, folder) or err from None
    finally:
        lock.release()


def _write_error(err: OSError, folder: Path) -> StorageError | None:
    """A failed write into the store (a full disk, a read-only folder) as one line naming the folder; None
    for anything else (a source file that cannot be read says so itself)."""
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    if not full and not (err.filename and Path(err.filename).is_relative_to(folder)):
        return None
    line = write_failure(err, folder)
    return StorageError(f"{line}, while tokenizing into {folder}; free space there or use another folder, then run "
                        f"again (finished units are kept)")


def _build_locked(spec: str, tokenizer: Tokenizer, folder: Path, *, workers: int, shard_mb: float, text_field: str,
                  skip_bad: bool, max_bytes: int | None, stream: bool, say: Callable[[str], None],
                  progress_every: float, say_done: bool) -> dict[str, Any]:
    unit_bytes = max(1, int(shard_mb * 2**20))
    source = source_of(spec)
    units = plan_units(source, text_field=text_field, unit_bytes=unit_bytes, max_bytes=max_bytes, stream=stream)
    dtype = token_dtype(tokenizer.vocab_size)
    meta = {"dtype": dtype.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
            "tokenizer": tokenizer.fingerprint(), "source": spec, "text_field": text_field}
    plan = {"format": FORMAT, **meta, "max_bytes": max_bytes, "skip_bad": skip_bad, "shard_mb": shard_mb,
            "data": source.plan_key(text_field=text_field, max_bytes=max_bytes),
            "units": units}
    _check_plan(folder, plan)
    if (folder / INDEX).is_file():
        return read_index(folder)
    recover_temps(folder)  # what a killed run left mid-write
    _save_tokenizer(tokenizer, folder / "tokenizer")
    done = {i: read_done(folder, i, dtype) for i in range(len(units))}
    pending = [i for i, d in done.items() if d is None]
    for i in pending:
        clear_unit(folder, i)
    if len(pending) < len(units):
        say(f"tokenize: resuming: {len(units) - len(pending)} of {len(units)} units are done")
    shard_tokens = max(1, unit_bytes // dtype.itemsize)
    progress = Progress(sum(u["bytes"] for u in units), len(units), every=progress_every, say=say)
    if workers <= 1 or len(pending) <= 1:
        chars = 0

        def seen(n: int) -> None:
            nonlocal chars
            chars += n
            progress.show(chars, sum(1 for d in done.values() if d), 0)

        for i in pending:
            done[i] = encode_unit(units[i], i, folder=folder, tokenizer=tokenizer, shard_tokens=shard_tokens,
                                  text_field=text_field, skip_bad=skip_bad, progress=seen)
    else:
        _run_pool(pending, units, folder=folder, workers=min(workers, len(pending)), shard_tokens=shard_tokens,
                  text_field=text_field, skip_bad=skip_bad, progress=progress, done=done)
    if progress.shown or say_done:  # a long run, or asked for: a last line says it is complete
        tokens = sum(s["num_tokens"] for d in done.values() for s in d["shards"])
        progress.show(progress.total_bytes, len(units), tokens, force=True)
    index = write_index(folder, list(done.values()), meta)
    if index["skipped_records"]:
        first = next(d["first_skipped"] for d in sorted(done.values(), key=lambda d: d["unit"]) if d["skipped"])
        say(f"skipped {index['skipped_records']} bad records (data.on_bad_record=skip), the first at {first}")
    return index
