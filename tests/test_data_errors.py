"""Bad data, full disks and damaged files met before or during a run: each one line naming the file or
field and what would help, never a traceback (issue 27)."""

from __future__ import annotations

import errno
import json
import re
import shutil
import signal
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
from tetron.data.token_store import ShardWriter, TokenStore
from tetron.data.tokenizer import Tokenizer
from tetron.errors import ConfigError, DataError, StorageError
from tetron.fs import STATE_FILE
from tetron.observe.metrics import MetricsLog
from tetron.observe.step_report import check_outputs
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


def test_a_store_of_a_larger_vocabulary_is_refused_before_start(store, corpus, tmp_path):
    """What a store's index says of its ids is checked before start (its shards are not read then): a store
    written with a larger vocabulary than the model's is one line, before any rank meets its ids."""
    from tetron.cli import _check_data

    index = json.loads((store / "index.json").read_text())
    (store / "index.json").write_text(json.dumps({**index, "vocab_size": 300}))
    raw = tiny_config(corpus, tmp_path / "cache", tmp_path / "out", data={"path": str(store), "tokenizer": None})
    with pytest.raises(ConfigError, match=r"^data.path=.*store: its ids come from a vocabulary of 300 .*more than "
                                          r"model.vocab_size=256"):
        _check_data(from_dict(raw))


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


@pytest.mark.timeout(120)  # were it not refused, it would train
def test_epochs_that_end_before_the_steps_are_refused_before_start(store, corpus, tmp_path, capsys):
    """Every source has epochs: the windows they give bound the steps; more is one line before any rank."""
    path = _mixture_config(store, corpus, tmp_path, steps=4000, epochs="1e0")  # about 3,150 steps' worth
    assert cli_main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"tetron: error: data.sources: the epochs of {store} \([\d,]+ tokens\), {corpus} \([\d,]+ "
                        rf"tokens\) give [\d,]+ more windows of data.seq_len\+1=33, fewer than the 8,000 that "
                        rf"4000 steps of 2 rows need; train at most \d+ steps, raise their epochs, or leave one "
                        rf"without epochs\n", err), err
    assert not (tmp_path / "out").exists()


def test_reordered_sources_on_resume(store, corpus, tmp_path):
    """A checkpoint's sources given in another order: refused before start, naming both lists; the loader
    refuses it too, even when the token counts cannot tell (two stores of one size)."""
    from tetron.data.mixture import MixtureLoader, WeightedTokens

    tokens = np.arange(3000) % 200
    first = [WeightedTokens(tokens, 1.0, name="a"), WeightedTokens(tokens[::-1].copy(), 1.0, name="b")]
    loader = MixtureLoader(first, 8, micro_batch=2, grad_acc=1, dp_size=1, dp_rank=0, seed=0)
    loader.next_batch()
    swapped = MixtureLoader(first[::-1], 8, micro_batch=2, grad_acc=1, dp_size=1, dp_rank=0, seed=0)
    with pytest.raises(DataError, match=r"in another order: the checkpoint was trained on a \(3,000 tokens\), b "
                                        r"\(3,000 tokens\); this run gives b \(3,000 tokens\), a \(3,000 tokens\)"):
        swapped.load_state_dict(loader.state_dict())
    moved = [WeightedTokens(tokens, 1.0, name="elsewhere/a"), WeightedTokens(tokens, 1.0, name="elsewhere/b")]
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


