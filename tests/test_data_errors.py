"""Bad data, full disks and damaged files met before or during a run: each one line naming the file or
field and what would help, never a traceback (issue 27)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tetron.config import from_dict
from tetron.data.batch import MicroBatch
from tetron.data.loader import check_token_ids, prepare_data
from tetron.data.store_build import build_store
from tetron.data.token_store import TokenStore
from tetron.data.tokenizer import Tokenizer
from tetron.errors import DataError
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
