"""Faults: a rank killed mid-training or mid-save, a collective that never completes, a NaN loss.

Each recovery is checked against an uninterrupted run: the final weights must be equal."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file
from test_cli import user_env

import tetron.checkpoint.save
from tetron.checkpoint.check import inspect_checkpoint
from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.fs import find_latest
from tetron.mesh import Mesh
from tetron.train import train

from conftest import run_training, tiny_config, train_rank_losses
from harness import run_ranks

REPO = Path(__file__).resolve().parent.parent


run = run_training  # train on forked ranks, rank 0's losses


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_same_model(a: Path, b: Path, atol: float = 0.0) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    for k in x:
        torch.testing.assert_close(x[k], y[k], rtol=0, atol=atol, msg=k)


# ----------------------------------------------------------------------------- SIGKILL during a save


def _slow_save_child(raw: dict) -> None:
    """Train on one rank; once step_2 is saved, each tensor written takes 0.3 s (the parent kills us)."""
    write = tetron.checkpoint.save.SafetensorsWriter.write

    def slow(self, name, tensor):
        if (Path(raw["out"]) / "checkpoints" / "step_2").exists():
            time.sleep(0.3)
        return write(self, name, tensor)

    tetron.checkpoint.save.SafetensorsWriter.write = slow
    torch.set_num_threads(1)  # as tests/harness.py: the parent's thread pool does not survive a fork
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    train(from_dict(raw), Mesh())
    os._exit(0)


@pytest.mark.parametrize("async_save", [False, True], ids=["foreground", "background"])
def test_sigkill_during_checkpoint_write(corpus, cache_dir, tmp_path, async_save):
    """Killed while step_4's tensors are written (in the background: by the writer thread, while training
    goes on): step_2 stays whole and `latest`, and --resume auto ends where an uninterrupted run does."""
    steps = {"steps": 6}
    ref = tiny_config(corpus, cache_dir, tmp_path / "ref", train=steps)
    run(ref)
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train=steps,
                      checkpoint={"save_every": 2, "async_save": async_save})
    prepare_data(from_dict(raw))
    child = mp.get_context("fork").Process(target=_slow_save_child, args=(raw,))
    child.start()
    root = tmp_path / "run" / "checkpoints"
    try:
        deadline = time.time() + 120
        while not list(root.glob("step_4.tmp-*")) and time.time() < deadline:
            time.sleep(0.02)
        assert list(root.glob("step_4.tmp-*")), "the save of step 4 never started"
        before = hashes(root / "step_2")
        time.sleep(0.5)  # well inside the write of step_4's tensors
        logged = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    assert list(root.glob("step_4.tmp-*")) and not (root / "step_4").exists()
    assert logged == (6 if async_save else 4)  # in the background, training went on to its end meanwhile
    assert hashes(root / "step_2") == before
    assert (root / "latest").read_text().strip() == "step_2"
    assert find_latest(tmp_path / "run") == root / "step_2"
    inspect_checkpoint(root / "step_2")
    resumed = tiny_config(corpus, cache_dir, tmp_path / "run", train=steps,
                          checkpoint={"resume": "auto", "async_save": async_save})
    assert len(run(resumed)) == 4  # steps 3..6
    assert not list(root.glob("*.tmp-*"))  # the killed save's folder was cleaned at start-up
    assert_same_model(tmp_path / "ref" / "model", tmp_path / "run" / "model")


# ----------------------------------------------------------------------------- SIGKILL of a rank under the launcher


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _is_rank(pid: int, launcher: int) -> bool:
    """On the CPU the launcher forks its ranks (tetron.device.rank_start_method): a rank is a child running
    the launcher's own command line."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() == Path(f"/proc/{launcher}/cmdline").read_bytes()
    except OSError:
        return False


