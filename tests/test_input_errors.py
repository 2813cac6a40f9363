"""Bad input through the `tetron` command, in this process: each bad config value, flag or YAML file ends in
exactly one `tetron: error:` line and exit 2, before anything starts, quoting at most a short prefix of the
value, with every file on disk as it was. A seeded fuzz loop drives a systematic list of them; the tests
after it pin each message and the arithmetic refusal of absurd models."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import pytest
import yaml
from test_cli import REPO, user_env

import tetron.cli as cli
from tetron.config import SECTIONS, ConfigError, from_dict, load_config
from tetron.data.loader import open_store, prepare_data
from tetron.data.store_build import build_store
from tetron.data.tokenizer import Tokenizer
from tetron.errors import DataError
from tetron.fs import STATE_FILE, write_json
from tetron.plan import fit
from tetron.plan.memory import floor, predict
from tetron.validate import validate

HUGE = "9" * 400  # a 400-digit integer
LONG_QUOTE = 120  # an error line may quote at most this much of one value


def tree_hash(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def base_raw(tmp: Path) -> dict:
    """A tiny valid config (conftest.tiny_config's shape) on a small corpus: each case spoils one thing."""
    return {"model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
            "data": {"path": str(tmp / "corpus.txt"), "tokenizer": "bytes", "seq_len": 32,
                     "cache_dir": str(tmp / "cache")},
            "train": {"steps": 4, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 1},
            "parallel": {"device": "cpu"},
            "logging": {"progress": False, "sample_tokens": 0},
            "out": str(tmp / "out")}


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """A corpus and a good config file; launching is replaced by exit 99 (no case may get that far)."""
    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x + 1\n" * 500)
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(base_raw(tmp_path)))
    prepare_data(from_dict(base_raw(tmp_path)))  # the token cache exists: a case that reads it writes nothing
    monkeypatch.setattr(cli, "launch", lambda cfg: 99)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`tetron ARGV` in this process: (exit code, stdout, stderr)."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def expect_one_line(argv: list[str], capsys, match: str = "") -> str:
    code, _, err = run_cli(argv, capsys)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("tetron: error: "), (argv, code, err)
    assert match in lines[0], (argv, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- the cases, generated


def _numeric_fields() -> list[tuple[str, type]]:
    """(section.field, int or float) of every number in the config, optional ones included."""
    found = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
            kind = next((k for k in options if k in (int, float)), None)
            if kind is not None:
                found.append((f"{section}.{f.name}", kind))
    return found


def _enum_fields() -> list[str]:
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
            if typing.get_origin(typing.get_type_hints(cls)[f.name]) is typing.Literal]


# Zero is valid for these (0 disables, or counts from 0): only the values below are bad for every field.
BAD_NUMBERS = ["-1", "nan", "inf", "-inf", HUGE, "-" + HUGE, "many", "[1, -2]", "{a: 1}", "true"]
BOMB = ("a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
        "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
        "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]\n")
BAD_YAML = {
    "unclosed": "model: [1, 2\n", "tabs": "train:\n\tsteps: 3\n", "a list": "- 1\n- 2\n",
    "not text": "\udcff\udcfe", "billion laughs": BOMB + "data:\n  sources: *h\n",
    "laughs in a model": BOMB + "model:\n  rope_scaling: {rope_type: llama3, factor: *h}\n",
    "itself": "data:\n  sources: &s [*s]\n", "5000 digits": "train:\n  steps: " + "9" * 5000 + "\n",
    "nan": "train:\n  lr: .nan\n", "inf": "parallel:\n  timeout_s: .inf\n", "huge": f"train:\n  steps: {HUGE}\n",
    "huge float field": f"train:\n  lr: {HUGE}\n", "unknown section": "trian:\n  steps: 3\n",
    "numeric key": "train:\n  1: 2\n  lrr: 3\n", "section a number": "train: 3\n",
}


