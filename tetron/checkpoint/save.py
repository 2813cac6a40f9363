"""Checkpoints, written: the model as a Hugging Face model folder, optimizer state beside it, trainer state.

    OUT/checkpoints/step_N/
        config.json, model-XXXXX-of-YYYYY.safetensors, model.safetensors.index.json   (transformers loads this)
        optimizer-XXXXX-of-YYYYY.safetensors, optimizer.safetensors.index.json   ("{name}.{state}" for each state
                                                                                   tensor the optimizer declares:
                                                                                   AdamW's exp_avg, exp_avg_sq)
        rng.safetensors ("rank_{i}": every rank's CPU generator state), tokenizer files
        trainer_state.json   (step, tokens, loader position, config, layout; the optimizer's name and state
                              names; every file's size and who wrote it, each tensor's crc32, each small
                              file's sha256; written last)
    OUT/checkpoints/latest   ("step_N", replaced after the folder is complete)

Every rank writes its share: each tensor is gathered whole on its pipeline stage and written by one rank
of that stage into shards of its own (shards.py says who and why). Rank 0 then writes the indexes, the
small files and trainer_state.json last. The folder is written as `step_N.tmp-<random>`, synced, renamed;
`latest` is updated last, so a run killed at any moment leaves the previous checkpoint whole. With
checkpoint.async_save the same writing runs on a background thread from a copy of the state
(background.py). No pickle: safetensors and JSON only, nothing here can run code when read. Reading is in
load.py, checking before start-up in check.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from tetron import device as dev
from tetron.checkpoint.background import BackgroundSaver, saver_of, wait_for_save  # noqa: F401  (its callers')
from tetron.checkpoint.safetensors_stream import SafetensorsWriter  # noqa: F401  (tests slow or fail its writes)
from tetron.checkpoint.shards import (
    Comm,
    Layout,
    Pieces,
    Shard,
    ShardWriter,
    Spec,
    choose_writers,
    file_keys,
    full_tensor,
    gather_rng,
    gather_to_writers,
    nbytes,
    plan_files,
    send_line,
    stage_of,
)
from tetron.data.tokenizer import Tokenizer
from tetron.errors import StorageError
from tetron.fs import (
    STATE_FILE,
    checkpoints_dir,
    complete_checkpoints,
    find_latest,
    fsync_dir,
    recover_temps,
    replace_folder,
    sha256,
    temp_name,
    write_failure,
    write_json,
    write_text,
)
from tetron.mesh import Mesh
from tetron.models.spec import spec_of, split_stored, stored_as_of
from tetron.optim import OPTIMIZERS, Role
from tetron.parallel.parallelize import param_roles
from tetron.parallel.zero import ShardedOptimizer

FORMAT = "tetron-checkpoint/1"
# A checkpoint's optimizer where its trainer state names none (written before optimizers were named), and its state
ADAMW, ADAMW_STATE = "adamw", ("exp_avg", "exp_avg_sq")


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """The trainer state with a checksum of its own content, so an edit anywhere in it is caught."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return {**body, "checksum": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


# --------------------------------------------------------------------------- whole model folders


