"""Checkpoints, written: the model as a Hugging Face model folder, optimizer state beside it, trainer state.

    OUT/checkpoints/step_N/
        config.json, model-XXXXX-of-YYYYY.safetensors, model.safetensors.index.json   (transformers loads this)
        optimizer-XXXXX-of-YYYYY.safetensors, optimizer.safetensors.index.json   ("{name}.exp_avg", "{name}.exp_avg_sq")
        rng.safetensors ("rank_{i}": every rank's CPU generator state), tokenizer files
        trainer_state.json   (step, tokens, loader position, config, layout, sha256 of every other file; written last)
    OUT/checkpoints/latest   ("step_N", replaced after the folder is complete)

Every tensor is gathered whole (over tp, padding cut) on its pipeline stage and sent to rank 0, which
streams it into the current shard: no rank holds more than one full tensor. The folder is written as
`step_N.tmp-<random>`, synced, renamed; `latest` is updated last, so a run killed at any moment leaves the
previous checkpoint whole. No pickle: safetensors and JSON only, nothing here can run code when read.
Reading is in checkpoint_load.py, checking before start-up in checkpoint_check.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from tetron import device as dev
from tetron.checkpoint.safetensors_stream import SafetensorsWriter
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
from tetron.models.spec import ParallelPlan, spec_of
from tetron.parallel.comm import all_gather_dim
from tetron.parallel.layout import layout_of
from tetron.parallel.zero import ShardedAdamW

FORMAT = "tetron-checkpoint/1"
Spec = tuple[str, str, torch.dtype, tuple[int, ...]]  # (key in the file, parameter name, dtype, full shape)


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """The trainer state with a checksum of its own content, so an edit anywhere in it is caught."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return {**body, "checksum": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


# --------------------------------------------------------------------------- whole model folders


