"""Token stores and `tetron tokenize`: parallel = serial = the documents encoded one by one, shards and
document boundaries, resume after a kill, bad data in the parallel path, streaming hf: datasets, and a
store as data.path."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tetron.cli import main as cli_main
from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.data.sources import iter_texts
from tetron.data.store_build import build_store
from tetron.data.token_store import TokenStore
from tetron.data.tokenizer import Tokenizer, load_tokenizer
from tetron.errors import DataError

from conftest import run_training, tiny_config

REPO = Path(__file__).resolve().parent.parent


def _jsonl(path: Path, texts: list, field: str = "text") -> Path:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({field: t}) + "\n")
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    cache = tmp_path_factory.mktemp("tok")
    return load_tokenizer("bpe:300", data_spec="stdlib", cache_dir=cache, max_bytes=100_000)


@pytest.fixture(scope="module")
def mixed_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~400 KB: a .jsonl of stdlib modules, text files, a parquet file of two row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("src")
    docs = list(iter_texts("stdlib", max_bytes=400_000))
    _jsonl(root / "a.jsonl", docs[: len(docs) // 2])
    for i, d in enumerate(docs[len(docs) // 2: len(docs) // 2 + 5]):
        (root / f"b{i}.py").write_text(d)
    pq.write_table(pa.table({"text": docs[-20:]}), root / "c.parquet", row_group_size=10)
    return root


def _expected(spec: str, tok: Tokenizer) -> list[int]:
    return [i for t in iter_texts(spec) for i in (*tok.encode(t), tok.eos_id)]


def test_parallel_equals_serial_and_the_documents(tmp_path, mixed_source, bpe):
    serial = build_store(str(mixed_source), bpe, tmp_path / "s1", workers=1, shard_mb=0.03)
    parallel = build_store(str(mixed_source), bpe, tmp_path / "s2", workers=2, shard_mb=0.03)
    assert len(serial["shards"]) >= 5 and serial == parallel  # the same index, shard by shard
    a, b = TokenStore(tmp_path / "s1"), TokenStore(tmp_path / "s2")
    expected = _expected(str(mixed_source), bpe)
    assert a.tolist() == expected and b.tolist() == expected
    assert a.dtype == np.uint16 and serial["num_docs"] == len(list(iter_texts(str(mixed_source))))
    ends = a.doc_ends()
    assert len(ends) == serial["num_docs"] and ends[-1] == len(a)
    assert (np.asarray(a)[ends - 1] == bpe.eos_id).all()  # each document ends with EOS, where recorded
    # a window across a shard boundary reads both shards
    edge = int(a.starts[1])
    assert np.asarray(a[edge - 3: edge + 3]).tolist() == expected[edge - 3: edge + 3]
    # the saved tokenizer is the one used
    assert load_tokenizer(str(tmp_path / "s1" / "tokenizer"), data_spec=None,
                          cache_dir=tmp_path).fingerprint() == bpe.fingerprint()


def test_large_text_file_streams_in_pieces(tmp_path, bpe, monkeypatch):
    """A text file above the piece size is encoded in pieces (constant memory), as one document, with
    the same ids as encoding it whole (byte-level BPE)."""
    from tetron.data import units

    text = "".join(iter_texts("stdlib", max_bytes=60_000))
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(units, "PIECE_BYTES", 5_000)
    pieces = list(units.unit_pieces({"kind": "files", "paths": [str(tmp_path / "big.txt")]}, text_field="text",
                                    skip=None))
    assert len(pieces) > 8 and "".join(p for p, _ in pieces) == text
    assert [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True]
    build_store(str(tmp_path / "big.txt"), bpe, tmp_path / "s", workers=1, shard_mb=1)
    store = TokenStore(tmp_path / "s")
    assert store.tolist() == bpe.encode(text) + [bpe.eos_id] and store.index["num_docs"] == 1


def test_resume_keeps_finished_units(tmp_path, mixed_source, bpe, monkeypatch):
    """An interrupted run (a unit without its done record, a temporary, a stray shard) resumes: finished
    units are kept as they are, the rest redone; the result equals an uninterrupted run."""
    out = tmp_path / "s"
    build_store(str(mixed_source), bpe, out, workers=1, shard_mb=0.03)
    expected = TokenStore(out).tolist()
    (out / "index.json").unlink()
    (out / "u00002.done.json").unlink()  # unit 2 was killed before finishing
    (out / "u00004-000.bin").write_bytes(b"\0" * 5)  # unit 4's shard half-written (its record says otherwise)
    (out / "u00003-000.bin.tmp-abcd").write_bytes(b"junk")
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("u0000[01]-*.bin")}
    redone: list[int] = []
    from tetron.data import store_build

    real = store_build.encode_unit
    monkeypatch.setattr(store_build, "encode_unit", lambda unit, i, **kw: redone.append(i) or real(unit, i, **kw))
    lines: list[str] = []
    build_store(str(mixed_source), bpe, out, workers=1, shard_mb=0.03, say=lines.append)
    assert redone == [2, 4] and any("resuming" in x for x in lines)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("u0000[01]-*.bin")} == mtimes
    assert TokenStore(out).tolist() == expected and not list(out.glob("*.tmp-*"))
    # another tokenizer into the same folder is refused, naming it
    with pytest.raises(DataError, match="holds another tokenization .*tokenizer"):
        build_store(str(mixed_source), Tokenizer(None, None), out, workers=1, shard_mb=0.03)


# The process that is killed: `tetron tokenize` as the command runs it (tetron.cli.main), after it has shown, in
# the same fresh interpreter, that a tokenize of local files never imports datasets (only hf: sources need it).
KILLED_TOKENIZE = ("import sys; from tetron.cli import main; "
                   "assert main(['tokenize', sys.argv[1], '--tokenizer', 'bytes', '--out', sys.argv[2], '--workers', "
                   "'1']) == 0; assert 'datasets' not in sys.modules, 'datasets imported'; "
                   "print('datasets not imported', flush=True); sys.exit(main(['tokenize', *sys.argv[3:]]))")


def test_killed_run_resumes(tmp_path, bpe, capsys):
    """`tetron tokenize` with 2 workers, killed (all its processes) once a unit is done, then run again: the
    finished units' shards are kept and the store equals the documents encoded one by one. The killed process
    first tokenizes a local file without importing datasets."""
    docs = list(iter_texts("stdlib", max_bytes=600_000))  # some 30 units of 0.02 MB: a kill lands after the first
    src = _jsonl(tmp_path / "d.jsonl", docs)
    bpe.save(tmp_path / "tok")
    out = tmp_path / "store"
    args = [str(src), "--tokenizer", str(tmp_path / "tok"), "--out", str(out), "--workers", "2", "--shard-mb", "0.02"]
    proc = subprocess.Popen([sys.executable, "-c", KILLED_TOKENIZE, str(REPO / "README.md"), str(tmp_path / "readme"),
                             *args], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("u*.done.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    printed, err = proc.communicate()
    assert "datasets not imported" in printed.splitlines(), printed + err
    assert not (out / "index.json").exists(), "finished before it could be killed: use more data"
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("u*.done.json")}
    assert kept
    capsys.readouterr()
    code = cli_main(["tokenize", *args])  # the same command again, in this process: nothing here is killed
    err = capsys.readouterr().err
    assert code == 0, err
    assert "resuming" in err and "ETA" in err
    assert all((out / name).stat().st_mtime_ns == t for name, t in kept.items())
    assert TokenStore(out).tolist() == [i for d in docs for i in (*bpe.encode(d), bpe.eos_id)]


def _workers(parent: int) -> list[int]:
    """The pids of the spawned worker processes whose parent is `parent`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if (int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent
                    and b"spawn_main" in (stat.parent / "cmdline").read_bytes()):
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


