"""Local files as text: files, folders and globs of .txt, .md, .py (each file one document), .jsonl and .parquet
(one document per record), and the Python standard library (`stdlib`), read in a fixed order; their
identity for cache keys (sizes and mtimes, or their bytes).

Every record is read defensively: a .jsonl line is bounded (MAX_RECORD_BYTES), and bad UTF-8, bad JSON,
JSON nested too deeply, a missing or non-string text field, or an unreadable parquet file is one DataError
naming the file and line or row; or, with data.on_bad_record=skip, the record is skipped and counted
(BadRecords)."""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Any, Callable, Iterator

from tetron.errors import DataError
from tetron.fs import missing_reason

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".py", ".md")
MAX_RECORD_BYTES = 256 << 20  # the longest .jsonl line read


class BadRecords:
    """Records skipped under data.on_bad_record=skip: how many, and where the first was."""

    def __init__(self) -> None:
        self.count = 0
        self.first: str | None = None

    def add(self, where: str) -> None:
        self.count += 1
        self.first = self.first or where


def _bad(where: str, what: str, skip: BadRecords | None) -> None:
    """A record that cannot be used: a DataError (on_bad_record=stop, skip None), or counted and skipped."""
    if skip is None:
        raise DataError(f"data: {where} {what}; data.on_bad_record=skip skips such records")
    skip.add(where)


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
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data: no files match {spec} (give a file, a folder or a glob)")
        return files
    if path.is_file():
        return [path]
    if not path.is_dir() and (path.exists() or path.is_symlink()):  # a FIFO, a device, a link loop or to nothing
        raise DataError(f"data: {spec} is {missing_reason(path)} (give a file, a folder, a glob, 'stdlib' or hf:NAME)")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise DataError(
                f"data: no {'/'.join(TEXT_SUFFIXES)} files under {path} (give a file, a folder or a glob)"
            )
        return files
    raise DataError(f"data: {spec} does not exist (give a file, a folder, a glob, 'stdlib' or hf:NAME)")


# A UTF-16 surrogate without its pair: JSON may spell one ("\ud800"), but it is no character, and no text
# with one can be encoded (as UTF-8, for the tokenizers and the byte-level store)
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_WHAT = "holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): not text"


def column_texts(values: Iterator[Any], where: Callable[[int], str], text_field: str,
           skip: BadRecords | None) -> Iterator[str]:
    """The strings of a text column (null: an empty document); any other value is a bad record."""
    for i, text in enumerate(values):
        if isinstance(text, str) and _LONE_SURROGATE.search(text):
            _bad(where(i), _SURROGATE_WHAT, skip)
        elif text is None or isinstance(text, str):
            yield text or ""
        else:
            _bad(where(i), f"has a {type(text).__name__} in {text_field!r}, not text (set data.text_field)", skip)


def _jsonl_record(line: bytes, where: str, text_field: str, skip: BadRecords | None) -> str | None:
    """The text of one .jsonl line, or None (blank, or a bad record skipped)."""
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except UnicodeDecodeError:
        return _bad(where, "is not valid UTF-8", skip)
    except RecursionError:
        return _bad(where, "is JSON nested too deeply", skip)
    except ValueError as e:  # JSONDecodeError, or an integer too long to convert
        return _bad(where, f"is not JSON ({getattr(e, 'msg', e)}); expected one object per line", skip)
    if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
        return _bad(where, f"has no string field {text_field!r} (set data.text_field)", skip)
    if _LONE_SURROGATE.search(obj[text_field]):
        return _bad(where, _SURROGATE_WHAT, skip)
    return obj[text_field]


def _skip_line(f: Any) -> None:
    """Read past the rest of the current line, in bounded pieces."""
    while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
        pass


