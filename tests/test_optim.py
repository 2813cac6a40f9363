"""Optimizers as a seam (tetron/optim): optim.name chosen and checked before start, the roles an optimizer sees,
the state it declares saved under its names, resuming with another optimizer refused unless
checkpoint.new_optimizer, and an optimizer defined only here (SGD with momentum) trained under dp2 and ZeRO-1/2
equal to its single process: nothing of ZeRO or checkpoints knows it."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tetron.checkpoint.save import seal
from tetron.config import from_dict
from tetron.errors import ConfigError
from tetron.fs import STATE_FILE
from tetron.models.llama import Llama
from tetron.optim import OPTIMIZERS, AdamW, Param, StateSpec, TorchOptimizer
from tetron.parallel.parallelize import param_roles
from tetron.validate import validate

from conftest import check_layout, cli_in_process, run_training, tiny_config


class SGDMomentum(TorchOptimizer):
    """torch's SGD with momentum: one state tensor per parameter, no step counter."""

    name = "test_sgd"
    state = (StateSpec("momentum_buffer"),)

    def __init__(self, params: list[Param], train) -> None:
        super().__init__(params, train, torch.optim.SGD([p.tensor for p in params], lr=train.lr, momentum=0.9))


class WholeMatrices(SGDMomentum):
    """An optimizer whose step needs each matrix whole on one rank (as Muon's does)."""

    name = "test_whole"
    needs_whole_matrices = True


@pytest.fixture
def toy(monkeypatch):
    """The toy optimizers registered for one test (forked ranks inherit the registry)."""
    monkeypatch.setitem(OPTIMIZERS, SGDMomentum.name, SGDMomentum)
    monkeypatch.setitem(OPTIMIZERS, WholeMatrices.name, WholeMatrices)


def test_optim_name_is_checked_before_start(corpus, cache_dir, tmp_path, toy):
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", optim={"name": "lion"})
    with pytest.raises(ConfigError, match=r"^optim.name='lion': unknown optimizer; use one of adamw, test_sgd, "
                                          r"test_whole$"):
        validate(from_dict(raw))
    for name in ("adamw", "test_sgd"):
        validate(from_dict({**raw, "optim": {"name": name}}))
    assert from_dict(tiny_config(corpus, cache_dir, tmp_path / "d")).optim.name == "adamw"  # the default
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({**raw, "optim": {"name": "adamw"}}))
    found = cli_in_process(["train", str(tmp_path / "tiny.yaml"), "--optim.name=lion"], tmp_path)
    assert found.returncode == 2 and found.stderr.strip().splitlines() == [
        "tetron: error: optim.name='lion': unknown optimizer; use one of adamw, test_sgd, test_whole"]


def test_an_optimizer_that_needs_whole_matrices_is_refused_under_zero(corpus, cache_dir, tmp_path, toy):
    """ZeRO's flat slices cut matrices anywhere: such an optimizer runs without ZeRO (or ZeRO over one rank)."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", optim={"name": "test_whole"},
                      parallel={"dp": 2, "zero": 1})
    with pytest.raises(ConfigError, match=r"^optim.name=test_whole needs whole matrices, which ZeRO's flat slices "
                                          r"cut \(parallel.zero=1 over 2 ranks\); use parallel.zero=0$"):
        validate(from_dict(raw))
    validate(from_dict({**raw, "parallel": {"dp": 2, "zero": 0}}))
    validate(from_dict({**raw, "parallel": {"dp": 2, "zero": 1, "dp_shard": 1}}))


@pytest.mark.parametrize("tied", [False, True])
def test_roles_come_from_the_plan(corpus, cache_dir, tmp_path, tied):
    """Each parameter's role as the family's plan tells it, and AdamW's groups by role: weight decay on matrices,
    the embedding and the head, none on vectors (norms)."""
    cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path, model={"tie_word_embeddings": tied}))
    model = Llama(cfg.model)
    roles = param_roles([model])
    named = dict(model.named_parameters())
    assert roles[id(named["model.embed_tokens.weight"])] == "embedding"
    assert ("lm_head.weight" in named) == (not tied)
    if not tied:
        assert roles[id(named["lm_head.weight"])] == "head"
    assert {roles[id(p)] for n, p in named.items() if "layers." in n and n.endswith("proj.weight")} == {"matrix"}
    assert {roles[id(p)] for n, p in named.items() if "norm" in n} == {"vector"}
    adamw = AdamW([Param(p, roles[id(p)], p.shape) for p in named.values()], cfg.train)
    decay, keep = adamw.param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay and keep["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(p) for p in named.values() if p.ndim >= 2}
    assert {id(p) for p in keep["params"]} == {id(p) for p in named.values() if p.ndim < 2}


def _trainer_state(folder):
    return json.loads((folder / STATE_FILE).read_text())


def test_checkpoints_hold_the_declared_state(corpus, cache_dir, tmp_path, toy):
    """The optimizer's own state names in the optimizer files and trainer state, for AdamW as for the toy."""
    for name, state in (("adamw", ["exp_avg", "exp_avg_sq"]), ("test_sgd", ["momentum_buffer"])):
        raw = tiny_config(corpus, cache_dir, tmp_path / name, optim={"name": name}, train={"steps": 2})
        run_training(raw)
        folder = tmp_path / name / "checkpoints" / "step_2"
        assert _trainer_state(folder)["optimizer"] == {"present": True, "step": 2.0, "name": name, "state": state}
        index = json.loads((folder / "optimizer.safetensors.index.json").read_text())["weight_map"]
        params = [n for n in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]]
        assert sorted(index) == sorted(f"{p}.{s}" for p in params for s in state)