def cases(tmp: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of every bad input, in a fixed order: numbers, enums, keys, flags, YAML files."""
    good = str(tmp / "good.yaml")
    found = [(f"{key}={value[:12]}", ["train", good, f"--{key}={value}"])
             for key, _ in _numeric_fields() for value in BAD_NUMBERS]
    found += [(f"{key}=bogus", ["train", good, f"--{key}=bogus"]) for key in _enum_fields()]
    found += [(name, ["train", good, *argv]) for name, argv in {
        "unknown key": ["--train.lrr=1"], "unknown section": ["--nosuch.key=1"], "unknown flag": ["--lrr", "1"],
        "flag without value": ["--steps"], "stray argument": ["--steps", "3", "extra"],
        "long out": ["--out", "x" * 100_000], "rope nan": ["--model.rope_scaling={rope_type: llama3, factor: .nan, "
                                                           "low_freq_factor: 1, high_freq_factor: 4}"],
        "sources bomb": [f"--data.sources={BOMB.replace(chr(10), ' ')}"],
        "sources alias list": ["--data.sources=[&a [1, 2, 3], *a, *a]"],
        "pp_split nan": ["--parallel.pp_split=[.nan, 1]"], "pp_virtual with 1f1b": ["--pp", "2", "--pp-virtual", "2"],
        "zbv on 1 layer": ["--pp", "2", "--pp-schedule", "zbv", "--pp-virtual", "2", "--model.num_hidden_layers=1"],
        "absurd model": ["--model.hidden_size=1000000", "--model.num_hidden_layers=10000",
                         "--model.vocab_size=1000000000"],
        "vocab past int64 elements": ["--model.vocab_size=1000000000000000000"],
        "absurd batch": ["--micro-batch", "1000000000", "--seq-len", "64"],
    }.items()]
    plan = ["plan", good, "--nodes", "1", "--gpus-per-node", "2"]
    found += [(f"plan {' '.join(a)}", plan + a) for a in (
        ["--memory-gb", "nan"], ["--memory-gb", "-5"], ["--memory-gb", "inf"], ["--memory-gb", "1e300"],
        ["--top", "-1"], ["--pick", "0"], ["--batch-tokens", "0"], ["--batch-tokens", HUGE], ["--steps", "0"],
        ["--measure", "-1"], ["--pp-virtual", "2", "--pp-schedule", "1f1b"], ["--pp-schedule", "foo"],
        ["--recompute", "most"], ["--zero", "7"], ["--dp", "0"], ["--nodes", HUGE], ["--gpus-per-node", "0"])]
    tokenize = ["tokenize", str(tmp / "corpus.txt"), "--tokenizer", "bytes", "--out", str(tmp / "store")]
    found += [(f"tokenize --shard-mb {v}", [*tokenize, "--shard-mb", v]) for v in ("inf", "nan", "-1", "1e-9", "1e-4")]
    found += [(f"generate {' '.join(a)}", ["generate", str(tmp / "nowhere"), *a]) for a in (
        ["--temperature", "nan"], ["--top-k", "-1"], ["--max-new-tokens", "-1"], ["--seed", HUGE])]
    for name, text in BAD_YAML.items():
        path = tmp / f"bad-{len(found)}.yaml"
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        found.append((f"yaml {name}", ["train", str(path)]))
    return found


def test_fuzz_bad_input_through_the_cli(folder, capsys):
    """Every generated bad input (a seeded shuffle of the systematic list): one line, exit 2, files unchanged."""
    all_cases = cases(folder)
    assert len(all_cases) >= 100
    random.Random(27).shuffle(all_cases)
    before = tree_hash(folder)
    start = time.monotonic()
    failed = []
    for name, argv in all_cases:
        code, _, err = run_cli(argv, capsys)
        line = err.splitlines()[0] if err else ""
        if code != 2 or len(err.splitlines()) != 1 or not line.startswith("tetron: error: "):
            failed.append((name, code, err[-300:]))
        elif len(line) > 600 or HUGE[:100] in line or "x" * LONG_QUOTE in line:
            failed.append((name, "quotes too much", line[:300]))
        after = tree_hash(folder)
        if after != before:
            failed.append((name, "changed files", sorted(set(after.items()) ^ set(before.items()))[:3]))
            before = after
    assert not failed, failed
    # seconds: each case is checks on a tiny config, nothing started (a launch costs 10-20 s a case); loose
    # enough for a loaded CI machine
    assert time.monotonic() - start < 180


# ----------------------------------------------------------------------------- each item's message


@pytest.mark.parametrize("argv, match", [
    (["--train.steps=" + HUGE], "train.steps=9999999999...99999999999: out of range"),
    (["--train.steps=.inf"], "train.steps='.inf': expected an integer"),
    (["--parallel.timeout_s=inf"], "parallel.timeout_s=inf must be a finite number"),
    (["--data.sources=[&a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], *a, *a, *a, *a, *a, *a, *a, *a, *a, *a]"],
     "data.sources[0]=[1, 2, 3, ...]"),
    (["--pp", "2", "--pp-virtual", "2"], "needs pp_schedule=interleaved (or zbv, with 2; or dualpipev, with 2)"),
    (["--dp", "4", "--zero", "2", "--parallel.dp_shard=3"], "parallel.dp_shard=3 must divide dp*cp=4"),
    (["--dp", "4", "--parallel.dp_shard=2"], "parallel.dp_shard=2 needs parallel.zero >= 1"),
    (["--pp", "4", "--pp-schedule", "zbv", "--pp-virtual", "2"], "num_hidden_layers=4 must fill them; use pp=2"),
    (["--pp", "2", "--pp-schedule", "zbv", "--pp-virtual", "2", "--model.num_hidden_layers=3"],
     "use pp_schedule=zbh1 or 1f1b (zbv needs at least 4 layers)"),
])
def test_config_messages(folder, capsys, argv, match):
    expect_one_line(["train", str(folder / "good.yaml"), *argv], capsys, match)


@pytest.mark.parametrize("name, match", [
    ("billion laughs", "expands to more than 100,000 values"), ("itself", "a YAML alias that contains itself"),
    ("5000 digits", "an integer of more than 4,300 digits"), ("numeric key", "train.1: unknown key"),
])
def test_yaml_messages(folder, capsys, name, match):
    path = folder / "bad.yaml"
    path.write_text(BAD_YAML[name])
    start = time.monotonic()
    expect_one_line(["train", str(path)], capsys, match)
    assert time.monotonic() - start < 30  # the aliases are counted, not expanded (that would not end)


@pytest.mark.parametrize("args, match", [
    (["--memory-gb", "nan"], "--memory-gb=nan: give the memory per device in GiB"),
    (["--memory-gb", "-5"], "--memory-gb=-5.0"), (["--top", "-1"], "--top=-1 must be at least 1"),
    (["--batch-tokens", "0"], "--batch-tokens=0 must be at least 1"),
    (["--pp-virtual", "2", "--pp-schedule", "1f1b"], "--pp-virtual=2 needs --pp-schedule interleaved"),
    (["--nodes", HUGE], "together at most 131,072 ranks"),
])
def test_plan_messages(folder, capsys, args, match):
    expect_one_line(["plan", str(folder / "good.yaml"), "--nodes", "1", "--gpus-per-node", "2", *args], capsys, match)


def test_shard_mb_that_would_make_too_many_files(folder, capsys):
    argv = ["tokenize", str(folder / "corpus.txt"), "--tokenizer", "bytes", "--out", str(folder / "store")]
    expect_one_line([*argv, "--shard-mb", "inf"], capsys, "--shard-mb=inf: give MB of input per shard")
    expect_one_line([*argv, "--shard-mb", "1e-9"], capsys, "from 0.0009766 (1 KiB)")
    with open(folder / "big.txt", "wb") as f:
        f.truncate(2**27)  # 128 MiB of input (sparse: its size is what counts) in 1 KiB shards
    argv[1] = str(folder / "big.txt")
    expect_one_line([*argv, "--shard-mb", "0.001"], capsys, "more than 100,000 files; use --shard-mb 0.00128")
    assert not (folder / "store").exists()


def test_absurd_model_is_refused_by_arithmetic(folder, capsys, monkeypatch):
    """Sizes far past any machine: refused from the lower bound alone, never building a layer for the memory
    model (a vocabulary of 10**21 overflowed its meta-device embedding), in well under a second."""
    monkeypatch.setattr(fit, "predict", lambda cfg: pytest.fail("the memory model ran for an absurd model"))
    monkeypatch.setattr(fit, "available_memory", lambda: 64 * 2**30)  # whatever this machine has free
    for sizes in (["--model.vocab_size=1000000000000000000"],
                  ["--model.hidden_size=1000000", "--model.num_hidden_layers=10000", "--model.vocab_size=10**9"],
                  ["--model.num_hidden_layers=10000000", "--zero", "2", "--dp", "2"],
                  ["--model.num_hidden_layers=10000", "--pp", "2", "--pp-schedule", "afab",
                   "--train.grad_acc=100000000"]):
        sizes = [s.replace("10**9", "1000000000") for s in sizes]
        start = time.monotonic()
        expect_one_line(["train", str(folder / "good.yaml"), *sizes], capsys, "at least, from the sizes alone")
        assert time.monotonic() - start < 20, sizes  # no layer built (20,000 on meta took 238 s), under any load


@pytest.mark.parametrize("overrides", [
    [], ["--zero", "1", "--dp", "2"], ["--zero", "2", "--dp", "2"], ["--zero", "3", "--dp", "2", "--cp", "2"],
    ["--pp", "2", "--pp-schedule", "afab", "--grad-acc", "4"], ["--tp", "2", "--sp"], ["--dp-impl", "naive"],
    ["--train.dtype=bfloat16", "--zero", "1", "--dp", "2", "--model.tie_word_embeddings=true"],
    ["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual", "2", "--grad-acc", "2", "--tp", "2"],
])
def test_the_floor_is_below_the_prediction(folder, overrides):
    """The arithmetic refusal never refuses what the memory model would accept: floor <= predict."""
    cfg = load_config(str(folder / "good.yaml"), overrides)
    assert 0 < floor(cfg).total <= predict(cfg).total, overrides


def test_store_mismatch_with_tokenizer_unset_says_which_it_took(tmp_path):
    """With data.tokenizer unset, the fix is not "leave it unset": the line names what unset took."""
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    build_store(str(tmp_path / "a.txt"), Tokenizer(None, None), tmp_path / "s", workers=1, shard_mb=1)
    other = types.SimpleNamespace(fingerprint=lambda: "another")
    with pytest.raises(DataError) as unset:
        open_store(tmp_path / "s", other, unset_means="/runs/x/checkpoints/step_9")
    assert "unset takes from /runs/x/checkpoints/step_9" in str(unset.value)
    assert "leave data.tokenizer unset" not in str(unset.value)
    with pytest.raises(DataError, match=r"leave data.tokenizer unset \(--data.tokenizer=null\)"):
        open_store(tmp_path / "s", other)


def test_tokenizer_null_unsets_it(folder, capsys):
    code, out, _ = run_cli(["train", str(folder / "good.yaml"), "--data.tokenizer=null", "--print-config"], capsys)
    assert code == 0 and yaml.safe_load(out)["data"]["tokenizer"] is None


def test_resealed_bad_config_in_trainer_state_is_named(folder):
    """A checksum proves trainer_state.json whole, not its saved config valid: the line names the file."""
    ck = folder / "ck"
    ck.mkdir()
    write_json(ck / STATE_FILE, {"step": 1, "config": {"train": {"lr": "fast"}}})
    cfg = from_dict({**base_raw(folder), "checkpoint": {"resume": str(ck)}})
    with pytest.raises(ConfigError, match=r"ck/trainer_state.json: the config saved there is not valid "
                                          r"\(train.lr='fast': expected a number\)"):
        cli._schedule_note(cfg)


def test_a_closed_pipe_ends_quietly():
    """`tetron train --help | head -1`: the reader has gone; no BrokenPipeError traceback, at the print or at
    the interpreter's exit (a real process: the pipe's read end is closed before the command writes)."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "tetron.cli", "train", "--help"], cwd=REPO, env=user_env(),
                              stdout=write, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)
    assert proc.stderr == b"" and proc.returncode == 141, proc.stderr.decode()[-500:]


