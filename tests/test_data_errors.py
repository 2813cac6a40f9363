"""Bad data, full disks and damaged files met before or during a run: each one line naming the file or
field and what would help, never a traceback (issue 27)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tetron.cli import _check_data
from tetron.cli import main as cli_main
from tetron.config import from_dict, load_config
from tetron.data.batch import MicroBatch
from tetron.data.loader import check_token_ids, prepare_data
from tetron.data.store_build import build_store
from tetron.data.token_store import TokenStore
from tetron.data.tokenizer import Tokenizer
from tetron.errors import ConfigError, DataError
from tetron.fs import STATE_FILE
from tetron.validate import validate

from conftest import tiny_config


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A bytes store of three documents in two shards."""
    (tmp_path / "src").mkdir()
    for i, text in enumerate(["first document " * 40, "second " * 60, "third " * 50]):
        (tmp_path / "src" / f"{i}.txt").write_text(text)
    build_store(str(tmp_path / "src"), Tokenizer(None, None), tmp_path / "store", shard_mb=0.0003)
    assert len(TokenStore(tmp_path / "store").shards) >= 2
    return tmp_path / "store"


def test_a_store_without_its_tokenizer_says_so(store, corpus, tmp_path):
    """Not "does not exist" or "the hub is unreachable": the store's tokenizer/ folder is what is missing."""
    shutil.rmtree(store / "tokenizer")
    raw = tiny_config(corpus, tmp_path / "cache", tmp_path / "out", data={"path": str(store), "tokenizer": None})
    with pytest.raises(DataError, match=r"^data.path=.*store: the token store has no tokenizer/ folder .*set "
                                        r"data.tokenizer"):
        validate(from_dict(raw))


def test_missing_or_garbage_docs_files(store):
    """A store whose .docs is missing or the wrong size is refused at opening (a stat, as for the .bin); one
    of the right size holding garbage is refused when the document ends are read."""
    docs = next(p for p in sorted(store.glob("*.docs")) if p.stat().st_size)
    good = docs.read_bytes()
    docs.unlink()
    with pytest.raises(DataError, match=rf"{docs} is truncated or missing \(None bytes; .*make the store again"):
        TokenStore(store)
    docs.write_bytes(b"garbage")
    with pytest.raises(DataError, match=rf"{docs} is truncated or missing \(7 bytes"):
        TokenStore(store)
    docs.write_bytes(np.full(len(good) // 8, 1 << 40, np.int64).tobytes())  # past the shard's end
    with pytest.raises(DataError, match=rf"{docs} is damaged \(its document ends are not increasing"):
        TokenStore(store).doc_ends()


def test_a_cached_store_without_its_docs_is_tokenized_again(corpus, tmp_path):
    """The README's promise for the automatic cache holds for the .docs files too."""
    raw = tiny_config(corpus, tmp_path / "cache", tmp_path / "out")
    cached = prepare_data(from_dict(raw))[1]
    (docs,) = cached.glob("*.docs")
    docs.unlink()
    lines: list[str] = []
    assert prepare_data(from_dict(raw), say=lines.append)[1] == cached
    assert "is truncated or missing" in lines[0] and lines[0].endswith("tokenizing again") and docs.is_file()


def test_token_ids_beyond_the_vocabulary(corpus, tmp_path):
    """A store is never read whole at opening, so an id the embedding has no row for is caught in the batch
    that holds it, as one line naming the data, not an IndexError inside the model."""
    cfg = from_dict(tiny_config(corpus, tmp_path / "cache", tmp_path / "out"))
    ok = MicroBatch(torch.full((2, 4), 255), torch.full((2, 4), 255))
    check_token_ids([ok], cfg, step=1)
    bad = MicroBatch(torch.full((2, 4), 7), torch.tensor([[1, 2, 3, 4], [5, 6, 7, 256]]))
    with pytest.raises(DataError, match=rf"^data: step 3's batch holds token id 256, not below model.vocab_size=256: "
                                        rf"{corpus} holds ids of another vocabulary"):
        check_token_ids([ok, bad], cfg, step=3)


# ----------------------------------------------------------------------------- mixtures


def _mixture_config(store: Path, corpus: Path, tmp_path: Path, *, steps: int, epochs=None, weight="5e-1") -> Path:
    """A YAML config of two sources, written as a user would (YAML 1.1 reads `5e-1` as text)."""
    raw = tiny_config(corpus, tmp_path / "cache", tmp_path / "out", train={"steps": steps})
    raw["data"] = {**raw["data"], "path": "stdlib", "tokenizer": None,
                   "sources": [{"path": str(store), "weight": weight}, {"path": str(corpus), "weight": 1}]}
    if epochs is not None:
        for s in raw["data"]["sources"]:
            s["epochs"] = epochs
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(raw).replace("'5e-1'", "5e-1"))
    return path


def test_a_weight_in_exponent_form_is_a_number(store, corpus, tmp_path):
    """`weight: 5e-1` in YAML is accepted like `lr: 3e-4`: a number, not the text '5e-1'."""
    path = _mixture_config(store, corpus, tmp_path, steps=2)
    assert "weight: 5e-1" in path.read_text() and isinstance(yaml.safe_load(path.read_text())["data"]["sources"][0]
                                                              ["weight"], str)
    cfg = load_config(str(path))
    assert cfg.data.sources[0]["weight"] == 0.5
    validate(cfg)
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight='half': expected a number"):
        from_dict({"data": {"sources": [{"path": str(store), "weight": "half"}]}})


def test_epochs_that_end_before_the_steps_are_refused_before_start(store, corpus, tmp_path, capsys):
    """Every source has epochs: the windows they give bound the steps; more is one line before any rank."""
    path = _mixture_config(store, corpus, tmp_path, steps=100_000, epochs="1e0")
    assert cli_main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"tetron: error: data.sources: the epochs of {store} \([\d,]+ tokens\), {corpus} \([\d,]+ "
                        rf"tokens\) give [\d,]+ more windows of data.seq_len\+1=33, fewer than the 200,000 that 100000 "
                        rf"steps of 2 rows need; train at most \d+ steps, raise their epochs, or leave one without "
                        rf"epochs\n", err), err
    assert not (tmp_path / "out").exists()


