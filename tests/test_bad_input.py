"""Bad input: damaged or mismatched checkpoints, bad data, out and tokenizer paths. Each ends in one line
naming the file and what is wrong (exit code 2 through the CLI), and leaves every file on disk as it was.
A seeded fuzz loop feeds many random corruptions through validation."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_cli import user_env

from tetron.checkpoint.check import verify_tensors
from tetron.checkpoint.load import TensorReader
from tetron.checkpoint.save import seal
from tetron.checkpoint.shards import tensor_crc32
from tetron.config import ConfigError, from_dict
from tetron.errors import CheckpointError
from tetron.fs import STATE_FILE, sha256, write_json
from tetron.validate import validate

from conftest import cli_in_process, run_training, tiny_config

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory, corpus, cache_dir) -> tuple[Path, dict]:
    """A real checkpoint after 2 steps (single rank) and the raw config that made it."""
    tmp = tmp_path_factory.mktemp("good")
    raw = tiny_config(corpus, cache_dir, tmp / "run", train={"steps": 2})
    run_training(raw)
    return tmp / "run" / "checkpoints" / "step_2", raw


def hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def reseal(folder: Path) -> None:
    """Recompute the trainer state's file list and checksums (each tensor's crc32, each small file's
    sha256) and its own checksum: a checkpoint consistent with itself."""
    state = json.loads((folder / STATE_FILE).read_text())
    files = {}
    for f in sorted(folder.iterdir()):
        try:
            with safe_open(str(f), "pt") as st:
                files[f.name] = {"size": f.stat().st_size, "writer": 0,
                                 "crc32": {k: tensor_crc32(st.get_tensor(k)) for k in st.keys()}}
        except Exception:  # not (readable as) safetensors: a small file
            files[f.name] = {"size": f.stat().st_size, "sha256": sha256(f)}
    state["files"] = {name: meta for name, meta in files.items() if name != STATE_FILE}
    write_json(folder / STATE_FILE, seal(state))


@contextmanager
def time_limit(seconds: int):
    def fail(*_):
        raise TimeoutError(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def expect_error(raw: dict, root: Path, match: str) -> str:
    """validate() raises one ConfigError line matching `match`; nothing under `root` changes."""
    before = hashes(root)
    with time_limit(30), pytest.raises(ConfigError) as info:
        validate(from_dict(raw))
    message = str(info.value)
    assert "\n" not in message and __import__("re").search(match, message), message
    assert hashes(root) == before
    return message


def copy_of(good, tmp_path) -> tuple[Path, dict]:
    ck, raw = good
    folder = tmp_path / "step_2"
    shutil.copytree(ck, folder)
    return folder, {**raw, "checkpoint": {"resume": str(folder)}, "out": str(tmp_path / "out")}


# ----------------------------------------------------------------------------- each bad input, by name


def test_truncated_safetensors(good, tmp_path):
    folder, raw = copy_of(good, tmp_path)
    data = (folder / SHARD).read_bytes()
    (folder / SHARD).write_bytes(data[: len(data) // 2])
    expect_error(raw, tmp_path, f"{SHARD}: .* bytes, trainer_state.json says .*: truncated")
    reseal(folder)  # even when the trainer state agrees, the header says what is missing
    expect_error(raw, tmp_path, f"{SHARD}: truncated")


def test_flipped_bytes_in_header(good, tmp_path):
    folder, raw = copy_of(good, tmp_path)
    data = bytearray((folder / SHARD).read_bytes())
    data[9:13] = b"@@@@"
    (folder / SHARD).write_bytes(bytes(data))
    expect_error(raw, tmp_path, f"{SHARD}: the safetensors header is not valid JSON: corrupted")


def test_a_flipped_tensor_byte_is_caught_when_read_and_by_tetron_check(good, tmp_path):
    """Nothing reads the tensors before start (sizes, headers and the sealed state are checked): a byte
    flipped inside one is caught by the rank that reads it whole, and by `tetron check`, naming both the
    file and the tensor; an intact checkpoint checks clean."""
    folder, raw = copy_of(good, tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    with open(folder / SHARD, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        begin = json.loads(fh.read(n))[name]["data_offsets"][0]
    data = bytearray((folder / SHARD).read_bytes())
    data[8 + n + begin + 5] ^= 0x10
    (folder / SHARD).write_bytes(bytes(data))
    validate(from_dict(raw))  # passes: the launcher reads no tensor bytes
    line = f"{folder / SHARD}: tensor {name}: its bytes differ from the crc32 in trainer_state.json: corrupted"
    with TensorReader(folder, "model") as reader, pytest.raises(CheckpointError) as info:
        reader.read(name)
    assert str(info.value) == line
    found = cli_in_process(["check", str(tmp_path)], tmp_path)  # a folder holding checkpoints
    assert found.returncode == 2 and "no checkpoint there" in found.stderr
    found = cli_in_process(["check", str(folder)], tmp_path)
    assert found.returncode == 1 and found.stdout.splitlines() == [line], found
    whole = cli_in_process(["check", str(good[0].parent.parent)], tmp_path)  # a run folder: each checkpoint
    assert whole.returncode == 0 and whole.stdout.startswith(f"{good[0]}: ok ("), whole


def test_missing_tensor(good, tmp_path):
    folder, raw = copy_of(good, tmp_path)
    tensors = load_file(folder / SHARD)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / SHARD, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    reseal(folder)
    expect_error(raw, tmp_path, "model.safetensors.index.json: tensor model.layers.1.mlp.up_proj.weight is missing")


def test_wrong_model_shape(good, tmp_path):
    folder, raw = copy_of(good, tmp_path)
    raw["model"] = {**raw["model"], "hidden_size": 64}
    expect_error(raw, tmp_path, "step_2/config.json: model.hidden_size=32 there, but this run has model.hidden_size=64")


def test_edited_json(good, tmp_path):
    folder, raw = copy_of(good, tmp_path)
    (folder / STATE_FILE).write_text((folder / STATE_FILE).read_text().replace('"step": 2', '"step": 7'))
    expect_error(raw, tmp_path, "trainer_state.json: its checksum does not match its content")
    (folder / STATE_FILE).write_text("{ not json")
    expect_error(raw, tmp_path, "trainer_state.json: not valid JSON")
    folder, raw = copy_of(good, tmp_path / "b")
    (folder / "model.safetensors.index.json").write_text("[1, 2")
    expect_error(raw, tmp_path / "b", "model.safetensors.index.json: .*(truncated|corrupted)")
    reseal(folder)
    expect_error(raw, tmp_path / "b", "model.safetensors.index.json: not valid JSON")


CLI_CASES = {
    "truncated checkpoint": (lambda t, ck: ["--resume", str(ck)], f"{SHARD}: .*truncated"),
    "wrong model shape": (lambda t, ck: ["--resume", str(t / "pristine"), "--model.hidden_size=64"],
                          "model.hidden_size=32 there"),
    "missing data path": (lambda t, ck: ["--data", str(t / "nope.txt")], "nope.txt"),
    "unwritable out": (lambda t, ck: ["--out", str(t / "file.txt" / "out")], "cannot create or write"),
    "tokenizer larger than the model": (lambda t, ck: ["--tokenizer", "bpe:300"],
                                        "larger vocabulary than model.vocab_size=256"),
    "resume not a folder": (lambda t, ck: ["--resume", str(t / "nowhere")], "no such folder"),
    "resume past train.steps": (lambda t, ck: ["--resume", str(t / "pristine"), "--steps", "1"],
                                "train.steps=1 is below step 2"),
    "out a folder tetron did not write": (lambda t, ck: ["--out", str(t / "foreign")],
                                          "neither empty nor a tetron run"),
}


def test_bad_inputs_through_the_cli(good, tmp_path):
    folder, raw = copy_of(good, tmp_path)
    shutil.copytree(folder, tmp_path / "pristine")
    data = (folder / SHARD).read_bytes()
    (folder / SHARD).write_bytes(data[:100])
    (tmp_path / "file.txt").write_text("a file, not a folder")
    (tmp_path / "foreign" / "model").mkdir(parents=True)
    (tmp_path / "foreign" / "model" / "notes.txt").write_text("not tetron's: a run must not replace model/")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({**raw, "checkpoint": {}}))
    before = hashes(tmp_path)
    # Two real processes (the exit code of an interpreter); the other cases run the CLI in this process.
    real = {"truncated checkpoint": ["train", str(tmp_path / "tiny.yaml"), "--resume", str(folder)],
            "convert onto an existing path": ["convert", str(folder), str(tmp_path / "file.txt")]}
    procs = {name: subprocess.Popen([sys.executable, "-m", "tetron.cli", *argv], cwd=tmp_path, env=user_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, argv in real.items()}
    results = {name: cli_in_process(["train", str(tmp_path / "tiny.yaml"), *args(tmp_path, folder)], tmp_path)
               for name, (args, _) in CLI_CASES.items() if name not in procs}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())
    assert set(results) == {*CLI_CASES, "convert onto an existing path"}
    for name, result in results.items():
        err = result.stderr
        assert result.returncode == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tetron: error: "), (name, err)
        pattern = CLI_CASES[name][1] if name in CLI_CASES else "(truncated|already exists)"
        assert __import__("re").search(pattern, lines[0]), (name, err)
    assert hashes(tmp_path) == before


# ----------------------------------------------------------------------------- fuzz


BAD_CONFIG = [("checkpoint", "keep", 0), ("checkpoint", "save_every", -1), ("checkpoint", "resume", "/no/such/ck"),
              ("checkpoint", "init_from", "not a hub name!"), ("checkpoint", "shard_mb", 0),
              ("train", "on_nonfinite", "maybe"), ("parallel", "max_restarts", -2), ("checkpoint", "keep", "many"),
              ("checkpoint", "resume", 3.5), ("checkpoint", "init_from", "/no/such/model")]
ODD_VALUES = [None, "x", -1, 3.5, [], {}, True, "", 10**30]


def _corrupt(folder: Path, rng: random.Random) -> str:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    kind = rng.choice(["truncate", "overwrite", "delete", "json", "shape"])
    f = rng.choice(files)
    if kind == "truncate":
        size = f.stat().st_size
        f.write_bytes(f.read_bytes()[: rng.randrange(0, size - 1)])  # a trailing newline alone is not damage
    elif kind == "overwrite":
        data = bytearray(f.read_bytes())
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] = rng.choice([c for c in b"AZaz09@#{}\"" if c != data[i]])
        f.write_bytes(bytes(data))
    elif kind == "delete":
        f.unlink()
    elif kind == "json":
        f = rng.choice([p for p in files if p.suffix == ".json"])
        obj = json.loads(f.read_text())
        node = obj
        key = rng.choice(sorted(node))
        if isinstance(node[key], dict) and node[key] and rng.random() < 0.5:
            node, key = node[key], rng.choice(sorted(node[key]))
        node[key] = rng.choice([v for v in ODD_VALUES if v != node[key]])
        f.write_text(json.dumps(obj))
        if rng.random() < 0.3 and f.name != STATE_FILE:
            reseal(folder)  # consistent hashes: the content itself must be caught
    else:
        tensors = load_file(folder / SHARD)
        name = rng.choice(sorted(tensors))
        t = tensors[name]
        tensors[name] = torch.zeros((t.shape[0] + rng.randint(1, 3), *t.shape[1:]))
        save_file(tensors, folder / SHARD, metadata={"format": "pt"})
        if rng.random() < 0.5:
            reseal(folder)
    return f"{kind} {f.name}"


def test_fuzz_corrupted_checkpoints_and_configs(good, tmp_path):
    rng = random.Random(1234)
    for case in range(50):
        where = tmp_path / f"case{case}"
        folder, raw = copy_of(good, where)
        if case % 5 == 4:  # a bad config value instead
            section, key, value = rng.choice(BAD_CONFIG)
            raw = {**raw, section: {**raw.get(section, {}), key: value}}
            what = f"config {section}.{key}={value!r}"
        else:
            what = _corrupt(folder, rng)
        before = hashes(where)
        try:
            with time_limit(30):
                validate(from_dict(raw))
        except ConfigError as err:
            assert "\n" not in str(err) and str(err), (case, what, err)
        else:  # tensor bytes overwritten pass the start-up checks; reading them (tetron check too) catches them
            assert what.startswith("overwrite") and verify_tensors(folder), f"case {case} ({what}): no error"
        assert hashes(where) == before, (case, what)
        shutil.rmtree(where)


# ----------------------------------------------------------------------------- files a user names


def test_plan_write_and_report_out_never_replace_what_is_there(tmp_path):
    """`tetron plan --write PATH` and `tetron report --out PATH`: a user's file, a folder, a FIFO (in place of a
    device node, which a rename run as root would turn into a plain file) or a link is refused in one line and
    kept as it was; a new name is written, and the report's own PNG is drawn again."""
    from test_report import fake_run

    fake_run(tmp_path / "run", parallel={"dp": 1}, steps=3, timers=False)
    (tmp_path / "README.md").write_text("the user's own")
    (tmp_path / "docs").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "README.md")
    before = hashes(tmp_path)
    plan = ["plan", "--model", "demo", "--nodes", "1", "--gpus-per-node", "2", "--top", "1"]
    for name, what in (("README.md", "a file"), ("docs", "a folder"), ("fifo", "a FIFO"), ("link", "a symbolic link")):
        for argv in ([*plan, "--write", name], ["report", "run", "--out", name]):
            result = cli_in_process(argv, tmp_path)
            lines = result.stderr.strip().splitlines()
            assert result.returncode == 2 and len(lines) == 1, (argv, result.stderr)
            assert lines[0].startswith(f"tetron: error: {argv[-2]} {name}: {what}") and "nothing is overwritten" in \
                lines[0], (argv, lines)
    assert hashes(tmp_path) == before
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode) and (tmp_path / "link").is_symlink()
    assert not any((tmp_path / "docs").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "docs", "fifo", "link", "run"]  # no temporaries

    assert cli_in_process([*plan, "--write", "new.yaml"], tmp_path).returncode == 0
    assert (tmp_path / "new.yaml").read_text().startswith("# tetron plan #1: ")
    for argv in (["report", "run"], ["report", "run"], ["report", "run", "--out", "pic.png"]):
        result = cli_in_process(argv, tmp_path)
        assert result.returncode == 0, result.stderr
    for picture in (tmp_path / "run" / "report.png", tmp_path / "pic.png"):
        assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_new_file_is_never_written_over_or_through_what_is_there(tmp_path, monkeypatch, hard_links):
    """fs.write_bytes(replace=False) links the finished file to its name, or where the file system has no hard
    links creates the name exclusively: either way an existing name (a FIFO here) is an error and stays."""
    import errno

    from tetron.fs import write_bytes

    if not hard_links:
        def no_link(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(os, "link", no_link)
    os.mkfifo(tmp_path / "fifo")
    write_bytes(tmp_path / "new", b"written", replace=False)
    with pytest.raises(FileExistsError):
        write_bytes(tmp_path / "fifo", b"never", replace=False)
    assert (tmp_path / "new").read_bytes() == b"written" and stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "new"]


