"""What a checkpoint or model folder may not smuggle past the checks before start: a hub-layout piece of the
wrong shape or dtype, a re-sealed trainer state whose values would crash a rank or poison the weights, a
flipped tensor byte read in slices, a side file that links outside its folder; and a save that fails on a
full disk or a file-size limit (one line, no temporary folder left, the previous checkpoint whole)."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tetron.checkpoint.check import inspect_checkpoint
from tetron.checkpoint.load import TensorReader
from tetron.checkpoint.save import save_model, seal
from tetron.checkpoint.shards import tensor_crc32
from tetron.config import ConfigError, from_dict
from tetron.errors import CheckpointError
from tetron.fs import STATE_FILE, write_json
from tetron.models.spec import piece_names, stored_as_of
from tetron.parallel.init import seeded_model
from tetron.validate import validate

from conftest import cli_in_process, run_training, tiny_config

SHARD = "model-00001-of-00001.safetensors"

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


# ----------------------------------------------------------------------------- a checkpoint's trust (item 10)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus, cache_dir) -> tuple[Path, dict]:
    """A real checkpoint after 2 steps of one rank, and the raw config that made it."""
    tmp = tmp_path_factory.mktemp("saved")
    raw = tiny_config(corpus, cache_dir, tmp / "run", train={"steps": 2})
    run_training(raw)
    return tmp / "run" / "checkpoints" / "step_2", raw


def resumed_from(saved, tmp_path, **sections) -> tuple[Path, dict]:
    """A copy of the saved checkpoint, and a config that resumes from it into a new run folder."""
    folder = tmp_path / "step_2"
    shutil.copytree(saved[0], folder)
    raw = {**saved[1], "checkpoint": {"resume": str(folder)}, "out": str(tmp_path / "out"), **sections}
    return folder, raw


def edit_state(folder: Path, edit) -> None:
    """Change trainer_state.json with `edit(state)` and seal it again, as a hostile folder would."""
    state = json.loads((folder / STATE_FILE).read_text())
    edit(state)
    write_json(folder / STATE_FILE, seal(state))


def refused(raw: dict, tmp_path: Path, folder: Path, match: str) -> None:
    """validate() (before any rank starts) and `tetron check` both refuse the checkpoint in one line."""
    with pytest.raises(ConfigError) as info:
        validate(from_dict(raw))
    assert "\n" not in str(info.value) and re.search(match, str(info.value)), info.value
    found = cli_in_process(["check", str(folder)], tmp_path)
    assert found.returncode == 1 and len(found.stdout.splitlines()) == 1, found
    assert re.search(match, found.stdout), found.stdout


def rng_file(folder: Path, **tensors: torch.Tensor) -> None:
    """rng.safetensors with some tensors replaced, the trainer state re-sealed to match (crc32s, size)."""
    states = load_file(folder / "rng.safetensors")
    save_file({**states, **tensors}, folder / "rng.safetensors")
    rng = {"size": (folder / "rng.safetensors").stat().st_size, "writer": 0,
           "crc32": {k: tensor_crc32(v) for k, v in {**states, **tensors}.items()}}
    edit_state(folder, lambda s: s["files"].__setitem__("rng.safetensors", rng))


@pytest.mark.parametrize("case", ["step NaN", "step negative", "step fractional", "rng short", "rng garbage",
                                  "cuda rng long", "layout", "loader batch"])
def test_a_resealed_trainer_state_is_checked_for_values_a_rank_cannot_use(saved, tmp_path, case):
    """Item 10 of issue 38: a trainer state edited and sealed again is consistent with itself, so its values
    are checked too: a step count AdamW's bias correction cannot use (NaN would turn every weight NaN and
    save it), generator states torch.set_rng_state refuses (a rank would crash), a layout whose ranks do not
    multiply out. Refused before start and by `tetron check`; the checkpoint as saved passes both."""
    folder, raw = resumed_from(saved, tmp_path)
    validate(from_dict(raw))  # the reference: as saved, it passes
    good = cli_in_process(["check", str(folder)], tmp_path)
    assert good.returncode == 0, good
    state = load_file(folder / "rng.safetensors")["rank_0"]
    if case.startswith("step"):
        value = {"step NaN": float("nan"), "step negative": -1.0, "step fractional": 1.5}[case]
        edit_state(folder, lambda s: s["optimizer"].__setitem__("step", value))
        refused(raw, tmp_path, folder, "trainer_state.json: optimizer must be .*step: a whole number >= 0")
    elif case == "rng short":
        rng_file(folder, rank_0=state[:-8].clone())
        refused(raw, tmp_path, folder, r"rng.safetensors: rank_0 must be a U8 tensor of shape \[5056\]")
    elif case == "rng garbage":
        rng_file(folder, rank_0=torch.zeros_like(state))
        refused(raw, tmp_path, folder, "rng.safetensors: rank_0 is not a CPU generator's state")
    elif case == "cuda rng long":
        rng_file(folder, cuda_rank_0=torch.zeros(24, dtype=torch.uint8))
        refused(raw, tmp_path, folder, r"rng.safetensors: cuda_rank_0 must be a U8 tensor of shape \[16\]")
    elif case == "layout":
        edit_state(folder, lambda s: s["layout"].__setitem__("dp", 2))  # rank 1 of a dp2 resume: no generator state
        refused(raw, tmp_path, folder, r"trainer_state.json: bad layout \(.*world_size = dp\*tp\*pp\*cp\)")
    else:
        edit_state(folder, lambda s: s["loader"].__setitem__("global_batch", 0))
        refused(raw, tmp_path, folder, r"trainer_state.json: loader must hold .*global_batch \(>= 1\)")


def flip_byte(folder: Path, name: str) -> str:
    """Flip one byte inside tensor `name` of the checkpoint's model shard; the line a reader refuses it with."""
    path = folder / SHARD
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    return f"{path}: tensor {name}: its bytes differ from the crc32 in {STATE_FILE}: corrupted"