def test_resume_with_another_optimizer(corpus, cache_dir, tmp_path, toy):
    """An AdamW checkpoint resumed with the toy: refused naming --checkpoint.new_optimizer; with it the weights
    are taken (the resumed step's loss is the uninterrupted run's) and the toy's state starts fresh. A checkpoint
    written before optimizers were named reads as AdamW's."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 4}, checkpoint={"save_every": 2})
    losses = run_training(raw)
    folder = tmp_path / "run" / "checkpoints" / "step_2"
    resumed = {**raw, "optim": {"name": "test_sgd"}, "checkpoint": {"resume": str(folder)},
               "out": str(tmp_path / "resumed")}
    with pytest.raises(ConfigError, match=r"^optim.name=test_sgd: .*step_2 holds the state of optim.name=adamw; use "
                                          r"optim.name=adamw to continue it, or --checkpoint.new_optimizer to take "
                                          r"its weights and start test_sgd's state fresh$"):
        validate(from_dict(resumed))
    resumed["checkpoint"]["new_optimizer"] = True
    after = run_training(resumed)
    assert after[0] == losses[2]  # the checkpoint's weights, bit for bit (the update differs from then on)
    assert after[1] != losses[3]
    state = _trainer_state(tmp_path / "resumed" / "checkpoints" / "step_4")["optimizer"]
    assert (state["name"], state["state"], state["step"]) == ("test_sgd", ["momentum_buffer"], 2.0)

    old = _trainer_state(folder)  # as written before optimizers were named
    del old["optimizer"]["name"], old["optimizer"]["state"]
    (folder / STATE_FILE).write_text(json.dumps(seal(old)))
    validate(from_dict({**raw, "checkpoint": {"resume": str(folder)}, "out": str(tmp_path / "old")}))
    with pytest.raises(ConfigError, match=r"holds the state of optim.name=adamw"):
        validate(from_dict({**resumed, "checkpoint": {"resume": str(folder)}}))


TOY_LAYOUTS = {
    "dp2": {"dp": 2},
    "dp2-zero1": {"dp": 2, "zero": 1, "bucket_mb": 0.01},  # small buckets: pieces straddle the ranks' slices
    "dp2-zero2": {"dp": 2, "zero": 2, "bucket_mb": 0.01},
}


@pytest.mark.parametrize("name", sorted(TOY_LAYOUTS))
def test_an_optimizer_defined_elsewhere_runs_in_every_layout(corpus, cache_dir, tmp_path, toy, name):
    """The toy optimizer under data parallelism and ZeRO-1/2 equals its single process (check_layout's losses and
    weights), and ZeRO sharded the state it declared: its checkpoint holds every momentum_buffer whole."""
    check_layout(corpus, cache_dir, tmp_path, parallel=TOY_LAYOUTS[name], optim={"name": "test_sgd"},
                 checkpoint={"save_every": 1})
    folder = tmp_path / "run" / "checkpoints" / "step_2"
    state = _trainer_state(folder)["optimizer"]
    assert (state["name"], state["state"], state["step"]) == ("test_sgd", ["momentum_buffer"], 2.0)
