"""train.compile: each decoder layer compiled, trained against the eager single process (fp32, same losses)."""

from __future__ import annotations

import pytest
import torch

from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.device import compile_problem
from tetron.mesh import Mesh
from tetron.train import train
from tetron.validate import validate

from conftest import LOSS_RTOL, tiny_config
from harness import run_ranks


def _compiled_rank(raw: dict) -> dict:
    import torch._inductor.config
    from torch._dynamo.utils import counters

    # Inductor's default pool of compile workers starts processes that each import torch: on 2 cores that
    # costs more than it saves on these few small kernels.
    torch._inductor.config.compile_threads = 1
    cfg = from_dict(raw)
    result = train(cfg, Mesh(tp=cfg.parallel.tp))
    layers = list(result.model.model.layers.values())
    return {"losses": result.losses, "graphs": counters["stats"]["unique_graphs"],
            "compiled": all(layer._compiled_call_impl is not None for layer in layers),
            "names": sorted(result.model.state_dict())}


def _eager_rank(raw: dict) -> dict:
    cfg = from_dict(raw)
    result = train(cfg, Mesh())
    return {"losses": result.losses, "names": sorted(result.model.state_dict())}


# Inductor compiles its CPU kernels with a C++ compiler; without one, torch.compile cannot run at all.
@pytest.mark.skipif(compile_problem("cpu") is not None, reason=str(compile_problem("cpu")))
def test_compiled_layers_train_like_eager(corpus, cache_dir, tmp_path):
    """Tensor parallelism and selective recompute inside the compiled layers (the hardest case: the policy
    traced by torch.compile, the tp collectives in autograd Functions), against the eager single process."""
    train_cfg = {"steps": 4, "recompute": "selective"}
    eager_raw = tiny_config(corpus, cache_dir, tmp_path / "eager", train=train_cfg)
    compiled_raw = tiny_config(corpus, cache_dir, tmp_path / "compiled", parallel={"tp": 2},
                               train={**train_cfg, "compile": True})
    for raw in (eager_raw, compiled_raw):
        validate(from_dict(raw))
        prepare_data(from_dict(raw))
    (eager,) = run_ranks(1, _eager_rank, eager_raw, timeout=300)
    compiled = run_ranks(2, _compiled_rank, compiled_raw, timeout=600)
    for rank in compiled:
        assert rank["compiled"] and rank["graphs"] >= 1  # Dynamo really produced graphs
        assert rank["names"] == eager["names"]  # compiled in place: Hugging Face names kept
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(eager["losses"]), rtol=LOSS_RTOL, atol=0)


def test_compile_without_a_compiler_is_refused_before_start(corpus, cache_dir, tmp_path, monkeypatch):
    from tetron import device as dev
    from tetron.errors import ConfigError

    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"compile": True}, parallel={"device": "cpu"})
    validate(from_dict(raw))  # a compiler is here
    monkeypatch.setattr(dev.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^train.compile=true: .*C\+\+ compiler.*set train.compile=false$"):
        validate(from_dict(raw))
