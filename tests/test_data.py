"""Tests for tetron.data.loader: sources, tokenizers, the token cache and the layout-free sampler."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from tetron.data import tokenizer as tokenizer_module
from tetron.data.loader import BatchSampler, DataLoader, default_cache_dir, load_tokens, prepare_tokens
from tetron.data.sources import data_fingerprint, iter_texts, resolve_files
from tetron.data.tokenizer import Tokenizer, load_tokenizer
from tetron.errors import DataError


def _write_jsonl(path: Path, texts: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))


def _write_parquet(path: Path, texts: list[str], field: str = "text", row_group_size: int = 2) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts, "n": list(range(len(texts)))}), path, row_group_size=row_group_size)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha text\n")
    (root / "sub" / "b.py").write_text("print('b')\n")
    (root / "sub" / "c.md").write_text("# c\n")
    (root / "ignored.bin").write_bytes(b"\x00\x01")
    return root


# ----------------------------------------------------------------------------- sources


def test_resolve_file_folder_glob(corpus: Path) -> None:
    assert resolve_files(str(corpus / "a.txt")) == [corpus / "a.txt"]
    assert resolve_files(str(corpus)) == [corpus / "a.txt", corpus / "sub" / "b.py", corpus / "sub" / "c.md"]
    assert resolve_files(str(corpus / "**" / "*.py")) == [corpus / "sub" / "b.py"]
    assert resolve_files(str(corpus / "*.txt")) == [corpus / "a.txt"]


def test_resolve_stdlib() -> None:
    files = resolve_files("stdlib")
    root = Path(sysconfig.get_paths()["stdlib"])
    assert len(files) > 500
    assert files == sorted(files)
    assert all(p.suffix == ".py" and p.is_file() for p in files)
    assert not any({"site-packages", "dist-packages"} & set(p.parts) for p in files)
    assert root / "os.py" in files and root / "json" / "decoder.py" in files


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        resolve_files(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"0")
    with pytest.raises(DataError, match=r"no \.txt/\.jsonl/\.parquet"):
        resolve_files(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="no files match"):
        resolve_files(str(tmp_path / "**" / "*.nothing"))


def test_read_formats(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "1.jsonl", ["first doc", "second doc"])
    _write_parquet(tmp_path / "2.parquet", ["p0", "p1", "p2", "p3", "p4"])
    (tmp_path / "3.txt").write_text("whole file\nas one doc\n")
    assert list(iter_texts(str(tmp_path))) == [
        "first doc", "second doc", "p0", "p1", "p2", "p3", "p4", "whole file\nas one doc\n",
    ]
    _write_jsonl(tmp_path / "c.jsonl", ["x"], field="content")
    assert list(iter_texts(str(tmp_path / "c.jsonl"), text_field="content")) == ["x"]


def test_bad_text_field(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, ["ok"])
    with open(path, "a") as f:
        f.write(json.dumps({"body": "no text here"}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl line 2 has no string field 'text'"):
        list(iter_texts(str(path)))
    _write_parquet(tmp_path / "e.parquet", ["a"])
    with pytest.raises(DataError, match=r"no column 'body'.*columns: text, n"):
        list(iter_texts(str(tmp_path / "e.parquet"), text_field="body"))


def test_non_utf8_file(tmp_path: Path) -> None:
    (tmp_path / "latin1.py").write_bytes("# caf\u00e9\n".encode("latin-1"))
    assert list(iter_texts(str(tmp_path / "latin1.py"))) == ["# caf\ufffd\n"]


def test_max_bytes_is_a_prefix(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(f"doc{i} " * 10)  # 50 bytes each
    full = "".join(iter_texts(str(tmp_path)))
    docs = list(iter_texts(str(tmp_path), max_bytes=120))
    assert len(docs) == 3 and "".join(docs) == full[:120]
    # A multi-byte character is never split in half.
    (tmp_path / "u.txt").write_text("\u00e9" * 10)
    assert list(iter_texts(str(tmp_path / "u.txt"), max_bytes=5)) == ["\u00e9\u00e9"]


def test_hf_local_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "ds"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", [f"row {i}" for i in range(7)])
    assert list(iter_texts(f"hf:{folder}")) == [f"row {i}" for i in range(7)]
    assert list(iter_texts(f"hf:{folder}:train", max_bytes=12)) == ["row 0", "row 1", "ro"]
    with pytest.raises(DataError, match="has no column 'body'"):
        list(iter_texts(f"hf:{folder}", text_field="body"))
    pq_folder = tmp_path / "pq"
    pq_folder.mkdir()
    _write_parquet(pq_folder / "data.parquet", ["a", "b"], field="content")
    assert list(iter_texts(f"hf:{pq_folder}", text_field="content")) == ["a", "b"]


# ----------------------------------------------------------------------------- tokenizers


def test_bytes_tokenizer(tmp_path: Path) -> None:
    tok = load_tokenizer("bytes", data_spec=None, cache_dir=tmp_path)
    assert tok.vocab_size == 256 and tok.eos_id is None
    assert tok.encode("h\u00e9") == [104, 0xC3, 0xA9]
    assert tok.encode_batch(["a", "bc"]) == [[97], [98, 99]]
    assert tok.decode(tok.encode("h\u00e9 \u2713")) == "h\u00e9 \u2713"
    assert tok.decode([0xFF]) == "\ufffd"
    tok.save(tmp_path / "tok")
    back = load_tokenizer(str(tmp_path / "tok"), data_spec=None, cache_dir=tmp_path)
    assert back.backend is None and back.fingerprint() == tok.fingerprint()


def test_tokenizer_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="integer vocabulary size from 257"):
        load_tokenizer("bpe:abc", data_spec="stdlib", cache_dir=tmp_path)
    with pytest.raises(DataError, match="give a data spec"):
        load_tokenizer("bpe:300", data_spec=None, cache_dir=tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope" / "tokenizer.json"), data_spec=None, cache_dir=tmp_path)


SAMPLE = "def f(x):\n    return x + 1  # caf\u00e9 \u2713\n\nclass A:\n    pass\n"


@pytest.fixture(scope="module")
def bpe_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding a bpe:384 tokenizer trained on ~200 KB of the standard library."""
    cache = tmp_path_factory.mktemp("cache")
    load_tokenizer("bpe:384", data_spec="stdlib", cache_dir=cache, max_bytes=200_000)
    return cache