class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader has gone; its descriptor is a pipe of the test's own (main points it at /dev/null)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


@pytest.mark.parametrize("argv", [["plan", "--model", "smollm-135m", "--nodes", "1", "--gpus-per-node", "1", "--gpu",
                                   "H100", "--top", "2", "--seq-len", "256", "--batch-tokens", "256"],
                                  ["train", "--help"]])
def test_a_closed_pipe_in_process(argv, capsys, monkeypatch):
    """`tetron plan ... | head -2`: the same, for a command whose output comes at the end of its work."""
    read, write = os.pipe()
    monkeypatch.setattr(sys, "stdout", _ClosedPipe(write))
    try:
        assert cli.main(argv) == 141
    finally:
        os.close(read)
        os.close(write)
    assert capsys.readouterr().err == ""


def test_numbers_in_range_pass(folder):
    """The int64 bound refuses nothing a run uses: the largest seed, and whole floats for integers."""
    raw = base_raw(folder)
    cfg = from_dict({**raw, "train": {**raw["train"], "seed": 2**63 - 1, "steps": 4.0}})
    assert cfg.train.seed == 2**63 - 1 and cfg.train.steps == 4 and isinstance(cfg.train.steps, int)


def test_plan_weighs_an_absurd_model_by_arithmetic(folder, capsys, monkeypatch):
    """tetron plan on a vocabulary of 10**18: every layout is over the limit by the lower bound alone (the layer
    read off the meta device for the step time no longer builds that embedding, which overflowed)."""
    monkeypatch.setattr("tetron.plan.search.predict", lambda *a, **k: pytest.fail("the memory model ran"))
    code, out, err = run_cli(["plan", str(folder / "good.yaml"), "--nodes", "1", "--gpus-per-node", "2", "--gpu",
                              "H100", "--model.vocab_size=1000000000000000000"], capsys)
    assert code == 1 and err == "" and "nothing fits" in out, (code, err)