def test_reordered_sources_on_resume(store, corpus, tmp_path):
    """A checkpoint's sources given in another order: refused before start, naming both lists; the loader
    refuses it too, even when the token counts cannot tell (two stores of one size)."""
    from tetron.data.mixture import MixtureLoader, Source

    tokens = np.arange(3000) % 200
    first = [Source(tokens, 1.0, name="a"), Source(tokens[::-1].copy(), 1.0, name="b")]
    loader = MixtureLoader(first, 8, micro_batch=2, grad_acc=1, dp_size=1, dp_rank=0, seed=0)
    loader.next_batch()
    swapped = MixtureLoader(first[::-1], 8, micro_batch=2, grad_acc=1, dp_size=1, dp_rank=0, seed=0)
    with pytest.raises(DataError, match=r"in another order: the checkpoint was trained on a \(3,000 tokens\), b "
                                        r"\(3,000 tokens\); this run gives b \(3,000 tokens\), a \(3,000 tokens\)"):
        swapped.load_state_dict(loader.state_dict())
    moved = [Source(tokens, 1.0, name="elsewhere/a"), Source(tokens, 1.0, name="elsewhere/b")]
    MixtureLoader(moved, 8, micro_batch=2, grad_acc=1, dp_size=1, dp_rank=0, seed=0).load_state_dict(
        loader.state_dict())  # stores copied to another folder: the counts decide

    path = _mixture_config(store, corpus, tmp_path, steps=4)
    cfg = load_config(str(path))
    state = {"step": 2, "seed": 1, "global_batch": 2, "seq_len": 32, "num_tokens": 0,
             "sources": [{"path": str(corpus), "num_tokens": len(TokenStore(prepare_data(cfg)[1][1])), "consumed": 3},
                         {"path": str(store), "num_tokens": len(TokenStore(store)), "consumed": 1}]}
    step = tmp_path / "out" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / STATE_FILE).write_text(json.dumps({"step": 2, "loader": state}))
    with pytest.raises(DataError) as err:  # what tetron train checks before it starts any rank
        _check_data(load_config(str(path), ["--resume", "auto"]))
    assert str(err.value).startswith(f"data.sources: in another order: the checkpoint was trained on {corpus} (")
    assert f"this run gives {store} (" in str(err.value)
