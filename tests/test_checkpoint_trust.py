"""What a checkpoint or model folder may not smuggle past the checks before start: a hub-layout piece of the
wrong shape or dtype, a re-sealed trainer state whose values would crash a rank or poison the weights, a
flipped tensor byte read in slices, a side file that links outside its folder; and a save that fails on a
full disk or a file-size limit (one line, no temporary folder left, the previous checkpoint whole)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tetron.checkpoint.check import inspect_checkpoint
from tetron.checkpoint.save import save_model
from tetron.config import ConfigError, from_dict
from tetron.errors import CheckpointError
from tetron.models.spec import piece_names, stored_as_of
from tetron.parallel.init import seeded_model
from tetron.validate import validate

from conftest import tiny_config

MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


def hub_folder(model, folder) -> dict[str, torch.Tensor]:
    """`model` saved as a Hugging Face folder with its experts one by one (the hub's layout, as transformers
    writes it): each fused tensor cut into the pieces its family's stored_as names. Returns the pieces."""
    save_model(model, folder)
    stored_as = stored_as_of(model.config)
    tensors = {}
    for name, value in model.state_dict().items():
        stored = stored_as(name)
        if stored is None:
            tensors[name] = value
        elif isinstance(stored, str):
            tensors[stored] = value
        else:
            for row, expert in zip(stored, value):
                for piece, part in zip(row, expert.chunk(len(row))):
                    tensors[piece] = part.contiguous()
    assert any(len(piece_names(stored_as(n) or [])) > 1 for n in model.state_dict())  # pieces there to check
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return tensors


@pytest.fixture
def moe_init(corpus, cache_dir, tmp_path):
    """A run config that starts from a hub-layout MoE folder, the folder and its pieces."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=MOE)
    raw["checkpoint"] = {"init_from": str(tmp_path / "hub")}
    model = seeded_model(from_dict(raw).model, seed=0, device=torch.device("cpu"))
    return raw, tmp_path / "hub", hub_folder(model, tmp_path / "hub")


def test_every_piece_of_a_hub_layout_folder_is_checked_before_start(moe_init):
    """Item 5 of issue 38: a piece of the wrong shape, or of an integer dtype, anywhere among the experts is
    refused in one line naming the piece, the tensor it belongs to and what was expected; the intact folder
    passes the same check."""
    raw, folder, tensors = moe_init
    validate(from_dict(raw))  # the reference: the folder as written passes
    piece = "model.layers.1.mlp.experts.3.up_proj.weight"  # the last expert of the last layer: not the first piece
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    for bad, problem in [(torch.zeros(17, 32), "has shape [17, 32], the model needs [16, 32]"),
                         (tensors[piece].to(torch.int32), "has dtype I32, expected one of ['BF16', 'F16', 'F32', "
                                                          "'F64']")]:
        save_file({**tensors, piece: bad}, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConfigError) as info:
            validate(from_dict(raw))
        assert str(info.value) == f"{folder / 'model.safetensors'}: tensor {piece} (a piece of {fused}) {problem}"
        with pytest.raises(CheckpointError, match="a piece of"):
            inspect_checkpoint(folder, require_state=False)  # tetron convert's and generate's check