def test_a_fifo_or_a_link_loop_is_named_not_missing(folder, capsys):
    """A config or data path where a FIFO or a loop of symbolic links stands says so: "no such file" or "does
    not exist" would send the user looking for a file that is there."""
    os.mkfifo(folder / "fifo.yaml")
    os.mkfifo(folder / "fifo.txt")
    (folder / "loop").symlink_to(folder / "loop")
    (folder / "dangling").symlink_to(folder / "nowhere.txt")
    good = str(folder / "good.yaml")
    expect_one_line(["train", str(folder / "fifo.yaml")], capsys, "fifo.yaml: a FIFO (a named pipe), not a file")
    expect_one_line(["train", str(folder / "loop")], capsys, "loop: a loop of symbolic links")
    expect_one_line(["train", good, "--data", str(folder / "fifo.txt")], capsys, "fifo.txt is a FIFO")
    expect_one_line(["train", good, "--data", str(folder / "loop")], capsys, "loop is a loop of symbolic links")
    expect_one_line(["train", good, "--data", str(folder / "dangling")], capsys,
                    "dangling is a symbolic link to ")


def test_a_folder_config_heavier_than_its_tensors_is_refused_before_building(folder, capsys, monkeypatch):
    """A config.json of 10**6 layers beside four layers' tensors: train --init-from, convert and generate weigh it
    against the safetensors headers and refuse it, never building the model (its meta model alone took
    minutes)."""
    import transformers

    import tetron.checkpoint.check as check

    model = base_raw(folder)["model"]
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**model)).save_pretrained(folder / "hf")
    hf = json.loads((folder / "hf" / "config.json").read_text())
    (folder / "hf" / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 10**6}))
    (folder / "from-hf.yaml").write_text(yaml.safe_dump({k: v for k, v in base_raw(folder).items() if k != "model"}))
    capsys.readouterr()  # transformers' progress bar
    monkeypatch.setattr(check, "model_specs", lambda *a, **k: pytest.fail("the model was built"))
    for argv in (["train", str(folder / "from-hf.yaml"), "--init-from", str(folder / "hf")],
                 ["convert", str(folder / "hf"), str(folder / "converted")], ["generate", str(folder / "hf")]):
        start = time.monotonic()
        expect_one_line(argv, capsys, "num_hidden_layers=1000000, and the folder's tensors hold 4 layers")
        assert time.monotonic() - start < 10, argv  # "did not build 10**6 layers" (minutes), loosely