# ----------------------------------------------------------------------------- full disks, damaged outputs


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_tokenizing(corpus, tmp_path, monkeypatch, capsys):
    """A full cache disk (data.path tokenized on start) or store disk (tetron tokenize --out) is one line
    saying "no space" and naming the folder, not an OSError traceback or a line blaming data.path."""
    monkeypatch.setattr(ShardWriter, "add", _no_space)
    raw = tiny_config(corpus, tmp_path / "cache", tmp_path / "out")
    with pytest.raises(StorageError, match=rf"^{tmp_path}/cache/tokens/\w+.*: no space left on device \([\d.]+ \w+ "
                                           rf"free\), while tokenizing into {tmp_path}/cache/tokens/\w+; free space"):
        prepare_data(from_dict(raw))
    assert cli_main(["tokenize", str(corpus), "--tokenizer", "bytes", "--out", str(tmp_path / "s"),
                     "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"tetron: error: {tmp_path}/s\S*: no space left on device .*, while tokenizing into "
                        rf"{tmp_path}/s; .*finished units are kept\)\n", err), err


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tiny model folder (weights, config.json, bytes tokenizer), written in-process."""
    from tetron.checkpoint.save import save_model
    from tetron.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    save_model(Llama(config), tmp_path / "model", tokenizer=Tokenizer(None, None))
    return tmp_path / "model"


def test_convert_to_a_full_or_unwritable_destination(model_dir, tmp_path, monkeypatch, capsys):
    """Both directions: one line naming the destination, and no temporary folder left beside it."""
    import tetron.checkpoint.convert as convert

    monkeypatch.setattr(convert, "write_tensors", _no_space)
    assert cli_main(["convert", str(model_dir), str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"tetron: error: {tmp_path}\S*: no space left on device \(.* free; it needs about "
                        rf"[\d.]+ KiB\), while writing {tmp_path}/ck\n", err), err
    monkeypatch.undo()
    assert cli_main(["convert", str(model_dir), str(tmp_path / "ck")]) == 0
    monkeypatch.setattr(convert.shutil, "copyfile", _no_space)
    assert cli_main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 2
    assert "no space left on device" in capsys.readouterr().err
    monkeypatch.undo()

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert cli_main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"tetron: error: {tmp_path}/\.hf\.tmp-\w+: cannot write \(Read-only file system\), while "
                        rf"writing {tmp_path}/hf\n", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "model"]


@pytest.mark.parametrize("temperature", ["1e-30", "1e30", "0", "1e-300"])
def test_generate_at_extreme_temperatures(model_dir, temperature, capsys):
    """Tiny temperatures are greedy in the limit (not inf - inf = nan inside torch.multinomial); huge ones
    near uniform."""
    assert cli_main(["generate", str(model_dir), "--temperature", temperature, "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.parametrize("temperature", ["-1", "nan", "inf"])
def test_generate_refuses_bad_temperatures(model_dir, temperature, capsys):
    assert cli_main(["generate", str(model_dir), "--temperature", temperature]) == 2
    assert capsys.readouterr().err == (f"tetron: error: --temperature={float(temperature)} must be a finite number "
                                       f">= 0 (0: greedy)\n")


def test_generate_from_weights_holding_nan(model_dir, capsys):
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / "model.safetensors")
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert cli_main(["generate", str(model_dir), "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err == (f"tetron: error: {model_dir}: the weights of model.norm.weight hold NaN or inf "
                                       f"(saved from a run that diverged?); sample from an earlier checkpoint "
                                       f"(RUN/checkpoints/step_N)\n")


def test_metrics_log_replaced_by_a_folder(corpus, tmp_path, capsys):
    """Refused before any rank starts (and where the log is opened), not an IsADirectoryError on rank 0."""
    (tmp_path / "out" / "metrics.jsonl").mkdir(parents=True)
    raw = tiny_config(corpus, tmp_path / "cache", tmp_path / "out", train={"steps": 2})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli_main(["train", str(path)]) == 2
    assert capsys.readouterr().err == (f"tetron: error: out: {tmp_path}/out/metrics.jsonl is a folder, where the "
                                       f"run appends its log; move it aside or give another out\n")
    with pytest.raises(StorageError, match="is a folder"):
        MetricsLog(tmp_path / "out" / "metrics.jsonl")


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A machine without W&B credentials: no key in the environment, an empty home (no ~/.netrc)."""
    import wandb

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    wandb.teardown()  # wandb keeps the settings it first read
    yield
    wandb.teardown()


def test_wandb_without_credentials_is_refused_before_start(corpus, tmp_path, monkeypatch, no_wandb_login):
    import wandb

    cfg = from_dict(tiny_config(corpus, tmp_path / "cache", tmp_path / "out", logging={"wandb": "proj"}))
    with pytest.raises(ConfigError, match=r"^logging.wandb=proj: no W&B credentials here \(WANDB_API_KEY, or "
                                          r"~/.netrc from `wandb login`\); run `wandb login`, set WANDB_MODE=offline"):
        check_outputs(cfg)
    monkeypatch.setenv("WANDB_MODE", "offline")  # offline needs none
    wandb.teardown()
    check_outputs(cfg)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    wandb.teardown()
    check_outputs(cfg)


# ----------------------------------------------------------------------------- stops and restarts, as said


def _report(folder: Path, attempt: int, rank: int, state: str, **fields) -> None:
    (folder / f"attempt{attempt}_rank{rank}.json").write_text(json.dumps(
        {"pid": 1 << 22, "rank": rank, "attempt": attempt, "state": state, **fields}))


def _checkpoint(out: Path, step: int) -> Path:
    folder = out / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text("{}")
    return folder


def test_a_killed_rank_suggests_resuming_only_from_a_checkpoint(tmp_path):
    """"continue with --resume auto" only where something was saved to resume from."""
    from types import SimpleNamespace

    from tetron.observe.watch import RankWatch

    (tmp_path / "reports").mkdir()
    watch = RankWatch(tmp_path / "reports", out=str(tmp_path / "out"), steps=10, timeout_s=5, stop_signal=None)
    error = SimpleNamespace(failures={1: SimpleNamespace(exitcode=-signal.SIGKILL)})
    reports = {0: {"rank": 0, "state": "running"}, 1: {"rank": 1, "state": "running"}}
    assert watch.failure_line(error, reports) == (
        "tetron: error: rank 1 was killed by SIGKILL (out of memory, or killed from outside); the run ended (no "
        "checkpoint was saved: run the same command again to start over)")
    watch.stuck = {1: "T"}
    timed_out = {0: {"rank": 0, "state": "timeout"}, 1: {"rank": 1, "state": "running"}}
    assert watch.failure_line(error, timed_out).endswith("the run ended (no checkpoint was saved: run the same "
                                                         "command again to start over)")
    _checkpoint(tmp_path / "out", 4)
    assert watch.failure_line(error, timed_out).endswith("the run ended (continue with --resume auto)")


def test_a_stop_signal_sent_to_one_rank_ends_with_the_stopped_line(tmp_path, capsys):
    """SIGTERM to one rank's pid (not to tetron): every rank saves; the launcher's last line says so, naming
    the signal and the rank that got it, as for a signal to tetron itself."""
    from tetron.observe.watch import RankWatch

    (tmp_path / "reports").mkdir()
    step = _checkpoint(tmp_path / "out", 3)
    _report(tmp_path / "reports", 0, 0, "stopped", step=3, checkpoint=str(step), signal=None)
    _report(tmp_path / "reports", 0, 1, "stopped", step=3, checkpoint=str(step), signal="SIGTERM")
    watch = RankWatch(tmp_path / "reports", out=str(tmp_path / "out"), steps=10, timeout_s=5, stop_signal=None)
    assert watch.finish(None) == 0
    assert capsys.readouterr().out == (f"tetron: stopped by SIGTERM (sent to rank 1) after step 3 of 10: saved {step}; "
                                       f"continue with the same command and --resume auto\n")


def test_a_restart_names_the_rank_that_died_and_its_signal(tmp_path):
    """The launcher notes when each rank's process ends and keeps its Process object, so the restart's line
    names the first rank to die and its signal even when torch's launcher has collected the process first
    (a waitid racing it lost, on a loaded machine, and blamed the dead rank's peer), and where ranks resume."""
    import multiprocessing
    import threading
    import time

    from tetron.observe.watch import RankWatch

    (tmp_path / "reports").mkdir()
    watch = RankWatch(tmp_path / "reports", out=str(tmp_path / "out"), steps=10, timeout_s=5, stop_signal=None,
                      max_restarts=2)
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))
    child.start()
    waiter = threading.Thread(target=watch._note_exit, args=(0, 1, child))  # as poll() starts it
    waiter.start()
    child.kill()
    child.join(timeout=10)  # torch's launcher collects it, maybe before the watcher has run again
    waiter.join(timeout=10)
    assert child.exitcode == -signal.SIGKILL
    _report(tmp_path / "reports", 0, 0, "peer", message="connection closed by peer")  # what rank 1's death did
    _report(tmp_path / "reports", 0, 1, "running")
    assert watch.restart_line(1) == "restart 1 of 2 after rank 1 was killed by SIGKILL: starting over: no checkpoint " \
                                    "was saved"
    step = _checkpoint(tmp_path / "out", 2)
    _report(tmp_path / "reports", 0, 0, "error", message="disk full")
    assert watch.restart_line(1) == f"restart 1 of 2 after rank 0 failed (an error): resuming from {step}"



