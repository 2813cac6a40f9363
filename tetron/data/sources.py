"""Data sources: what a data spec names (data.path, data.sources[i].path, data.val_path, `tetron tokenize`'s
SOURCE), behind one protocol, `Source`, found by `source_of(spec)`.

    files       local files, folders and globs (.txt, .md, .py, .jsonl, .parquet; files.py)
    stdlib      the Python standard library's .py files
    hf:NAME     a Hugging Face dataset, `hf:NAME[[:CONFIG]:SPLIT]`, streamed where it can be (hf_source.py)
    token store a folder made by `tetron tokenize`: tokens already, nothing to read as text (token_store.py)

A text source yields documents in a fixed order, says what identifies them for cache keys, and cuts itself
into work units that processes tokenize independently (store_build.py); a token store brings its
tokenizer. Everything after that reads token stores alone: the loader, mixtures and the loader's position
in checkpoints count windows of tokens, whatever the source was. A new kind of source is one subclass of
`Source` and one `register_source`: validation, tokenizing and the cache ask `source_of`, never the spec's form.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator, TypeVar

from tetron.data import units as file_units
from tetron.data.files import BadRecords, file_documents, hash_files, resolve_files
from tetron.data.hf_source import hf_documents, hf_identity, hf_streams, hf_unit_documents, hf_units, parse_hf
from tetron.data.token_store import is_store
from tetron.errors import DataError

__all__ = ["BadRecords", "Source", "data_fingerprint", "iter_texts", "plan_units", "read_unit", "register_source",
           "resolve_files", "source_of"]


class Source(ABC):
    """One kind of data, named by a spec. A subclass says which specs are its own (`claims`) and how its
    documents are read, and overrides what else its data supports; the defaults describe a source read
    whole, in order, by one process, known by its text alone."""

    tokenized = False  # a token store: tokens already (the run opens it, checked against its tokenizer)

    def __init__(self, spec: str) -> None:
        self.spec = spec

    @classmethod
    @abstractmethod
    def claims(cls, spec: str) -> bool:
        """Whether `spec` names data of this kind."""

    def check(self) -> None:
        """Resolve the spec without reading the data (before any rank starts): a DataError says what is wrong."""
        return None  # by default nothing to resolve: what is wrong shows when the data is read

    @abstractmethod
    def documents(self, *, text_field: str, skip: BadRecords | None, max_bytes: int | None) -> Iterator[str]:
        """The documents in a fixed order. `max_bytes`: only a prefix of about that many bytes is used (reading
        may stop there); a bad record raises DataError, or with `skip` is counted there and left out."""

    def identify(self, h: Any, *, text_field: str, hash_contents: bool, by_text: bool) -> bool:
        """Add what identifies the documents to hash `h` without reading them, for cache keys; False when only
        their text can (then data_fingerprint hashes the text). `by_text`: data.hash_contents with a
        data.max_bytes prefix, where a source keyed by its files' bytes is keyed by the prefix's text."""
        return False

    def streams(self) -> bool:
        """Whether the source is cut into its own work units (`units`); else one unit reads it in order."""
        return True

    def units(self, *, text_field: str, unit_bytes: int) -> list[dict[str, Any]]:
        """Work units of about `unit_bytes` of input each, in the source's order (units.py); JSON-able dicts
        with a "kind", and a "spec" naming this source unless their kind is one of units.FILE_UNITS."""
        return [_texts_unit(self.spec, None)]

    def unit_pieces(self, unit: dict[str, Any], *, text_field: str,
                    skip: BadRecords | None) -> Iterator[tuple[str, bool]]:
        """(text, ends_document) of one of this source's own units, in order."""
        raise DataError(f"data: {self.spec} makes no work units of kind {unit['kind']!r}")

    def plan_key(self, *, text_field: str, max_bytes: int | None) -> str:
        """What a token store built from this source records as its data (STORE/plan.json): another build
        into the same store must give the same."""
        return data_fingerprint(self.spec, text_field=text_field, max_bytes=max_bytes)

    def size_bytes(self) -> int | None:
        """The bytes of input, if known without reading it (None: not before it is read)."""
        return None

    def tokenizer_folder(self) -> Path | None:
        """The tokenizer the data was tokenized with (a token store's), None for text."""
        return None

    def anchored(self, workdir: Path) -> str:
        """The spec as a process started in another folder reads the same data (a Slurm job's): local paths
        relative to `workdir` made absolute; by default the spec names no local path and stays as it is."""
        return self.spec


