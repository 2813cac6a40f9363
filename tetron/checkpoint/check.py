"""Checkpoints and model folders checked before any process starts, without reading their tensors: the
trainer state (its checksum, every listed file's size, the small files' sha256), the side files
(tokenizer, generation config), and every tensor the model needs with its shape from the safetensors
headers (load.py reads them); a problem is one CheckpointError naming the file. The tensors' bytes are
checked where they are read (each tensor's crc32, by load.TensorReader), and all of them on demand by
`tetron check` (verify_tensors, in parallel)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tetron.checkpoint.load import FLOAT_DTYPES, TensorReader
from tetron.checkpoint.save import ADAMW, ADAMW_STATE, FORMAT, model_specs, optimizer_specs, seal
from tetron.data.tokenizer import load_tokenizer
from tetron.errors import CheckpointError, DataError, check, failed
from tetron.fs import STATE_FILE, STEP_DIR, complete_checkpoints, read_json, sha256
from tetron.models.spec import config_from_hf, read_as_of, spec_of

# the family and the shapes: always the same (an MoE model's experts, their width, which layers have them)
MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                "num_experts", "moe_intermediate_size", "n_shared_experts", "decoder_sparse_step", "mlp_only_layers")
# what gives trained weights their meaning without changing a shape: the same unless
# checkpoint.new_model_settings (extending the context changes rope_theta or rope_scaling on purpose; an MoE
# model's routing: which experts a token goes to, and with what weights)
SETTING_FIELDS = ("rope_theta", "rope_scaling", "rope_local_base_freq", "rms_norm_eps", "query_pre_attn_scalar",
                  "scoring_func", "num_experts_per_tok", "norm_topk_prob", "n_group", "topk_group",
                  "routed_scaling_factor", "sliding_window", "layer_types", "attn_logit_softcapping",
                  "swiglu_alpha", "swiglu_limit")

_need = functools.partial(check, error=CheckpointError)
BLOCK = 16 << 20  # bytes read at a time by `tetron check`
CPU_RNG_SHAPE = tuple(torch.get_rng_state().shape)  # torch's CPU generator state: (5056,) bytes
CUDA_RNG_SHAPE = (16,)  # a CUDA generator's state: its seed and offset, 8 bytes each


def read_model_config(folder: Path) -> Any:
    path = Path(folder) / "config.json"
    raw = read_json(path)
    _need(isinstance(raw, dict), f"{path}: expected a JSON object")
    try:
        return config_from_hf(raw)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: {err}") from None


def compare_models(found: Any, want: Any, where: Path, *, settings: bool = True) -> None:
    """The same shapes, and with `settings` the same SETTING_FIELDS, or a CheckpointError naming the field."""
    for f in MODEL_FIELDS:  # (a field one family lacks is None on its side: model_type differs first)
        there, here = getattr(found, f, None), getattr(want, f, None)
        _need(there == here, f"{where}: model.{f}={there} there, but this run has model.{f}={here}; "
                             f"use the same model config")
    for f in SETTING_FIELDS if settings else ():
        there, here = getattr(found, f, None), getattr(want, f, None)
        _need(there == here,
              f"{where}: model.{f}={there} there, but this run has model.{f}={here}: "
              f"the weights were trained with the first; use it, or set checkpoint.new_model_settings=true")


def _check_trainer_state(folder: Path, *, verify_data: bool) -> dict[str, Any]:
    path = folder / STATE_FILE
    s = read_json(path)
    _need(isinstance(s, dict) and s.get("format") == FORMAT, f"{path}: not a {FORMAT} trainer state")
    _need(seal(s).get("checksum") == s.get("checksum"),
          f"{path}: its checksum does not match its content: edited or corrupted")
    _need(type(s.get("step")) is int and s["step"] >= 0, f"{path}: step must be a non-negative integer")
    named = STEP_DIR.match(folder.name)
    _need(not named or int(named.group(1)) == s["step"], f"{path}: step={s['step']} but the folder is {folder.name}")
    _need(type(s.get("tokens")) is int and s["tokens"] >= 0, f"{path}: tokens must be a non-negative integer")
    loader = s.get("loader")
    _need(loader is None or (isinstance(loader, dict) and all(type(loader.get(k)) is int for k in
          ("step", "seed", "global_batch", "seq_len", "num_tokens")) and loader["step"] == s["step"]
          and loader["global_batch"] >= 1 and loader["seq_len"] >= 1 and loader["num_tokens"] >= 0),
          f"{path}: loader must hold integer step (= {s['step']}), seed, global_batch (>= 1), seq_len (>= 1), "
          f"num_tokens (>= 0)")
    _need(s.get("config") is None or isinstance(s["config"], dict), f"{path}: config must be a mapping")
    layout = s.get("layout")
    _need(layout is None or (isinstance(layout, dict) and all(type(layout.get(k)) is int and layout[k] >= 1
          for k in ("dp", "tp", "pp", "cp", "pp_virtual", "world_size"))
          and layout["world_size"] == layout["dp"] * layout["tp"] * layout["pp"] * layout["cp"]),
          f"{path}: bad layout (integers dp, tp, pp, cp, pp_virtual >= 1, world_size = dp*tp*pp*cp)")
    opt = s.get("optimizer")
    # AdamW's bias correction divides by 1 - beta**step: a NaN, negative or fractional count turns every weight NaN
    _need(isinstance(opt, dict) and type(opt.get("present")) is bool and _is_count(opt.get("step"))
          and isinstance(opt.get("name", ""), str) and isinstance(opt.get("state", []), list)
          and all(isinstance(n, str) and re.fullmatch(r"\w+", n) for n in opt.get("state", [])),
          f"{path}: optimizer must be {{present: bool, step: a whole number >= 0, name: text, state: [names]}}, "
          f"not {opt!r:.200}")
    files = s.get("files")
    _need(isinstance(files, dict) and files, f"{path}: files must list every file with its size and checksums")
    for name, meta in files.items():
        f = folder / name
        _need(Path(name).name == name and name not in (".", ".."), f"{path}: bad file name {name!r}")
        crc32 = meta.get("crc32") if isinstance(meta, dict) else None
        _need(isinstance(meta, dict) and type(meta.get("size")) is int and (isinstance(meta.get("sha256"), str) or (
              isinstance(crc32, dict) and all(type(v) is int for v in crc32.values()))),
              f"{path}: bad entry for {name}")
        _need(f.is_file(), f"{f}: missing (listed in {STATE_FILE})")
        _need(f.stat().st_size == meta["size"],
              f"{f}: {f.stat().st_size} bytes, {STATE_FILE} says {meta['size']}: truncated or replaced")
        # the small files' sha256 only: tensor bytes are checked where they are read (a checkpoint written
        # before tensors had a crc32 lists a sha256 for its safetensors files too: `tetron check` reads them)
        small = "sha256" in meta and not name.endswith(".safetensors")
        _need(not verify_data or not small or sha256(f) == meta["sha256"],
              f"{f}: contents differ from the sha256 in {STATE_FILE}: corrupted")
    if layout is not None:
        _need("rng.safetensors" in files, f"{path}: rng.safetensors is not listed")
    return s


def _is_count(value: Any) -> bool:
    """A whole number >= 0, as an int or a finite float (JSON keeps a float count as 3.0)."""
    return (type(value) is int and value >= 0) or (
        type(value) is float and math.isfinite(value) and value >= 0 and value.is_integer())


def _check_rng(folder: Path, world_size: int) -> None:
    """Every rank's generator states: the sizes and values torch accepts (set_rng_state would crash a rank
    on anything else), read whole, so against their crc32 too (a few KiB a rank)."""
    path = folder / "rng.safetensors"
    with TensorReader(folder, "rng") as reader:
        for i in range(world_size):
            info = reader.info(f"rank_{i}")
            _need(info is not None and info == ("U8", CPU_RNG_SHAPE),
                  f"{path}: rank_{i} must be a U8 tensor of shape {list(CPU_RNG_SHAPE)} (a CPU generator's state), "
                  f"not {info}")
            try:
                torch.Generator().set_state(reader.read(f"rank_{i}"))
            except RuntimeError as err:
                raise CheckpointError(f"{path}: rank_{i} is not a CPU generator's state "
                                      f"({str(err).splitlines()[0]})") from None
            cuda = reader.info(f"cuda_rank_{i}")
            _need(cuda is None or cuda == ("U8", CUDA_RNG_SHAPE),
                  f"{path}: cuda_rank_{i} must be a U8 tensor of shape {list(CUDA_RNG_SHAPE)} (a CUDA generator's "
                  f"seed and offset), not {cuda}")


def _is_ids(value: Any) -> bool:
    return value is None or type(value) is int or (isinstance(value, list) and all(type(v) is int for v in value))


def _check_side_files(folder: Path) -> None:
    """The tokenizer a run may train with, and the ids generation stops at: readable and well typed."""
    if (folder / "tetron_tokenizer.json").is_file():
        try:
            load_tokenizer(str(folder), data_spec=None, cache_dir=folder)
        except DataError as err:
            raise CheckpointError(str(err)) from None
    generation = folder / "generation_config.json"
    if generation.is_file():
        g = read_json(generation)
        _need(isinstance(g, dict) and all(_is_ids(g.get(k)) for k in ("bos_token_id", "eos_token_id", "pad_token_id")),
              f"{generation}: bos/eos/pad_token_id must be integers, lists of integers or null")


def _weigh(config: Any, reader: TensorReader, where: Path) -> None:
    """config.json's layers against the layers the folder's tensors hold (their names in the safetensors
    headers), before the model is built even on the meta device: a config of far more layers than its weights
    (a num_hidden_layers of 10**6, whose meta model alone would take minutes and gigabytes) is refused at once.
    (Its other sizes cost nothing to build on the meta device: each tensor's shape is then checked.)"""
    prefix = spec_of(config).plan.layers + "."
    read_as = read_as_of(config)  # the layers kept under another prefix too (a multimodal folder's)
    prefixes = [prefix, *(other for other in (read_as(prefix) if read_as else []) if isinstance(other, str))]
    held = [int(i) for i in {name[len(p):].split(".", 1)[0] for name in reader.file_of for p in prefixes
                             if name.startswith(p)} if i.isdigit() and len(i) < 20]
    layers = max(held) + 1 if held else 0
    _need(config.num_hidden_layers <= layers,
          f"{where}: num_hidden_layers={config.num_hidden_layers}, and the folder's tensors hold {layers} layers "
          f"({prefix}N): the config is not the one its weights were saved with; use that one")


def inspect_checkpoint(folder: Path, model: Any = None, *, require_state: bool = True,
                       verify_data: bool = True, settings: bool = True) -> dict[str, Any] | None:
    """Check a checkpoint (or, with require_state=False, any HF model folder) without loading it: JSON,
    safetensors headers, every tensor the model needs with its shape, file sizes and hashes; and that its
    model equals `model` where given (its shapes, and with `settings` its rope and norm settings). Returns
    the trainer state (None for a plain HF folder). Writes nothing."""
    folder = Path(folder)
    _need(folder.is_dir(), f"{folder}: no such checkpoint folder")
    state = None
    if (folder / STATE_FILE).exists() or require_state:
        _need((folder / STATE_FILE).exists(), f"{folder / STATE_FILE}: missing (not a complete tetron checkpoint)")
        state = _check_trainer_state(folder, verify_data=verify_data)
    _check_side_files(folder)
    config = read_model_config(folder)
    if model is not None:
        compare_models(config, model, folder / "config.json", settings=settings)
    dtypes = {"F32"} if state is not None else FLOAT_DTYPES
    reader = TensorReader(folder, "model", read_as=read_as_of(config))
    _weigh(config, reader, folder / "config.json")
    for name, _, _, shape in model_specs(config, buffers=False):  # a buffer missing is left at its start value
        reader.check(name, shape, dtypes=dtypes)
    readers = [reader]
    if state is not None and state["optimizer"]["present"]:
        opt = TensorReader(folder, "optimizer")
        for name, _, _, shape in optimizer_specs(config, names=state["optimizer"].get("state", ADAMW_STATE),
                                                 optimizer=state["optimizer"].get("name", ADAMW)):
            opt.check(name, shape, dtypes={"F32"})
        readers.append(opt)
    for r in readers if state is not None else []:  # tetron writes the exact byte count of its tensors
        total = sum(math.prod(s) * 4 for f, h in r.headers.items() for n, (_, s) in h.items() if r.file_of.get(n) == f)
        _need(r.total_size in (None, total), f"{r.where}: total_size={r.total_size}, its tensors hold {total} bytes")
    if state is not None and state.get("layout") is not None:
        _check_rng(folder, state["layout"]["world_size"])
    return state


# --------------------------------------------------------------------------- every byte, on demand (tetron check)


def _data_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """{tensor: (first byte, end)} in the file, for a safetensors file whose header read_header accepted."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return {name: (8 + n + entry["data_offsets"][0], 8 + n + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def _crc32_of(path: Path, begin: int, end: int) -> int:
    """The crc32 of bytes [begin, end) of a file, read in blocks (both the read and the sum let other
    threads run)."""
    crc, fd = 0, os.open(path, os.O_RDONLY)
    try:
        for pos in range(begin, end, BLOCK):
            crc = zlib.crc32(os.pread(fd, min(BLOCK, end - pos), pos), crc)
    finally:
        os.close(fd)
    return crc


def _verify(folder: Path, name: str, tensor: str | None, want: int | str, span: tuple[int, int] | None) -> str | None:
    """One problem line for a tensor (or a small file, `tensor` None) whose bytes differ, else None."""
    path = folder / name
    if tensor is None:
        return None if sha256(path) == want else f"{path}: contents differ from the sha256 in {STATE_FILE}: corrupted"
    if span is None:
        return f"{path}: tensor {tensor} (listed in {STATE_FILE}) is missing"
    if _crc32_of(path, *span) != want:
        return f"{path}: tensor {tensor}: its bytes differ from the crc32 in {STATE_FILE}: corrupted"
    return None


def verify_tensors(folder: Path, *, files: dict[str, Any] | None = None, workers: int = 8) -> list[str]:
    """Every byte of a checkpoint (checked first with inspect_checkpoint) against its checksums: each
    tensor's crc32, each small file's sha256, read by `workers` threads. One line per problem, naming the
    file and the tensor; an empty list when all is whole. `files`: the entries of its trainer state's
    `files` to check (a copy of some of a checkpoint's files: that checkpoint's entries for them)."""
    files = read_json(folder / STATE_FILE)["files"] if files is None else files
    jobs: list[tuple[str, str | None, int | str, tuple[int, int] | None]] = []
    for name, meta in files.items():
        if "crc32" in meta:
            spans = _data_ranges(folder / name)
            jobs += [(name, tensor, crc, spans.get(tensor)) for tensor, crc in meta["crc32"].items()]
        else:
            jobs.append((name, None, meta["sha256"], None))
    jobs.sort(key=lambda job: -(job[3][1] - job[3][0]) if job[3] else 0)  # the largest first: the pool ends together
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = pool.map(lambda job: _verify(folder, *job), jobs)
        return sorted(line for line in found if line is not None)


def check_command(args: list[str]) -> int:
    """`tetron check RUN_OR_CHECKPOINT`: every checkpoint of a run folder (or the one given) checked as a
    resume checks it, then every byte against its checksums. Prints one line per problem; exit 1 if any."""
    if len(args) != 1 or args[0].startswith("-"):
        return failed("usage: tetron check RUN_OR_CHECKPOINT (a run folder: each of its checkpoints)")
    path = Path(args[0]).expanduser()
    folders = [path] if (path / STATE_FILE).is_file() else complete_checkpoints(path)
    if not folders:
        return failed(f"{path}: no checkpoint there (no {STATE_FILE}, no checkpoints/step_N)")
    bad = 0
    for folder in folders:
        try:
            inspect_checkpoint(folder, verify_data=False)
            problems = verify_tensors(folder)
        except CheckpointError as err:
            problems = [str(err)]
        for line in problems:
            print(line, flush=True)
        bad += len(problems)
        if not problems:
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            print(f"{folder}: ok ({size / 2**20:,.1f} MiB checked)", flush=True)
    return 1 if bad else 0