def test_bpe_trains_and_round_trips(bpe_cache: Path) -> None:
    tok = load_tokenizer("bpe:384", data_spec="stdlib", cache_dir=bpe_cache, max_bytes=200_000)
    assert tok.vocab_size == 384
    assert tok.eos_id == tok.backend.token_to_id("<|endoftext|>") == 0
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert len(ids) < len(SAMPLE.encode()) * 0.8  # merges learned from code compress code
    assert tok.encode_batch([SAMPLE, "x = 1"]) == [ids, tok.encode("x = 1")]


def test_bpe_cache_hit(bpe_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (trained,) = (bpe_cache / "tokenizers").iterdir()
    mtime = (trained / "tokenizer.json").stat().st_mtime_ns

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tokenizer_module, "_train_bpe", no_training)
    tok = load_tokenizer("bpe:384", data_spec="stdlib", cache_dir=bpe_cache, max_bytes=200_000)
    assert tok.vocab_size == 384
    assert (trained / "tokenizer.json").stat().st_mtime_ns == mtime
    assert [p.name for p in (bpe_cache / "tokenizers").iterdir()] == [trained.name]
    # Other data is another key, so it trains.
    with pytest.raises(AssertionError, match="retrained"):
        load_tokenizer("bpe:384", data_spec="stdlib", cache_dir=bpe_cache, max_bytes=100_000)