def test_a_restart_names_the_dead_rank_while_its_exit_code_is_being_collected(tmp_path):
    """Reading a dead rank's exit code collects it, racing torch's launcher doing the same from its thread: the
    loser of the two waitpid calls reads None until the winner records the code. A restart read then blamed rank
    0's lost peer (seen under load, tests/test_faults.py); the read waits for the code."""
    import time

    from tetron.observe.watch import RankWatch

    class BeingCollected:  # rank 1's Process as the losing reader sees it: no code for three reads, then its signal
        reads = 0

        @property
        def exitcode(self) -> int | None:
            self.reads += 1
            return None if self.reads <= 3 else -signal.SIGKILL

    (tmp_path / "reports").mkdir()
    watch = RankWatch(tmp_path / "reports", out=str(tmp_path / "out"), steps=10, timeout_s=5, stop_signal=None,
                      max_restarts=2)
    watch.exits[(0, 1)] = (time.monotonic(), BeingCollected())  # its sentinel has closed
    _report(tmp_path / "reports", 0, 0, "peer", message="connection closed by peer")
    _report(tmp_path / "reports", 0, 1, "running")
    assert watch.restart_line(1) == "restart 1 of 2 after rank 1 was killed by SIGKILL: starting over: no checkpoint " \
                                    "was saved"