def iter_jsonl(path: Path, text_field: str, skip: BadRecords | None, *, start: int = 0,
               end: int | None = None) -> Iterator[str]:
    """The texts of the lines of a .jsonl file that begin in bytes [start, end) (all of it by default); a
    record is named by its line number when reading from the start, else by the byte it begins at."""
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            _skip_line(f)  # a line that began before `start` belongs to the range before
        lineno, pos = 0, f.tell()
        while (end is None or pos < end) and (line := f.readline(MAX_RECORD_BYTES + 1)):
            lineno += 1
            where = f"{path} line {lineno}" if start == 0 else f"{path} line at byte {pos}"
            if len(line) > MAX_RECORD_BYTES:
                if not line.endswith(b"\n"):
                    _skip_line(f)
                _bad(where, f"is longer than {MAX_RECORD_BYTES} bytes", skip)
            else:
                text = _jsonl_record(line, where, text_field, skip)
                if text is not None:
                    yield text
            pos = f.tell()


def iter_parquet(path: Path, text_field: str, skip: BadRecords | None, *,
                 row_groups: tuple[int, int] | None = None) -> Iterator[str]:
    """The texts of a parquet file's column (of row groups [a, b) if given), read in batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if text_field not in names:
            raise DataError(f"data: {path} has no column {text_field!r} (columns: {', '.join(names)}; set text_field)")
        groups = range(*row_groups) if row_groups else range(pf.num_row_groups)
        row = sum(pf.metadata.row_group(i).num_rows for i in range(groups.start))
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024, row_groups=list(groups)):
            values = batch.column(0).to_pylist()
            yield from column_texts(iter(values), lambda i, row=row: f"{path} row {row + i}", text_field, skip)
            row += len(values)
    except (pa.ArrowException, OSError) as err:  # a damaged file: its footer, a page, a codec
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data: {path} is not a readable parquet file ({first}); replace or remove it") from None


def read_text(path: Path, limit: int | None) -> str:
    """A whole file as one document; not all files are UTF-8, so undecodable bytes become U+FFFD."""
    with open(path, "rb") as f:
        raw = f.read() if limit is None else f.read(limit)
    # final=False drops a multi-byte character cut in half by the limit instead of replacing it.
    final = limit is None or len(raw) < limit
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw, final=final)


def iter_text_pieces(path: Path, piece_bytes: int) -> Iterator[str]:
    """A text file as one document in pieces of about `piece_bytes` (constant memory for any size). A piece
    ends after a newline that a non-space follows, where byte-level pre-tokenizers split anyway, so
    byte-level BPE encodes the pieces as it would the whole file."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    carry = ""
    with open(path, "rb") as f:
        while block := f.read(piece_bytes):
            text = carry + decoder.decode(block)
            cut = max(text.rfind("\n", 0, len(text) - 1), 0)
            while cut and text[cut + 1].isspace():
                cut = text.rfind("\n", 0, cut)
                cut = max(cut, 0)
            carry = text[cut + 1:] if cut else text
            if cut:
                yield text[: cut + 1]
            if len(carry) > 4 * piece_bytes:  # no such newline in a long stretch: cut it anyway
                yield carry
                carry = ""
    carry += decoder.decode(b"", final=True)
    if carry:
        yield carry


def hash_files(h: Any, files: list[Path], root: Path, hash_contents: bool) -> None:
    """Add files to hash `h`: their paths relative to `root` and sizes, and their mtimes or (`hash_contents`)
    their bytes."""
    for p in files:
        st = p.stat()
        h.update(f"\0file:{p.relative_to(root).as_posix()}:{st.st_size}".encode())
        if not hash_contents:
            h.update(f":{st.st_mtime_ns}\0".encode())
            continue
        with open(p, "rb") as f:  # whole files: hashing their bytes is cheaper than parsing them
            while chunk := f.read(1 << 20):
                h.update(chunk)


def file_documents(files: list[Path], *, text_field: str, skip: BadRecords | None,
                   max_bytes: int | None) -> Iterator[str]:
    """The documents of local files in order; a text file is read only as far as `max_bytes` (the prefix of
    all the documents that will be used) needs."""
    total = 0
    for path in files:
        if path.suffix == ".jsonl":
            docs = iter_jsonl(path, text_field, skip)
        elif path.suffix == ".parquet":
            docs = iter_parquet(path, text_field, skip)
        else:  # read no more than needed: a prefix of a huge file is enough
            docs = iter([read_text(path, None if max_bytes is None else max_bytes - total)])
        for doc in docs:
            if max_bytes is not None:
                total += len(doc.encode("utf-8"))
            yield doc