BUILD = ("import sys; from pathlib import Path; from tetron.data.store_build import build_store; "
         "from tetron.data.tokenizer import load_tokenizer; src, tok, out = sys.argv[1:]; "
         "build_store(src, load_tokenizer(tok, data_spec=None, cache_dir=Path(tok)), Path(out), workers=2, "
         "shard_mb=0.05)")


def _when_working(folder: Path, parent: int, act: Callable[[list[int]], None], seen: dict) -> threading.Thread:
    """A thread that, once `folder` holds a finished unit and `parent` runs its 2 workers, notes the workers and
    the finished units' times in `seen` and calls `act(workers)`."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            done = list(folder.glob("u*.done.json"))
            pids = _workers(parent) if done else []
            if len(pids) == 2:
                seen.update(workers=pids, kept={p.name: p.stat().st_mtime_ns for p in done})
                act(pids)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_stopped_or_killed_tokenize_leaves_no_worker(tmp_path, bpe, capsys):
    """Once a unit is done (2 workers): SIGTERM to tetron tokenize, or Ctrl-C twice (a terminal sends it to
    every process of its group, the workers too) ends the workers, then releases the lock, then ends with
    one line (exit 143, 130), the finished units kept; SIGKILL to tetron: its workers die with it."""
    src = _jsonl(tmp_path / "d.jsonl", list(iter_texts("stdlib", max_bytes=1_500_000)) * 4)
    bpe.save(tmp_path / "tok")

    def args(name: str) -> list[str]:
        return [str(src), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / name), "--workers", "2",
                "--shard-mb", "0.05"]

    running = [False]

    def unhandled(signum: int, _frame) -> None:  # tetron's own handlers replace this while it runs
        if running[0]:
            raise AssertionError(f"signal {signum} reached the test: tetron tokenize does not handle it")
        # else a second Ctrl-C that came after tetron ended: a terminal's would reach the shell

    killed: dict = {}
    # the killed one builds the store as tetron tokenize does, in a process that needs no torch (seconds)
    proc = subprocess.Popen([sys.executable, "-c", BUILD, str(src), str(tmp_path / "tok"), str(tmp_path / "kill")],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    previous = {sig: signal.signal(sig, unhandled) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        watch = _when_working(tmp_path / "kill", proc.pid, lambda _: proc.kill(), killed)

        def ctrl_c(workers: list[int]) -> None:
            for _ in range(2):
                for pid in [*workers, os.getpid()]:
                    try:
                        os.kill(pid, signal.SIGINT)
                    except ProcessLookupError:  # the second: a worker already ended
                        pass
                time.sleep(0.05)

        me = os.getpid()
        for name, act, code in [("term", lambda _: os.kill(me, signal.SIGTERM), 143), ("int", ctrl_c, 130)]:
            seen: dict = {}
            thread = _when_working(tmp_path / name, me, act, seen)
            capsys.readouterr()
            running[0] = True
            code_ = cli_main(["tokenize", *args(name)])
            running[0] = False
            thread.join(120)
            err = capsys.readouterr().err
            assert code_ == code, err
            assert seen and not any(_alive(pid) for pid in seen["workers"]), err  # gone before tetron ended
            assert not (tmp_path / name / "tokenize.lock").exists(), err
            lines = [line for line in err.splitlines() if not line.startswith("tokenize: ")]  # progress lines
            sig = "SIGTERM" if name == "term" else "SIGINT"
            assert len(lines) == 1 and re.fullmatch(rf"tetron: tokenize stopped by {sig}: \d+ finished units kept "
                                                    rf"in {tmp_path / name}; run the same command again to resume",
                                                    lines[0]), err
            assert all((tmp_path / name / n).stat().st_mtime_ns == t for n, t in seen["kept"].items())
        watch.join(120)
        proc.wait(60)
        stop = time.monotonic() + 10
        while killed and any(_alive(pid) for pid in killed["workers"]) and time.monotonic() < stop:
            time.sleep(0.05)
        assert killed and not any(_alive(pid) for pid in killed["workers"])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of that run's session
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------- bad data


def test_bad_records_in_the_parallel_path(tmp_path, capsys):
    """A malformed line deep in a file (a later unit), a non-UTF-8 line, a wrong column type, a corrupt
    parquet file: one line naming the file and the position, no traceback, no index; or skipped and
    counted with --on-bad-record skip."""
    good = ["x" * 50] * 400
    src = tmp_path / "d.jsonl"
    _jsonl(src, good)
    with open(src, "ab") as f:
        offset = f.tell()
        f.write(b'{"text": "unterminated\n')
        f.write(b'{"text": "caf\xe9"}\n')
        f.write(b'{"text": 7}\n')
    _jsonl(tmp_path / "more.jsonl", good)
    out = tmp_path / "s"
    args = [str(tmp_path), "--tokenizer", "bytes", "--out", str(out), "--workers", "2", "--shard-mb", "0.005"]
    assert cli_main(["tokenize", *args]) == 2
    err = capsys.readouterr().err
    # Progress lines ("tokenize: ... ETA") come every 5 s, so a loaded machine shows one first.
    assert [line for line in err.splitlines() if not line.startswith("tokenize: ")] == [err.splitlines()[-1]]
    assert err.splitlines()[-1].startswith("tetron: error: ") and "Traceback" not in err
    assert f"d.jsonl line at byte {offset} is not JSON" in err and "data.on_bad_record=skip" in err
    assert not (out / "index.json").exists()
    assert cli_main(["tokenize", *args, "--on-bad-record", "skip"]) == 2  # another plan: refused, named
    assert "holds another tokenization (its skip_bad differs" in capsys.readouterr().err
    out2 = tmp_path / "s2"
    assert cli_main(["tokenize", *args[:3], "--out", str(out2), *args[5:], "--on-bad-record", "skip"]) == 0
    captured = capsys.readouterr()
    assert f"skipped 3 bad records (data.on_bad_record=skip), the first at {src} line at byte {offset}" in captured.err
    assert len(TokenStore(out2)) == 800 * 50
    # a corrupt parquet file: one line naming it
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    assert cli_main(["tokenize", str(tmp_path / "p"), "--tokenizer", "bytes", "--out", str(tmp_path / "s3")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.parquet is not a readable parquet file" in err


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_out_is_new_empty_or_the_same_store(tmp_path, capsys, monkeypatch):
    """--out: a folder of someone's files (a tokenizer/, a temporary, a file named like a shard), a live run
    folder, a file, or '' (the current folder) is refused in one line and left as it was; a new folder
    becomes the store, and the same command again finds it."""
    src = _jsonl(tmp_path / "d.jsonl", ["x = 1\n" * 20] * 20)
    mine, run = tmp_path / "mine", tmp_path / "run"
    (mine / "tokenizer").mkdir(parents=True)
    (mine / "tokenizer" / "vocab.json").write_text("{}")
    (mine / "notes.tmp-1").write_text("mine")
    (mine / "u00000-keep.bin").write_text("mine")
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "tetron.lock").write_text("{}")
    monkeypatch.chdir(mine)
    before = _snapshot(tmp_path)
    for out, pattern in [(mine, f"--out={re.escape(str(mine))}: a folder that is neither empty nor a token store"),
                         (run, f"--out={re.escape(str(run))}: a folder that is neither empty nor a token store"),
                         (src, "--out=.*d.jsonl: exists and is not a folder"), ("", "--out='': give the store's")]:
        assert cli_main(["tokenize", str(src), "--tokenizer", "bytes", "--out", str(out), "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and re.match(f"tetron: error: {pattern}", err), err
    assert _snapshot(tmp_path) == before
    args = ["tokenize", str(src), "--tokenizer", "bytes", "--out", str(tmp_path / "store"), "--workers", "1"]
    assert cli_main(args) == 0 and cli_main(args) == 0, capsys.readouterr().err
    assert len(TokenStore(tmp_path / "store")) == 20 * 20 * 6


# ----------------------------------------------------------------------------- streaming hf: datasets


def test_hf_streaming(tmp_path, bpe, monkeypatch):
    """hf:FOLDER is read with datasets' streaming mode (shards of the dataset over the workers): nothing
    is written to the datasets cache, and the store equals the rows encoded one by one."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    folder = tmp_path / "ds"
    folder.mkdir()
    rows = list(iter_texts("stdlib", max_bytes=60_000))
    ds = datasets.Dataset.from_dict({"text": rows, "n": list(range(len(rows)))})
    for k in range(3):  # three files: three shards of the streamed dataset
        ds.shard(3, k, contiguous=True).to_parquet(str(folder / f"part-{k}.parquet"))
    index = build_store(f"hf:{folder}", bpe, tmp_path / "s", workers=2, shard_mb=1)
    assert len(index["shards"]) == 3 and index["num_docs"] == len(rows)
    assert TokenStore(tmp_path / "s").tolist() == [i for r in rows for i in (*bpe.encode(r), bpe.eos_id)]
    assert not any(p.suffix == ".arrow" for p in (tmp_path / "hf-cache").rglob("*"))  # never materialized
    with pytest.raises(DataError, match=r"has a int in 'n', not text"):
        build_store(f"hf:{folder}", bpe, tmp_path / "s2", workers=1, shard_mb=1, text_field="n")
    with pytest.raises(DataError, match=r"has no column 'body'"):
        build_store(f"hf:{folder}", bpe, tmp_path / "s3", workers=1, shard_mb=1, text_field="body")


