"""Checkpoints, read: JSON and safetensors headers read defensively, then tensors loaded slice by slice,
each rank reading only the part of each tensor it holds (so any layout loads any checkpoint). What is
checked before any process starts, from the same readers, is in checkpoint_check.py.

The same reader takes Hugging Face model folders (`--init-from`: model.safetensors, or shards with an
index; tied models without lm_head.weight). Problems raise CheckpointError: one line naming the file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import shutil
import stat
import struct
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from tetron import device as dev
from tetron.checkpoint.safetensors_stream import DTYPES
from tetron.checkpoint.save import ADAMW
from tetron.checkpoint.shards import tensor_crc32
from tetron.data.hub import hub_problem
from tetron.errors import CheckpointError, ConfigError, check
from tetron.fs import STATE_FILE, read_json
from tetron.models.spec import assemble, config_from_hf, piece_names, read_as_of, spec_of
from tetron.parallel.init import name_seed
from tetron.parallel.layout import full_shape, layout_of
from tetron.parallel.zero import ShardedOptimizer

FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
# what travels with the weights when a folder is converted: the tokenizer, and when generation stops
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tetron_tokenizer.json", "special_tokens_map.json",
                   "generation_config.json")


_need = functools.partial(check, error=CheckpointError)


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a safetensors file, after checking that the header parses and its byte
    ranges tile the rest of the file exactly (so a truncated or padded file is caught here)."""
    try:
        info = path.stat()
        _need(stat.S_ISREG(info.st_mode), f"{path}: not a regular file")
        size = info.st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            _need(len(head) == 8, f"{path}: truncated (shorter than a safetensors header)")
            (n,) = struct.unpack("<Q", head)
            _need(n <= size - 8 and n <= 100 << 20, f"{path}: header length {n} is past the end of the file "
                                                    f"({size} bytes): truncated or corrupted")
            raw = fh.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON: corrupted") from None
    _need(isinstance(header, dict), f"{path}: the safetensors header is not a mapping: corrupted")
    out, ranges = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(entry, dict) and entry.get("dtype") in DTYPES and isinstance(entry.get("shape"), list)
              and all(type(d) is int and d >= 0 for d in entry["shape"]) and isinstance(entry.get("data_offsets"), list)
              and len(entry["data_offsets"]) == 2 and all(type(o) is int for o in entry["data_offsets"]))
        _need(ok, f"{path}: bad header entry for tensor {name!r}: corrupted")
        begin, end = entry["data_offsets"]
        nbytes = math.prod(entry["shape"]) * torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()
        _need(end - begin == nbytes,
              f"{path}: tensor {name} has {end - begin} bytes for shape {entry['shape']}: corrupted")
        ranges.append((begin, end))
        out[name] = (entry["dtype"], tuple(entry["shape"]))
    pos = 0
    for begin, end in sorted(ranges):
        _need(begin == pos, f"{path}: tensor byte ranges overlap or leave gaps: corrupted")
        pos = end
    data = size - 8 - n
    _need(pos <= data, f"{path}: truncated ({data} bytes of tensor data, the header needs {pos})")
    _need(pos == data, f"{path}: {data - pos} bytes after the last tensor: corrupted")
    return out


def tensor_checksums(folder: Path) -> dict[str, dict[str, int]]:
    """{file: {tensor: crc32}} from a checkpoint's trainer_state.json ({} for a plain model folder, or a
    checkpoint written before tensors had checksums)."""
    if not (Path(folder) / STATE_FILE).is_file():
        return {}
    files = read_json(Path(folder) / STATE_FILE).get("files")
    return {name: meta["crc32"] for name, meta in (files.items() if isinstance(files, dict) else [])
            if isinstance(meta, dict) and isinstance(meta.get("crc32"), dict)}