def test_plan_of_a_model_far_too_large_returns(folder, capsys, monkeypatch):
    """`tetron plan` of 10**6 layers: every layout over the memory limit by arithmetic, none timed layer by layer;
    it says nothing fits (exit 1)."""
    from tetron.plan import search

    monkeypatch.setattr(search, "estimate", lambda *a, **k: pytest.fail("a layout that does not fit was timed"))
    code, out, _ = run_cli(["plan", "demo", "--model.num_hidden_layers=1000000", "--nodes", "1",
                            "--gpus-per-node", "2", "--gpu", "H100"], capsys)
    assert code == 1 and "nothing fits" in out, out


@pytest.fixture
def moe_folder(folder, capsys) -> Path:
    """A tiny Qwen3-MoE as transformers' save_pretrained writes it (4 experts, top 2)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(folder / "moe")
    (folder / "from-hf.yaml").write_text(yaml.safe_dump({k: v for k, v in base_raw(folder).items() if k != "model"}))
    capsys.readouterr()  # transformers' progress bar
    return folder / "moe"


LLAMA3 = {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "rope_theta": 1e4}
BAD_MOE_AND_ROPE = {  # config.json fields -> what the one line names
    "n_group 0": ({"n_group": 0}, "n_group=0 must be at least 1"),
    "decoder_sparse_step 0": ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be at least 1"),
    "n_shared_experts -1": ({"n_shared_experts": -1}, "n_shared_experts=-1 must be >= 0"),
    "num_experts text": ({"num_experts": "4", "num_local_experts": "4"}, "num_experts='4': expected an integer"),
    "scoring_func 1": ({"scoring_func": 1}, "scoring_func=1: use one of"),
    "one expert a group": ({"n_group": 4, "topk_group": 2}, "n_group=4 leaves 1 expert(s) per group"),
    "factor a list": ({"rope_parameters": {**LLAMA3, "factor": [1]}}, "rope_scaling.factor=[1]: expected a number"),
    "factor text": ({"rope_parameters": {**LLAMA3, "factor": "abc"}}, "rope_scaling.factor='abc': expected a number"),
    "original length null": ({"rope_parameters": {**LLAMA3, "original_max_position_embeddings": None}},
                             "rope_scaling.original_max_position_embeddings=None: expected a positive integer"),
    "rope_parameters a list": ({"rope_parameters": [1, 2]}, "rope_parameters=[1, 2]: expected a mapping"),
}


@pytest.mark.parametrize("name", sorted(BAD_MOE_AND_ROPE))
def test_bad_moe_and_rope_values_in_config_json(moe_folder, capsys, name):
    """Each bad MoE or rope value of a model folder's config.json: one line naming it in train, plan, convert
    and generate (group-limited routing needs two experts per group: the router scores a group by its best
    two)."""
    change, match = BAD_MOE_AND_ROPE[name]
    hf = json.loads((moe_folder / "config.json").read_text())
    (moe_folder / "config.json").write_text(json.dumps({**hf, **change}))
    here = moe_folder.parent
    for argv in (["train", str(here / "from-hf.yaml"), "--init-from", str(moe_folder)],
                 ["plan", "--model", str(moe_folder), "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "32"],
                 ["convert", str(moe_folder), str(here / "converted")], ["generate", str(moe_folder)]):
        expect_one_line(argv, capsys, match)


def test_bad_rope_factor_on_the_command_line_names_the_field(folder, capsys):
    expect_one_line(["train", str(folder / "good.yaml"), "--model.rope_scaling={rope_type: llama3, factor: abc, "
                     "low_freq_factor: 1, high_freq_factor: 4}"], capsys,
                    "model.rope_scaling.factor='abc': expected a number")


@pytest.mark.parametrize("override, kind", [
    ("--model.num_experts_per_tok=1", "setting"), ("--model.scoring_func=sigmoid", "setting"),
    ("--model.norm_topk_prob=true", "setting"), ("--model.routed_scaling_factor=2.5", "setting"),
    ("--model.mlp_only_layers=[1]", "shape"), ("--model.n_shared_experts=1", "shape"),
])
def test_moe_fields_are_compared_with_the_folder_started_from(moe_folder, capsys, override, kind):
    """--init-from a folder whose MoE routing or experts differ from the run's model: one line naming the
    field; a routing change passes with checkpoint.new_model_settings, as a rope change does."""
    field = override.split("=")[0].removeprefix("--")
    argv = ["train", str(moe_folder.parent / "from-hf.yaml"), "--init-from", str(moe_folder), "--model",
            str(moe_folder), override]
    expect_one_line(argv, capsys, f"{field}=")
    allowed = load_config(str(moe_folder.parent / "from-hf.yaml"), [*argv[2:], "--checkpoint.new_model_settings=true"])
    if kind == "setting":
        validate(allowed)
    else:
        with pytest.raises(ConfigError, match=f"{field}="):
            validate(allowed)


def test_init_from_a_hub_name_offline_says_why(folder, capsys, monkeypatch):
    """No model section, --init-from a hub name neither cached nor reachable: that is the line, not "model: none
    given"; a path that is not there and no hub name says so."""
    import tetron.validate.paths

    monkeypatch.setattr(tetron.validate.paths, "hub_problem", lambda name, kind: "not in the cache, and the hub is "
                                                                                 "unreachable: offline")
    argv = ["train", str(folder / "from-hf.yaml"), "--init-from"]
    (folder / "from-hf.yaml").write_text(yaml.safe_dump({k: v for k, v in base_raw(folder).items() if k != "model"}))
    expect_one_line([*argv, "Qwen/Qwen3-0.6B"], capsys,
                    "checkpoint.init_from=Qwen/Qwen3-0.6B: not in the cache, and the hub is unreachable: offline")
    expect_one_line([*argv, "./nowhere"], capsys, "checkpoint.init_from=./nowhere: no such folder, and not a hub name")


