"""Work units: a data source cut into pieces that processes tokenize independently, each piece a
contiguous range of documents, so that the store's token order is the source's whatever the number of
workers. A unit is a small JSON-able dict; its source reads it (sources.read_unit, streaming, in constant
memory). This module plans and reads the units of local files; the others are their sources' own.

    lines    a byte range of a .jsonl file (the lines that begin in it)
    files    consecutive whole text files (.txt, .py, .md), each one document
    parquet  a range of a parquet file's row groups
    hf       one shard of a Hugging Face dataset read in streaming mode, never downloaded whole (hf_source.py)
    texts    a whole source read in order (sources.py: a max_bytes prefix of any source, or an hf: dataset
             loaded whole from the local cache when the hub cannot be asked)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from tetron.data.files import BadRecords, iter_jsonl, iter_parquet, iter_text_pieces, read_text
from tetron.errors import DataError

MIN_UNIT_BYTES = 1 << 20  # units are not made smaller than this to make more of them
PIECE_BYTES = 8 << 20  # a text file larger than this is read (and encoded) in pieces of about this size
FILE_UNITS = ("lines", "files", "parquet")


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


def plan_file_units(files: list[Path], *, text_field: str, unit_bytes: int) -> list[dict[str, Any]]:
    """The units of local files, in their order: about `unit_bytes` of input each, or less, so that files
    smaller than 64 such units still give some 64 (work for many processes). The plan depends on the files
    alone, not on the number of workers."""
    total = sum(p.stat().st_size for p in files)
    unit_bytes = max(1, min(unit_bytes, max(MIN_UNIT_BYTES, total // 64)))
    units: list[dict[str, Any]] = []
    group: list[str] = []
    group_bytes = 0
    for path in files:
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


def unit_pieces(unit: dict[str, Any], *, text_field: str, skip: BadRecords | None) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) of a unit of local files (FILE_UNITS) in order: a document is one piece, or for a
    large text file several."""
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
                yield read_text(Path(name), None), True
                continue
            last = ""
            for k, text in enumerate(iter_text_pieces(Path(name), PIECE_BYTES)):
                if k:
                    yield last, False
                last = text
            yield last, True
    else:
        raise DataError(f"a work unit of kind {kind!r} is not one of local files ({', '.join(FILE_UNITS)})")
