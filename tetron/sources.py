"""Text sources: local files (.txt, .jsonl, .parquet, source code), the Python standard library
(`stdlib`) or a Hugging Face dataset (`hf:NAME[:CONFIG][:SPLIT]`), read as documents in a fixed order,
and a fingerprint of what a source yields, for cache keys."""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Any, Iterator

from tetron.errors import DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet", ".py", ".md")


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


def data_fingerprint(spec: str, *, text_field: str, max_bytes: int | None) -> str:
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
