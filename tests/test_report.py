"""`tetron report` (its picture holds the runs' numbers), the progress display, the per-rank logs, and one
real 2-rank `tetron train` with every observer on, read back by `tetron report`."""

from __future__ import annotations

import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tetron.errors import ConfigError
from tetron.observe.metrics import ProgressBar, say
from tetron.observe.report import PANELS, TIME_PANEL, figure, mark_differences, read_run, report, table

from conftest import cli_in_process

REPO = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 300  # s: one real launch of 2 ranks, tokenizing included


def fake_run(folder: Path, *, parallel: dict, steps: int, timers: bool, torn: bool = False,
             skipped: int | None = None, config: dict | None = None) -> list[dict]:
    """A run folder as tetron writes it: metrics.jsonl (step `skipped` with a NaN loss, as
    train.on_nonfinite=skip logs it) and a latest checkpoint's trainer state."""
    records = []
    for s in range(1, steps + 1):
        r = {"step": s, "loss": 5.0 / s + 0.01 * (s % 3), "lr": 1e-3 * min(s, 3), "grad_norm": 2.0 / s,
             "tokens": 128 * s, "tokens_per_s": 1000.0 + 10 * s, "step_time_s": 0.1, "peak_mem_mb": 300.0 + s,
             "mfu": None}
        if s % 2 == 0:
            r["val_loss"], r["val_ppl"] = 5.5 / s, 2.0
        if timers:
            r.update(time_compute_s=0.05 + 0.001 * s, time_dp_s=0.02 * s, time_pp_s=0.01)
        if s == skipped:
            r.update(loss=float("nan"), grad_norm=float("nan"), skipped=True)
        records.append(r)
    folder.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + ('{"step": 99, "lo' if torn else "")
    (folder / "metrics.jsonl").write_text(text)
    step = folder / "checkpoints" / f"step_{steps}"
    step.mkdir(parents=True)
    state = {"step": steps, "config": {"parallel": parallel, **(config or {})}}
    (step / "trainer_state.json").write_text(json.dumps(state))
    (folder / "checkpoints" / "latest").write_text(f"step_{steps}")
    return records


@pytest.fixture
def runs(tmp_path) -> dict[str, list[dict]]:
    return {"a": fake_run(tmp_path / "a", parallel={"dp": 2, "pp": 2, "pp_virtual": 2, "zero": 1}, steps=7,
                          timers=True, torn=True),
            "b": fake_run(tmp_path / "b", parallel={"dp": 1}, steps=5, timers=False, skipped=4)}