# ----------------------------------------------------------------------------- a store as data.path


def test_train_on_a_store(corpus, cache_dir, tmp_path, bpe):
    """data.path naming a store trains exactly as the source it was made from; its own tokenizer is used
    when data.tokenizer is unset; another tokenizer is refused."""
    bpe.save(tmp_path / "tok")
    build_store(str(corpus), bpe, tmp_path / "store", workers=1, shard_mb=0.02)  # several shards
    assert len(TokenStore(tmp_path / "store").shards) > 3
    model = {"vocab_size": 300}
    from_text = tiny_config(corpus, cache_dir, tmp_path / "a", model=model, train={"steps": 3},
                            data={"tokenizer": str(tmp_path / "tok")})
    from_store = tiny_config(corpus, cache_dir, tmp_path / "b", model=model, train={"steps": 3},
                             data={"path": str(tmp_path / "store"), "tokenizer": None})
    assert run_training(from_store) == run_training(from_text)
    tok, path = prepare_data(from_dict(from_store))
    assert path == tmp_path / "store" and tok.fingerprint() == bpe.fingerprint()
    with pytest.raises(DataError, match="was tokenized with another tokenizer"):
        prepare_data(from_dict({**from_store, "data": {**from_store["data"], "tokenizer": "bytes"}}))


