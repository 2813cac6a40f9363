"""Seeing a run: the validation loss (its held-out windows, its value in every layout, on resume), the
per-axis timers, the profiler's traces and the TensorBoard events, each against a reference."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tetron.checkpoint.load import load_model
from tetron.config import from_dict
from tetron.data.loader import DataLoader, load_tokens, prepare_data
from tetron.data.store_build import build_store
from tetron.data.tokenizer import Tokenizer
from tetron.errors import ConfigError
from tetron.mesh import Mesh
from tetron.observe.evaluate import eval_windows, held_out_tokens, held_out_windows, prepare_val_tokens, training_tokens
from tetron.train import train
from tetron.validate import validate

from conftest import GQA, LAYOUT_LR, LOSS_RTOL, tiny_config
from harness import run_ranks

VAL_RTOL = 1e-5  # val_loss of a layout against the single process, relative
TIMER_RTOL = 0.10  # the timers' categories against the step's own time, on each rank
STEPS = 3


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def observed_rank(raw: dict) -> dict:
    """On one rank: train, return the losses and this rank's timers."""
    cfg = from_dict(raw)
    p = cfg.parallel
    result = train(cfg, Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp))
    return {"losses": result.losses, "timings": result.timings}


def launch(raw: dict) -> list[dict]:
    cfg = from_dict(raw)
    validate(cfg)
    prepare_data(cfg)
    return run_ranks(cfg.world_size, observed_rank, raw, timeout=600)


def observed_config(corpus, cache_dir, out: Path, *, parallel: dict, logging: dict | None = None, **train) -> dict:
    """A 4-layer GQA model, micro-batches of 1, 5% held out, validation after every step."""
    return tiny_config(corpus, cache_dir, out, model={**GQA, "num_hidden_layers": 4}, parallel=parallel,
                       data={"val_fraction": 0.05},
                       train={"steps": STEPS, "micro_batch": 1, "grad_acc": 2, "lr": LAYOUT_LR,
                              "eval_every": 1, "eval_batches": 2, **train},
                       logging={"timers": True, **(logging or {})})


def direct_val_loss(cfg, out: Path) -> float:
    """The mean loss of OUT/model on the evaluated windows, by the plain single-device model."""
    _, token_path = prepare_data(cfg)
    val = held_out_tokens(load_tokens(token_path), cfg)
    T = cfg.data.seq_len
    windows = torch.from_numpy(np.stack([np.asarray(val[s:s + T + 1], dtype=np.int64)
                                         for s in eval_windows(val, cfg)]))
    model = load_model(out / "model")
    with torch.no_grad():
        logits = model(windows[:, :-1], torch.arange(T))
    return F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten()).item()


def check_timers(results: list[dict], records: list[dict], axes: set[str]) -> None:
    """On every rank and step the categories add up to the step's time (the step's clock and the timers
    start together; the batch is fetched before either); each axis in use waited;
    metrics.jsonl has the maximum over ranks of each, for compute and those axes only."""
    for rank, result in enumerate(results):
        assert len(result["timings"]) == STEPS
        for step, timing in enumerate(result["timings"]):
            spent = sum(v for k, v in timing.items() if k != "step_time_s")
            assert spent == pytest.approx(timing["step_time_s"], rel=TIMER_RTOL), (rank, step, timing)
            assert all(timing[a] > 0 for a in axes), (rank, step, timing)
    for step, record in enumerate(records):
        logged = {k for k in record if k.startswith("time_")}
        assert logged == {"time_compute_s", *(f"time_{a}_s" for a in axes)}, record
        for key in logged:
            category = key[len("time_"):-len("_s")]
            assert record[key] == pytest.approx(max(r["timings"][step][category] for r in results), rel=1e-6)


@pytest.fixture(scope="module")
def reference(corpus, cache_dir, tmp_path_factory):
    """The single process, the global batch in one micro-batch."""
    out = tmp_path_factory.mktemp("observe") / "ref"
    raw = observed_config(corpus, cache_dir, out, parallel={}, micro_batch=4, grad_acc=1)
    results = launch(raw)
    return from_dict(raw), out, results