def write_configs(folder: Path, config: Any, tokenizer: Tokenizer | None, *, dtype: str = "float32") -> None:
    """config.json, generation_config.json and the tokenizer's files of a model folder being written.
    The end-of-text id comes from the tokenizer where the model config has none, so that generation
    (tetron's and transformers') stops at the end of a document; padding uses it too (the bytes tokenizer,
    which has none, pads with a byte no text has)."""
    hf = config.to_hf(dtype=dtype)
    if hf["eos_token_id"] is None and tokenizer is not None:
        hf["eos_token_id"] = tokenizer.eos_id
    eos = hf["eos_token_id"]
    hf["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    if hf["pad_token_id"] is None and tokenizer is not None:
        hf["pad_token_id"] = tokenizer.pad_id
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": eos, "pad_token_id": hf["pad_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(folder, model_type=config.model_type, model_max_length=config.max_position_embeddings)


def save_model(model: nn.Module, folder: Path, *, tokenizer: Tokenizer | None = None) -> None:
    """Write a whole, plain model as a HF model folder at `folder`, replacing any old one."""
    save_state(model.state_dict(), model.config, folder, tokenizer=tokenizer)


def save_state(state: dict[str, Tensor], config: Any, folder: Path, *,
               tokenizer: Tokenizer | None = None) -> None:
    """Write full tensors named as in transformers' class of the family as a HF model folder (MoE experts one
    by one, as the hub keeps them), atomically."""
    folder = Path(folder)
    recover_temps(folder.parent, folder.name)  # what an earlier save killed mid-way left
    tmp = temp_name(folder)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    state.pop(spec_of(config).plan.tied_head(config), None)  # the embedding's tensor; HF ties it back on load
    layout = stored_as_of(config)
    state = {name: piece.clone() for key, value in state.items()  # clone: save_file refuses views of one tensor
             for name, piece in split_stored((layout(key) if layout else None) or key, value)}
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    write_configs(tmp, config, tokenizer)
    replace_folder(tmp, folder)


# --------------------------------------------------------------------------- tensors and their writers


@torch.no_grad()
def gather_full_state(model: nn.Module, tp_group: dist.ProcessGroup,
                      ep_group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """The whole tensors of a tensor- or expert-parallel model (every tp and ep rank gets them); for tests and
    small models."""
    return {name: full_tensor(p.detach(), p, tp_group, ep_group).cpu()
            for name, p in model.named_parameters(remove_duplicate=False)}


_META_MODELS: dict[tuple[type, str], nn.Module] = {}


def meta_model(config: Any) -> nn.Module:
    """The whole model on the meta device (names and full shapes, no storage), built once per config: a save
    asks for it three times, and building SmolLM-135M's takes 0.05 s. Read, never changed."""
    key = (type(config), repr(config))  # a config is a dataclass: its repr names every field
    if key not in _META_MODELS:
        with torch.device("meta"):
            whole = spec_of(config).model_class(config)
        _META_MODELS.clear()  # the last config only: a run saves one model
        _META_MODELS[key] = whole
    return _META_MODELS[key]


def model_specs(config: Any, dtype: torch.dtype = torch.float32, *, buffers: bool = True) -> list[Spec]:
    """Every tensor of the HF model folder in the plain model's order, then (with `buffers`) the state that
    is no parameter (an MoE routing bias); a tied head is not stored. Named as the model's parameters: the
    family's layout (stored_as_of) says which are written in pieces."""
    spec = spec_of(config)
    whole = meta_model(config)
    tied_head = spec.plan.tied_head(config)
    stored = whole.state_dict().keys()  # the persistent buffers among them
    return [(name, name, dtype, tuple(p.shape)) for name, p in whole.named_parameters(remove_duplicate=False)
            if name != tied_head] + [(name, name, dtype, tuple(b.shape)) for name, b in whole.named_buffers()
                                     if buffers and name in stored]


def optimizer_specs(config: Any, params: list[Spec] | None = None, *,
                    names: tuple[str, ...] | list[str] = ADAMW_STATE, optimizer: str = ADAMW) -> list[Spec]:
    """The optimizer's state tensors `names` of every stored parameter, full (unpadded) shapes, fp32 (`params`:
    model_specs' answer without buffers, where already known: each builds the model on the meta device). A known
    `optimizer` keeps only its role's names per parameter (Muon: momentum_buffer of a matrix, exp_avg and
    exp_avg_sq of the rest); an unknown one every name of every parameter."""
    kind = OPTIMIZERS.get(optimizer)
    roles = stored_roles(config) if kind is not None else {}
    return [(f"{name}.{state}", name, torch.float32, shape) for name, _, _, shape in
            params or model_specs(config, buffers=False) for state in names
            if kind is None or state in kind.state_names(roles[name])]


def stored_roles(config: Any) -> dict[str, Role]:
    """Each stored parameter's role for the optimizer (parallelize.param_roles on the whole model), by name."""
    whole = meta_model(config)
    roles = param_roles([whole])
    return {name: roles[id(p)] for name, p in whole.named_parameters()}


def write_index(folder: Path, prefix: str, shards: list[Shard], *, layout: Layout | None = None) -> None:
    """`{prefix}.safetensors.index.json`: every tensor's file (each piece's, under `layout`), as transformers
    reads it."""
    weight_map = {key: shard.file for shard in shards for key in file_keys(shard.specs, layout)}
    total = sum(nbytes(spec) for shard in shards for spec in shard.specs)
    write_json(folder / f"{prefix}.safetensors.index.json",
               {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_tensors(folder: Path, prefix: str, specs: list[Spec], stream: Iterator[tuple[str, Tensor]], *,
                  shard_bytes: int, single_file: bool = False,
                  layout: Layout | None = None) -> dict[str, dict[str, int]]:
    """All of `stream` (whole tensors in spec order) written by this one process: the shards and, unless
    one `{prefix}.safetensors` (`single_file`), the index; under `layout` a tensor kept in pieces as its
    pieces. Returns each file's tensors' crc32."""
    shards = plan_files(prefix, specs, [0] * len(specs), shard_bytes, single_file=single_file)
    writer = ShardWriter(folder, shards, 0, layout=layout)
    writer.consume(stream)
    if writer.error is not None:
        raise writer.error
    if len(shards) > 1 or not single_file:
        write_index(folder, prefix, shards, layout=layout)
    return {shard.file: {key: writer.crc32[key] for key in file_keys(shard.specs, layout)} for shard in shards}


def write_model_folder(folder: Path, chunks: list[nn.Module], mesh: Mesh, *, config: Any,
                       weights: Callable[[nn.Parameter], Tensor], dtype: torch.dtype, layer_ranks: list[int],
                       tokenizer: Tokenizer | None, shard_mb: int) -> None:
    """OUT/model: the model as a HF folder in `dtype` (model.safetensors when it fits one shard), replaced
    atomically. `weights(param)` is this rank's fp32 part of a parameter (its master weights). Every
    rank calls this; rank 0 writes (one file, as transformers writes a small model)."""
    tmp = None
    try:
        if mesh.rank == 0:
            recover_temps(folder.parent, folder.name)  # what an earlier save killed mid-way left
            tmp = temp_name(folder)
            tmp.mkdir(parents=True)
        specs = model_specs(config, dtype)
        stream = gather_to_writers(chunks, mesh, specs, [0] * len(specs), layer_ranks=layer_ranks,
                                   buffers={name: b for chunk in chunks for name, b in chunk.named_buffers()},
                                   local=lambda p, k, dst, me: weights(p).to(dtype), tp_group=mesh.group("tp"),
                                   ep_group=mesh.group("ep"))
        if tmp is None:
            for _ in stream:  # the gathers this rank takes part in; rank 0 writes
                pass
        else:
            write_tensors(tmp, "model", specs, stream, shard_bytes=shard_mb << 20, single_file=True,
                          layout=stored_as_of(config))
            write_configs(tmp, config, tokenizer, dtype=str(dtype).removeprefix("torch."))
            replace_folder(tmp, folder)
    except Exception as err:  # one line naming the file; the checkpoint just saved holds the same weights
        if mesh.rank != 0:
            raise
        needed = sum(torch.Size(shape).numel() for *_, shape in specs) * dtype.itemsize
        error = storage_error(err, tmp or folder.parent, what=f"{folder} (the final checkpoint holds the same "
                                                              f"weights: tetron convert makes a model folder of it)",
                              needed=needed)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise
        raise error from None
    dist.barrier()


def checkpoint_bytes(config: Any, *, optimizer: bool = True, states: int = len(ADAMW_STATE)) -> int:
    """The bytes of a checkpoint's tensors: fp32 weights, and the optimizer's `states` fp32 tensors of each."""
    return sum(torch.Size(shape).numel() * 4 for *_, shape in model_specs(config)) * (1 + states if optimizer else 1)


def storage_error(err: BaseException, folder: Path, *, what: str, needed: int | None) -> StorageError | None:
    """A one-line StorageError for a write that failed into `folder` (None if `err` is no failed write)."""
    line = write_failure(err, folder, needed=needed)
    if line is not None and isinstance(err, OSError) and err.errno == errno.EFBIG:  # past RLIMIT_FSIZE, or the fs's
        line = (f"{line.rsplit(': cannot write', 1)[0]}: file too large (past this process's file-size limit, "
                f"ulimit -f, or the file system's largest file; raise the limit or lower checkpoint.shard_mb)")
    return None if line is None else StorageError(f"{line}, while writing {what}")


def clean_stale(out: Path) -> None:
    """Clear what a save killed mid-write left under OUT/checkpoints (never a complete checkpoint; a
    `step_N.tmp-old-*` whose step_N is missing is the only copy of that checkpoint and goes back)."""
    recover_temps(checkpoints_dir(out))


# --------------------------------------------------------------------------- checkpoints: every rank writes


class CheckpointWrite:
    """One checkpoint, written by every rank: built in the training thread, `run` there or on a thread
    (which also plans who writes what: nothing of it holds training up)."""

    def __init__(self, final: Path, chunks: list[nn.Module], mesh: Mesh, *, cfg: Any, state: dict[str, Any],
                 rng: dict[str, Tensor], layer_ranks: list[int], tokenizer: Tokenizer | None,
                 on_saved: Callable[[Path], None] | None) -> None:
        self.final, self.chunks, self.mesh, self.cfg, self.state, self.rng = final, chunks, mesh, cfg, state, rng
        # the state that is no parameter (an MoE routing bias, small), as it is now: a background write
        # must not see the steps after
        self.buffers = {name: b.detach().to("cpu", copy=True) for chunk in chunks for name, b in chunk.named_buffers()}
        self.layer_ranks, self.tokenizer, self.on_saved = layer_ranks, tokenizer, on_saved
        self.keys: list[str] = []  # every tensor of the files (an MoE layer's experts one by one)
        self.parts: list[tuple[str, list[Spec], list[int], list[Shard], Layout | None]] = []

    def _plan(self, comm: Comm, pieces: Pieces) -> None:
        """Every tensor's writer and file, the same on every rank (shards.py). The model's files are a model
        folder as the hub has it (experts one by one); the optimizer's keep the parameters' names."""
        cfg, mesh = self.cfg, self.mesh
        model, params = model_specs(cfg.model), model_specs(cfg.model, buffers=False)
        optimizer = self.state["optimizer"]
        specs = model + (optimizer_specs(cfg.model, params, names=optimizer["state"], optimizer=optimizer["name"])
                         if optimizer["present"] else [])
        plan = spec_of(cfg.model).plan
        stages = [stage_of(name, self.layer_ranks, plan) for _, name, _, _ in specs]
        owners = choose_writers(specs, stages, mesh, self.chunks, pieces, comm.world, comm.device)
        n, shard_bytes = len(model), cfg.checkpoint.shard_mb << 20
        for prefix, part, layout in (("model", slice(0, n), stored_as_of(cfg.model)),
                                     ("optimizer", slice(n, None), None)):
            if specs[part]:
                self.parts.append((prefix, specs[part], owners[part],
                                   plan_files(prefix, specs[part], owners[part], shard_bytes), layout))
                self.keys += file_keys(specs[part], layout)

    def _tmp(self, comm: Comm) -> tuple[Path, BaseException | None]:
        """The temporary folder, made by rank 0 and named to the others by a broadcast (which also says it
        exists)."""
        token = torch.tensor([secrets.randbits(48) if self.mesh.rank == 0 else 0], device=comm.device)
        error = None
        if self.mesh.rank == 0:
            try:
                self.final.parent.mkdir(parents=True, exist_ok=True)
                self.final.with_name(f"{self.final.name}.tmp-{int(token):012x}").mkdir()
            except OSError as err:
                error = err
        dist.broadcast(token, src=0, group=comm.world)
        return self.final.with_name(f"{self.final.name}.tmp-{int(token):012x}"), error

    def _line(self, err: BaseException, tmp: Path) -> str:
        latest = find_latest(self.final.parent.parent)
        kept = f"{latest.name} is intact" if latest else "no earlier checkpoint"
        error = storage_error(err, tmp, what=f"checkpoint {self.final.name} ({kept}); free space or fix it, then "
                                             f"--resume auto", needed=checkpoint_bytes(
                                                 self.cfg.model, states=len(self.state["optimizer"]["state"])))
        return str(error) if error is not None else f"{type(err).__name__}: {err}".splitlines()[0]

    def _agree(self, error: BaseException | None, failed: list[int], tmp: Path, comm: Comm) -> None:
        """Raise the same one line on every rank when any failed (that of the lowest failed rank)."""
        if not failed:
            return
        line = send_line(self._line(error, tmp) if error is not None else "", failed[0], comm)
        if self.mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None and self.mesh.rank == failed[0] and write_failure(error, tmp) is None:
            raise error  # not a failed write but a defect: its traceback
        raise StorageError(line)

    def run(self, comm: Comm, pieces: Pieces) -> None:
        """Gather, write this rank's shards; agree; rank 0 writes the rest and renames. Every rank calls this."""
        mesh = self.mesh
        self._plan(comm, pieces)
        rng = gather_rng(self.rng, comm.world, comm.device, mesh.world_size)
        tmp, error = self._tmp(comm)
        crc32: dict[str, int] = {}
        sends: list = []  # this rank's pieces on their way to their writers
        for prefix, specs, owners, shards, layout in self.parts:
            kind = (lambda key: "master") if prefix == "model" else (lambda key: key.rsplit(".", 1)[1])
            writer = ShardWriter(tmp, shards, mesh.rank, layout=layout)
            writer.error = error  # after a failed write this rank writes nothing more, but still gathers
            writer.consume(gather_to_writers(self.chunks, mesh, specs, owners, layer_ranks=self.layer_ranks,
                                             buffers=self.buffers,
                                             local=lambda p, key, dst, me, kind=kind:
                                             pieces.gather(p, kind(key), dst=dst, me=me, sends=sends),
                                             tp_group=comm.tp, ep_group=comm.ep))
            error, crc32 = writer.error, {**crc32, **writer.crc32}
        for work in sends:
            work.wait()
        # one all-reduce: which ranks failed, and every tensor's crc32 (each from its writer, zero elsewhere)
        summary = torch.zeros(mesh.world_size + len(self.keys), dtype=torch.int64)
        summary[mesh.rank] = error is not None
        for i, key in enumerate(self.keys):
            summary[mesh.world_size + i] = crc32.get(key, 0)
        summary = summary.to(comm.device)
        dist.all_reduce(summary, group=comm.world)
        summary = summary.cpu().tolist()
        self._agree(error, [r for r in range(mesh.world_size) if summary[r]], tmp, comm)
        if mesh.rank == 0:
            try:
                self._finish(tmp, dict(zip(self.keys, summary[mesh.world_size:])), rng)
            except Exception as err:
                error = err
        self._agree(error, [0] if send_line("x" if error else "", 0, comm) else [], tmp, comm)
        if mesh.rank == 0 and self.on_saved is not None:
            self.on_saved(self.final)

    def _finish(self, tmp: Path, crc32: dict[str, int], rng: dict[str, Tensor]) -> None:
        """Rank 0, once every shard is written: indexes, rng, configs, trainer_state.json last; rename, point
        `latest` at it, prune."""
        files: dict[str, dict[str, Any]] = {}
        for prefix, _, _, shards, layout in self.parts:
            write_index(tmp, prefix, shards, layout=layout)
            for shard in shards:
                files[shard.file] = {"size": (tmp / shard.file).stat().st_size, "writer": shard.writer,
                                     "crc32": {key: crc32[key] for key in file_keys(shard.specs, layout)}}
        # streamed as the shards are: a failed write is an OSError naming the file, as theirs
        crc32 = write_tensors(tmp, "rng", [(k, k, v.dtype, tuple(v.shape)) for k, v in rng.items()], iter(rng.items()),
                              shard_bytes=1 << 62, single_file=True)
        files["rng.safetensors"] = {"size": (tmp / "rng.safetensors").stat().st_size, "writer": 0,
                                    "crc32": crc32["rng.safetensors"]}
        write_configs(tmp, self.cfg.model, self.tokenizer)
        for f in sorted(tmp.iterdir()):  # the small files: config, indexes, tokenizer
            if f.name not in files:
                files[f.name] = {"size": f.stat().st_size, "sha256": sha256(f)}
        write_json(tmp / STATE_FILE, seal({**self.state, "files": dict(sorted(files.items()))}))  # last: complete
        # The same step saved again (a resumed run ending where it began) replaces the old folder.
        replace_folder(tmp, self.final)
        write_text(self.final.parent / "latest", self.final.name + "\n")
        fsync_dir(self.final.parent)
        out = self.final.parent.parent
        for stale in complete_checkpoints(out)[:-self.cfg.checkpoint.keep]:
            if stale != self.final:
                shutil.rmtree(stale, ignore_errors=True)


def save_checkpoint(out: Path, chunks: list[nn.Module], mesh: Mesh, *, cfg: Any, optimizer: ShardedOptimizer,
                    trainer_state: dict[str, Any], layer_ranks: list[int], tokenizer: Tokenizer | None,
                    background: BackgroundSaver | None = None,
                    on_saved: Callable[[Path], None] | None = None) -> Path:
    """Write OUT/checkpoints/step_N (N = trainer_state["step"]) atomically, point `latest` at it and keep
    the newest `cfg.checkpoint.keep`. Every rank calls this and writes its share. With `background` (or
    with cfg.checkpoint.async_save, the mesh's own saver: wait_for_save() waits for it), the state is copied
    and written on its thread after the save before it: the folder is complete once `background.wait()`
    returns. `on_saved(folder)` is called on rank 0 when the folder is complete."""
    final = checkpoints_dir(out) / f"step_{int(trainer_state['step'])}"
    device = next(chunks[0].parameters()).device
    rng = {"rank": torch.get_rng_state()}
    if dev.rng_state(device) is not None:
        rng["cuda_rank"] = dev.rng_state(device)
    moments = optimizer.has_state()  # a fresh optimizer has no state to save
    state = {"format": FORMAT, **trainer_state, "optimizer": {"present": moments, "step": optimizer.steps,
                                                              "name": optimizer.name,
                                                              "state": list(optimizer.state_names)}}
    job = CheckpointWrite(final, chunks, mesh, cfg=cfg, state=state, rng=rng, layer_ranks=layer_ranks,
                          tokenizer=tokenizer, on_saved=on_saved)
    if background is None and cfg.checkpoint.async_save:
        background = saver_of(mesh)
    if background is None:
        job.run(Comm(mesh.group("tp"), None, device, mesh.group("ep")),
                Pieces(optimizer.local_parts, optimizer.piece_ranges, optimizer.shards > 1, mesh.group("dp_cp"),
                       device, shard=optimizer.shards))
        return final
    background.wait()  # at most one save in flight; the one before raises its error here
    groups = mesh.checkpoint_groups()
    params = list({id(p): p for chunk in chunks for p in chunk.parameters()}.values())
    pieces = background.snapshot.take(optimizer, params, moments=moments, group=groups["dp_cp"])
    comm = Comm(groups["tp"], groups["world"], torch.device("cpu"), groups.get("ep"))
    background.start(lambda: job.run(comm, pieces))
    return final