def write_configs(folder: Path, config: Any, tokenizer: Tokenizer | None, *, dtype: str = "float32") -> None:
    """config.json, generation_config.json and the tokenizer's files of a model folder being written.
    The end-of-text id comes from the tokenizer where the model config has none, so that generation
    (tetron's and transformers') stops at the end of a document; padding uses it too."""
    hf = config.to_hf(dtype=dtype)
    if hf["eos_token_id"] is None and tokenizer is not None:
        hf["eos_token_id"] = tokenizer.eos_id
    eos = hf["eos_token_id"]
    hf["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": eos, "pad_token_id": hf["pad_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(folder)


def save_model(model: nn.Module, folder: Path, *, tokenizer: Tokenizer | None = None) -> None:
    """Write a whole, plain model as a HF model folder at `folder`, replacing any old one."""
    save_state(model.state_dict(), model.config, folder, tokenizer=tokenizer)


def save_state(state: dict[str, Tensor], config: Any, folder: Path, *,
               tokenizer: Tokenizer | None = None) -> None:
    """Write full tensors named as in transformers' class of the family as a HF model folder, atomically."""
    folder = Path(folder)
    recover_temps(folder.parent, folder.name)  # what an earlier save killed mid-way left
    tmp = temp_name(folder)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    state.pop(spec_of(config).plan.tied_head(config), None)  # the embedding's tensor; HF ties it back on load
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    write_configs(tmp, config, tokenizer)
    replace_folder(tmp, folder)


# --------------------------------------------------------------------------- gathering, one tensor at a time


def _full_tensor(local: Tensor, param: nn.Parameter, tp_group: dist.ProcessGroup,
                 ep_group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole tensor of which `local` (the parameter or a state of the same shape) is this rank's part
    (an expert shard's experts gathered over `ep_group`, every rank of it joining)."""
    if layout_of(param).ep is not None:
        return all_gather_dim(local, layout_of(param).ep.dim, ep_group)
    shard = layout_of(param).tp
    if shard is None:
        return local
    full = all_gather_dim(local, shard.dim, tp_group)
    return full.narrow(shard.dim, 0, shard.logical_size or full.shape[shard.dim])


@torch.no_grad()
def gather_full_state(model: nn.Module, tp_group: dist.ProcessGroup,
                      ep_group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """The whole tensors of a tensor- or expert-parallel model (every tp and ep rank gets them); for tests and
    small models."""
    return {name: _full_tensor(p.detach(), p, tp_group, ep_group).cpu()
            for name, p in model.named_parameters(remove_duplicate=False)}


def stage_of(name: str, layer_ranks: list[int], plan: ParallelPlan) -> int:
    """The pipeline rank that holds parameter `name`: layers by `layer_ranks`, the embedding with the
    first layer, the final norm and head with the last (under zbv both on rank 0)."""
    part = plan.stage_part(name)
    if part == "layer":
        return layer_ranks[plan.layer_index(name)]
    return layer_ranks[0] if part == "embedding" else layer_ranks[-1]


def model_specs(config: Any, dtype: torch.dtype = torch.float32, *, buffers: bool = True) -> list[Spec]:
    """Every tensor of the HF model folder in the plain model's order, then (with `buffers`) the state that
    is no parameter (an MoE routing bias); a tied head is not stored."""
    spec = spec_of(config)
    with torch.device("meta"):
        whole = spec.model_class(config)  # names and full shapes, no storage
    tied_head = spec.plan.tied_head(config)
    stored = whole.state_dict().keys()  # the persistent buffers among them
    return [(name, name, dtype, tuple(p.shape)) for name, p in whole.named_parameters(remove_duplicate=False)
            if name != tied_head] + [(name, name, dtype, tuple(b.shape)) for name, b in whole.named_buffers()
                                     if buffers and name in stored]


def optimizer_specs(config: Any) -> list[Spec]:
    """AdamW's two moments of every stored parameter, full (unpadded) shapes, fp32."""
    return [(f"{name}.{kind}", name, torch.float32, shape)
            for name, _, _, shape in model_specs(config, buffers=False) for kind in ("exp_avg", "exp_avg_sq")]


@torch.no_grad()
def gather_tensors(chunks: list[nn.Module], mesh: Mesh, specs: list[Spec], *, layer_ranks: list[int],
                   local: Callable[[nn.Parameter, str], Tensor]) -> Iterator[tuple[str, Tensor | None]]:
    """Yield (key, whole tensor) on global rank 0 for every spec, in order; (key, None) on the other ranks,
    which take part in the tp all-gathers of their stage, and, on the owning stage's (dp=0, cp=0, tp=0)
    rank, send the tensor to rank 0. `local(param, key)` is this rank's part of the tensor; a buffer (the same
    on every rank of a stage) is sent as it is."""
    pp_rank, plan = mesh.local_rank("pp"), spec_of(chunks[0].config).plan
    in_column = all(mesh.local_rank(axis) == 0 for axis in ("dp", "cp", "tp"))
    mine = {name: p for chunk in chunks for name, p in chunk.named_parameters(remove_duplicate=False)}
    buffers = {name: b for chunk in chunks for name, b in chunk.named_buffers()}  # whole on every rank
    device = next(iter(mine.values())).device
    for key, name, dtype, shape in specs:
        owner = stage_of(name, layer_ranks, plan)
        if owner == pp_rank:
            if name in buffers:
                full = buffers[name].to(dtype).contiguous()
            else:
                param = mine[name]
                # all tp ranks join, and for an expert shard all ep ranks
                full = _full_tensor(local(param, key), param, mesh.group("tp"), mesh.group("ep")).contiguous()
            if mesh.rank == 0:
                yield key, full.cpu()
                continue
            if in_column:
                dist.send(full, dst=0)
        elif mesh.rank == 0:
            full = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(full, src=mesh.stage_rank(owner))
            yield key, full.cpu()
            continue
        yield key, None


def plan_shards(specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    """Consecutive specs grouped into shards of at most `shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = torch.Size(spec[3]).numel() * torch.empty((), dtype=spec[2]).element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_tensors(folder: Path | None, prefix: str, specs: list[Spec], stream: Iterator[tuple[str, Tensor | None]],
                  *, shard_bytes: int, single_file: bool = False) -> None:
    """Consume `stream` (from gather_tensors) on every rank; rank 0 (folder not None) writes the shards
    `{prefix}-XXXXX-of-YYYYY.safetensors` and `{prefix}.safetensors.index.json` (or, with `single_file`
    and one shard, `{prefix}.safetensors` alone, as transformers writes small models)."""
    plan = plan_shards(specs, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(plan):
        fname = (f"{prefix}.safetensors" if single_file and len(plan) == 1
                 else f"{prefix}-{i + 1:05d}-of-{len(plan):05d}.safetensors")
        writer = (SafetensorsWriter(folder / fname, [(k, dt, sh) for k, _, dt, sh in shard],
                                    metadata={"format": "pt"}) if folder is not None else None)
        for key, _, _, _ in shard:
            got, tensor = next(stream)
            assert got == key  # the stream follows the same specs
            if writer is not None:
                writer.write(key, tensor)
                total += tensor.numel() * tensor.element_size()
            weight_map[key] = fname
        if writer is not None:
            writer.close()
    if folder is not None and not (single_file and len(plan) == 1):
        write_json(folder / f"{prefix}.safetensors.index.json",
                   {"metadata": {"total_size": total}, "weight_map": weight_map})


def _gather_rng(mesh: Mesh, device: torch.device) -> dict[str, Tensor]:
    """Every rank's generator states on rank 0: CPU ("rank_{i}"), and CUDA ("cuda_rank_{i}") on GPUs.
    All the same size, so a tensor all-gather carries them (all_gather_object would pickle)."""
    states = {"rank": torch.get_rng_state()}
    device_state = dev.rng_state(device)
    if device_state is not None:
        states["cuda_rank"] = device_state
    out: dict[str, Tensor] = {}
    for prefix, state in states.items():
        parts = [torch.empty_like(state, device=device) for _ in range(mesh.world_size)]
        dist.all_gather(parts, state.to(device))
        out.update({f"{prefix}_{i}": part.cpu() for i, part in enumerate(parts)})
    return out


def write_model_folder(folder: Path, chunks: list[nn.Module], mesh: Mesh, *, config: Any,
                       weights: Callable[[nn.Parameter], Tensor], dtype: torch.dtype, layer_ranks: list[int],
                       tokenizer: Tokenizer | None, shard_mb: int) -> None:
    """OUT/model: the model as a HF folder in `dtype` (model.safetensors when it fits one shard), replaced
    atomically. `weights(param)` is this rank's fp32 part of a parameter (its master weights). Every
    rank calls this; rank 0 writes."""
    tmp = None
    try:
        if mesh.rank == 0:
            recover_temps(folder.parent, folder.name)  # what an earlier save killed mid-way left
            tmp = temp_name(folder)
            tmp.mkdir(parents=True)
        specs = model_specs(config, dtype)
        stream = gather_tensors(chunks, mesh, specs, layer_ranks=layer_ranks, local=lambda p, k: weights(p).to(dtype))
        write_tensors(tmp, "model", specs, stream, shard_bytes=shard_mb << 20, single_file=True)
        if tmp is not None:
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


def checkpoint_bytes(config: Any, *, optimizer: bool = True) -> int:
    """The bytes of a checkpoint's tensors: fp32 weights, and AdamW's two fp32 moments."""
    return sum(torch.Size(shape).numel() * 4 for *_, shape in model_specs(config)) * (3 if optimizer else 1)


def storage_error(err: BaseException, folder: Path, *, what: str, needed: int | None) -> StorageError | None:
    """A one-line StorageError for a write that failed into `folder` (None if `err` is no failed write)."""
    line = write_failure(err, folder, needed=needed)
    return None if line is None else StorageError(f"{line}, while writing {what}")


def clean_stale(out: Path) -> None:
    """Clear what a save killed mid-write left under OUT/checkpoints (never a complete checkpoint; a
    `step_N.tmp-old-*` whose step_N is missing is the only copy of that checkpoint and goes back)."""
    recover_temps(checkpoints_dir(out))


def save_checkpoint(out: Path, chunks: list[nn.Module], mesh: Mesh, *, cfg: Any, optimizer: ShardedAdamW,
                    trainer_state: dict[str, Any], layer_ranks: list[int], tokenizer: Tokenizer | None) -> Path:
    """Write OUT/checkpoints/step_N (N = trainer_state["step"]) atomically, point `latest` at it and keep
    the newest `cfg.checkpoint.keep`. Every rank calls this; rank 0 writes."""
    step, rank0 = int(trainer_state["step"]), mesh.rank == 0
    root = checkpoints_dir(out)
    final = root / f"step_{step}"
    tmp = temp_name(final) if rank0 else None
    try:
        if tmp is not None:
            tmp.mkdir(parents=True)
        _write_checkpoint(tmp, final, chunks, mesh, cfg=cfg, optimizer=optimizer, trainer_state=trainer_state,
                          layer_ranks=layer_ranks, tokenizer=tokenizer)
    except Exception as err:  # a full disk, a folder made read-only: one line; the previous checkpoint stays
        if tmp is None:
            raise
        latest = find_latest(out)
        kept = f"{latest.name} is intact" if latest else "no earlier checkpoint"
        error = storage_error(err, tmp, what=f"checkpoint {final.name} ({kept}); free space or fix it, then "
                                             f"--resume auto", needed=checkpoint_bytes(cfg.model))
        shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise
        raise error from None
    if tmp is not None:
        for stale in complete_checkpoints(out)[:-cfg.checkpoint.keep]:
            if stale != final:
                shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def _write_checkpoint(tmp: Path | None, final: Path, chunks: list[nn.Module], mesh: Mesh, *, cfg: Any,
                      optimizer: ShardedAdamW, trainer_state: dict[str, Any], layer_ranks: list[int],
                      tokenizer: Tokenizer | None) -> None:
    """The checkpoint's files, streamed into `tmp` on rank 0 (None elsewhere), then renamed to `final` and
    named by `latest`."""
    device = next(chunks[0].parameters()).device
    rng = _gather_rng(mesh, device)
    shard_bytes = cfg.checkpoint.shard_mb << 20
    specs = model_specs(cfg.model)
    # The fp32 master weights (the parameters themselves in fp32 without ZeRO), so resuming is exact.
    masters = gather_tensors(chunks, mesh, specs, layer_ranks=layer_ranks,
                             local=lambda p, k: optimizer.full_tensor(p, "master"))
    write_tensors(tmp, "model", specs, masters, shard_bytes=shard_bytes)
    has_moments = optimizer.has_state()  # a fresh optimizer has no state to save
    if has_moments:
        ospecs = optimizer_specs(cfg.model)
        local = lambda p, key: optimizer.full_tensor(p, key.rsplit(".", 1)[1])  # noqa: E731
        write_tensors(tmp, "optimizer", ospecs, gather_tensors(chunks, mesh, ospecs, layer_ranks=layer_ranks,
                                                               local=local), shard_bytes=shard_bytes)
    if tmp is not None:
        save_file(rng, tmp / "rng.safetensors")
        write_configs(tmp, cfg.model, tokenizer)
        state = {"format": FORMAT, **trainer_state,
                 "optimizer": {"present": has_moments, "step": optimizer.steps},
                 "files": {f.name: {"size": f.stat().st_size, "sha256": sha256(f)} for f in sorted(tmp.iterdir())}}
        write_json(tmp / STATE_FILE, seal(state))  # last: its presence marks the folder complete
        # The same step saved again (a resumed run ending where it began) replaces the old folder.
        replace_folder(tmp, final)
        write_text(final.parent / "latest", final.name + "\n")
        fsync_dir(final.parent)
