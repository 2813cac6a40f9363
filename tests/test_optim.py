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
from tetron.optim import OPTIMIZERS, AdamW, Optimizer, Param, StateSpec, TorchOptimizer
from tetron.parallel.data_parallel import _Bucket
from tetron.parallel.parallelize import param_roles
from tetron.validate import validate

from conftest import check_layout, cli_in_process, run_training, tiny_config


class SGDMomentum(TorchOptimizer):
    """torch's SGD with momentum: one state tensor per parameter, no step counter."""

    name = "test_sgd"
    state = (StateSpec("momentum_buffer"),)

    def __init__(self, params: list[Param], train, optim=None) -> None:
        super().__init__(params, train, torch.optim.SGD([p.tensor for p in params], lr=train.lr, momentum=0.9))


class NormalizedMomentum(Optimizer):
    """Momentum whose update is scaled to a norm of lr per parameter: its step needs each matrix whole (a piece's
    norm is not the matrix's), as Muon's does."""

    name = "test_whole"
    state = (StateSpec("momentum_buffer"),)
    needs_whole_matrices = True

    def __init__(self, params: list[Param], train, optim=None) -> None:
        super().__init__(params, train, optim)
        self.lr, self.buffers = train.lr, {}

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    @torch.no_grad()
    def step(self, found_inf=None) -> None:
        if found_inf is not None and bool(found_inf):
            return
        for p in self.params:
            assert p.tensor.numel() == p.shape.numel()  # whole, if flat
            buf = self.buffers.setdefault(p.tensor, torch.zeros_like(p.tensor)).mul_(0.9).add_(p.tensor.grad)
            p.tensor.view(p.shape).sub_(buf.view(p.shape) / (buf.norm() + 1e-8), alpha=self.lr)  # as a matrix

    def state_tensor(self, tensor, name: str):
        return self.buffers[tensor]

    def load_state(self, tensor, values, *, step: float) -> None:
        self.buffers[tensor] = values["momentum_buffer"].clone().view_as(tensor)

    def tensors(self):
        return [*self.buffers.values(), *(p.tensor for p in self.params)]


@pytest.fixture
def toy(monkeypatch):
    """The toy optimizers registered for one test (forked ranks inherit the registry)."""
    monkeypatch.setitem(OPTIMIZERS, SGDMomentum.name, SGDMomentum)
    monkeypatch.setitem(OPTIMIZERS, NormalizedMomentum.name, NormalizedMomentum)


def test_optim_name_is_checked_before_start(corpus, cache_dir, tmp_path, toy):
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", optim={"name": "lion"})
    with pytest.raises(ConfigError, match=r"^optim.name='lion': unknown optimizer; use one of adamw, muon, "
                                          r"test_sgd, test_whole$"):
        validate(from_dict(raw))
    for name in ("adamw", "test_sgd"):
        validate(from_dict({**raw, "optim": {"name": name}}))
    assert from_dict(tiny_config(corpus, cache_dir, tmp_path / "d")).optim.name == "adamw"  # the default
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({**raw, "optim": {"name": "adamw"}}))
    found = cli_in_process(["train", str(tmp_path / "tiny.yaml"), "--optim.name=lion"], tmp_path)
    assert found.returncode == 2 and found.stderr.strip().splitlines() == [
        "tetron: error: optim.name='lion': unknown optimizer; use one of adamw, muon, test_sgd, test_whole"]


def test_an_optimizer_that_needs_whole_matrices_is_refused_under_tp(corpus, cache_dir, tmp_path, toy):
    """Tensor parallelism splits matrices; ZeRO keeps them whole for such an optimizer (see the layouts below)."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", optim={"name": "test_whole"},
                      parallel={"dp": 2, "tp": 2, "zero": 1})
    with pytest.raises(ConfigError, match=r"^optim.name=test_whole needs whole matrices, which tensor parallelism "
                                          r"splits \(parallel.tp=2\); use tp=1$"):
        validate(from_dict(raw))
    validate(from_dict({**raw, "parallel": {"dp": 2, "zero": 1}}))


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
    written before optimizers were named reads as AdamW's; one without optimizer state takes any optimizer."""
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
    old["optimizer"]["present"] = False  # no optimizer state (tetron convert's step 0): any optimizer starts fresh
    (folder / STATE_FILE).write_text(json.dumps(seal(old)))
    validate(from_dict({**resumed, "checkpoint": {"resume": str(folder)}}))


TOY_LAYOUTS = {  # (optimizer, parallel)
    "sgd-dp2": ("test_sgd", {"dp": 2}),
    # small buckets: pieces straddle the ranks' slices, or (whole) each rank owns several whole parameters
    "sgd-dp2-zero1": ("test_sgd", {"dp": 2, "zero": 1, "bucket_mb": 0.01}),
    "sgd-dp2-zero2": ("test_sgd", {"dp": 2, "zero": 2, "bucket_mb": 0.01}),
    "whole-dp2-zero1": ("test_whole", {"dp": 2, "zero": 1, "bucket_mb": 0.01}),
    "whole-dp2-zero2": ("test_whole", {"dp": 2, "zero": 2}),
    "whole-dp2-zero3": ("test_whole", {"dp": 2, "zero": 3}),
}


@pytest.mark.parametrize("name", sorted(TOY_LAYOUTS))
def test_an_optimizer_defined_elsewhere_runs_in_every_layout(corpus, cache_dir, tmp_path, toy, name):
    """The toy optimizers under data parallelism and ZeRO-1/2/3 equal their single process (check_layout's losses
    and weights): ZeRO shards the state they declare (their checkpoint holds every momentum_buffer whole), and for
    the one that needs whole matrices keeps each parameter whole on one rank."""
    optimizer, parallel = TOY_LAYOUTS[name]
    check_layout(corpus, cache_dir, tmp_path, parallel=parallel, optim={"name": optimizer},
                 checkpoint={"save_every": 1})
    folder = tmp_path / "run" / "checkpoints" / "step_2"
    state = _trainer_state(folder)["optimizer"]
    assert (state["name"], state["state"], state["step"]) == (optimizer, ["momentum_buffer"], 2.0)


@pytest.mark.parametrize("numels, shards", [([5, 3, 3, 2, 1], 2), ([7], 3), ([1, 1, 1, 1, 1, 1, 1], 4)])
def test_whole_buckets_give_each_parameter_one_owner(numels, shards):
    """A bucket laid out for whole parameters: each lies inside one rank's slice, none overlaps another, the
    slices as long as the fullest rank's parameters."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    bucket = _Bucket(params, torch.device("cpu"), shards=shards, whole=True, allocate=False)
    spans = sorted((bucket.offsets[p], bucket.offsets[p] + p.numel()) for p in params)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(a // bucket.slice_size == (b - 1) // bucket.slice_size for a, b in spans)
    held = [sum(b - a for a, b in spans if a // bucket.slice_size == r) for r in range(shards)]
    assert bucket.slice_size == max(held) and bucket.padded == shards * bucket.slice_size
    assert max(held) <= max(max(numels), -(-sum(numels) // shards) + max(numels))