def lines_by_label(ax) -> dict[str, tuple[list, list]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


@pytest.mark.parametrize("x", ["step", "tokens"])
def test_the_picture_holds_the_runs_metrics(tmp_path, runs, x):
    data = [read_run(tmp_path / "a"), read_run(tmp_path / "b")]
    assert [d.label for d in data] == ["a (dp2 pp2 (x2 virtual) zero1)", "b (1 process)"]
    fig = figure(data, x=x)
    axes = {ax.get_title(): ax for ax in fig.axes}
    for title, _, keys, _ in PANELS:
        drawn = lines_by_label(axes[title])
        want = {}
        for run, records in zip(data, runs.values()):
            for key in keys:
                points = [(r[x], r[key]) for r in records if key in r and math.isfinite(r[key])]
                if key == "mtp_loss" and not points:  # drawn only for runs with multi-token prediction
                    continue
                want[run.label + (" val" if key.startswith("val_") else " mtp" if key == "mtp_loss" else "")] = (
                    [p[0] for p in points], [p[1] for p in points])
        assert drawn == want, title
    # one stacked bar, run a's: the median of each timer over steps 2..7, categories in order
    bars = axes[TIME_PANEL].patches
    later = runs["a"][1:]
    medians = [statistics.median(r[f"time_{c}_s"] for r in later) for c in ("compute", "dp", "pp")]
    assert [b.get_width() for b in bars] == pytest.approx(medians, rel=1e-12)
    assert [b.get_x() for b in bars] == pytest.approx([0, medians[0], medians[0] + medians[1]], rel=1e-12)
    assert [t.get_text() for t in axes[TIME_PANEL].get_yticklabels()] == [data[0].label]


def test_report_writes_the_png_and_prints_the_summary(tmp_path, runs):
    import matplotlib.image

    out = tmp_path / "pics" / "both.png"
    text = report([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (850, 1500)
    head, a_row, b_row = text.splitlines()[:3]
    assert head.split()[:3] == ["run", "steps", "loss"]
    a, b = runs["a"], runs["b"]
    assert a_row.startswith("a (dp2 pp2 (x2 virtual) zero1)") and b_row.startswith("b (1 process)")
    assert f"{a[-1]['loss']:.4f}" in a_row and f"{min(r['loss'] for r in a):.4f}" in a_row
    assert f"{a[-2]['val_loss']:.4f}" in a_row.split()  # step 6's, the last measured
    assert f"{statistics.median(r['tokens_per_s'] for r in a[1:]):,.0f}" in a_row
    assert f"{max(r['peak_mem_mb'] for r in b):,.0f}" in b_row
    assert b_row.split()[4:6] == [f"{b[-1]['loss']:.4f}", f"{b[-1]['loss']:.4f}"]  # step 4's NaN is no best
    timing = text.split("median seconds per step (max over ranks):\n")[1].splitlines()
    assert timing[0].split() == ["run", "compute", "dp", "pp"] and timing[1].startswith("a (") and timing[2] == ""
    assert text.endswith(f"tetron: wrote {out}")
    assert "loss" in table([read_run(tmp_path / "b")]) and "median seconds" not in table([read_run(tmp_path / "b")])


def test_runs_of_one_layout_are_labelled_by_the_fields_that_differ(tmp_path):
    """Muon against AdamW, both dp2: each label names the layout and the config fields that differ between the
    runs (not those all share, not where each wrote, not the layout's fields again, not another optimizer's
    settings: AdamW's label leaves out optim.muon_*), in the table and the legend; one run alone keeps its plain
    label."""
    common = {"train": {"lr": 3e-3, "steps": 6}, "out": "ignored"}
    for name, optim in (("adamw", {"name": "adamw"}), ("muon", {"name": "muon", "muon_ns_dtype": "float32"})):
        fake_run(tmp_path / name, parallel={"dp": 2, "bucket_mb": 25 if name == "adamw" else 5}, steps=6,
                 timers=False, config={**common, "optim": optim, "out": str(tmp_path / name)})
    text = report([str(tmp_path / "adamw"), str(tmp_path / "muon"), "--out", str(tmp_path / "both.png")])
    rows = text.splitlines()[1:3]
    assert rows[0].startswith("adamw (dp2; optim.name=adamw) ")
    assert rows[1].startswith("muon (dp2; optim.muon_ns_dtype=float32, optim.name=muon) ")
    runs = [read_run(tmp_path / "adamw"), read_run(tmp_path / "muon")]
    mark_differences(runs)
    assert set(lines_by_label(figure(runs).axes[0])) >= {"adamw (dp2; optim.name=adamw)",
                                                         "muon (dp2; optim.muon_ns_dtype=float32, optim.name=muon)"}
    alone = [read_run(tmp_path / "muon")]
    mark_differences(alone)
    assert alone[0].label == "muon (dp2)"


def write_log(folder: Path, records: list[dict]) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_an_expert_parallel_run_with_timers_is_drawn(tmp_path):
    """The MoE demo's log (configs/demo-moe.yaml: dp2 ep2, timers on): ep's waits are one more stacked bar."""
    records = [{"step": s, "loss": 6.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s, "tokens_per_s": 900.0,
                "peak_mem_mb": 400.0, "moe_aux_loss": 2.1, "moe_load_imbalance": 1.4, "time_compute_s": 0.3,
                "time_dp_s": 0.05, "time_ep_s": 0.1 + 0.01 * s} for s in range(1, 6)]
    records[0]["layout"] = "dp2 ep2"
    write_log(tmp_path / "moe", records)
    run = read_run(tmp_path / "moe")
    assert run.label == "moe (dp2 ep2)"
    axes = {ax.get_title(): ax for ax in figure([run]).axes}
    medians = [0.3, 0.05, statistics.median(r["time_ep_s"] for r in records[1:])]
    assert [b.get_width() for b in axes[TIME_PANEL].patches] == pytest.approx(medians, rel=1e-12)
    assert [t.get_text() for t in axes[TIME_PANEL].get_legend().get_texts()] == ["compute", "dp", "ep"]
    text = report([str(tmp_path / "moe")])
    assert text.split("median seconds per step (max over ranks):\n")[1].splitlines()[0].split() == [
        "run", "compute", "dp", "ep"]


def test_resumes_and_layout_changes_are_marked(tmp_path):
    """A run started as pp2, resumed at step 4 as dp2, then again at step 7 as dp2: labelled by both
    layouts, a dotted line at each resume's first step on every curve panel (the first naming the new
    layout), and no time panel: no timers were on."""
    records = [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 100 * s, "tokens_per_s": 900.0,
                "peak_mem_mb": 400.0} for s in range(1, 10)]
    records[0]["layout"], records[4]["layout"], records[6]["layout"] = "pp2", "dp2", "dp2"
    write_log(tmp_path / "r", records)
    run = read_run(tmp_path / "r")
    assert run.label == "r (pp2 -> dp2)"
    assert [(launch.step, launch.layout) for launch in run.launches] == [(1, "pp2"), (5, "dp2"), (7, "dp2")]
    for x in ("step", "tokens"):
        fig = figure([run], x=x)
        assert [ax.get_title() for ax in fig.axes] == [title for title, *_ in PANELS]  # nothing empty drawn
        for ax in fig.axes:
            marks = {line.get_label(): line.get_xdata()[0] for line in ax.get_lines()
                     if line.get_label().startswith("_resume")}
            scale = 1 if x == "step" else 100
            assert marks == {"_resume r 5 dp2": 5 * scale, "_resume r 7": 7 * scale}, ax.get_title()
            assert [t.get_text() for t in ax.texts] == ["resumed (dp2)", "resumed"]
    out = tmp_path / "r.png"
    report([str(tmp_path / "r"), "--out", str(out)])
    import matplotlib.image

    assert matplotlib.image.imread(out).shape[:2] == (850, 1500)  # 3 panels over 2: the bottom two wider


def test_an_older_log_takes_its_layout_from_the_checkpoint_and_its_resumes_from_the_memory_figures(tmp_path):
    """Logs written before records named their layout: a launch's first record is the one with memory figures."""
    fake_run(tmp_path / "old", parallel={"dp": 2, "ep": 2}, steps=6, timers=False)
    log = tmp_path / "old" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for i in (0, 3):
        records[i]["mem_params_mb"] = 1.0
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = read_run(tmp_path / "old")
    assert run.label == "old (dp2 ep2)" and [launch.step for launch in run.resumes] == [4]


@pytest.mark.parametrize("resume", [None, "auto"])
def test_each_launch_names_its_layout_on_its_first_record(tmp_path, resume):
    """What the report reads: rank 0's Reporter writes the layout on the first record of each launch only."""
    import torch

    from tetron.config import from_dict
    from tetron.observe.step_report import Reporter, StepFigures

    cfg = from_dict({"model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2},
                     "parallel": {"dp": 2, "pp": 2, "zero": 1}, "logging": {"progress": False},
                     "checkpoint": {"resume": resume}, "out": str(tmp_path)})
    for first in (0, 2):
        reporter = Reporter(cfg, device=torch.device("cpu"), world_size=4, first_step=first)
        for step in range(first, first + 2):
            reporter.step(step, StepFigures(loss=1.0, grad_norm=1.0, lr=1e-3, skipped=False, time_s=0.1))
        reporter.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("layout")) for r in records] == [(1, "dp2 pp2 zero1"), (2, None), (3, "dp2 pp2 zero1"),
                                                             (4, None)]