def _anchored_path(path: str, workdir: Path) -> str:
    """`path` absolute where it names something that exists relative to `workdir` (else as it is: a glob, a typo
    that the data check names later)."""
    local = workdir / Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


KINDS: list[type[Source]] = []  # filled by register_source(); the most recent registration claims a spec first
Kind = TypeVar("Kind", bound=type[Source])


def register_source(kind: Kind) -> Kind:
    """Make `kind` claim the specs it recognises, before every kind registered earlier."""
    KINDS.insert(0, kind)
    return kind


def source_of(spec: str) -> Source:
    """The source a data spec names."""
    for kind in KINDS:
        if kind.claims(spec):
            return kind(spec)
    raise DataError(f"data: {spec}: no kind of data source recognises it (give a file, a folder, a glob, 'stdlib', "
                    f"hf:NAME or a token store)")


def _texts_unit(spec: str, max_bytes: int | None) -> dict[str, Any]:
    return {"kind": "texts", "spec": spec, "max_bytes": max_bytes, "bytes": max_bytes or 0}


# ----------------------------------------------------------------------------- the built-in kinds


@register_source
class TextFiles(Source):
    """Local files: a file, a folder (recursively), or a glob. It claims every spec no other kind does."""

    @classmethod
    def claims(cls, spec: str) -> bool:
        return True

    def files(self) -> list[Path]:
        return resolve_files(self.spec)

    def check(self) -> None:
        self.files()

    def documents(self, *, text_field: str, skip: BadRecords | None, max_bytes: int | None) -> Iterator[str]:
        return file_documents(self.files(), text_field=text_field, skip=skip, max_bytes=max_bytes)

    def identify(self, h: Any, *, text_field: str, hash_contents: bool, by_text: bool) -> bool:
        if by_text:
            return False
        files = self.files()
        hash_files(h, files, Path(os.path.commonpath([str(p.parent) for p in files])), hash_contents)
        return True

    def units(self, *, text_field: str, unit_bytes: int) -> list[dict[str, Any]]:
        return file_units.plan_file_units(self.files(), text_field=text_field, unit_bytes=unit_bytes)

    def size_bytes(self) -> int | None:
        return sum(f.stat().st_size for f in self.files())

    def anchored(self, workdir: Path) -> str:
        if glob.has_magic(self.spec) and not Path(self.spec).expanduser().is_absolute():
            return str(workdir.resolve() / Path(self.spec).expanduser())  # the pattern, from the same folder
        return _anchored_path(self.spec, workdir)


@register_source
class Stdlib(TextFiles):
    """`stdlib`: the Python standard library's .py files (site-packages left out)."""

    @classmethod
    def claims(cls, spec: str) -> bool:
        return spec == "stdlib"

    def check(self) -> None:  # it is there wherever Python is; walking it takes a while
        pass

    def anchored(self, workdir: Path) -> str:
        return self.spec


@register_source
class HFDataset(Source):
    """`hf:NAME[[:CONFIG]:SPLIT]`: a local dataset folder or a hub dataset (hf_source.py)."""

    @classmethod
    def claims(cls, spec: str) -> bool:
        return spec.startswith("hf:")

    def check(self) -> None:
        parse_hf(self.spec)

    def documents(self, *, text_field: str, skip: BadRecords | None, max_bytes: int | None) -> Iterator[str]:
        return hf_documents(self.spec, text_field, skip)

    def identify(self, h: Any, *, text_field: str, hash_contents: bool, by_text: bool) -> bool:
        return hf_identity(self.spec, h, text_field, hash_contents, by_text)

    def streams(self) -> bool:  # offline, without the hub's commit, the cached copy is loaded whole
        return hf_streams(self.spec)

    def units(self, *, text_field: str, unit_bytes: int) -> list[dict[str, Any]]:
        return hf_units(self.spec)

    def unit_pieces(self, unit: dict[str, Any], *, text_field: str,
                    skip: BadRecords | None) -> Iterator[tuple[str, bool]]:
        if unit["kind"] != "hf":
            return super().unit_pieces(unit, text_field=text_field, skip=skip)
        return ((text, True) for text in hf_unit_documents(unit, text_field, skip))

    def plan_key(self, *, text_field: str, max_bytes: int | None) -> str:
        return self.spec  # a store resumed from the hub keeps reading the same name

    def anchored(self, workdir: Path) -> str:
        name = parse_hf(self.spec)[0]
        local = _anchored_path(name, workdir)  # a local dataset folder; a hub name stays a name
        return f"hf:{local}{self.spec[len('hf:') + len(name):]}"  # the config and split as they were


