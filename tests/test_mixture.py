"""Mixtures (data.sources): weighted, layout-free sampling, per-source epochs, and the loader's position
(each source's) in checkpoints: a resumed run, in another layout, continues with the same losses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tetron.config import from_dict
from tetron.data.mixture import MixtureLoader, WeightedTokens
from tetron.data.store_build import build_store
from tetron.data.tokenizer import Tokenizer
from tetron.errors import ConfigError, DataError
from tetron.validate import validate

from conftest import LOSS_RTOL, run_training, tiny_config


def _sources(weights=(3.0, 1.0), epochs=(None, None), sizes=(4001, 1601)) -> list[WeightedTokens]:
    rng = np.random.default_rng(0)
    return [WeightedTokens(rng.integers(0, 60000, size=n).astype(np.uint16) + 0, w, e, name=f"s{i}")
            for i, (n, w, e) in enumerate(zip(sizes, weights, epochs))]


def _loader(sources, *, micro=8, acc=1, dp=1, rank=0, seed=3) -> MixtureLoader:
    return MixtureLoader(sources, 8, micro_batch=micro, grad_acc=acc, dp_size=dp, dp_rank=rank, seed=seed)


@pytest.mark.parametrize("dp,acc", [(1, 4), (2, 2), (4, 1)])
def test_layout_independence(dp, acc):
    sources, B = _sources(), 16
    ref = _loader(sources, micro=B)
    loaders = [_loader(sources, micro=B // (dp * acc), acc=acc, dp=dp, rank=r) for r in range(dp)]
    for _ in range(40):  # 640 rows: both sources wrap their epochs
        (rx, ry, *_), = ref.next_batch()
        parts = [mb for loader in loaders for mb in loader.next_batch()]
        assert torch.equal(torch.cat([mb.inputs for mb in parts]), rx)
        assert torch.equal(torch.cat([mb.targets for mb in parts]), ry)
    assert all(loader.consumed == ref.consumed for loader in loaders)


def test_weights_windows_and_epochs():
    sources = _sources()
    loader = _loader(sources, micro=16)
    rows = [loader.global_rows(s) for s in range(100)]
    for s in range(100):
        loader.consumed = loader._draw(s, loader.consumed)[2]
    src = np.concatenate([r[0] for r in rows])
    assert abs((src == 0).mean() - 0.75) < 0.04  # weights 3:1
    # each source's draws walk its epoch permutations: every window once per epoch
    n1 = loader.num_windows[1]
    first = np.concatenate([w[s == 1] for s, w in rows])[:n1]
    assert sorted(first.tolist()) == list(range(n1))
    # the row is the source's window: tokens [w*T, w*T+T+1)
    fresh = _loader(sources, micro=16)
    (x, y, *_), = fresh.batch_for_step(0)
    s0, w0 = fresh.global_rows(0)
    assert x[0].tolist() == sources[s0[0]].tokens[w0[0] * 8: w0[0] * 8 + 8].tolist()

    # epochs: source 0 (weight 3) leaves after one pass over its windows; source 1 fills the rest
    capped = _loader(_sources(epochs=(1, None)), micro=16)
    rows = [capped.next_batch() and capped.consumed[:] for _ in range(60)]
    assert rows[-1][0] == capped.num_windows[0] and rows[-1][1] == 60 * 16 - capped.num_windows[0]
    both = _loader(_sources(epochs=(1, 0.5)), micro=16)
    with pytest.raises(DataError, match="every source has given its epochs by step"):
        for _ in range(60):
            both.next_batch()


def test_state_resumes_exactly_and_checks_the_sources():
    a = _loader(_sources(), micro=4, acc=2, dp=2, rank=1)
    for _ in range(7):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    assert state["step"] == 7 and [s["consumed"] for s in state["sources"]] == a.consumed
    assert sum(a.consumed) == 7 * 16
    b = _loader(_sources(), micro=16)  # another layout, same global batch
    b.load_state_dict(state)
    ref = _loader(_sources(), micro=16)
    for _ in range(7):
        ref.next_batch()
    for _ in range(5):
        (bx, *_), = b.next_batch()
        (rx, *_), = ref.next_batch()
        assert torch.equal(bx, rx)
    # new weights continue from each source's position; other sources are refused
    _loader(_sources(weights=(1.0, 1.0)), micro=16).load_state_dict(state)
    with pytest.raises(DataError, match="give the same sources in the same order"):
        _loader(_sources(sizes=(4001, 1701)), micro=16).load_state_dict(state)
    with pytest.raises(DataError, match="seed=3, this run has 4"):
        _loader(_sources(), micro=16, seed=4).load_state_dict(state)


def test_sources_are_validated(corpus, cache_dir, tmp_path):
    def cfg(data):
        return from_dict(tiny_config(corpus, cache_dir, tmp_path / "o", data=data))

    from tetron.cli import _check_data

    good = cfg({"sources": [{"path": str(corpus), "weight": 2}, {"path": str(corpus), "epochs": 1}]})
    validate(good)
    _check_data(good)  # what `tetron train` checks before starting ranks: tokenized, enough windows
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight=-1 must be a positive number"):
        validate(cfg({"sources": [{"path": str(corpus), "weight": -1}]}))
    with pytest.raises(ConfigError, match=r"data.sources\[1\]=.*give \{path"):
        validate(cfg({"sources": [{"path": str(corpus)}, {"file": "x"}]}))
    with pytest.raises(ConfigError, match=r"data.sources\[0\]=.*nope does not exist"):
        validate(cfg({"sources": [{"path": str(tmp_path / "nope"), "weight": 1}]}))
    with pytest.raises(ConfigError, match="give data.val_path"):
        validate(cfg({"sources": [{"path": str(corpus)}], "val_fraction": 0.1}))
    with pytest.raises(ConfigError, match="data.tokenizer=bpe:300 is trained on text"):
        validate(from_dict(tiny_config(corpus, cache_dir, tmp_path / "o", model={"vocab_size": 300},
                                       data={"sources": [{"path": str(corpus)}], "tokenizer": "bpe:300"})))


def test_resume_in_another_layout(corpus, cache_dir, tmp_path):
    """A two-source mixture (a store and a text file) trained 8 steps at dp 2, against 4 steps at dp 1
    saved and resumed at dp 2 for the last 4: the same losses (LOSS_RTOL)."""
    half = len(corpus.read_text()) // 2
    (tmp_path / "b.txt").write_text(corpus.read_text()[half:])
    build_store(str(corpus), Tokenizer(None, None), tmp_path / "store", workers=1, shard_mb=0.05)
    sources = [{"path": str(tmp_path / "store"), "weight": 2.0}, {"path": str(tmp_path / "b.txt"), "weight": 1.0,
                                                                     "epochs": 2}]

    def cfg(out, dp, steps, **extra):
        return tiny_config(corpus, cache_dir, tmp_path / out, data={"sources": sources}, parallel={"dp": dp},
                           train={"steps": steps, "micro_batch": 4 // dp, "grad_acc": 1, "lr": 1e-3}, **extra)

    full = run_training(cfg("full", 2, 8))
    run_training(cfg("a", 1, 8, checkpoint={"save_every": 4}))
    step4 = tmp_path / "a" / "checkpoints" / "step_4"
    state = json.loads((step4 / "trainer_state.json").read_text())["loader"]
    assert state["step"] == 4 and sum(s["consumed"] for s in state["sources"]) == 16
    resumed = run_training(cfg("b", 2, 8, checkpoint={"resume": str(step4)}))
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[4:]), rtol=LOSS_RTOL, atol=0)
