"""Hugging Face datasets as data (`hf:NAME[[:CONFIG]:SPLIT]`): what a spec names, what identifies its
contents without downloading it, how it is opened, and how it is read (rows as documents, shards as work
units); sources.HFDataset is the Source that uses these.

A local dataset folder is identified by its files and a hub dataset by its repository's current commit
(one small request); both are then read with `datasets`' streaming mode, rows in order as they are used,
so a hub corpus is never downloaded whole. When the hub cannot be asked (offline mode, no network, a
failed request), the dataset is loaded whole from the local `datasets` cache, as it was cached there, and
identified by that copy's fingerprint: what worked offline before still does.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tetron.data.files import BadRecords, column_texts, hash_files
from tetron.data.hub import hub_problem, offline_reason
from tetron.errors import DataError

if TYPE_CHECKING:
    import torch

SHA_TIMEOUT_S = 10.0  # for the one request that asks the hub for a dataset's commit
SHA_TTL_S = 600.0  # a commit asked for is reused this long: one request per run, one answer for key and read
_SHAS: dict[str, tuple[float, str | None]] = {}  # name -> (when asked, commit or None)


def parse_hf(spec: str) -> tuple[str, str | None, str]:
    """`hf:NAME`, `hf:NAME:SPLIT` or `hf:NAME:CONFIG:SPLIT` -> (name, config, split)."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise DataError(f"data: cannot parse {spec} (use hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT)")
    if len(parts) == 1:
        return parts[0], None, "train"
    if len(parts) == 2:
        return parts[0], None, parts[1]
    return parts[0], parts[1], parts[2]


def hf_folder(spec: str) -> Path | None:
    """The local dataset folder an hf: spec names, or None for a hub name."""
    path = Path(parse_hf(spec)[0]).expanduser()
    return path if path.exists() else None