def test_sigkill_of_a_rank_restarts_and_resumes(corpus, cache_dir, tmp_path):
    train_cfg = {"steps": 40, "micro_batch": 1, "grad_acc": 1}
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train=train_cfg, parallel={"dp": 2, "timeout_s": 60})
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(raw))
    prepare_data(from_dict(raw))
    cmd = [sys.executable, "-m", "tetron.cli", "train", str(tmp_path / "tiny.yaml"), "--max-restarts", "1",
           "--save-every", "2", "--logging.progress=false"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    killed = None
    deadline = time.time() + 180
    while killed is None and time.time() < deadline and proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if lines and json.loads(lines[-1])["step"] >= 3:
            ranks = [p for p in _children(proc.pid) if _is_rank(p, proc.pid)]
            if ranks:
                killed = ranks[-1]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=240)
    assert killed is not None, out.decode()
    (tmp_path / "log.txt").write_bytes(out)  # the whole launcher log, for a failure
    assert proc.returncode == 0, out.decode()[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    # One record per step: the restarted ranks resumed (from a checkpoint, or from scratch if the kill
    # came first) and moved the killed attempt's later records aside.
    assert steps == list(range(1, 41))
    # said on the console, once, naming the rank that died and its signal
    restarts = [line for line in out.decode().splitlines() if line.startswith("tetron: restart")]
    assert len(restarts) == 1 and re.fullmatch(r"tetron: restart 1 of 1 after rank [01] was killed by SIGKILL: "
                                               r"(resuming from .*step_\d+|starting over: no checkpoint was saved)",
                                               restarts[0]), restarts
    ref = tiny_config(corpus, cache_dir, tmp_path / "ref", train=train_cfg, parallel={"dp": 2})
    run(ref)
    assert_same_model(tmp_path / "ref" / "model", tmp_path / "run" / "model", atol=1e-6)


# ----------------------------------------------------------------------------- a collective that never completes


def _timeout_child(rank: int, port: int, raw: dict, err_path: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)  # as tests/harness.py: the parent's thread pool does not survive a fork
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", closefd=False)  # under pytest, sys.stderr is its capture, not fd 2
    code = 0
    try:
        if rank == 0:
            from tetron.launch import run_rank

            run_rank(raw)
        else:  # joins the group and the mesh, then never takes part in a collective
            dist.init_process_group("gloo")
            Mesh(dp=2)
            time.sleep(60)
    except SystemExit as e:
        code = e.code
    except BaseException:
        code = 3
    sys.stderr.flush()
    os._exit(code)


def test_hung_collective_ends_with_a_clear_error(corpus, cache_dir, tmp_path):
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel={"dp": 2, "timeout_s": 3})
    prepare_data(from_dict(raw))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_timeout_child, args=(r, port, raw, str(tmp_path / f"err{r}"))) for r in (0, 1)]
    for p in procs:
        p.start()
    start = time.time()
    procs[0].join(150)
    elapsed = time.time() - start
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    err = (tmp_path / "err0").read_text()
    assert procs[0].exitcode == 1, err
    # did not hang: ended by its own 3 s timeout, not torch's 30-minute default (the bound is loose: a loaded CI
    # machine is slow to start and tear down the ranks)
    assert elapsed < 150
    assert ("tetron: rank 0: a collective did not finish within parallel.timeout_s=3 s (a rank died or hangs)"
            in err), err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- NaN / inf loss


def _nan_rank(raw: dict) -> list[float]:
    """Train with the loss of the third step made NaN."""
    import tetron.train as tt

    build = tt.build_run
    calls = [0]

    def build_nan(*args, **kwargs):
        run = build(*args, **kwargs)
        per_token = run.loss_fn

        def loss(summed):
            calls[0] += 1
            value = per_token(summed)
            return value * float("nan") if calls[0] == 3 else value
        run.loss_fn = loss
        return run

    tt.build_run = build_nan
    return train_rank_losses(raw)


def test_nan_loss_stops_naming_the_step(corpus, cache_dir, tmp_path):
    raw = tiny_config(corpus, cache_dir, tmp_path / "run")
    prepare_data(from_dict(raw))
    with pytest.raises(RuntimeError, match="FloatingPointError: step 3: loss is nan; stopping before the weights"):
        run_ranks(1, _nan_rank, raw)
    assert not (tmp_path / "run" / "model").exists()


def test_nan_loss_skips_the_step_when_configured(corpus, cache_dir, tmp_path):
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"on_nonfinite": "skip", "steps": 10})
    prepare_data(from_dict(raw))
    losses = run_ranks(1, _nan_rank, raw)[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped", False) for r in records] == [k == 2 for k in range(10)]
    assert all(torch.isfinite(torch.tensor(x)) for i, x in enumerate(losses) if i != 2)
    state = inspect_checkpoint(tmp_path / "run" / "checkpoints" / "step_10")
    assert state["optimizer"]["step"] == 9  # nine updates: the skipped step changed nothing
    for value in load_file(tmp_path / "run" / "model" / "model.safetensors").values():
        assert torch.isfinite(value).all()