def test_held_out_windows_are_never_trained_on(corpus, cache_dir, tmp_path):
    cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path / "run", data={"val_fraction": 0.1},
                                train={"eval_every": 1, "eval_batches": 3}))
    tokens = np.arange(10_001)  # 10,000 windows of seq_len 32 would need 320,001 tokens: 312 windows here
    T = cfg.data.seq_len
    held = held_out_windows(len(tokens), cfg)
    assert held == math.ceil((len(tokens) - 1) // T * 0.1) == 32
    train_part, val_part = training_tokens(tokens, cfg), held_out_tokens(tokens, cfg)
    assert np.array_equal(np.concatenate([train_part, val_part]), tokens)
    loader = DataLoader(train_part, T, micro_batch=2, grad_acc=1, dp_size=1, dp_rank=0, seed=1)
    assert loader.sampler.num_windows == (len(tokens) - 1) // T - held
    seen = set()
    for step in range(loader.sampler.num_windows // 2 + 1):  # a whole epoch and more
        for inputs, targets, *_ in loader.batch_for_step(step):
            seen |= set(inputs.flatten().tolist()) | set(targets.flatten().tolist())
    evaluated = {int(s) + i for s in eval_windows(val_part, cfg) for i in range(T + 1)}
    assert evaluated and not seen & {int(val_part[i]) for i in evaluated}
    assert len(eval_windows(val_part, cfg)) == 3 * cfg.global_batch
    # small data: 4 held-out windows fill 2 global batches of 2 (of the 8 asked for), or none of 5; the held-out
    # part stays the same whatever the batch, so the training data does not depend on it
    for micro_batch, evaluated in ((2, 4), (5, 0)):
        small = from_dict(tiny_config(corpus, cache_dir, tmp_path / "run", data={"val_fraction": 0.01},
                                      train={"eval_every": 1, "eval_batches": 8, "micro_batch": micro_batch}))
        assert held_out_windows(len(tokens), small) == 4
        starts = eval_windows(held_out_tokens(tokens, small), small)
        assert starts.tolist() == [i * T for i in range(evaluated)]


def test_val_loss_is_the_models_loss_on_held_out_windows(reference):
    cfg, out, _ = reference
    records = read_metrics(out)
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2, 3]
    assert records[-1]["val_loss"] == pytest.approx(direct_val_loss(cfg, out), rel=1e-6)
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(records[-1]["val_loss"]), rel=1e-12)
    assert abs(records[0]["val_loss"] - math.log(256)) < 0.5  # near-uniform after one step


