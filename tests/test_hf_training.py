"""A training config's hf: data (data.path, data.sources, data.val_path) is never loaded whole: a local
dataset folder is keyed by its files and streamed, a hub dataset keyed by its commit and streamed, and
only when the hub cannot be asked is the cached copy loaded whole, as before. All offline: the hub is
monkeypatched."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tetron.config import from_dict
from tetron.data import hf_source
from tetron.data.loader import load_tokens, prepare_data, prepare_tokens
from tetron.data.sources import data_fingerprint, iter_texts
from tetron.data.tokenizer import Tokenizer, load_tokenizer
from tetron.errors import DataError

# ~40 KB in a few hundred rows (paragraphs of standard library source), some of them not ASCII.
ROWS = [p for t in iter_texts("stdlib", max_bytes=40_000) for p in t.split("\n\n") if p.strip()] + ["caf\u00e9 \u2603"]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture
def hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Offline, an isolated datasets cache, no remembered hub answers, and datasets.load_dataset counted:
    `calls` holds its `streaming` flags; a non-streamed load raises unless `allow_whole` is set."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hf_source, "_SHAS", {})
    state: dict[str, Any] = {"calls": [], "allow_whole": False, "cache": tmp_path / "hf-cache"}
    real = datasets.load_dataset

    def load_dataset(*args: Any, streaming: bool = False, **kwargs: Any) -> Any:
        state["calls"].append(streaming)
        if not streaming and not state["allow_whole"]:
            raise AssertionError("the dataset was loaded whole")
        return real(*args, streaming=streaming, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    folder = tmp_path / "ds"
    folder.mkdir()
    _jsonl(folder / "part-0.jsonl", ROWS[: len(ROWS) // 2])  # two files: two shards when streamed
    _jsonl(folder / "part-1.jsonl", ROWS[len(ROWS) // 2:])
    state["folder"] = folder
    return state


def _raw(path: str, cache: Path, **data: Any) -> dict:
    return {"model": "demo", "data": {"path": path, "tokenizer": "bpe:300", "cache_dir": str(cache), **data}}


def test_config_on_hf_folder_streams(hf: dict[str, Any], tmp_path: Path) -> None:
    """data.path=hf:FOLDER trains the BPE and fills the token cache by streaming: the same tokenizer and
    tokens as the same rows in one .jsonl, nothing materialized in the datasets cache; a second call is a
    cache hit that opens nothing; a touched file is a new key, a new store."""
    cache = tmp_path / "cache"
    tok, path = prepare_data(from_dict(_raw(f"hf:{hf['folder']}", cache)))
    assert hf["calls"] and all(hf["calls"])
    assert not any(p.suffix == ".arrow" for p in hf["cache"].rglob("*"))
    ref_tok, ref_path = prepare_data(from_dict(_raw(str(_jsonl(tmp_path / "all.jsonl", ROWS)), cache)))
    assert tok.fingerprint() == ref_tok.fingerprint()
    tokens = load_tokens(path)
    assert tokens.tolist() == load_tokens(ref_path).tolist() == [i for r in ROWS for i in (*tok.encode(r), 0)]
    assert tokens.doc_ends().tolist() == load_tokens(ref_path).doc_ends().tolist()

    hf["calls"].clear()
    assert prepare_data(from_dict(_raw(f"hf:{hf['folder']}", cache)))[1] == path
    assert hf["calls"] == []  # keyed by the folder's files: neither the tokenizer nor the store opened it
    os.utime(hf["folder"] / "part-1.jsonl", ns=(1, 1))
    assert prepare_tokens(f"hf:{hf['folder']}", tok, cache_dir=cache) != path
    assert hf["calls"] and all(hf["calls"])


def test_folder_key(hf: dict[str, Any]) -> None:
    """A folder's key: every file's path, size and mtime (its bytes with hash_contents), and the
    config and split; hidden files are not the dataset's."""
    spec = f"hf:{hf['folder']}"

    def key(spec: str = spec, **kw: Any) -> str:
        return data_fingerprint(spec, text_field="text", max_bytes=None, **kw)

    plain, hashed = key(), key(hash_contents=True)
    assert len({plain, hashed, key(f"{spec}:test"), key(f"{spec}:cfg:train"), key(skip_bad=True)}) == 5
    (hf["folder"] / ".git").mkdir()
    (hf["folder"] / ".git" / "HEAD").write_text("ref")
    assert key() == plain
    os.utime(hf["folder"] / "part-0.jsonl", ns=(1, 1))  # touched, same bytes
    assert key() != plain and key(hash_contents=True) == hashed
    _jsonl(hf["folder"] / "part-0.jsonl", ROWS[: len(ROWS) // 2] + ["one more"])
    assert key(hash_contents=True) != hashed
    (hf["folder"] / "extra.parquet").write_bytes(b"x")  # any file of the folder counts
    assert key(hash_contents=True) not in (hashed, key())
    assert hf["calls"] == []


def test_max_bytes_streams_a_prefix(hf: dict[str, Any], tmp_path: Path) -> None:
    """data.max_bytes with hf:FOLDER reads only a prefix, streamed: the tokens of the non-streamed prefix,
    though the folder's second file cannot be read at all (rows are read 1000 at a time: the first file
    has more)."""
    spec, tok, limit = f"hf:{hf['folder']}", Tokenizer(None, None), 10_000
    _jsonl(hf["folder"] / "part-0.jsonl", ROWS * 4)
    hf["allow_whole"] = True
    with pytest.MonkeyPatch.context() as mp:  # the non-streamed prefix, as the offline fallback reads it
        mp.setattr(hf_source, "hf_streams", lambda spec: False)
        expected = "".join(iter_texts(spec, max_bytes=limit)).encode()
    assert hf["calls"] == [False] and len(expected) > limit - 4
    hf["allow_whole"], hf["calls"] = False, []
    (hf["folder"] / "part-1.jsonl").write_text("{not json\n" * 100)
    path = prepare_tokens(spec, tok, cache_dir=tmp_path / "cache", max_bytes=limit)
    assert bytes(load_tokens(path).tolist()) == expected
    assert hf["calls"] == [True]
    with pytest.raises(DataError, match=r"hf:.*ds shard 1 after row 0: cannot read"):  # all of it: the bad file
        prepare_tokens(spec, tok, cache_dir=tmp_path / "cache")


class _Hub:
    """A hub dataset `org/corpus` with the rows of the folder: its commit, as the hub would answer (None:
    unreachable), and datasets.load_dataset serving it from the folder (as from the local cache)."""

    def __init__(self, hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
        import datasets

        self.sha: str | None = "c0ffee"
        self.asked = 0
        (hf["cache"] / "org___corpus").mkdir(parents=True)  # "in the local datasets cache"
        folder, load = hf["folder"], datasets.load_dataset

        def ask(name: str) -> str | None:
            assert name == "org/corpus"
            self.asked += 1
            return self.sha

        monkeypatch.setattr(hf_source, "_ask_hub", ask)
        monkeypatch.setattr(datasets, "load_dataset", lambda name, *a, **kw: load(
            str(folder) if name == "org/corpus" else name, *a, **kw))


def test_hub_name_keyed_by_commit(hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """hf:ORG/NAME: the repository's commit is the key (asked once, remembered), a new commit a new key,
    and the data is streamed; no whole load anywhere."""
    hub, tok = _Hub(hf, monkeypatch), Tokenizer(None, None)

    def key(**kw: Any) -> str:
        return data_fingerprint("hf:org/corpus", text_field="text", max_bytes=None, **kw)

    first = key()
    assert key() == first and hub.asked == 1 and hf["calls"] == []
    assert key(hash_contents=True) != first and hub.asked == 1
    path = prepare_tokens("hf:org/corpus", tok, cache_dir=tmp_path / "cache")
    assert bytes(load_tokens(path).tolist()) == "".join(ROWS).encode() and all(hf["calls"])
    assert hub.asked == 1
    hub.sha = "beef"
    hf_source._SHAS.clear()  # what SHA_TTL_S later does
    assert key() != first and hub.asked == 2
    hub.sha = "c0ffee"
    hf_source._SHAS.clear()
    assert key() == first


def test_unreachable_hub_loads_the_cached_copy(hf: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """Hub unreachable: today's behaviour, the cached copy loaded whole and keyed by its fingerprint; the
    BPE trainer reads it the same way."""
    hub = _Hub(hf, monkeypatch)
    hub.sha, hf["allow_whole"] = None, True
    tok = load_tokenizer("bpe:300", data_spec="hf:org/corpus", cache_dir=tmp_path / "cache")
    ref = load_tokenizer("bpe:300", data_spec=str(_jsonl(tmp_path / "all.jsonl", ROWS)), cache_dir=tmp_path / "c2")
    assert tok.fingerprint() == ref.fingerprint()
    assert hf["calls"] and not any(hf["calls"])  # whole loads only: streaming needs the hub
    ds = hf_source.load_hf("hf:org/corpus", "text")
    key = data_fingerprint("hf:org/corpus", text_field="text", max_bytes=None)
    assert key == data_fingerprint("hf:org/corpus", text_field="text", max_bytes=None) and ds._fingerprint
    path = prepare_tokens("hf:org/corpus", tok, cache_dir=tmp_path / "cache")
    assert load_tokens(path).tolist() == [i for r in ROWS for i in (*tok.encode(r), 0)]
    assert not any(hf["calls"]) and hub.asked == 1
    monkeypatch.setattr(hf_source, "hub_problem", lambda name, kind: "the hub is unreachable")
    with pytest.raises(DataError, match=r"^data: hf:org/corpus: the hub is unreachable$"):
        data_fingerprint("hf:org/corpus", text_field="text", max_bytes=None)


def _share_rank() -> dict:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    hf_source._SHAS.clear()
    if rank == 0:
        hf_source.remember_commits({"org/web": "abc123", "org/offline": None})
    hf_source.share_hub_commits(rank, dist.get_world_size(), torch.device("cpu"))
    return hf_source.asked_commits()


def test_ranks_take_rank_zeros_hub_answers():
    """Rank 0's hub commits (an answer, and a None: the hub did not answer) reach every rank, which then
    keys and reads the data as rank 0 did, without asking the hub itself."""
    from harness import run_ranks

    for got in run_ranks(3, _share_rank):
        assert got == {"org/web": "abc123", "org/offline": None}