def test_a_run_folder_is_named_on_one_line_and_known_by_a_runs_own_marks(tmp_path):
    """`--out` with a newline is refused (every log line and message names the folder); a `tetron.lock` file
    does not make a folder holding anything else a run folder (a run that wrote more than its lock wrote its
    log), while a lock alone, or with the ranks' logs (a run killed early), still is."""
    from tetron.fs import RUN_LOCK, is_run_folder

    (tmp_path / "data.txt").write_text("x = 1\n" * 100)
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    (home / RUN_LOCK).write_text("")
    before = hashes(tmp_path)
    train = ["train", "--model", "demo", "--data", "data.txt", "--tokenizer", "bytes"]
    for out, pattern in (("home", r"out=home: a folder that is neither empty nor a tetron run"),
                         ("runs/a\nb", r"out='runs/a\\nb': a run folder's path with a control character")):
        result = cli_in_process([*train, "--out", out], tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and re.match(rf"tetron: error: {pattern}", lines[0]), \
            result.stderr
    assert hashes(tmp_path) == before and not (tmp_path / "runs").exists()

    killed = tmp_path / "killed"
    (killed / "logs").mkdir(parents=True)
    (killed / RUN_LOCK).write_text("")
    assert is_run_folder(killed)
    (killed / "logs" / "rank_0.log").write_text("step 1")
    assert is_run_folder(killed)
    (killed / "notes.txt").write_text("not a run's")
    assert not is_run_folder(killed)