def test_messages_about_a_mixture_name_its_sources(store, corpus, tmp_path):
    """Before start, with data.sources set: a source too short for a window, and too few windows for a batch,
    name the sources in use, not data.path (which the run does not read)."""
    path = _mixture_config(store, corpus, tmp_path, steps=2)
    with pytest.raises(DataError, match=rf"^data.sources\[0\] \({store}\): [\d,]+ tokens give no training window of "
                                        r"data.seq_len\+1=2049"):
        _check_data(load_config(str(path), ["--data.seq_len=2048", "--model.max_position_embeddings=2048"]))
    with pytest.raises(ConfigError, match=rf"^data.sources \({store}, {corpus}\): [\d,]+ tokens make [\d,]+ windows "
                                          r"of data.seq_len\+1=33, fewer than one global batch of 100000"):
        _check_data(load_config(str(path), ["--train.micro_batch=100000"]))


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_a_lone_surrogate_is_a_bad_record(tmp_path, capsys, tokenizer):
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"), which no text encoding holds: one line naming the
    record with on_bad_record=stop, skipped and counted with skip (a BPE trains on the rest)."""
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n{"text": "bad \\ud800 here"}\n{"text": "more"}\n')
    args = ["tokenize", str(tmp_path / "a.jsonl"), "--tokenizer", tokenizer, "--workers", "1",
            "--cache-dir", str(tmp_path / "cache")]
    assert cli_main([*args, "--out", str(tmp_path / "stop")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == (f"tetron: error: data: {tmp_path}/a.jsonl line 2 holds a lone UTF-16 surrogate (an escape "
                       f"such as \\ud800 without its pair): not text; data.on_bad_record=skip skips such records"), err
    assert cli_main([*args, "--out", str(tmp_path / "skip"), "--on-bad-record", "skip"]) == 0
    assert f"skipped 1 bad records (data.on_bad_record=skip), the first at {tmp_path}/a.jsonl line 2" in (
        capsys.readouterr().err)
    assert TokenStore(tmp_path / "skip").index["num_docs"] == 2


def test_a_bpe_of_an_absurd_vocabulary_is_refused_before_training(tmp_path, capsys):
    """bpe:10**12 aborted the process in the tokenizers library (a 72 TB allocation): refused naming the bound."""
    (tmp_path / "a.txt").write_text("hello world\n" * 10)
    for spec in ("bpe:1000000000000", "bpe:1048577"):
        assert cli_main(["tokenize", str(tmp_path / "a.txt"), "--tokenizer", spec, "--out", str(tmp_path / "s"),
                         "--cache-dir", str(tmp_path / "cache")]) == 2
        assert "integer vocabulary size from 257 (256 bytes + EOS) to 1,048,576" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"data.tokenizer=bpe:1000000000000: use bpe:N with N from 257 .* to "
                                          r"1,048,576"):
        validate(load_config(None, ["--model", "demo", "--model.vocab_size=2000000000000", "--data", str(
            tmp_path / "a.txt"), "--tokenizer", "bpe:1000000000000", "--out", str(tmp_path / "run")]))


def test_a_source_of_empty_documents_trains_no_bpe(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    assert cli_main(["tokenize", str(tmp_path / "a.jsonl"), "--tokenizer", "bpe:300", "--out", str(tmp_path / "s"),
                     "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("tetron: error: data: " + str(tmp_path / "a.jsonl") + ": every document is empty: no text to "
                       "train a BPE on (or to train on); check the source (and data.text_field)"), err
    assert not (tmp_path / "cache" / "tokenizers").exists() or not any((tmp_path / "cache" / "tokenizers").iterdir())


def test_a_disk_that_fills_says_no_space(corpus, tmp_path, monkeypatch, capsys):
    """Shards written onto a full device (/dev/full: every write fails with ENOSPC): the line says "no space",
    not numpy's "N requested and M written" (ndarray.tofile drops the errno)."""
    import builtins

    from tetron.data import token_store

    def full(path, mode="r", *args, **kwargs):
        return builtins.open("/dev/full", mode, *args, **kwargs) if "w" in mode else builtins.open(path, mode)

    monkeypatch.setattr(token_store, "open", full, raising=False)
    assert cli_main(["tokenize", str(corpus), "--tokenizer", "bytes", "--out", str(tmp_path / "s"),
                     "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"tetron: error: {tmp_path}/s\S*: no space left on device .*, while tokenizing into "
                        rf"{tmp_path}/s; .*\n", err), err