def test_the_start_line_names_expert_parallelism():
    """`tetron train`'s first line gives every axis the run uses: ep too (the MoE demo's dp2 ep2)."""
    from tetron.config import load_config
    from tetron.launch import start_line

    moe = load_config("demo-moe")
    assert start_line(moe) == "tetron: starting 2 ranks (dp=2 tp=1 pp=1 cp=1 ep=2), run folder runs/demo-moe"
    assert start_line(load_config("demo", ["--dp", "2"])) == (
        "tetron: starting 2 ranks (dp=2 tp=1 pp=1 cp=1), run folder runs/demo")


def test_report_refuses_a_folder_without_metrics(tmp_path):
    with pytest.raises(ConfigError, match=r"no metrics.jsonl there"):
        report([str(tmp_path)])
    with pytest.raises(ConfigError, match=r"--x: invalid choice"):
        report([str(tmp_path), "--x", "time"])


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_off_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(10, every=4, first=2, stream=stream)
    for step in range(3, 11):
        bar.update(step, {"loss": f"{1 / step:.3f}"})
    lines = stream.getvalue().splitlines()
    assert [int(re.match(r"step (\d+)/10 ", line).group(1)) for line in lines] == [3, 4, 8, 10]
    assert all(re.search(r"\| \d+s, ETA \d+s$", line) for line in lines), lines
    assert "loss 0.250" in lines[1] and lines[-1].endswith("ETA 0s")