@pytest.mark.parametrize("parallel, grad_acc, axes", [
    ({"dp": 2, "tp": 2, "pp": 2}, 2, {"dp", "tp", "pp"}),
    ({"cp": 2, "pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2, "zero": 1}, 4, {"dp", "pp", "cp"}),
    ({"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2}, 4, {"pp"}),  # stages in a V: rank 0 holds both ends
], ids=["dp2-tp2-pp2", "cp2-pp2-interleaved-zero1", "pp2-zbv"])
def test_val_loss_and_timers_in_every_layout(reference, corpus, cache_dir, tmp_path, parallel, grad_acc, axes):
    """The same val_loss as the single process (the same global batch of 4) in each layout; the timers
    of every rank add up."""
    _, ref_out, _ = reference
    profile = "2:2" if "cp" in parallel else None
    raw = observed_config(corpus, cache_dir, tmp_path / "run", parallel=parallel, logging={"profile": profile},
                          grad_acc=grad_acc)
    results = launch(raw)
    records, expected = read_metrics(tmp_path / "run"), read_metrics(ref_out)
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor([r["val_loss"] for r in records], dtype=torch.float64),
                               torch.tensor([r["val_loss"] for r in expected], dtype=torch.float64),
                               rtol=VAL_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor([r["loss"] for r in expected]),
                               rtol=LOSS_RTOL, atol=0)
    check_timers(results, records, axes)
    if profile:  # traces of the asked step only, one per rank, Chrome trace JSON
        folder = tmp_path / "run" / "profile"
        assert sorted(p.name for p in folder.iterdir()) == ["step_2"]
        world = from_dict(raw).world_size
        assert sorted(p.name for p in (folder / "step_2").iterdir()) == [f"rank_{r}.json" for r in range(world)]
        trace = json.loads((folder / "step_2" / "rank_0.json").read_text())
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])


def scalars_of(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_resume_keeps_val_loss_and_tensorboard_matches_metrics(corpus, cache_dir, tmp_path):
    """4 steps, then again from the step-2 checkpoint into the same folder: the same val_loss at step 4
    (the evaluated windows do not depend on the loader), and the TensorBoard events, read back with
    tensorboard's own reader, are metrics.jsonl's records, the abandoned attempt's steps purged."""
    out = tmp_path / "run"
    raw = tiny_config(corpus, cache_dir, out, data={"val_fraction": 0.05},
                      train={"steps": 4, "eval_every": 2, "eval_batches": 2},
                      checkpoint={"save_every": 2, "keep": 5}, logging={"tensorboard": True})
    launch(raw)
    first = read_metrics(out)
    saved = tmp_path / "step_2"
    shutil.copytree(out / "checkpoints" / "step_2", saved)
    launch({**raw, "checkpoint": {**raw["checkpoint"], "resume": str(saved)}})
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r.get("val_loss") for r in records] == [r.get("val_loss") for r in first]  # exact
    assert records[-1]["val_loss"] is not None and records[1]["val_loss"] is not None
    tags = scalars_of(out / "tensorboard")
    numeric = {k for r in records for k, v in r.items() if type(v) in (int, float)} - {"step"}
    assert set(tags) == numeric, set(tags) ^ numeric
    for tag, events in tags.items():
        want = [(r["step"], r[tag]) for r in records if r.get(tag) is not None]
        assert [s for s, _ in events] == [s for s, _ in want], tag
        torch.testing.assert_close(torch.tensor([v for _, v in events], dtype=torch.float64),
                                   torch.tensor([v for _, v in want], dtype=torch.float64), rtol=1e-6, atol=0,
                                   msg=tag)  # TensorBoard keeps float32


def wandb_history(run_file: Path) -> list[dict]:
    """The logged steps of an offline W&B run file: a LevelDB-style log (32 KiB blocks, each record a
    7-byte header of crc, length and kind, then its bytes) of W&B's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, history = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
    return history


def test_wandb_offline_gets_every_metric(corpus, cache_dir, tmp_path, monkeypatch):
    import wandb  # noqa: F401  the optional extra (pip install tetron[wandb]), in the test extra too
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    launch(tiny_config(corpus, cache_dir, out, data={"val_fraction": 0.05},
                       train={"steps": 3, "eval_every": 2, "eval_batches": 1}, logging={"wandb": "tetron-test"}))
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    records = read_metrics(out)
    assert [h["_step"] for h in history] == [r["step"] for r in records] == [1, 2, 3]
    for h, r in zip(history, records):
        want = {k: v for k, v in r.items() if type(v) in (int, float) and k != "step"}
        assert {k: v for k, v in h.items() if not k.startswith("_")} == pytest.approx(want, rel=1e-12), r["step"]


BAD_OBSERVING = [
    ({"data": {"val_fraction": 1.0}}, "data.val_fraction=1.0 must be in [0, 1)"),
    ({"train": {"eval_every": 5}}, "train.eval_every=5 needs held-out data: set data.val_fraction"),
    ({"data": {"val_fraction": 0.1, "val_path": "x.txt"}}, "data.val_path and data.val_fraction=0.1 both set"),
    ({"data": {"val_path": "no/such/file.txt"}}, "data.val_path=no/such/file.txt"),
    ({"train": {"eval_batches": 0}}, "train.eval_batches=0 must be at least 1"),
    ({"logging": {"profile": "7:5"}}, "logging.profile='7:5': give steps A:B with 1 <= A <= B"),
    ({"logging": {"profile": "five"}}, "logging.profile='five': give steps as A:B"),
    ({"logging": {"sample_temperature": -1}}, "logging.sample_temperature=-1.0 must be a finite number >= 0"),
    ({"logging": {"sample_top_k": -1}}, "logging.sample_top_k=-1 must be >= 0 (0: no limit)"),
]


@pytest.mark.parametrize("sections, message", BAD_OBSERVING, ids=[m.split("=")[0] for _, m in BAD_OBSERVING])
def test_bad_observing_settings_fail_in_validate(corpus, cache_dir, tmp_path, sections, message):
    with pytest.raises(ConfigError) as err:
        validate(from_dict(tiny_config(corpus, cache_dir, tmp_path / "run", **sections)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_wandb_without_the_package_fails_in_validate(corpus, cache_dir, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb=proj needs the wandb package: pip install 'tetron\[wandb\]'"):
        validate(from_dict(tiny_config(corpus, cache_dir, tmp_path / "run", logging={"wandb": "proj"})))


@pytest.mark.parametrize("micro_batch, batches", [(2, 3), (8, 0)])
def test_small_held_out_part_trains_with_a_note(corpus, cache_dir, tmp_path, micro_batch, batches):
    """Fewer held-out windows than train.eval_batches global batches: a note says what validation does (fewer
    batches, or none), and the run trains; val_loss is the mean over the batches there are."""
    from tetron.cli import _check_data

    raw = tiny_config(corpus, cache_dir, tmp_path / "run", data={"val_fraction": 0.001},
                      train={"steps": 2, "eval_every": 1, "eval_batches": 100, "micro_batch": micro_batch})
    cfg = from_dict(raw)
    held = r"data.val_fraction=0.001 holds out 7 windows of 33 tokens"
    tail = (rf": validating on {batches} global batches of 2, not train.eval_batches=100$" if batches else
            r", fewer than one global batch of 8: training without validation \(for val_loss, hold out more")
    [note] = _check_data(cfg)
    assert re.match(held + tail, note), note
    launch(raw)
    records = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert len(records) == (2 if batches else 0)
    if batches:  # the model's mean loss over those batches' every target token
        assert records[-1]["val_loss"] == pytest.approx(direct_val_loss(cfg, tmp_path / "run"), rel=1e-6)


@pytest.mark.parametrize("form", ["text", "token store"])
def test_val_path_is_held_out_text(corpus, cache_dir, tmp_path, form):
    """data.val_path: another text, tokenized with the run's tokenizer (or a token store made with it);
    the training data is all of data.path."""
    held = tmp_path / "held.txt"
    held.write_text(corpus.read_text()[-20_000:][::-1])  # other text than any training window
    if form == "token store":
        build_store(str(held), Tokenizer(None, None), tmp_path / "store", workers=1, shard_mb=0.005)
    out = tmp_path / "run"
    val_path = str(held if form == "text" else tmp_path / "store")
    raw = tiny_config(corpus, cache_dir, out, data={"val_path": val_path},
                      train={"steps": 1, "eval_every": 1, "eval_batches": 2})
    launch(raw)
    cfg = from_dict(raw)
    (record,) = read_metrics(out)
    tokenizer, _ = prepare_data(cfg)
    val = prepare_val_tokens(cfg, tokenizer)
    assert len(val) == len(held.read_bytes())  # bytes: one token per byte
    T = cfg.data.seq_len
    windows = torch.from_numpy(np.stack([np.asarray(val[s:s + T + 1], dtype=np.int64)
                                         for s in eval_windows(val, cfg)]))
    with torch.no_grad():
        logits = load_model(out / "model")(windows[:, :-1], torch.arange(T))
    want = F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten()).item()
    assert record["val_loss"] == pytest.approx(want, rel=1e-6)


def test_wandb_that_does_not_start_is_one_line(corpus, cache_dir, tmp_path, monkeypatch):
    import wandb  # the test extra installs it

    from tetron.observe.sinks import WandbSink

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path / "run", logging={"wandb": "proj"}))
    with pytest.raises(ConfigError, match=r"^logging.wandb=proj: W&B did not start \(No API key configured.*\); "
                                          r"run `wandb login`, set WANDB_MODE=offline, or unset logging.wandb$"):
        WandbSink("proj", cfg)


def test_profiler_start_and_stop_print_nothing(tmp_path, capfd):
    """Kineto's `USDT: ... profiler_start` / `profiler_stop` lines (one each per rank and profiled step) are
    dropped; the trace is written, and what else reaches standard error meanwhile still does."""
    import os

    from tetron.observe.profiling import StepProfiler, trace_path

    profiler = StepProfiler("1", out=tmp_path, rank=0, device=torch.device("cpu"))
    with profiler.step(0):
        torch.ones(4) @ torch.ones(4)
        os.write(2, b"a line of the step\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_st" not in err and err == "a line of the step\n", err
    assert json.loads(trace_path(tmp_path, 1, 0).read_text())["traceEvents"]
