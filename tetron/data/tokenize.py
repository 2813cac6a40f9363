"""`tetron tokenize SOURCE --tokenizer T --out STORE [--workers N] [--shard-mb M]`: a data source into a
token store that data.path or data.sources can name (the work: store_build.py)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from tetron.data.loader import default_cache_dir
from tetron.data.sources import source_of
from tetron.data.store_build import build_store, check_store_folder
from tetron.data.tokenizer import load_tokenizer
from tetron.errors import DataError, UserError


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line, as everywhere in tetron (not usage + error)."""

    def error(self, message: str) -> NoReturn:
        raise DataError(f"{self.prog}: {message} (see {self.prog} --help)")


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM: the build stops (store_build ends its workers first), finished units are kept."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals() -> Callable[[], None]:
    """SIGINT and SIGTERM raise Stopped in this (the main) thread; a second one is ignored, so that it cannot
    cut the clean-up short. Returns a function that restores the previous handlers."""
    def stop(signum: int, _frame: Any) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread can set handlers
        return lambda: None
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _stopped_line(err: Stopped, out: Path) -> str:
    done = len(list(out.glob("u*.done.json"))) if out.is_dir() else 0
    return (f"tetron: tokenize stopped by {err}: {done} finished units kept in {out}; run the same command again "
            f"to resume")


MAX_SHARDS = 100_000  # shard files one store may have: more is a folder no file system lists quickly


def _check_shard_count(source: str, shard_mb: float) -> None:
    """--shard-mb finite, at least 1 KiB, and large enough that the source's bytes (where known before it is
    read: a hub dataset's are not) make at most MAX_SHARDS work units, each writing a shard."""
    if not math.isfinite(shard_mb) or not 2**-10 <= shard_mb <= 2**20:
        raise DataError(f"--shard-mb={shard_mb}: give MB of input per shard, from {2**-10:.4g} (1 KiB) to {2**20} "
                        f"(e.g. 256)")
    size = source_of(source).size_bytes()
    if size is None:
        return
    units = size / max(1, int(shard_mb * 2**20))
    if units > MAX_SHARDS:
        least = size / MAX_SHARDS / 2**20
        raise DataError(f"--shard-mb={shard_mb} cuts {source}'s {size:,} bytes into about {units:,.0f} shards, more "
                        f"than {MAX_SHARDS:,} files; use --shard-mb {least:.3g} or more")


def tokenize_command(args: list[str]) -> int:
    """`tetron tokenize`: returns the exit status; a bad source or argument is one line on stderr."""
    parser = _Parser(prog="tetron tokenize", description="Tokenize a data source into a token store that "
                     "data.path or data.sources can name.")
    parser.add_argument("source", help="a file, folder, glob, stdlib, or hf:NAME[[:CONFIG]:SPLIT] (streamed)")
    parser.add_argument("--tokenizer", required=True, help="bytes, bpe:N (trained on the source), a tokenizer "
                        "folder or tokenizer.json, or a hub name")
    parser.add_argument("--out", required=True, help="the store folder (a killed run resumes into it)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    parser.add_argument("--shard-mb", type=float, default=256.0, help="input per work unit and tokens per shard, MB")
    parser.add_argument("--text-field", default="text", help="the text column of .jsonl/.parquet/hf data")
    parser.add_argument("--on-bad-record", choices=("stop", "skip"), default="stop")
    parser.add_argument("--cache-dir", default=None, help="where bpe:N tokenizers are cached")
    try:
        ns = parser.parse_args(args)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except DataError as err:
        print(f"tetron: error: {err}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    restore = _stop_on_signals()
    try:
        if ns.workers < 1 or not ns.shard_mb > 0:
            raise DataError(f"--workers={ns.workers} must be >= 1 and --shard-mb={ns.shard_mb} positive")
        _check_shard_count(ns.source, ns.shard_mb)
        if ns.tokenizer.startswith("bpe:") and source_of(ns.source).size_bytes() is None:
            raise DataError(f"--tokenizer={ns.tokenizer} would read all of {ns.source} to train before tokenizing "
                            f"it; train it on a sample (tetron tokenize SAMPLE --tokenizer {ns.tokenizer} saves it in "
                            f"STORE/tokenizer) and give that folder")
        if not ns.out.strip():
            raise DataError("--out='': give the store's folder (a new or empty folder, or a store to resume)")
        check_store_folder(Path(ns.out))  # before a bpe:N tokenizer is trained: refused at once
        cache = Path(ns.cache_dir).expanduser() if ns.cache_dir else default_cache_dir()
        tok = load_tokenizer(ns.tokenizer, data_spec=ns.source, cache_dir=cache, text_field=ns.text_field, say=say,
                             skip_bad=ns.on_bad_record == "skip")
        start = time.monotonic()
        index = build_store(ns.source, tok, Path(ns.out), workers=ns.workers, shard_mb=ns.shard_mb,
                            text_field=ns.text_field, skip_bad=ns.on_bad_record == "skip", say=say,
                            say_done=True)
    except UserError as err:  # a DataError, or a StorageError (a full disk)
        print(f"tetron: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"tetron: error: {err.filename or ns.out}: {err.strerror or err}", file=sys.stderr)
        return 2
    except Stopped as err:
        print(_stopped_line(err, Path(ns.out).expanduser()), file=sys.stderr)
        return 128 + err.signum
    finally:
        restore()
    secs = time.monotonic() - start
    print(f"tetron: {ns.out}: {index['num_tokens']:,} tokens in {len(index['shards'])} shards, "
          f"{index['num_docs']:,} documents ({secs:.1f} s); train on it with --data.path={ns.out}")
    return 0