def test_progress_bar_on_a_terminal_is_tqdm_with_eta(monkeypatch):
    stream = Terminal()
    monkeypatch.setattr(sys, "stdout", stream)
    bar = ProgressBar(10, every=5, stream=stream)
    for step in range(1, 4):
        bar.update(step, {"loss": "2.000", "tok/s": "1,234"})
        if step == 2:
            say("saved a checkpoint")  # the bar steps aside for the line, then comes back below it
    text = stream.getvalue()
    assert "\r" in text and "3/10" in text and "loss 2.000 tok/s 1,234" in text
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", text)  # elapsed < remaining: the ETA
    before, after = text.split("tetron: saved a checkpoint\n")
    assert before.endswith("\r") and "2/10" in before and "2/10" in after.split("\r")[1]
    bar.close()
    assert stream.getvalue().endswith("\n")


RANK_LOG_SCRIPT = """
import os, sys
from pathlib import Path
from tetron.observe.rank_logs import RankLog
log = RankLog.start(Path(sys.argv[1]), 3)
print("python to stdout", flush=True)
os.write(1, b"fd 1 directly\\n")
print("python to stderr", file=sys.stderr, flush=True)
os.write(2, b"fd 2 directly\\n")
if sys.argv[2] == "exit":
    os._exit(0)  # the tee still writes everything out
log.restore()
print("after restore", flush=True)
"""


@pytest.mark.parametrize("end", ["exit", "restore"])
def test_rank_log_copies_both_streams(tmp_path, end):
    script = tmp_path / "rank.py"
    script.write_text(RANK_LOG_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), end], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == ["python to stdout", "fd 1 directly"]
    assert proc.stderr.splitlines() == ["python to stderr", "fd 2 directly"]
    for _ in range(100):  # after os._exit the tee may still be writing
        logged = (tmp_path / "out" / "logs" / "rank_3.log").read_text().splitlines()
        if len(logged) == 4:
            break
        __import__("time").sleep(0.05)
    assert sorted(logged) == sorted(["python to stdout", "fd 1 directly", "python to stderr", "fd 2 directly"])
    assert ("after restore" in proc.stdout) == (end == "restore")


def user_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


@pytest.mark.slow
def test_a_real_run_with_every_observer(corpus, cache_dir, tmp_path):
    """2 ranks through tetron's launcher: per-rank logs, TensorBoard events, timers, a profile of step 2,
    the validation loss; then `tetron report` on the run folder."""
    config = {
        "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
        "data": {"path": str(corpus), "tokenizer": "bytes", "seq_len": 32, "cache_dir": str(cache_dir),
                 "val_fraction": 0.05},
        "train": {"steps": 4, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 2, "eval_every": 2, "eval_batches": 2},
        "parallel": {"dp": 2, "device": "cpu"},
        "logging": {"sample_tokens": 0, "timers": True, "tensorboard": True},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tetron.cli", "train", "run.yaml", "--out", str(out), "--profile", "2"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=user_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert all({"time_compute_s", "time_dp_s"} <= set(r) for r in records)
    # every rank's output in its own log: rank 0's story and progress lines, as the terminal got them
    rank0 = (out / "logs" / "rank_0.log").read_text()
    assert "tetron: model:" in rank0 and "step 4/4" in rank0 and "val_loss" in rank0
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank_0.log", "rank_1.log"]
    assert [p.name for p in (out / "profile").iterdir()] == ["step_2"]
    assert sorted(p.name for p in (out / "profile" / "step_2").iterdir()) == ["rank_0.json", "rank_1.json"]
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tensorboard").iterdir())
    # `tetron report` in this process: it starts nothing, so a child would only import torch again
    rep = cli_in_process(["report", str(out)], tmp_path)
    assert rep.returncode == 0, rep.stderr
    assert rep.stdout.splitlines()[1].startswith("out (dp2)")
    assert [r.get("layout") for r in records] == ["dp2", None, None, None]
    assert f"{records[-1]['val_loss']:.4f}" in rep.stdout and "median seconds per step" in rep.stdout
    assert (out / "report.png").is_file()
    bad = cli_in_process(["report", str(tmp_path / "nothing")], tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("tetron: error: ") and len(bad.stderr.splitlines()) == 1

