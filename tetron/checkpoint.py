"""The trained model as a Hugging Face model folder: config.json + safetensors (+ tokenizer).

transformers' `AutoModelForCausalLM.from_pretrained(folder)` loads it as it is. The folder is
written under a temporary name and renamed when complete, so a crash never leaves half a model
under the final name. No pickle: nothing here can run code when loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from tetron.data import Tokenizer
from tetron.mesh import Mesh
from tetron.model import Llama, LlamaConfig
from tetron.parallel.comm import all_gather_dim


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_model(model: Llama, folder: Path, *, tokenizer: Tokenizer | None = None) -> None:
    """Write a whole, plain Llama as a HF model folder at `folder`, replacing any old one."""
    save_state(model.state_dict(), model.config, folder, tokenizer=tokenizer)


def save_state(state: dict[str, Tensor], config: LlamaConfig, folder: Path, *,
               tokenizer: Tokenizer | None = None) -> None:
    """Write full tensors named as in LlamaForCausalLM as a HF model folder, atomically."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; HF ties it back on load
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(tmp)
    for f in tmp.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    tmp.rename(folder)
    _fsync_dir(folder.parent)
    shutil.rmtree(old, ignore_errors=True)


def load_model(folder: Path, *, device: torch.device | str = "cpu") -> Llama:
    """A plain Llama from a HF model folder (config.json + model.safetensors)."""
    folder = Path(folder)
    config = LlamaConfig.from_hf(folder)
    with torch.device("meta"):
        model = Llama(config)
    state = load_file(folder / "model.safetensors", device=str(device))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        name = sorted(missing or unexpected)[0]
        what = "missing" if missing else "unexpected"
        raise ValueError(f"{folder / 'model.safetensors'}: {what} tensor {name} for this config.json")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def _full_tensor(param: nn.Parameter, tp_group: dist.ProcessGroup) -> Tensor:
    """The whole tensor of which `param` holds a part (all-gathered over tp, padding cut), on its device."""
    full = param.detach()
    shard = getattr(param, "shard", None)
    if shard is not None:
        dim = shard[0]
        full = all_gather_dim(full, dim, tp_group)
        full = full.narrow(dim, 0, getattr(param, "logical_size", full.shape[dim]))
    return full


@torch.no_grad()
def gather_full_state(model: nn.Module, tp_group: dist.ProcessGroup) -> dict[str, Tensor]:
    """The whole tensors of a tensor-parallel model, one at a time (memory bounded by the largest):
    shards are all-gathered over tp and vocabulary padding is cut off. Every tp rank gets them."""
    return {name: _full_tensor(param, tp_group).cpu()
            for name, param in model.named_parameters(remove_duplicate=False)}


def _stage_of(name: str, layer_ranks: list[int], pp: int) -> int:
    """The pipeline rank that holds tensor `name`: layers by `layer_ranks`, the embedding on the first,
    the final norm and head on the last."""
    if name.startswith("model.layers."):
        return layer_ranks[int(name.split(".")[2])]
    return 0 if name.startswith("model.embed_tokens.") else pp - 1


@torch.no_grad()
def gather_pipeline_state(chunks: list[nn.Module], mesh: Mesh, *, config: LlamaConfig,
                          layer_ranks: list[int]) -> dict[str, Tensor]:
    """The whole model on global rank 0, from every pipeline stage: the stages of rank 0's (dp, cp, tp)
    column send it their tensors (gathered over tp) one at a time, in the plain model's order.
    Other ranks take part in the tp gathers and return {}."""
    pp = mesh.local_rank("pp")
    in_column = all(mesh.local_rank(axis) == 0 for axis in ("dp", "cp", "tp"))
    mine = {name: param for chunk in chunks for name, param in chunk.named_parameters(remove_duplicate=False)}
    with torch.device("meta"):
        whole = Llama(config)  # names and full shapes, no storage
    state: dict[str, Tensor] = {}
    for name, meta in whole.named_parameters(remove_duplicate=False):
        owner = _stage_of(name, layer_ranks, mesh.size("pp"))
        if owner == pp:
            full = _full_tensor(mine[name], mesh.group("tp")).contiguous()  # every tp rank joins the gather
            if mesh.rank == 0:
                state[name] = full.cpu()
            elif in_column:
                dist.send(full, dst=0)
        elif mesh.rank == 0:
            device = next(iter(mine.values())).device
            full = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            dist.recv(full, src=mesh.stage_rank(owner))
            state[name] = full.cpu()
    return state