def test_bpe_save_load_and_transformers(bpe_cache: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = load_tokenizer("bpe:384", data_spec="stdlib", cache_dir=bpe_cache, max_bytes=200_000)
    tok.save(tmp_path / "tok")
    back = load_tokenizer(str(tmp_path / "tok"), data_spec=None, cache_dir=tmp_path)
    assert (back.vocab_size, back.eos_id, back.fingerprint()) == (tok.vocab_size, tok.eos_id, tok.fingerprint())
    assert back.encode(SAMPLE) == tok.encode(SAMPLE)

    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"))
    assert fast.encode(SAMPLE, add_special_tokens=False) == tok.encode(SAMPLE)
    auto = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert auto.encode(SAMPLE, add_special_tokens=False) == tok.encode(SAMPLE)
    assert auto.eos_token_id == tok.eos_id and len(auto) == tok.vocab_size

    # Without tetron's own file the folder is read through transformers: same ids, same cache key.
    os.remove(tmp_path / "tok" / "tetron_tokenizer.json")
    via_hf = load_tokenizer(str(tmp_path / "tok"), data_spec=None, cache_dir=tmp_path)
    assert (via_hf.vocab_size, via_hf.eos_id) == (384, 0)
    assert via_hf.fingerprint() == tok.fingerprint()


# ----------------------------------------------------------------------------- token file


def test_prepare_tokens_eos_cache_atomic(tmp_path: Path, bpe_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = load_tokenizer("bpe:384", data_spec="stdlib", cache_dir=bpe_cache, max_bytes=200_000)
    docs = ["import os\n", "x = [1, 2]\n", "caf\u00e9\n"]
    _write_jsonl(tmp_path / "d.jsonl", docs)
    cache = tmp_path / "cache"
    path = prepare_tokens(str(tmp_path / "d.jsonl"), tok, cache_dir=cache)
    expected = [i for d in docs for i in (*tok.encode(d), tok.eos_id)]
    tokens = load_tokens(path)
    assert tokens.dtype == np.uint16 and len(tokens) == len(expected)
    assert tokens.tolist() == expected and np.asarray(tokens[2:5]).tolist() == expected[2:5]
    index = json.loads((path / "index.json").read_text())
    assert index["num_tokens"] == len(expected) and index["dtype"] == "uint16" and index["vocab_size"] == 384
    assert index["num_docs"] == 3 and tokens.doc_ends().tolist() == np.cumsum([len(tok.encode(d)) + 1
                                                                                for d in docs]).tolist()
    assert index["tokenizer"] == tok.fingerprint()

    # Cached: neither tokenized again nor read (a store opens by its index and its shards' sizes).
    mtime = (path / "index.json").stat().st_mtime_ns
    monkeypatch.setattr(Tokenizer, "encode_batch", lambda self, texts: pytest.fail("re-tokenized"))
    monkeypatch.setattr(np, "fromfile", lambda *a, **k: pytest.fail("a shard was read to open the store"))
    assert prepare_tokens(str(tmp_path / "d.jsonl"), tok, cache_dir=cache) == path
    assert len(load_tokens(path)) == len(expected)
    assert (path / "index.json").stat().st_mtime_ns == mtime
    monkeypatch.undo()

    # New content (another size or mtime), new key; a failure midway leaves no index, so nothing is used.
    _write_jsonl(tmp_path / "d.jsonl", docs + ["more"])

    def boom(self: Tokenizer, texts: list[str]) -> list[list[int]]:
        raise RuntimeError("crash while tokenizing")

    monkeypatch.setattr(Tokenizer, "encode_batch", boom)
    with pytest.raises(RuntimeError, match="crash"):
        prepare_tokens(str(tmp_path / "d.jsonl"), tok, cache_dir=cache)
    (half,) = [p for p in (cache / "tokens").iterdir() if p != path]
    assert not (half / "index.json").exists() and not list(half.glob("*.bin"))
    monkeypatch.undo()
    path2 = prepare_tokens(str(tmp_path / "d.jsonl"), tok, cache_dir=cache)
    assert path2 == half and load_tokens(path2).tolist() == expected + tok.encode("more") + [0]


def test_cache_key_uses_stat_not_contents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local source's cache key costs a stat per file; data.hash_contents reads the bytes."""
    (tmp_path / "a.txt").write_text("hello")
    reads: list[str] = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN202
        if "b" in mode and str(file).endswith("a.txt"):
            reads.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    import builtins

    monkeypatch.setattr(builtins, "open", counting_open)
    key = data_fingerprint(str(tmp_path), text_field="text", max_bytes=None)
    assert reads == []
    hashed = data_fingerprint(str(tmp_path), text_field="text", max_bytes=None, hash_contents=True)
    assert len(reads) == 1 and hashed != key
    monkeypatch.undo()
    os.utime(tmp_path / "a.txt", ns=(1, 1))  # touched, same bytes: a new key, unless hashing contents
    assert data_fingerprint(str(tmp_path), text_field="text", max_bytes=None) != key
    assert data_fingerprint(str(tmp_path), text_field="text", max_bytes=None, hash_contents=True) == hashed


def test_prepare_tokens_bytes_and_empty(tmp_path: Path) -> None:
    tok = Tokenizer(None, None)
    (tmp_path / "a.txt").write_text("h\u00e9")
    (tmp_path / "b.txt").write_text("yo")
    path = prepare_tokens(str(tmp_path), tok, cache_dir=tmp_path / "cache")
    assert load_tokens(path).tolist() == [104, 0xC3, 0xA9, 121, 111]  # no EOS for bytes
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    with pytest.raises(DataError, match="gave no tokens"):
        prepare_tokens(str(tmp_path / "empty"), tok, cache_dir=tmp_path / "cache")


def test_uint32_for_large_vocab(tmp_path: Path) -> None:
    tok = Tokenizer(None, None, vocab_size=70_000)  # bytes ids, but a vocabulary beyond uint16
    (tmp_path / "a.txt").write_text("ab")
    assert load_tokens(prepare_tokens(str(tmp_path / "a.txt"), tok, cache_dir=tmp_path)).dtype == np.uint32


# ----------------------------------------------------------------------------- sampling


def test_sampler_deterministic_and_epochs() -> None:
    # 1 + 10*4 tokens give 10 windows of 5 tokens; batches of 3 wrap across epochs.
    s = BatchSampler(41, 4, global_batch=3, seed=7)
    assert s.num_windows == 10
    stream = np.concatenate([s.indices(step) for step in range(10)])  # 30 positions = 3 epochs
    for e in range(3):
        epoch = stream[e * 10 : (e + 1) * 10]
        assert sorted(epoch.tolist()) == list(range(10))
        assert epoch.tolist() == np.random.default_rng([7, e]).permutation(10).tolist()
    assert stream[:10].tolist() != stream[10:20].tolist()
    again = BatchSampler(41, 4, global_batch=3, seed=7)
    assert again.indices(9).tolist() == s.indices(9).tolist() == stream[27:30].tolist()
    other = BatchSampler(41, 4, global_batch=3, seed=8)
    assert np.concatenate([other.indices(k) for k in range(4)]).tolist() != stream[:12].tolist()


def test_sampler_too_few_windows() -> None:
    with pytest.raises(DataError, match="40 tokens give 9 windows of seq_len\\+1=5, fewer than the global batch 10"):
        BatchSampler(40, 4, global_batch=10, seed=0)


def _tokens(n: int = 2000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 60000, size=n).astype(np.uint16)


def test_targets_are_shifted_windows() -> None:
    tokens = _tokens()
    loader = DataLoader(tokens, 16, micro_batch=2, grad_acc=3, dp_size=1, dp_rank=0, seed=1)
    batch = loader.batch_for_step(5)
    rows = loader.sampler.indices(5)
    assert len(batch) == 3
    for k, (x, y, *_) in enumerate(batch):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2, 16)
        for r in range(2):
            i = int(rows[k * 2 + r])
            window = tokens[i * 16 : i * 16 + 17].astype(np.int64)
            assert x[r].tolist() == window[:-1].tolist()
            assert y[r].tolist() == window[1:].tolist()
        assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("grad_acc", [1, 2, 4])
def test_layout_independence(dp_size: int, grad_acc: int) -> None:
    tokens, seq_len, global_batch = _tokens(), 8, 16
    ref = DataLoader(tokens, seq_len, micro_batch=global_batch, grad_acc=1, dp_size=1, dp_rank=0, seed=3)
    micro = global_batch // (dp_size * grad_acc)
    loaders = [
        DataLoader(tokens, seq_len, micro_batch=micro, grad_acc=grad_acc, dp_size=dp_size, dp_rank=r, seed=3)
        for r in range(dp_size)
    ]
    for _step in range(20):  # 20*16 windows > 249: crosses an epoch boundary
        (ref_x, ref_y, *_), = ref.next_batch()
        parts = [mb for loader in loaders for mb in loader.next_batch()]
        assert len(parts) == dp_size * grad_acc and all(mb.inputs.shape == (micro, seq_len) for mb in parts)
        assert torch.equal(torch.cat([mb.inputs for mb in parts]), ref_x)
        assert torch.equal(torch.cat([mb.targets for mb in parts]), ref_y)


def test_resume_from_state_dict() -> None:
    tokens = _tokens()
    a = DataLoader(tokens, 8, micro_batch=2, grad_acc=2, dp_size=2, dp_rank=1, seed=5)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"step": 3, "seed": 5, "global_batch": 8, "seq_len": 8, "num_tokens": 2000}
    b = DataLoader(tokens, 8, micro_batch=2, grad_acc=2, dp_size=2, dp_rank=1, seed=5)
    assert not torch.equal(b.batch_for_step(0)[0][0], a.batch_for_step(3)[0][0])
    b.load_state_dict(state)
    for (xa, ya, *_), (xb, yb, *_) in zip(a.next_batch(), b.next_batch()):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert b.step == 4
    # A different layout with the same global batch resumes too; different sampling does not.
    DataLoader(tokens, 8, micro_batch=8, grad_acc=1, dp_size=1, dp_rank=0, seed=5).load_state_dict(state)
    with pytest.raises(DataError, match="seed=5, this run has 6"):
        DataLoader(tokens, 8, micro_batch=2, grad_acc=2, dp_size=2, dp_rank=1, seed=6).load_state_dict(state)
    with pytest.raises(DataError, match="global_batch=8, this run has 4"):
        DataLoader(tokens, 8, micro_batch=2, grad_acc=2, dp_size=1, dp_rank=0, seed=5).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len=8, this run has 16"):
        DataLoader(tokens, 16, micro_batch=2, grad_acc=2, dp_size=2, dp_rank=1, seed=5).load_state_dict(state)


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "tetron"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "tetron"


def test_preparing_data_says_what_it_does(corpus, tmp_path):
    """Training a BPE and tokenizing take seconds to minutes: each says so once, and a cached
    call says nothing."""
    from tetron.config import from_dict
    from tetron.data.loader import prepare_data

    raw = {"model": "demo", "data": {"path": str(corpus), "tokenizer": "bpe:300", "cache_dir": str(tmp_path)}}
    lines: list[str] = []
    prepare_data(from_dict(raw), say=lines.append)
    assert len(lines) == 2 and lines[0].startswith("training a 300-token byte-level BPE on ")
    assert lines[1].startswith(f"tokenizing {corpus}")
    prepare_data(from_dict(raw), say=lines.append)
    assert len(lines) == 2