def folder_files(folder: Path) -> list[Path]:
    """The files of a dataset folder, sorted; hidden ones (.git, .cache) and __pycache__ are left out, as
    `datasets` leaves them out of a dataset's files."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and not any(
        part.startswith((".", "__")) for part in p.relative_to(folder).parts))


def _ask_hub(name: str) -> str | None:
    """The current commit of hub dataset `name`; None when the hub cannot be asked or does not answer."""
    if offline_reason() is not None:  # offline mode, or no route to the hub: no request that waits
        return None
    try:
        from huggingface_hub import HfApi  # comes with datasets

        return HfApi().dataset_info(name, expand=["sha"], timeout=SHA_TIMEOUT_S).sha or None
    except Exception:  # not found, no access, a network error: the cached copy is all there is
        return None


def hub_sha(name: str) -> str | None:
    """`_ask_hub`, asked once per SHA_TTL_S: the cache key and the way the data is read agree."""
    asked = _SHAS.get(name)
    if asked is None or time.monotonic() - asked[0] > SHA_TTL_S:
        asked = _SHAS[name] = (time.monotonic(), _ask_hub(name))
    return asked[1]


def asked_commits() -> dict[str, str | None]:
    """The hub commits this process has asked for (None: the hub did not answer), by dataset name."""
    return {name: sha for name, (_, sha) in _SHAS.items()}


def remember_commits(commits: dict[str, str | None]) -> None:
    """Take another process's answers (rank 0's) as this one's: all ranks then key and read hub data alike,
    and the hub is asked once per run, not once per rank."""
    for name, sha in commits.items():
        _SHAS[name] = (time.monotonic(), sha)


def hf_streams(spec: str) -> bool:
    """Whether an hf: spec is read streamed (a local folder, or a hub dataset whose commit is known) rather
    than loaded whole from the local cache."""
    return hf_folder(spec) is not None or hub_sha(parse_hf(spec)[0]) is not None


def _load_dataset(spec: str, *, streaming: bool) -> Any:
    """datasets.load_dataset of an hf: spec; a hub name that cannot be reached fails at once, not after a
    minute of retries, and any failure is one DataError naming the spec."""
    name, config, split = parse_hf(spec)
    if hf_folder(spec) is None and (problem := hub_problem(name, "dataset")) is not None:
        raise DataError(f"data: {spec}: {problem}")
    import datasets  # slow to import; only needed for hf: specs

    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as e:  # datasets raises many types; all mean "cannot load this"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        verb, fix = ("stream", "a hub name") if streaming else ("load", "a cached hub name")
        raise DataError(f"data: cannot {verb} {spec}: {msg} (give a local dataset folder or {fix})") from e


def load_hf(spec: str, text_field: str) -> Any:
    """The whole dataset, loaded (from the local cache where it is there): the offline fallback."""
    ds = _load_dataset(spec, streaming=False)
    if text_field not in ds.column_names:
        columns = ", ".join(ds.column_names)
        raise DataError(f"data: {spec} has no column {text_field!r} (columns: {columns}; set text_field)")
    return ds


def open_hf_stream(spec: str) -> Any:
    """A Hugging Face dataset as an IterableDataset (streaming: rows are read as they are used)."""
    return _load_dataset(spec, streaming=True)


def iter_hf_rows(ds: Any, where: str, text_field: str, skip: BadRecords | None) -> Iterator[str]:
    """The texts of a streamed dataset (or one shard of it), named `where` in errors: a file of the dataset
    that cannot be read is one DataError naming the row it stopped after."""
    row = 0
    try:
        for batch in ds.iter(batch_size=1000):
            if text_field not in batch:
                raise DataError(f"data: {where} has no column {text_field!r} (columns: {', '.join(batch)}; "
                                f"set data.text_field)")
            yield from column_texts(iter(batch[text_field]), lambda i, r=row: f"{where} row {r + i}", text_field, skip)
            row += len(batch[text_field])
    except DataError:
        raise
    except Exception as e:  # a damaged file inside the dataset: arrow, json or parquet errors
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"data: {where} after row {row}: cannot read ({msg}); fix or remove that file of the "
                        f"dataset") from None


def hf_documents(spec: str, text_field: str, skip: BadRecords | None) -> Iterator[str]:
    """Streamed (a prefix reads only the rows it uses), or loaded whole from the cache when offline."""
    ds = open_hf_stream(spec) if hf_streams(spec) else load_hf(spec, text_field).select_columns([text_field])
    yield from iter_hf_rows(ds, spec, text_field, skip)



def hf_units(spec: str) -> list[dict[str, Any]]:
    """The work units of a streamed dataset: one per shard of its files."""
    ds = open_hf_stream(spec)
    return [{"kind": "hf", "spec": spec, "shard": i, "num_shards": ds.num_shards, "bytes": 0}
            for i in range(ds.num_shards)]


def hf_unit_documents(unit: dict[str, Any], text_field: str, skip: BadRecords | None) -> Iterator[str]:
    """The documents of one "hf" unit: a shard of the dataset, streamed."""
    spec, shard = unit["spec"], unit["shard"]
    ds = open_hf_stream(spec).shard(num_shards=unit["num_shards"], index=shard)
    yield from iter_hf_rows(ds, f"{spec} shard {shard}", text_field, skip)


def hf_identity(spec: str, h: Any, text_field: str, hash_contents: bool, by_text: bool) -> bool:
    """Add what identifies an hf: dataset to `h` without reading its rows; False when only its text can
    (`by_text`: a prefix under hash_contents, as for local files; or a loaded dataset without a fingerprint)."""
    name, config, split = parse_hf(spec)
    if (folder := hf_folder(spec)) is not None:  # read streamed: keyed like local files
        if by_text:
            return False
        h.update(f"hf-folder:{config}:{split}".encode())
        hash_files(h, folder_files(folder) if folder.is_dir() else [folder], folder, hash_contents)
        return True
    if (sha := hub_sha(name)) is not None:  # read streamed: the commit names the bytes
        h.update(f"hf-hub:{name}:{config}:{split}:{sha}".encode())
        return True
    fp = getattr(load_hf(spec, text_field), "_fingerprint", None)  # offline: the cached copy, loaded
    if fp:
        h.update(f"hf-fingerprint:{fp}".encode())
    return bool(fp)



def share_hub_commits(rank: int, world_size: int, device: torch.device) -> None:
    """Every rank of the default process group takes the hub commits rank 0 asked for: the same cache keys
    on every rank, and one request per run rather than one per rank. JSON bytes in a tensor (no pickle);
    a collective, so it is also every rank's wait for rank 0."""
    if world_size == 1:
        return
    # imported here: `tetron tokenize`'s worker processes import this module, and torch would cost each seconds
    import torch
    import torch.distributed as dist

    payload = json.dumps(asked_commits()).encode() if rank == 0 else b""
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buffer = torch.empty(int(size), dtype=torch.uint8, device=device)
    if rank == 0:
        buffer.copy_(torch.tensor(list(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    if rank != 0:
        remember_commits(json.loads(bytes(buffer.cpu().tolist())))