class TensorReader:
    """Tensors of `{prefix}.safetensors` or `{prefix}-*.safetensors` + `{prefix}.safetensors.index.json`
    in `folder`, read whole or one slice at a time; every header is checked on opening. Every tensor read,
    whole or in part, is checked against its crc32 in the checkpoint's trainer_state.json, where one is
    listed (a slice's tensor once, all of its bytes)."""

    def __init__(self, folder: Path, prefix: str = "model", *,
                 read_as: Callable[[str], list[str | list[list[str]]]] | None = None) -> None:
        self.folder = Path(folder)
        self.read_as = read_as  # a family's other names for a tensor, in order (models.spec.read_as_of)
        index, single = self.folder / f"{prefix}.safetensors.index.json", self.folder / f"{prefix}.safetensors"
        if index.exists():
            data = read_json(index)
            wmap = data.get("weight_map") if isinstance(data, dict) else None
            _need(isinstance(wmap, dict) and all(isinstance(v, str) for v in wmap.values()),
                  f"{index}: no weight_map of tensor name to file")
            meta = data.get("metadata", {})
            _need(isinstance(meta, dict) and type(meta.get("total_size", 0)) in (int, float),
                  f"{index}: metadata must be a mapping with a numeric total_size")
            self.total_size = meta.get("total_size")
            for f in set(wmap.values()):  # plain file names only: an index must not point outside the folder
                _need(f and Path(f).name == f and f not in (".", ".."), f"{index}: bad file name {f!r}")
            self.where = index
        elif single.exists():
            wmap, self.where = None, single
        else:
            raise CheckpointError(f"{self.folder}: no {single.name} or {index.name}")
        if wmap is None:
            self.total_size = None
        files = sorted(set(wmap.values())) if wmap is not None else [single.name]
        self.headers = {f: read_header(self.folder / f) for f in files}
        self.file_of: dict[str, str] = {}
        for f, header in self.headers.items():
            for name in header:
                if wmap is None or wmap.get(name) == f:
                    self.file_of[name] = f
        for name, f in (wmap or {}).items():
            _need(name in self.headers[f], f"{self.folder / f}: tensor {name} (listed in {index.name}) is missing")
        self.crc32 = tensor_checksums(self.folder)
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}
        self._verified: set[tuple[str, str]] = set()  # (file, tensor) whose bytes were checked whole

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self.file_of)

    def _stored(self, name: str) -> str | list[list[str]] | None:
        """The other names `name` is stored under here, when it is not stored as named and they all are."""
        if name in self.file_of or self.read_as is None:
            return None
        return next((stored for stored in self.read_as(name) if all(n in self.file_of for n in piece_names(stored))),
                    None)

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        f = self.file_of.get(name)
        if f is not None:
            return self.headers[f][name]
        stored = self._stored(name)
        if stored is None or isinstance(stored, str):
            return None if stored is None else self.info(stored)
        dtype, shape = self.info(stored[0][0])
        return dtype, (len(stored), sum(self.info(n)[1][0] for n in stored[0]), *shape[1:])

    def check(self, name: str, shape: tuple[int, ...], *, dtypes: set[str]) -> None:
        """Tensor `name` is there with `shape` and one of `dtypes`; a tensor kept in pieces (the hub's experts
        one by one), every piece: each row's pieces split the row's first dim equally, the rest as `shape`."""
        stored = self._stored(name)
        if stored is not None and not isinstance(stored, str):
            _need(len(stored) == shape[0] and len(shape) >= 2,
                  f"{self.where}: tensor {name} is kept in {len(stored)} pieces, the model needs {list(shape)}")
            for row in stored:
                _need(shape[1] % len(row) == 0, f"{self.where}: tensor {name}: {len(row)} pieces cannot split "
                                                f"{shape[1]} rows equally")
                for piece in row:
                    self._check_one(piece, (shape[1] // len(row), *shape[2:]), dtypes=dtypes, part_of=name)
            return
        self._check_one(stored or name, shape, dtypes=dtypes, part_of=name if stored else None)

    def _check_one(self, name: str, shape: tuple[int, ...], *, dtypes: set[str], part_of: str | None) -> None:
        info = self.info(name)
        _need(info is not None, f"{self.where}: tensor {name} is missing")
        where = self.folder / self.file_of[name] if name in self.file_of else self.where
        what = f"tensor {name}" + (f" (a piece of {part_of})" if part_of else "")
        _need(info[1] == tuple(shape), f"{where}: {what} has shape {list(info[1])}, the model needs {list(shape)}")
        _need(info[0] in dtypes, f"{where}: {what} has dtype {info[0]}, expected one of {sorted(dtypes)}")

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> Tensor:
        """The whole tensor, or rows [start, stop) along `dim`, as stored (its own dtype)."""
        stored = self._stored(name)
        if stored is not None:  # assembled whole from its pieces, then cut
            if dim == 0 and not isinstance(stored, str):  # an expert shard: only its experts' pieces
                return assemble(stored[start:stop], self.read)
            whole = assemble(stored, self.read)
            return whole if dim is None else whole.narrow(dim, start, stop - start)
        f = self.file_of.get(name)
        _need(f is not None, f"{self.where}: tensor {name} is missing")
        try:
            if f not in self._handles:
                self._handles[f] = self._stack.enter_context(safe_open(str(self.folder / f), framework="pt"))
            piece = self._handles[f].get_slice(name)
            index = [slice(None)] * len(self.headers[f][name][1])
            if dim is not None:
                index[dim] = slice(start, stop)
            tensor = piece[tuple(index)] if index else self._handles[f].get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:  # safetensors' own errors: the file changed or is damaged
            raise CheckpointError(f"{self.folder / f}: cannot read tensor {name} ({err})") from None
        expected = self.crc32.get(f, {}).get(name)
        if expected is not None and (f, name) not in self._verified:
            # a slice cannot be checked alone: its whole tensor is (mapped from the file, not copied), once
            whole = tensor if dim is None else self._handles[f].get_tensor(name)
            ok = tensor_crc32(whole) == expected
            self._verified.add((f, name))
        else:
            ok = True
        _need(ok, f"{self.folder / f}: tensor {name}: its bytes differ from the crc32 in {STATE_FILE}: corrupted")
        return tensor


def load_model(folder: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A plain model of its family from a HF model folder (config.json + model.safetensors, or shards + index), its
    weights in `dtype` whatever the folder stores (fp32 by default: bf16 matmuls are slow on CPUs)."""
    folder = Path(folder)
    config = config_from_hf(folder)
    spec = spec_of(config)
    with torch.device("meta"):
        model = spec.model_class(config)
    tied_head = spec.plan.tied_head(config)
    expected = {k for k in model.state_dict() if k != tied_head}
    read_as = read_as_of(config)
    if (folder / "model.safetensors").is_file():
        state = load_file(folder / "model.safetensors", device=str(device))
        where = folder / "model.safetensors"
        for key in sorted(expected - set(state)) if read_as else []:  # kept under other names (the hub's)
            stored = next((s for s in read_as(key) if all(n in state for n in piece_names(s))), None)
            if stored:
                state[key] = assemble(stored, state.__getitem__)
                for n in piece_names(stored):
                    del state[n]
    else:
        with TensorReader(folder, "model", read_as=read_as) as reader:
            state = {k: reader.read(k).to(device) for k in expected if reader.info(k) is not None}
        where = folder / "model.safetensors.index.json"
    state.pop(tied_head, None)
    unread = spec.unread(config) if callable(spec.unread) else spec.unread
    state = {k: v.to(dtype) for k, v in state.items() if not (unread and k.startswith(unread))}
    optional = {name for name, _ in model.named_buffers()}  # a folder without a routing bias starts it at 0
    missing, unexpected = expected - set(state) - optional, set(state) - expected
    if missing or unexpected:
        name = sorted(missing or unexpected)[0]
        what = "missing" if missing else "unexpected"
        raise ValueError(f"{where}: {what} tensor {name} for this config.json")
    for name, buffer in model.named_buffers():
        state.setdefault(name, torch.zeros(buffer.shape, dtype=dtype, device=device))
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


# --------------------------------------------------------------------------- loading, slice by slice


def _read_local(reader: TensorReader, key: str, param: nn.Parameter) -> Tensor:
    """This rank's part of tensor `key` for `param`, in fp32: its slice along the tp dim, vocab padding as zeros,
    or its experts."""
    reader.check(key, full_shape(param), dtypes=FLOAT_DTYPES)
    shard = layout_of(param).tp or layout_of(param).ep  # an expert shard: its experts (never both)
    if shard is None:
        return reader.read(key).to(torch.float32)
    dim, index = shard.dim, shard.index
    local = param.shape[dim]
    logical = full_shape(param)[dim]
    start, stop = min(index * local, logical), min((index + 1) * local, logical)
    part = reader.read(key, dim, start, stop).to(torch.float32)
    if stop - start < local:  # padded vocabulary rows start at zero, as at init
        pad = [0, 0] * (param.dim() - 1 - dim) + [0, local - (stop - start)]
        part = torch.nn.functional.pad(part, pad)
    return part


def _source_name(name: str, param: nn.Parameter, reader: TensorReader, chunk: nn.Module) -> str:
    """The stored tensor of `param`: its layout's `source` for a pipeline's tied head copy; the embedding
    for a tied head that the folder leaves out (as transformers does)."""
    src = layout_of(param).source or name
    plan = spec_of(chunk.config).plan
    if src == plan.head_weight and reader.info(src) is None:
        return plan.embedding_weight
    return src


@torch.no_grad()
def load_weights(chunks: list[nn.Module], folder: Path, optimizer: ShardedOptimizer) -> None:
    """Fill this rank's parameters, and the optimizer's fp32 master weights, from a checkpoint or HF
    model folder, reading only this rank's slices."""
    with TensorReader(folder, "model", read_as=read_as_of(chunks[0].config)) as reader:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                weights = _read_local(reader, _source_name(name, param, reader, chunk), param)
                if optimizer.sharding is None:  # under ZeRO-3 only the slices exist, which load fills
                    param.copy_(weights)
                optimizer.load(param, master=weights)
            for name, buffer in chunk.named_buffers():  # an MoE routing bias; a folder without it starts it at 0
                if reader.info(name) is not None:
                    reader.check(name, tuple(buffer.shape), dtypes=FLOAT_DTYPES)
                    buffer.copy_(reader.read(name))


@torch.no_grad()
def load_optimizer(optimizer: ShardedOptimizer, chunks: list[nn.Module], folder: Path, *, step: float) -> None:
    """The optimizer's state tensors (every name it declares) for this rank's parameters (their slices, and its
    ZeRO pieces of those), and its step count."""
    with TensorReader(folder, "model") as model_reader, TensorReader(folder, "optimizer") as reader:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                src = _source_name(name, param, model_reader, chunk)
                optimizer.load(param, state={kind: _read_local(reader, f"{src}.{kind}", param)
                                             for kind in optimizer.state_names_of(param)}, step=step)


def saved_optimizer(state: dict[str, Any]) -> str:
    """The optimizer a checkpoint's trainer state was written by (adamw where it names none: written before
    optimizers were named)."""
    return state["optimizer"].get("name", ADAMW)


def optimizer_problem(state: dict[str, Any], cfg: Any, folder: Path) -> str | None:
    """Why resuming from `folder` with cfg.optim.name cannot take its optimizer state, or None (also where it holds
    none: a converted folder, or one saved before the first step)."""
    saved, mine = saved_optimizer(state), cfg.optim.name
    if saved == mine or cfg.checkpoint.new_optimizer or not state["optimizer"]["present"]:
        return None
    return (f"optim.name={mine}: {folder} holds the state of optim.name={saved}; use optim.name={saved} to continue "
            f"it, or --checkpoint.new_optimizer to take its weights and start {mine}'s state fresh")


def same_layout(state: dict[str, Any], cfg: Any) -> bool:
    layout, p = state.get("layout"), cfg.parallel
    return layout is not None and all(layout[k] == getattr(p, k) for k in ("dp", "tp", "pp", "cp", "pp_virtual"))


def load_checkpoint(folder: Path, *, chunks: list[nn.Module], optimizer: ShardedOptimizer, loader: Any,
                    mesh: Any, cfg: Any) -> dict[str, Any]:
    """Resume from a checkpoint folder on every rank: weights, optimizer, loader position and RNG. The optimizer's
    state only where the checkpoint's optimizer is this run's and checkpoint.new_optimizer does not ask for a fresh
    one (another optimizer without it is refused; validate.py refuses it before start).

    RNG: with the same layout each rank gets back its own generator state; with another, the states
    cannot correspond, so each rank is reseeded from (seed, step, rank), deterministically."""
    state = read_json(Path(folder) / STATE_FILE)
    problem = optimizer_problem(state, cfg, Path(folder))
    if problem is not None:
        raise ConfigError(problem)
    load_weights(chunks, folder, optimizer)
    if state["optimizer"]["present"] and not cfg.checkpoint.new_optimizer:
        load_optimizer(optimizer, chunks, folder, step=state["optimizer"]["step"])
    if state["loader"] is not None:
        loader.load_state_dict(state["loader"])
    else:
        loader.step = state["step"]
    if same_layout(state, cfg):
        with TensorReader(folder, "rng") as reader:
            torch.set_rng_state(reader.read(f"rank_{mesh.rank}"))
            device = next(chunks[0].parameters()).device
            if device.type == "cuda" and reader.info(f"cuda_rank_{mesh.rank}") is not None:
                dev.set_rng_state(device, reader.read(f"cuda_rank_{mesh.rank}"))
    else:
        torch.manual_seed(name_seed(cfg.train.seed, f"resume:{state['step']}:{mesh.rank}"))
    dist.barrier()
    return state


def resolve_init_from(spec: str) -> Path:
    """A local HF model folder, or a hub name downloaded (cached) with huggingface_hub."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    problem = hub_problem(spec, "model")
    if problem is not None:  # refused at once, not after a minute of retries
        raise CheckpointError(f"checkpoint.init_from={spec}: {problem}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
    except Exception as err:  # offline, unknown repo, no access: all one message
        raise CheckpointError(f"checkpoint.init_from={spec}: not a local folder and not downloadable "
                              f"from the Hugging Face hub ({type(err).__name__})") from None


def inside(src: Path, name: str) -> Path:
    """`src / name`, where it is a file whose real path stays in `src` (or, for a Hugging Face hub cache's
    snapshot, whose links point into that repository's blobs/), else a CheckpointError: a downloaded folder
    must not make a copy of it carry any other file of this machine."""
    path = Path(src) / name
    real, root = path.resolve(), Path(src).resolve()
    roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    _need(any(real.is_relative_to(r) for r in roots),
          f"{path}: a link to {real}, outside {src}; copy that file into the folder (or remove the link)")
    return path


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer's and generation's side files of `src` that exist, copied into `dst` (never through a
    link out of `src`)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(inside(src, name), dst / name)
