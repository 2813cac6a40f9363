"""The `tetron` command as a user runs it: bad input fails with one line, `train` launches ranks for real.

Every child is a fresh interpreter that imports torch (a few seconds each): two bad inputs and the three
real launches (elastic launcher, torchrun, torchrun with the wrong world size) are all this file starts.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tetron.checkpoint.load import load_model
from tetron.config import TrainConfig, from_dict
from tetron.data.sources import iter_texts
from tetron.mesh import Mesh
from tetron.observe.generate import sample_from_run
from tetron.schedule import lr_at
from tetron.train import train

from conftest import cli_in_process
from harness import run_ranks

REPO = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 240  # s, one real launch of 2 ranks (about 10 s here)
ERROR_TIMEOUT = 90  # s, one child that fails during config checks
LOSS_RTOL = 1e-5  # per-step loss against the single-process run, relative, fp32
WEIGHT_ATOL = 1e-5  # final weights against the single-process run, absolute, fp32
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "peak_mem_mb", "mfu"}
# measured once, on the first step of each launch
MEMORY_KEYS = {"mem_params_mb", "mem_grads_mb", "mem_optimizer_mb", "mem_buffers_mb", "mem_total_mb",
               "mem_activations_mb"}
STEPS, MICRO_BATCH, SEQ_LEN, SAMPLE_TOKENS = 4, 2, 32, 20


def user_env() -> dict[str, str]:
    """This environment without any launcher's variables, with this checkout importable from any folder."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONIOENCODING"] = "utf-8"
    return env