def test_a_flipped_byte_is_refused_when_its_tensor_is_read_in_slices(saved, tmp_path):
    """Item 10 of issue 38: a tensor read in slices (tp2: each rank its rows) is checked against its crc32
    whole, once, as one process reading it whole checks it; the slice read is still the rows asked for."""
    folder, raw = resumed_from(saved, tmp_path, parallel={"tp": 2})
    name = "model.layers.1.mlp.up_proj.weight"  # column-parallel: each tp rank reads half its rows
    with TensorReader(folder, "model") as reader:
        whole = reader.read(name)
        torch.testing.assert_close(reader.read(name, 0, 32, 64), whole[32:], rtol=0, atol=0)
    line = flip_byte(folder, name)
    with TensorReader(folder, "model") as reader, pytest.raises(CheckpointError) as info:
        reader.read(name, 0, 0, 32)
    assert str(info.value) == line
    with pytest.raises(RuntimeError) as info:  # every tp rank refuses it: none waits for another
        run_training(raw)
    assert str(info.value).count(f"CheckpointError: {line}") == 2, info.value


# ----------------------------------------------------------------------------- tetron convert (item 9)


def converts(src: Path, dst: Path, tmp_path: Path, match: str | None) -> None:
    """`tetron convert SRC DST`: with `match`, refused in one line matching it, nothing written beside DST;
    without, it succeeds."""
    found = cli_in_process(["convert", str(src), str(dst)], tmp_path)
    if match is None:
        assert found.returncode == 0 and dst.is_dir(), found
        return
    assert found.returncode == 2 and len(found.stderr.splitlines()) == 1, found
    assert re.search(match, found.stderr), found.stderr
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.tmp-*"))


def test_convert_copies_no_side_file_through_a_link_out_of_its_folder(saved, tmp_path):
    """Item 9 of issue 38: a tokenizer side file that links outside the source folder (a downloaded folder
    naming ~/.ssh/id_rsa) is refused, both ways, naming the link and its target; a link inside the folder,
    and a Hugging Face hub cache's snapshot (every file a link into the repository's blobs/), convert."""
    secret = tmp_path / "secret.txt"
    secret.write_text("a private key")
    folder, _ = resumed_from(saved, tmp_path)
    converts(folder, tmp_path / "hf", tmp_path, None)  # the reference: as saved it converts
    hf = tmp_path / "hf"
    for src in (folder, hf):  # checkpoint -> HF, and HF -> checkpoint
        (src / "special_tokens_map.json").symlink_to(secret)
        converts(src, tmp_path / f"{src.name}-out", tmp_path,
                 rf"{src / 'special_tokens_map.json'}: a link to {secret}, outside {src}; copy that file")
        (src / "special_tokens_map.json").unlink()
    (hf / "notes.json").write_text("{}")
    (hf / "special_tokens_map.json").symlink_to("notes.json")  # inside the folder: copied
    converts(hf, tmp_path / "ck", tmp_path, None)
    assert (tmp_path / "ck" / "special_tokens_map.json").read_text() == "{}"
    snapshot = tmp_path / "models--org--name" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "blobs").mkdir()
    for f in hf.iterdir():
        if f.is_file() and not f.is_symlink():
            shutil.copyfile(f, snapshot.parent.parent / "blobs" / f.name)
            (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    converts(snapshot, tmp_path / "from-cache", tmp_path, None)


def test_convert_checks_every_byte_of_a_checkpoint(saved, tmp_path):
    """Item 9 of issue 38: a checkpoint converted to a model folder is checked against its checksums as
    `tetron check` and a resume check it: a flipped tensor byte is refused naming the file and the tensor."""
    folder, _ = resumed_from(saved, tmp_path)
    line = flip_byte(folder, "model.layers.0.self_attn.o_proj.weight")
    converts(folder, tmp_path / "hf", tmp_path, "^tetron: error: " + re.escape(line) + "$")
