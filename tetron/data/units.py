"""Work units: a data source cut into pieces that processes tokenize independently, each piece a
contiguous range of documents, so that the store's token order is the source's whatever the number of
workers. A unit is a small JSON-able dict; `unit_pieces` reads one (streaming, in constant memory).

    lines    a byte range of a .jsonl file (the lines that begin in it)
    files    consecutive whole text files (.txt, .py, .md), each one document
    parquet  a range of a parquet file's row groups
    hf       one shard of a Hugging Face dataset read in streaming mode (never downloaded whole)
    texts    a whole spec read in order by iter_texts (a max_bytes prefix, streamed for hf: where it can be; or
             an hf: dataset loaded whole from the local cache when the hub cannot be asked)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from tetron.data.hf_source import open_hf_stream
from tetron.data.sources import (
    BadRecords,
    _read_text,
    iter_hf_rows,
    iter_jsonl,
    iter_parquet,
    iter_text_pieces,
    iter_texts,
    resolve_files,
)
from tetron.errors import DataError

MIN_UNIT_BYTES = 1 << 20  # units are not made smaller than this to make more of them
PIECE_BYTES = 8 << 20  # a text file larger than this is read (and encoded) in pieces of about this size


def _parquet_units(path: Path, text_field: str, unit_bytes: int) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
        sizes = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
    except (pa.ArrowException, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"data: {path} is not a readable parquet file ({first}); replace or remove it") from None
    units, a, size = [], 0, 0
    for i, n in enumerate(sizes):
        size += n
        if size >= unit_bytes or i == len(sizes) - 1:
            units.append({"kind": "parquet", "path": str(path), "groups": [a, i + 1], "bytes": size})
            a, size = i + 1, 0
    return units


def _hf_units(spec: str, text_field: str) -> list[dict[str, Any]]:
    ds = open_hf_stream(spec)
    return [{"kind": "hf", "spec": spec, "shard": i, "num_shards": ds.num_shards, "bytes": 0}
            for i in range(ds.num_shards)]


def plan_units(spec: str, *, text_field: str, unit_bytes: int, max_bytes: int | None = None,
               stream_hf: bool = True) -> list[dict[str, Any]]:
    """The units of a data spec, in the source's order: about `unit_bytes` of input each, or less, so that a
    source smaller than 64 such units still gives some 64 (work for many processes). The plan depends on
    the source alone, not on the number of workers."""
    if max_bytes is not None or (spec.startswith("hf:") and not stream_hf):
        return [{"kind": "texts", "spec": spec, "max_bytes": max_bytes, "bytes": max_bytes or 0}]
    if spec.startswith("hf:"):
        return _hf_units(spec, text_field)
    total = sum(p.stat().st_size for p in resolve_files(spec))
    unit_bytes = max(1, min(unit_bytes, max(MIN_UNIT_BYTES, total // 64)))
    units: list[dict[str, Any]] = []
    group: list[str] = []
    group_bytes = 0
    for path in resolve_files(spec):
        size = path.stat().st_size
        if path.suffix in (".jsonl", ".parquet") and group:
            units.append({"kind": "files", "paths": group, "bytes": group_bytes})
            group, group_bytes = [], 0
        if path.suffix == ".jsonl":
            units.extend({"kind": "lines", "path": str(path), "start": a, "end": min(a + unit_bytes, size),
                          "bytes": min(unit_bytes, size - a)} for a in range(0, max(size, 1), unit_bytes))
        elif path.suffix == ".parquet":
            units.extend(_parquet_units(path, text_field, unit_bytes))
        else:
            group.append(str(path))
            group_bytes += size
            if group_bytes >= unit_bytes:
                units.append({"kind": "files", "paths": group, "bytes": group_bytes})
                group, group_bytes = [], 0
    if group:
        units.append({"kind": "files", "paths": group, "bytes": group_bytes})
    return units


def _hf_pieces(unit: dict[str, Any], text_field: str, skip: BadRecords | None) -> Iterator[tuple[str, bool]]:
    spec, shard = unit["spec"], unit["shard"]
    ds = open_hf_stream(spec).shard(num_shards=unit["num_shards"], index=shard)
    for text in iter_hf_rows(ds, f"{spec} shard {shard}", text_field, skip):
        yield text, True


def unit_pieces(unit: dict[str, Any], *, text_field: str, skip: BadRecords | None) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) in order: a document is one piece, or for a large text file several."""
    kind = unit["kind"]
    if kind == "lines":
        for text in iter_jsonl(Path(unit["path"]), text_field, skip, start=unit["start"], end=unit["end"]):
            yield text, True
    elif kind == "parquet":
        for text in iter_parquet(Path(unit["path"]), text_field, skip, row_groups=tuple(unit["groups"])):
            yield text, True
    elif kind == "files":
        for name in unit["paths"]:
            if Path(name).stat().st_size <= PIECE_BYTES:
                yield _read_text(Path(name), None), True
                continue
            last = ""
            for k, text in enumerate(iter_text_pieces(Path(name), PIECE_BYTES)):
                if k:
                    yield last, False
                last = text
            yield last, True
    elif kind == "hf":
        yield from _hf_pieces(unit, text_field, skip)
    else:
        for text in iter_texts(unit["spec"], text_field=text_field, max_bytes=unit["max_bytes"], skip=skip):
            yield text, True