def test_a_damaged_cached_store_is_made_again(corpus, tmp_path):
    """A truncated shard or a damaged index of a cached store: said, and tokenized again."""
    raw = tiny_config(corpus, tmp_path / "cache", tmp_path / "out")
    _, store = prepare_data(from_dict(raw))
    (shard,) = store.glob("*.bin")
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    lines: list[str] = []
    assert prepare_data(from_dict(raw), say=lines.append)[1] == store
    assert any(re.search(r"the token cache .* is truncated or missing .*; tokenizing again", x) for x in lines)
    assert shard.stat().st_size == size
    (store / "index.json").write_text("{ not json")
    lines.clear()
    prepare_data(from_dict(raw), say=lines.append)
    assert "is unreadable" in lines[0] and len(TokenStore(store)) == size // 2


def test_held_out_tail_of_a_store(corpus, cache_dir, tmp_path):
    """data.val_fraction cuts the held-out tail off a multi-shard store lazily (a view: nothing read); the
    training sampler never reaches it."""
    from tetron.data.loader import DataLoader
    from tetron.observe.evaluate import held_out_tokens, training_tokens

    build_store(str(corpus), Tokenizer(None, None), tmp_path / "s", workers=1, shard_mb=0.02)
    store = TokenStore(tmp_path / "s")
    assert len(store.shards) > 5
    cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path / "o", data={"val_fraction": 0.1}))
    train, held = training_tokens(store, cfg), held_out_tokens(store, cfg)
    assert not store._maps  # views: no shard mapped yet
    assert len(train) + len(held) == len(store) and len(held) >= 0.1 * len(store) - cfg.data.seq_len
    assert np.array_equal(np.concatenate([np.asarray(train), np.asarray(held)]), np.asarray(store))
    loader = DataLoader(train, cfg.data.seq_len, micro_batch=4, grad_acc=1, dp_size=1, dp_rank=0, seed=0)
    last = max(int(w) for s in range(loader.sampler.num_windows // 4 + 1) for w in loader.sampler.indices(s))
    assert (last + 1) * cfg.data.seq_len + 1 <= len(train)  # the last window sampled ends before the tail


def test_a_stores_tokenizer_wins_over_the_config_files(tmp_path, capsys):
    """configs/demo.yaml names bpe:4096 for the stdlib; on a token store the store's own tokenizer wins, with a
    note. The same tokenizer given on the command line is still refused in one line."""
    from tetron.cli import _fit_tokenizer
    from tetron.config import CONFIGS_DIR, load_config
    from tetron.data.loader import tokenizer_spec

    (tmp_path / "text.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    store = tmp_path / "store"
    build_store(str(tmp_path / "text.txt"), Tokenizer(None, None), store, workers=1)
    demo, data = str(CONFIGS_DIR / "demo.yaml"), ["--data", str(store), "--out", str(tmp_path / "run")]
    cfg, notes = _fit_tokenizer(load_config(demo, data), data)
    assert cfg.data.tokenizer is None and tokenizer_spec(cfg) == str(store / "tokenizer")
    assert notes == [f"data.tokenizer=bpe:4096 (from the config) gives way to {store / 'tokenizer'}, the tokenizer "
                     f"the data was tokenized with"]
    assert cli_main(["train", demo, *data, "--print-config"]) == 0
    assert "  tokenizer: null\n" in capsys.readouterr().out
    assert cli_main(["train", demo, *data, "--tokenizer", "bpe:4096"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tetron: error: data.tokenizer=bpe:4096 is trained on text, and data.path is a token "
                          "store: leave data.tokenizer unset") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