@register_source
class TokenStoreSource(Source):
    """A token store made by `tetron tokenize` (a folder with an index.json)."""

    tokenized = True

    @classmethod
    def claims(cls, spec: str) -> bool:
        return is_store(spec)

    def folder(self) -> Path:
        return Path(self.spec).expanduser()

    def anchored(self, workdir: Path) -> str:
        return _anchored_path(self.spec, workdir)

    def _not_text(self) -> DataError:
        return DataError(f"data: {self.spec} is a token store (made by tetron tokenize): it holds tokens, not "
                         f"text; train on it with --data.path={self.spec}")

    def documents(self, *, text_field: str, skip: BadRecords | None, max_bytes: int | None) -> Iterator[str]:
        raise self._not_text()

    def units(self, *, text_field: str, unit_bytes: int) -> list[dict[str, Any]]:
        raise self._not_text()

    def size_bytes(self) -> int | None:
        raise self._not_text()

    def tokenizer_folder(self) -> Path | None:
        return self.folder() / "tokenizer"


# ----------------------------------------------------------------------------- what every source offers


def iter_texts(spec: str, *, text_field: str = "text", max_bytes: int | None = None,
               skip: BadRecords | None = None) -> Iterator[str]:
    """Yield the documents of a data spec, in a fixed order; stop after about max_bytes of UTF-8 text.
    A bad record raises DataError, or with `skip` (data.on_bad_record=skip) is counted there and left out."""
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"data: max_bytes={max_bytes} must be positive (or None for all the data)")
    total = 0
    for doc in source_of(spec).documents(text_field=text_field, skip=skip, max_bytes=max_bytes):
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


def data_fingerprint(spec: str, *, text_field: str, max_bytes: int | None, skip_bad: bool = False,
                     hash_contents: bool = False) -> str:
    """A key for the documents a spec yields, for caches: what its source says identifies them (local files:
    their relative paths, sizes and modification times, one stat per file whatever their size, or with
    `hash_contents` (data.hash_contents) their bytes; so the files of a local hf: dataset folder, while a hub
    dataset counts by its repository's commit, offline by the cached copy's fingerprint), else the text itself.
    `skip_bad` (data.on_bad_record=skip) yields other documents from the same files: another key."""
    head = {"text_field": text_field, "max_bytes": max_bytes, **({"skip_bad": True} if skip_bad else {}),
            **({"hash_contents": True} if hash_contents else {})}
    h = hashlib.sha256(json.dumps(head).encode())
    by_text = hash_contents and max_bytes is not None
    if source_of(spec).identify(h, text_field=text_field, hash_contents=hash_contents, by_text=by_text):
        return h.hexdigest()
    # A prefix (or a dataset without a fingerprint): hash exactly the text that will be used.
    for doc in iter_texts(spec, text_field=text_field, max_bytes=max_bytes, skip=BadRecords() if skip_bad else None):
        raw = doc.encode("utf-8")
        h.update(f"\0doc:{len(raw)}\0".encode())
        h.update(raw)
    return h.hexdigest()


def plan_units(source: Source, *, text_field: str, unit_bytes: int, max_bytes: int | None = None,
               stream: bool = True) -> list[dict[str, Any]]:
    """The work units of a source, in its order (units.py). A max_bytes prefix, or a source that is not
    `stream`ed, is one unit read in order."""
    if max_bytes is not None or not stream:
        return [_texts_unit(source.spec, max_bytes)]
    return source.units(text_field=text_field, unit_bytes=unit_bytes)


def read_unit(unit: dict[str, Any], *, text_field: str, skip: BadRecords | None) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) of a work unit in order: a document is one piece, or for a large text file several."""
    if unit["kind"] in file_units.FILE_UNITS:
        return file_units.unit_pieces(unit, text_field=text_field, skip=skip)
    if unit["kind"] == "texts":
        texts = iter_texts(unit["spec"], text_field=text_field, max_bytes=unit["max_bytes"], skip=skip)
        return ((text, True) for text in texts)
    return source_of(unit["spec"]).unit_pieces(unit, text_field=text_field, skip=skip)