def tetron(*args, cwd: Path, timeout: float, launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m tetron.cli ARGS` (or under `launcher`); stdout and stderr as text, no newline translation."""
    cmd = [sys.executable, *(launcher or []), "-m", "tetron.cli", *map(str, args)]
    proc = subprocess.run(cmd, cwd=cwd, env=user_env(), capture_output=True, timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode("utf-8", "replace"),
                                       proc.stderr.decode("utf-8", "replace"))


def torchrun(nproc: int) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def tiny_raw(tmp: Path) -> dict:
    """The shape of conftest.tiny_config: a 2-layer, hidden-32 Llama on bytes, 4 steps, progress and a sample."""
    return {
        "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
        "data": {"path": str(tmp / "corpus.txt"), "tokenizer": "bytes", "seq_len": SEQ_LEN,
                 "cache_dir": str(tmp / "cache")},
        "train": {"steps": STEPS, "micro_batch": MICRO_BATCH, "grad_acc": 1, "lr": 1e-2, "warmup_steps": 2,
                  "seed": 1},
        "parallel": {"dp": 1, "device": "cpu"},
        "logging": {"progress": True, "sample_tokens": SAMPLE_TOKENS, "sample_temperature": 0.5, "sample_top_k": 5},
        "out": str(tmp / "out"),
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder holding corpus.txt (100 KB of stdlib source) and tiny.yaml."""
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "corpus.txt").write_text("\n".join(iter_texts("stdlib", max_bytes=100_000)))
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(tiny_raw(tmp)))
    return tmp


# --- bad input: exit 2, one line on stderr ------------------------------------------------------

BAD_INPUT = {
    "unknown flag": (["train", "tiny.yaml", "--bogus", "1"], ["--bogus"]),
    "tp does not divide heads": (["train", "tiny.yaml", "--tp", "3"], ["tp=3", "num_attention_heads=4"]),
    "kv heads do not divide heads": (["train", "tiny.yaml", "--model.num_key_value_heads=3"],
                                     ["num_key_value_heads=3", "num_attention_heads=4"]),
    "missing data": (["train", "tiny.yaml", "--data", "no/such/corpus.txt"], ["data.path=no/such/corpus.txt"]),
    "unknown model": (["train", "tiny.yaml", "--model", "no-such-model"], ["model=no-such-model", "unknown model"]),
    "missing config": (["train", "missing.yaml", "--dp", "2"], ["missing.yaml", "no such file"]),
    # no model given: a run must not start with some default (transformers' is Llama-7B)
    "no model": (["train", "--data", "corpus.txt", "--out", "out"], ["model: none given", "--model", "demo"]),
}


# Started as real processes (exit code, stderr and stdout of an interpreter); the rest run tetron.cli.main in
# this process, which is the same code after the first import, without a torch import each.
REAL_PROCESS = ("unknown flag", "missing config")


@pytest.fixture(scope="module")
def bad_runs(workdir) -> dict[str, subprocess.CompletedProcess]:
    """Every BAD_INPUT command: REAL_PROCESS ones started at once, the rest in this process meanwhile."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "tetron.cli", *BAD_INPUT[name][0]], cwd=workdir,
                                    env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in REAL_PROCESS}
    results = {name: cli_in_process(args, workdir) for name, (args, _) in BAD_INPUT.items() if name not in procs}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=ERROR_TIMEOUT)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line(bad_runs, workdir, case):
    result = bad_runs[case]
    assert "Traceback" not in result.stderr + result.stdout
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tetron: error: "), result.stderr
    for needle in BAD_INPUT[case][1]:
        assert needle in lines[0], (needle, lines[0])
    assert result.stdout == ""  # nothing started
    assert not (workdir / "out").exists()


# --- real launches --------------------------------------------------------------------------------


def _train_reference(raw: dict) -> dict:
    cfg = from_dict(raw)
    result = train(cfg, Mesh(dp=1, tp=1, pp=1, cp=1))
    return {"losses": result.losses, "state": {k: v.detach().clone() for k, v in result.model.state_dict().items()}}


@pytest.fixture(scope="module")
def reference(workdir) -> dict:
    """The same run in one process, whose micro-batch holds the whole global batch of the 2 ranks."""
    raw = tiny_raw(workdir)
    raw["train"]["micro_batch"] = 2 * MICRO_BATCH
    raw["logging"] = {"progress": False, "sample_tokens": 0}
    raw["out"] = str(workdir / "reference")
    return run_ranks(1, _train_reference, raw, timeout=LAUNCH_TIMEOUT)[0]


@pytest.fixture(scope="module")
def elastic_run(workdir) -> tuple[subprocess.CompletedProcess, Path]:
    out = workdir / "elastic"
    result = tetron("train", "tiny.yaml", "--dp", "2", "--out", out, cwd=workdir, timeout=LAUNCH_TIMEOUT)
    return result, out


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_launches_2_ranks(elastic_run, reference):
    result, out = elastic_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr

    records = read_metrics(out)
    assert len(records) == STEPS
    assert set(records[0]) == METRIC_KEYS | MEMORY_KEYS | {"layout"}, records[0]  # a launch's first names its layout
    assert records[0]["layout"] == "dp2"
    assert all(set(r) == METRIC_KEYS for r in records[1:]), records[1]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    t = TrainConfig(steps=STEPS, lr=1e-2, warmup_steps=2)
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, t) for s in range(STEPS)], rel=1e-12)
    assert [r["tokens"] for r in records] == [s * 2 * MICRO_BATCH * SEQ_LEN for s in range(1, STEPS + 1)]
    assert all(r["mfu"] is None for r in records)  # no known peak for a CPU
    assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_mb"] >= 0 for r in records)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
    # the 2-rank run is the single-process run with the same global batch
    assert abs(records[0]["loss"] - math.log(256)) < 0.1  # near-uniform logits at init
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor(reference["losses"]),
                               rtol=LOSS_RTOL, atol=0)

    assert (out / "model" / "config.json").is_file() and (out / "model" / "model.safetensors").is_file()
    state = load_model(out / "model").state_dict()
    assert state.keys() == reference["state"].keys()
    for name, value in state.items():
        torch.testing.assert_close(value, reference["state"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)

    assert f"starting 2 ranks (dp=2 tp=1 pp=1 cp=1), run folder {out}" in result.stdout
    assert "step 4/4" in result.stdout and "step 1/4" in result.stdout  # the progress bar, plain lines off a tty
    # the story on rank 0, one line each: size, data, the final save
    n = from_dict(tiny_raw(out.parent)).model.num_params()
    assert re.search(rf"^tetron: model: {n:,} parameters, {n:,} on rank 0$", result.stdout, re.M), result.stdout
    assert re.search(r"^tetron: data: [\d,]+ tokens; 128 tokens per step; 4 steps = 512 tokens, [\d.]+ epochs$",
                     result.stdout, re.M), result.stdout
    assert re.search(rf"^tetron: saved {re.escape(str(out))}/checkpoints/step_4 \([\d.]+ MiB, [\d.]+ s\)$",
                     result.stdout, re.M), result.stdout
    marker = f"--- sample from {out}/model ---\n"
    assert marker in result.stdout
    sample = result.stdout.split(marker, 1)[1].rsplit("\n---", 1)[0]
    assert sample == sample_from_run(out, prompt="def ", max_new_tokens=SAMPLE_TOKENS, temperature=0.5, top_k=5,
                                     seed=1)  # logging.sample_temperature and sample_top_k


def test_generate_from_the_run(elastic_run, workdir):
    _, out = elastic_run
    assert (out / "model" / "model.safetensors").is_file()
    result = tetron("generate", out, "--max-new-tokens", "10", "--prompt", "def ", cwd=workdir, timeout=ERROR_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")
    # the command's text is the library's sample with the command's defaults (seed 0)
    assert result.stdout == sample_from_run(out, prompt="def ", max_new_tokens=10, seed=0) + "\n"
    assert len(result.stdout) > len("def \n")


def test_torchrun_runs_the_same_training(workdir, elastic_run):
    out = workdir / "torchrun"
    result = tetron("train", "tiny.yaml", "--dp", "2", "--out", out, "--logging.sample_tokens=0",
                    cwd=workdir, timeout=LAUNCH_TIMEOUT, launcher=torchrun(2))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "starting 2 ranks" not in result.stdout  # it is one of torchrun's ranks, it launches nothing
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    elastic = read_metrics(elastic_run[1])
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in elastic], rel=LOSS_RTOL)
    assert (out / "model" / "model.safetensors").is_file()


def test_torchrun_with_the_wrong_world_size_fails(workdir):
    out = workdir / "wrong"
    result = tetron("train", "tiny.yaml", "--dp", "2", "--out", out,  # one rank (a torch import less than two)
                    cwd=workdir, timeout=LAUNCH_TIMEOUT, launcher=torchrun(1))
    assert result.returncode != 0
    assert "tetron: error: world size 1 is not dp*tp*pp*cp = 2*1*1*1 = 2" in result.stdout + result.stderr
    assert not (out / "metrics.jsonl").exists()


# Ctrl-C while `tetron` loads torch (seconds, before any of its own code runs): an import hook raises what
# SIGINT would, in the middle of that import, deterministically.
INTERRUPT_WHILE_LOADING = """
import importlib.abc, runpy, sys
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            raise KeyboardInterrupt
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["tetron", "train", "--model", "demo"]
runpy.run_module("tetron.cli", run_name="__main__")
"""


def test_ctrl_c_before_a_run_starts_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    """While torch loads, and in any command once loaded (here plan's search): `tetron: interrupted`, exit
    130 as for a shell's interrupted command, no traceback."""
    from tetron.cli import COMMANDS, main

    proc = subprocess.run([sys.executable, "-c", INTERRUPT_WHILE_LOADING], cwd=tmp_path, env=user_env(),
                          capture_output=True, text=True, timeout=ERROR_TIMEOUT)
    assert (proc.returncode, proc.stderr) == (130, "tetron: interrupted\n"), proc.stderr

    def interrupted(args: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(COMMANDS, "plan", interrupted)
    capsys.readouterr()
    assert main(["plan", "--nodes", "1"]) == 130
    assert capsys.readouterr().err == "tetron: interrupted\n"