@pytest.mark.parametrize("typed, meant", [
    (["--stpes", "3"], "unknown flag --stpes (did you mean --steps?)"),
    (["--seq_len", "32"], "unknown flag --seq_len (did you mean --seq-len?)"),
    (["--warmup_steps", "3"], "unknown flag --warmup_steps (did you mean --train.warmup_steps?)"),
    (["--train.stesp=3"], "train.stesp: unknown key (did you mean steps?)"),
    (["--trian.steps=3"], "trian: unknown section (did you mean train?)"),
    (["--tokenizer", "bpe1024"], "data.tokenizer=bpe1024: no such tokenizer folder or hub name; did you mean "
                                 "bpe:1024?"),
])
def test_a_typo_gets_a_suggestion(folder, capsys, typed, meant):
    expect_one_line(["train", str(folder / "good.yaml"), *typed], capsys, meant)


def test_generate_and_plan_refuse_what_never_ends_or_cannot_hold_anything(folder, capsys):
    """--max-new-tokens 10**20 sampled for ever; --memory-gb 1e-6 planned with negative MiB per rank."""
    expect_one_line(["generate", str(folder), "--max-new-tokens", str(10**20)], capsys,
                    f"--max-new-tokens={10**20}: at most 100,000")
    expect_one_line(["plan", str(folder / "good.yaml"), "--nodes", "1", "--gpus-per-node", "2", "--memory-gb",
                     "0.000001"], capsys, "--memory-gb=1e-06: 9.99e-07 GiB per device leaves nothing for tensors "
                                          "once each rank sets aside 1 GiB")
