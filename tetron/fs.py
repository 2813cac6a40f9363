"""Writing files so that a kill at any moment leaves either the old or the new version, never half of one.

Everything tetron writes that another run may read (checkpoints, model folders, token caches,
tokenizers, logs moved aside) goes through these: write under a temporary name in the same folder,
sync, rename over the final name, sync the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path, tag: str = "") -> Path:
    """A sibling of `path` no other writer uses: `{name}.tmp-{tag}{random}`."""
    return path.with_name(f"{path.name}.tmp-{tag}{secrets.token_hex(4)}")


def write_text(path: Path, text: str) -> None:
    """`text` written to a temporary name, synced, then renamed over `path`."""
    tmp = temp_name(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, obj: Any, *, indent: int = 1) -> None:
    """JSON written atomically (see write_text)."""
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def replace_folder(tmp: Path, folder: Path, *, overwrite: bool = True) -> None:
    """Sync every file of the complete folder `tmp`, then put it at `folder`.

    An existing `folder` is first renamed to `{folder}.tmp-old-*` and removed once the new one is in
    place (a kill between the two renames leaves that copy, which checkpoint.clean_stale restores).
    With `overwrite=False` an existing `folder` is an error and nothing is touched."""
    for f in tmp.iterdir():
        if f.is_file():
            fsync_file(f)
    fsync_dir(tmp)
    old = None
    if folder.exists():
        if not overwrite:
            raise FileExistsError(f"{folder}: already exists")
        old = temp_name(folder, "old-")
        folder.rename(old)
    tmp.rename(folder)
    fsync_dir(folder.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover_temps(parent: Path, name: str | None = None) -> None:
    """Clear what writers killed mid-way left in `parent` (only the temporaries of `name`, if given):
    a `.tmp-old-*` folder whose final name is free is the previous version that replace_folder had
    moved aside, the only copy left, so it goes back; every other temporary is removed."""
    for p in parent.iterdir() if parent.is_dir() else []:
        if ".tmp-" not in p.name or (name is not None and not p.name.startswith(f"{name}.tmp-")):
            continue
        final = parent / p.name.split(".tmp-")[0]
        if ".tmp-old-" in p.name and p.is_dir() and not final.exists():
            p.rename(final)
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
