"""`tetron convert SRC DST`: a tetron checkpoint to a standalone Hugging Face folder, and back.

Checkpoint -> HF: the weights are streamed, one tensor at a time, into the model files of a HF folder (each
tensor checked against its crc32 as it is read; MoE experts one by one, as the hub keeps them, also from a
checkpoint written before tetron stored them so), beside the checkpoint's config.json and tokenizer files
(a tetron tokenizer saved again, so that transformers reads it to tetron's ids). No file is read or copied
through a link that leaves the source folder.
HF -> checkpoint: the weights are streamed into a step-0 checkpoint with no optimizer state, which
`--resume` accepts (the optimizer then starts fresh).
DST is written under a temporary name and renamed; an existing DST is never touched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

from tetron.checkpoint.check import inspect_checkpoint, read_model_config
from tetron.checkpoint.load import TensorReader, copy_tokenizer, inside
from tetron.checkpoint.save import FORMAT, checkpoint_bytes, model_specs, seal, storage_error, write_tensors
from tetron.data.tokenizer import load_tokenizer
from tetron.errors import CheckpointError
from tetron.fs import STATE_FILE, replace_folder, sha256, write_json
from tetron.models.spec import read_as_of, stored_as_of


def _tmp_for(dst: Path) -> Path:
    if dst.exists() or dst.is_symlink():
        raise CheckpointError(f"{dst}: already exists; give a new folder (nothing is overwritten)")
    parent = dst.parent if str(dst.parent) else Path(".")
    if not (parent.is_dir() and os.access(parent, os.W_OK)):
        raise CheckpointError(f"{dst}: cannot create it ({parent} is not a writable folder)")
    tmp = parent / f".{dst.name}.tmp-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
    except OSError as err:  # a read-only file system, or a folder only root's access check let through
        raise storage_error(err, parent, what=str(dst), needed=None) from None
    return tmp


def _written(tmp: Path, dst: Path, write: Callable[[], None], *, needed: int) -> None:
    """Run `write` (which fills `tmp`), then put `tmp` at `dst`; on any failure remove `tmp`, and a failed
    write (a full disk) is one line naming the folder and the space it needs."""
    try:
        write()
        _finish(tmp, dst)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        error = storage_error(err, dst.parent if str(dst.parent) else Path("."), what=str(dst), needed=needed)
        if error is None:
            raise
        raise error from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _finish(tmp: Path, dst: Path) -> None:
    try:
        replace_folder(tmp, dst, overwrite=False)
    except FileExistsError:
        raise CheckpointError(f"{dst}: already exists; give a new folder (nothing is overwritten)") from None


def _stream_model(src: Path, dst: Path, config: Any, *, shard_mb: int) -> dict[str, dict[str, int]]:
    """The model tensors of folder `src` (either layout) written into `dst` in fp32, one at a time, in the
    family's layout (model.safetensors.index.json and shards); returns each file's tensors' crc32."""
    specs, layout = model_specs(config), stored_as_of(config)
    with TensorReader(src, "model", read_as=read_as_of(config)) as reader:
        stream = ((key, reader.read(key).to(dtype)) for key, _, dtype, _ in specs)
        return write_tensors(dst, "model", specs, stream, shard_bytes=shard_mb << 20, layout=layout)


def convert(src: Path, dst: Path, *, shard_mb: int = 2000) -> str:
    """Convert `src` (checkpoint or HF folder) into `dst`; returns what was done, in words."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such folder (give a tetron checkpoint or a Hugging Face model folder)")
    if (src / STATE_FILE).exists():
        inspect_checkpoint(src)
        config = read_model_config(src)

        def copy() -> None:
            _stream_model(src, tmp, config, shard_mb=shard_mb)
            shutil.copyfile(inside(src, "config.json"), tmp / "config.json")
            copy_tokenizer(src, tmp)
            if (src / "tetron_tokenizer.json").is_file():  # saved again: an older checkpoint's lack files for
                # transformers (the bytes tokenizer's tokenizer.json, the padding token)
                tokenizer = load_tokenizer(str(src), data_spec=None, cache_dir=src)
                tokenizer.save(tmp, model_type=config.model_type, model_max_length=config.max_position_embeddings)

        tmp = _tmp_for(dst)
        _written(tmp, dst, copy, needed=checkpoint_bytes(config, optimizer=False))
        return f"wrote the Hugging Face model folder {dst}"
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src}: neither a tetron checkpoint ({STATE_FILE}) "
                              f"nor a Hugging Face folder (config.json)")
    inspect_checkpoint(src, require_state=False)
    config = read_model_config(src)

    def write() -> None:
        crc32 = _stream_model(src, tmp, config, shard_mb=shard_mb)
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
        copy_tokenizer(src, tmp)
        files = {f.name: ({"size": f.stat().st_size, "writer": 0, "crc32": crc32[f.name]} if f.name in crc32
                          else {"size": f.stat().st_size, "sha256": sha256(f)}) for f in sorted(tmp.iterdir())}
        write_json(tmp / STATE_FILE, seal({"format": FORMAT, "step": 0, "tokens": 0, "loader": None, "config": None,
                                      "layout": None, "optimizer": {"present": False, "step": 0.0},
                                      "files": files, "converted_from": str(src)}))

    tmp = _tmp_for(dst)
    _written(tmp, dst, write, needed=checkpoint_bytes(config, optimizer=False))
    return f"wrote the tetron checkpoint {dst} (step 0, no optimizer state: resuming starts AdamW fresh)"
