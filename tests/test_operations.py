"""Operations: a run folder is never damaged, every group times out, preemption saves, bad input is one line.

One section per class of the operations issue, each with the issue's examples and more. Most checks run in
this process: validate, the CLI's `main` with the launcher replaced (exit code, one stderr line, files
unchanged), forked ranks. Real launches start at once for what only they can show: SIGTERM saves and
the run resumes to the uninterrupted run's losses exactly (also under torchrun, exiting 0), a
second signal aborts at once, and a rank stopped with SIGSTOP ends the run within parallel.timeout_s, naming
that rank.
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import yaml
from test_bad_input import _corrupt, hashes, time_limit
from test_cli import user_env

import tetron.cli
import tetron.data.files
from tetron.checkpoint.check import inspect_checkpoint, verify_tensors
from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.errors import ConfigError
from tetron.fs import find_latest
from tetron.mesh import Mesh
from tetron.stop import StopRequest
from tetron.train import train
from tetron.validate import validate

from conftest import run_training, tiny_config, train_rank_losses
from harness import run_ranks

LAUNCH_TIMEOUT = 240  # s, a real launch of 2 ranks on a busy machine
# s from a signal (or a stopped rank) to the end of the run: bounds that mean "did not hang", not a speed. A
# hang lasts until LAUNCH_TIMEOUT (or torch's 30-minute collective timeout); the real end takes a few seconds
# on an idle machine and has taken 29 s in a loaded `make test` on a shared CI machine.
ENDED_S = 120
PREEMPT_STEPS = 60  # the preempted run's length: a SIGTERM after step 2 lands long before its end (tens of steps
# later even on a loaded machine, where a step takes tens of milliseconds), and the reference and resume stay short
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def tetron_cli(capsys, monkeypatch):
    """`tetron ARGS` in this process, the launcher replaced: returns (exit code, stdout, stderr, configs the
    command would have launched). Offline, as on a cluster node without network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    launched: list = []
    monkeypatch.setattr(tetron.cli, "launch", lambda cfg: launched.append(cfg) or 0)

    def run(*args) -> tuple[int, str, str, list]:
        capsys.readouterr()
        launched.clear()
        with time_limit(60):
            code = tetron.cli.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err, list(launched)

    return run


def one_line(code: int, err: str, pattern: str, launched: list | None = None) -> str:
    """Exit 2, exactly one stderr line `tetron: error: ...` matching `pattern`, nothing launched."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tetron: error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert not launched
    return lines[0]


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def ck(tmp_path_factory, corpus, cache_dir) -> tuple[Path, dict]:
    """A finished single-rank run of 4 steps saving every 2 (its folder holds step_2, step_4 and model/)
    and its raw config."""
    run = tmp_path_factory.mktemp("ops") / "run"
    raw = tiny_config(corpus, cache_dir, run, train={"steps": 4}, checkpoint={"save_every": 2})
    run_training(raw)
    return run, raw


def fresh(ck, tmp_path) -> tuple[Path, Path, dict]:
    """A copy of the module's run folder, a YAML config training into it, and that raw config."""
    run, raw = ck
    shutil.copytree(run, tmp_path / "run")
    raw = {**raw, "out": str(tmp_path / "run")}
    return tmp_path / "run", write_yaml(tmp_path / "run.yaml", raw), raw


# ----------------------------------------------------------------------------- run folders are never damaged


def test_resume_below_the_checkpoint_is_refused_and_nothing_changes(corpus, cache_dir, tmp_path, tetron_cli):
    """The issue's example: dp2 --save-every 2 --steps 6, then --resume auto --steps 4 (refused, nothing
    touched), then --steps 8 (continues: step_8 holds step 8, and `latest` stays loadable)."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 6}, checkpoint={"save_every": 2},
                      parallel={"dp": 2})
    run_training(raw)
    config = write_yaml(tmp_path / "run.yaml", raw)
    before = hashes(tmp_path / "run")
    code, _, err, launched = tetron_cli("train", config, "--resume", "auto", "--steps", "4")
    one_line(code, err, r"train\.steps=4 is below step 6 of .*step_6.*use train\.steps >= 6", launched)
    assert hashes(tmp_path / "run") == before
    # the library refuses too, past validate: a checkpoint named step_4 must never hold step 6
    later = {**raw, "train": {**raw["train"], "steps": 4}, "checkpoint": {"resume": "auto"}}
    with pytest.raises(RuntimeError, match=r"ConfigError: train\.steps=4 is below the step the run resumes at \(6\)"):
        run_ranks(2, train_rank_losses, later, timeout=120)
    assert hashes(tmp_path / "run") == before
    run_training({**later, "train": {**raw["train"], "steps": 8}})
    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_8"
    assert inspect_checkpoint(root / "step_8")["step"] == 8 and inspect_checkpoint(root / "step_6")["step"] == 6
    assert tetron_cli("train", config, "--resume", "auto", "--steps", "10")[3]  # `latest` is accepted again


HOLD_LOCK = ("import sys, time; from pathlib import Path; from tetron.folder_lock import FolderLock; "
             "FolderLock(Path(sys.argv[1]), 'tetron.lock').acquire(); print('held', flush=True); time.sleep(120)")


def test_a_second_run_into_the_same_folder_is_refused(ck, tmp_path, tetron_cli):
    """A run holds OUT/tetron.lock: a second is refused in one line naming the holder; once the holder is
    killed (SIGKILL: no clean-up), the lock is stale and taken over; any exit of the CLI releases it."""
    run, config, _ = fresh(ck, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], env=user_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = hashes(run)
        code, _, err, launched = tetron_cli("train", config, "--resume", "auto", "--steps", "6")
        one_line(code, err, rf"out=.*tetron\.lock is held by another run \(pid {holder.pid} on host .*\); "
                            r"give another out", launched)
        assert hashes(run) == before
    finally:
        holder.kill()
        holder.wait()
    assert (run / "tetron.lock").exists()  # left behind by the kill
    assert tetron_cli("train", config, "--resume", "auto", "--steps", "6")[3]  # stale: taken over
    assert not (run / "tetron.lock").exists()  # and released when the command ended
    code, _, err, launched = tetron_cli("train", config, "--resume", "auto", "--steps", "6", "--data.max_bytes=150000")
    one_line(code, err, "other data", launched)  # refused after the lock was taken
    assert not (run / "tetron.lock").exists()


def test_the_run_folder_is_new_empty_or_tetrons(ck, tmp_path, tetron_cli):
    """`--out ''`, a file, or a folder tetron did not write (whose model/ a run would replace) are refused;
    a new or empty folder, or an earlier run's, is accepted."""
    _, config, _ = fresh(ck, tmp_path)
    foreign = tmp_path / "project"
    (foreign / "model").mkdir(parents=True)
    (foreign / "model" / "weights.bin").write_bytes(b"precious")
    (tmp_path / "file.txt").write_text("a file")
    before = hashes(tmp_path)
    cases = {"": r"out='': give a run folder", str(foreign): r"neither empty nor a tetron run",
             str(tmp_path / "file.txt"): r"exists and is not a folder"}
    for out, pattern in cases.items():
        code, _, err, launched = tetron_cli("train", config, "--out", out)
        one_line(code, err, pattern, launched)
    assert hashes(tmp_path) == before
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new"):
        assert tetron_cli("train", config, "--out", out, "--checkpoint.resume=null")[3], out
    assert tetron_cli("train", config, "--out", tmp_path / "run", "--resume", "auto", "--steps", "6")[3]


def test_a_fresh_run_never_mixes_with_or_replaces_an_earlier_run(ck, tmp_path, tetron_cli, monkeypatch):
    """The issue's example: the same command with another --seed into a finished run's folder (or a copy of
    it) is refused in one line saying how to continue and how to start anew; --overwrite moves the run to
    the first free OUT.old-N, whole; metrics alone are a run too; a torchrun restart of the job goes on."""
    run, config, _ = fresh(ck, tmp_path)
    shutil.copytree(run, tmp_path / "copy")
    (tmp_path / "run.old-1").mkdir()  # taken: the run moves to run.old-2
    before = hashes(tmp_path)
    for args in (["--seed", "5"], ["--out", tmp_path / "copy"], ["--init-from", run / "model"]):
        code, _, err, launched = tetron_cli("train", config, *args)
        one_line(code, err, r"out=.*(run|copy) holds an earlier run \(metrics\.jsonl, checkpoints/step_4, model/\); "
                            r"continue it with --resume auto, or start anew with another --out, or --overwrite to "
                            r"move it to .*(run\.old-2|copy\.old-1)$", launched)
    code, _, err, launched = tetron_cli("train", config, "--overwrite", "--resume", "auto")
    one_line(code, err, r"checkpoint\.overwrite=true with checkpoint\.resume=auto: .* give one of them", launched)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    code, _, err, launched = tetron_cli("train", config, "--overwrite")  # torchrun's first attempt
    one_line(code, err, r"holds an earlier run .* move it aside before torchrun starts", launched)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert tetron_cli("train", config)[3]  # torchrun's restart: it resumes
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert hashes(tmp_path) == before
    code, out, err, launched = tetron_cli("train", config, "--seed", "5", "--overwrite")
    assert code == 0 and launched, err
    assert f"tetron: moved the earlier run in {run} to {tmp_path / 'run.old-2'}\n" in out
    assert hashes(tmp_path / "run.old-2") == hashes(tmp_path / "copy") and not run.exists()
    shutil.rmtree(tmp_path / "copy" / "checkpoints")
    shutil.rmtree(tmp_path / "copy" / "model")
    code, _, err, launched = tetron_cli("train", config, "--out", tmp_path / "copy")
    one_line(code, err, r"copy holds an earlier run \(metrics\.jsonl\)", launched)


def test_every_path_the_run_writes_is_checked_before_start(ck, tmp_path, tetron_cli):
    """A checkpoints/ the run cannot write is refused before start, not after training (as root, only an
    immutable folder is unwritable)."""
    run, config, _ = fresh(ck, tmp_path)
    target = run / "checkpoints"
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(target)]).returncode != 0:
            pytest.skip("root, and no immutable attribute on this file system")
    else:
        target.chmod(0o555)
    try:
        code, _, err, launched = tetron_cli("train", config, "--resume", "auto", "--steps", "6")
        one_line(code, err, r"checkpoints is not writable, and the run writes there", launched)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(target)])
        else:
            target.chmod(0o755)


def _full_disk_child(raw: dict, err_path: str, fault: str = "full disk") -> None:
    """One rank through run_rank; writing step_4's tensors fails as a full disk does, or (`fault` "file size")
    past a file-size limit: the kernel's own EFBIG, whose buffered bytes fail again when the file is closed."""
    import resource

    import tetron.checkpoint.save
    from tetron.launch import run_rank

    write = tetron.checkpoint.save.SafetensorsWriter.write

    def full(self, name, tensor):
        if "step_4" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, name, tensor)

    def limited(self, name, tensor):
        if "step_4" in str(self.path) and self.next == 1:  # past the embedding, written through: the small
            # tensors after it wait in the file's buffer, whose flush fails, and fails again at close
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.file.tell() + 1, resource.RLIM_INFINITY))
        return write(self, name, tensor)

    if fault == "file size":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, not kill
    tetron.checkpoint.save.SafetensorsWriter.write = limited if fault == "file size" else full
    for var in LAUNCHER_VARS:
        os.environ.pop(var, None)  # this child is a single process started without a launcher
    # as tests/harness.py: one thread, since the parent's thread pool does not survive a fork (run_rank
    # gives each rank cpu_count / LOCAL_WORLD_SIZE threads)
    os.environ["LOCAL_WORLD_SIZE"] = str(os.cpu_count() or 1)
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    sys.stderr = open(2, "w", closefd=False)
    code = 0
    try:
        run_rank(raw)
    except SystemExit as e:
        code = e.code
    except BaseException:
        code = 3
    sys.stderr.flush()
    os._exit(code)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(corpus, cache_dir, tmp_path):
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 6}, checkpoint={"save_every": 2})
    prepare_data(from_dict(raw))
    child = mp.get_context("fork").Process(target=_full_disk_child, args=(raw, str(tmp_path / "err")))
    child.start()
    child.join(120)
    if child.exitcode is None:
        child.kill()
    err = (tmp_path / "err").read_text()
    assert child.exitcode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.fullmatch(r"tetron: error: .*/checkpoints/step_4\.tmp-\w+/model-00001-of-00001\.safetensors: no space "
                        r"left on device \([\d.]+ \w+ free; it needs about [\d.]+ KiB\), while writing checkpoint "
                        r"step_4 \(step_2 is intact\); free space or fix it, then --resume auto", lines[0]), lines[0]
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]  # no half-written step_4 left
    assert find_latest(tmp_path / "run") == root / "step_2" and inspect_checkpoint(root / "step_2")["step"] == 2


def test_a_file_size_limit_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(corpus, cache_dir, tmp_path):
    """Item 6 of issue 38: past RLIMIT_FSIZE the write fails with EFBIG and so does closing the file (its
    buffered bytes): one line naming the file, no step_4.tmp-* left, step_2 whole."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 6}, checkpoint={"save_every": 2})
    prepare_data(from_dict(raw))
    child = mp.get_context("fork").Process(target=_full_disk_child, args=(raw, str(tmp_path / "err"), "file size"))
    child.start()
    child.join(120)
    if child.exitcode is None:
        child.kill()
    err = (tmp_path / "err").read_text()
    assert child.exitcode == 1 and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(r"tetron: error: .*/checkpoints/step_4\.tmp-\w+/model-00001-of-00001\.safetensors: file too "
                        r"large \(past this process's file-size limit, ulimit -f, .*\), while writing checkpoint "
                        r"step_4 \(step_2 is intact\); .*--resume auto", err.strip()), err
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]  # no half-written step_4 left
    assert find_latest(tmp_path / "run") == root / "step_2" and verify_tensors(root / "step_2") == []


def test_resuming_with_other_model_settings_or_data_is_refused(ck, tmp_path, tetron_cli):
    """rope_theta, rope_scaling and rms_norm_eps give the weights their meaning, as the data gives the data
    order its: a change is one line, unless the matching override says so."""
    run, config, _ = fresh(ck, tmp_path)
    before = hashes(run)
    scaling = "{rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4}"
    for flag, pattern in [("--model.rope_theta=500000", r"model\.rope_theta=10000\.0 there, .*500000\.0"),
                          (f"--model.rope_scaling={scaling}", r"model\.rope_scaling=None there"),
                          ("--model.rms_norm_eps=1e-5", r"model\.rms_norm_eps=1e-06 there")]:
        code, _, err, launched = tetron_cli("train", config, "--resume", "auto", "--steps", "6", flag)
        one_line(code, err, pattern + r".*checkpoint\.new_model_settings=true", launched)
        assert tetron_cli("train", config, "--resume", "auto", "--steps", "6", flag,
                          "--checkpoint.new_model_settings=true")[3]
    code, _, err, launched = tetron_cli("train", config, "--resume", "auto", "--steps", "6", "--data.max_bytes=150000")
    one_line(code, err, r"gives [\d,]+ tokens, but .*step_4 was trained on [\d,]+: other data.*new_data=true", launched)
    assert tetron_cli("train", config, "--resume", "auto", "--steps", "6", "--data.max_bytes=150000",
                      "--checkpoint.new_data=true")[3]
    assert hashes(run) == before


# ----------------------------------------------------------------------------- every group honours the timeout


def _group_timeouts(layout: dict, done: str) -> dict[str, float]:
    """Rank 0 waits on each size-2 group of `layout` (and a P2P under pp) that rank 1 never joins; the
    seconds each took to fail. Rank 1 stays alive and silent meanwhile, until rank 0 touches `done`."""
    mesh = Mesh(**layout, timeout=timedelta(seconds=1))
    axis = next(a for a, n in layout.items() if n == 2)
    names = [axis, *(["dp_cp"] if axis in ("dp", "cp") else [])]
    if dist.get_rank() == 1:
        deadline = time.monotonic() + 30
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    took = {}
    for name in names:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out"):
            dist.all_reduce(torch.ones(1), group=mesh.group(name))
        took[name] = time.monotonic() - start
    if axis == "pp":  # the pp pair is closed by its timeout: the P2P goes over the other pp-wide group
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out|timeout"):
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.ones(1), 1, mesh.group("embed"))]):
                work.wait()
        took["p2p"] = time.monotonic() - start
    Path(done).touch()
    return took


@pytest.mark.parametrize("axis", ["dp", "tp", "pp", "cp"])
def test_every_group_honours_the_timeout(axis, tmp_path):
    """Groups made without a timeout wait torch's default 30 minutes: every one of the mesh carries its own."""
    took = run_ranks(2, _group_timeouts, {axis: 2}, str(tmp_path / "done"), timeout=60)[0]
    # at least the group's 1 s timeout; under 25 s means "did not hang": rank 1 stays in the group for 30 s, and
    # a group without its own timeout would wait torch's default 30 minutes
    assert took and all(0.9 < t < 25 for t in took.values()), took


# ----------------------------------------------------------------------------- stopping on a signal


class _StopOnRank(StopRequest):
    """A stop request that arrives on one rank only, as it is read at a given step."""

    def __init__(self, rank: int, at_read: int) -> None:
        super().__init__()
        self.rank, self.at_read, self.reads = rank, at_read, 0

    @property
    def requested(self) -> bool:
        self.reads += 1
        return dist.get_rank() == self.rank and self.reads >= self.at_read


def _train_until_stopped(raw: dict) -> tuple[list[float], int | None]:
    cfg = from_dict(raw)
    result = train(cfg, Mesh(dp=cfg.parallel.dp), stop=_StopOnRank(rank=1, at_read=3))
    return result.losses, result.stopped_at


def test_a_stop_on_one_rank_stops_every_rank_after_the_same_step_and_resumes_exactly(corpus, cache_dir, tmp_path):
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel={"dp": 2}, train={"steps": 8})
    whole = run_training(tiny_config(corpus, cache_dir, tmp_path / "ref", parallel={"dp": 2}, train={"steps": 8}))
    validate(from_dict(raw))
    stopped = run_ranks(2, _train_until_stopped, raw, timeout=120)
    assert [s for _, s in stopped] == [3, 3]  # both ranks, the same step: the request rode on step 3's loss
    root = tmp_path / "run" / "checkpoints"
    assert inspect_checkpoint(root / "step_3")["step"] == 3 and not (tmp_path / "run" / "model").exists()
    rest = run_training({**raw, "checkpoint": {"resume": "auto"}})
    assert stopped[0][0] + rest == whole  # bit for bit


def _launch(workdir: Path, name: str, *args, launcher: tuple[str, ...] = (), out: str | None = None
            ) -> tuple[subprocess.Popen, Path]:
    log = workdir / f"{name}.log"
    cmd = [sys.executable, *launcher, "-m", "tetron.cli", "train", "tiny.yaml", "--out", out or name,
           *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=workdir, env=user_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, log


def _rank_pids(parent: int) -> dict[int, int]:
    """RANK -> pid of the ranks the launcher `parent` spawned, from the reports the ranks keep for it."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                children.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    found = {}
    for report in _rank_reports():
        try:
            info = json.loads(report.read_text())
        except (OSError, ValueError):
            continue
        if info["pid"] in children:
            found[info["rank"]] = info["pid"]
    return found


def _rank_reports() -> list[Path]:
    """The rank report files of every tetron launch on this machine. Other runs' folders (another test
    session, a CI run) may vanish while this looks, so each folder is read on its own."""
    found: list[Path] = []
    for folder in Path(tempfile.gettempdir()).iterdir():
        if folder.name.startswith("tetron-ranks-"):
            try:
                found += list(folder.glob("attempt*_rank*.json"))
            except OSError:
                continue
    return found


def _report_pid(report: Path) -> int | None:
    try:
        return json.loads(report.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _steps(workdir: Path, name: str) -> int:
    path = workdir / name / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def launches(tmp_path_factory, corpus, cache_dir) -> dict:
    """Real launches of 2 ranks at once. `preempt` (saving in the background): SIGTERM to tetron once step 2
    is logged, then `--resume auto` to the end. `abort`: SIGINT twice. `stopped`: rank 1 gets SIGSTOP, timeout_s=5.
    `killed`: tetron itself gets SIGKILL. `single`: one rank, SIGHUP. `torchrun`: one rank under torchrun
    (python -m tetron.launch), its agent gets SIGTERM. Each records its exit code, log, how long it took to
    end after the signal, and its ranks' pids."""
    workdir = tmp_path_factory.mktemp("launches")
    raw = tiny_config(corpus, cache_dir, workdir / "unused", parallel={"dp": 2}, train={"steps": PREEMPT_STEPS})
    raw["out"] = "unused"
    write_yaml(workdir / "tiny.yaml", raw)
    prepare_data(from_dict(raw))
    runs = {"preempt": _launch(workdir, "preempt", "--async-save"),  # the stop waits for the background write
            "abort": _launch(workdir, "abort", "--steps", 5000, "--save-every", 2),
            "stopped": _launch(workdir, "stopped", "--steps", 5000, "--parallel.timeout_s=5"),
            "killed": _launch(workdir, "killed", "--steps", 5000),
            "single": _launch(workdir, "single", "--steps", 5000, "--dp", 1),
            "torchrun": _launch(workdir, "torchrun", "--steps", 5000, "--dp", 1, launcher=(
                "-m", "tetron.launch", "--standalone", "--nproc-per-node", "1"))}
    # The resume starts as soon as `preempt` has ended, while the others still run, and the uninterrupted run
    # trains here while the resume runs: the fixture's time is its slowest launch's, not their sum.
    acted, ended, pids, resumed = {}, {}, {}, None
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        while len(ended) < len(runs) and time.monotonic() < deadline:
            if resumed is None and "preempt" in ended:
                resumed = _launch(workdir, "resumed", "--resume", "auto", out="preempt")
            for name, (proc, _) in runs.items():
                if name in acted:  # signalled: only its end is awaited (no /proc scan every 20 ms)
                    if name not in ended and proc.poll() is not None:
                        ended[name] = time.monotonic()
                    continue
                ready = _steps(workdir, name) >= (4 if name == "abort" else 2)
                alone = name in ("single", "torchrun")  # no tetron launcher's reports: signal the process itself
                ranks = {0: proc.pid} if alone else _rank_pids(proc.pid) if ready else {}
                if ready and len(ranks) == (1 if alone else 2):
                    pids[name] = ranks
                    if name in ("preempt", "torchrun"):
                        proc.send_signal(signal.SIGTERM)
                    elif name == "single":  # a closed terminal: the same stop as SIGTERM's
                        proc.send_signal(signal.SIGHUP)
                    elif name == "abort":
                        proc.send_signal(signal.SIGINT)
                        time.sleep(0.05)
                        proc.send_signal(signal.SIGINT)
                    elif name == "killed":
                        proc.kill()
                    else:
                        os.kill(ranks[1], signal.SIGSTOP)
                    acted[name] = time.monotonic()
                if name not in ended and proc.poll() is not None:
                    ended[name] = time.monotonic()
            time.sleep(0.02)
        killed = time.monotonic()  # the ranks of `killed` save (its death signal is a stop request) and end
        while any(not _gone(pid) for pid in pids.get("killed", {}).values()) and time.monotonic() - killed < 60:
            time.sleep(0.1)
        orphans = {pid: _gone(pid) for pid in pids.get("killed", {}).values()}
        for folder in {r.parent for r in _rank_reports() if _report_pid(r) in orphans}:
            shutil.rmtree(folder, ignore_errors=True)  # the killed launcher's report folder: nobody else removes it
    finally:
        for proc, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
        for ranks in pids.values():
            for pid in ranks.values():
                if not _gone(pid):
                    os.kill(pid, signal.SIGKILL)
    result = {name: {"code": proc.returncode, "log": log.read_text(), "pids": pids.get(name, {}),
                     "took": ended[name] - acted[name] if name in acted and name in ended else None}
              for name, (proc, log) in runs.items()}
    if resumed is None:  # preempt never ended: the test reading it fails on its exit code
        resumed = _launch(workdir, "resumed", "--resume", "auto", out="preempt")
    reference = run_training({**raw, "out": str(workdir / "reference")})
    resumed[0].wait(LAUNCH_TIMEOUT)
    result.update(workdir=workdir, reference=reference, orphans=orphans,
                  resumed={"code": resumed[0].returncode, "log": resumed[1].read_text()})
    (workdir / "times.json").write_text(json.dumps({k: v["took"] for k, v in result.items() if isinstance(v, dict)
                                                    and "took" in v}))
    return result


@pytest.mark.timeout(600)
def test_sigterm_through_the_launcher_saves_exits_0_and_resumes_exactly(launches):
    run = launches["preempt"]
    assert run["code"] == 0, run["log"]
    assert "Traceback" not in run["log"]
    last = run["log"].strip().splitlines()[-1]
    match = re.fullmatch(rf"tetron: stopped by SIGTERM after step (\d+) of {PREEMPT_STEPS}: saved "
                         r"preempt/checkpoints/step_(\d+); continue with the same command and --resume auto", last)
    assert match and match.group(1) == match.group(2), run["log"]
    assert run["took"] is not None and run["took"] < ENDED_S  # did not hang
    assert all(_gone(pid) for pid in run["pids"].values())
    resumed = launches["resumed"]
    assert resumed["code"] == 0, resumed["log"]
    assert f"resumed from preempt/checkpoints/step_{match.group(1)}" in resumed["log"]
    log = launches["workdir"] / "preempt" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, PREEMPT_STEPS + 1))
    assert [r["loss"] for r in records] == launches["reference"]  # the uninterrupted run's, exactly


@pytest.mark.timeout(600)
def test_a_second_signal_aborts_at_once_and_keeps_the_last_checkpoint(launches):
    run = launches["abort"]
    assert run["code"] == 128 + signal.SIGINT, run["log"]
    last = run["log"].strip().splitlines()[-1]
    assert re.fullmatch(r"tetron: aborted by a second SIGINT: every rank was killed; the last complete checkpoint "
                        r"is abort/checkpoints/step_\d+", last), run["log"]
    assert "Traceback" not in run["log"] and run["took"] is not None and run["took"] < ENDED_S  # did not hang
    assert all(_gone(pid) for pid in run["pids"].values())  # no orphaned rank
    latest = find_latest(launches["workdir"] / "abort")
    assert inspect_checkpoint(latest)["step"] == int(latest.name[5:])


@pytest.mark.timeout(600)
def test_a_stopped_rank_ends_the_run_within_the_timeout_naming_it(launches):
    run = launches["stopped"]
    assert run["code"] == 1, run["log"]
    errors = [line for line in run["log"].splitlines() if "error" in line.lower() or "Traceback" in line]
    # nothing was saved (no --save-every): nothing to resume from
    assert errors == ["tetron: error: rank 1 stopped answering (its process is stopped): rank 0 waited "
                      "parallel.timeout_s=5 s in a collective; the run ended (no checkpoint was saved: run the same "
                      "command again to start over)"], run["log"]
    # ended by the 5 s timeout and the watch (which rank, which message: above), not by the test's deadline: the
    # timeout, the watch's grace and the launcher's wind-down take ~10 s idle, 29 s once under a loaded make test
    assert run["took"] is not None and run["took"] < ENDED_S, run["took"]
    assert all(_gone(pid) for pid in run["pids"].values())


@pytest.mark.timeout(600)
def test_sighup_to_a_single_process_run_saves_and_exits_0(launches):
    """One rank runs in the `tetron train` process itself: the same stop, said by the rank. SIGHUP (the
    terminal closed) stops a run as SIGTERM does (the other launches get SIGTERM)."""
    run = launches["single"]
    assert run["code"] == 0 and "Traceback" not in run["log"], run["log"]
    assert re.fullmatch(r"tetron: stopped by SIGHUP after step (\d+) of 5000: saved single/checkpoints/step_\1; "
                        r"continue with the same command and --resume auto", run["log"].strip().splitlines()[-1])
    assert inspect_checkpoint(find_latest(launches["workdir"] / "single"))["step"] >= 2


@pytest.mark.timeout(600)
def test_sigterm_to_torchrun_saves_and_exits_0(launches):
    """Under torchrun (`python -m tetron.launch`, as `tetron slurm` starts it) a preemption's SIGTERM to the
    agent: the ranks save, and the exit status is 0 as under tetron's launcher (torchrun itself exits 1)."""
    run = launches["torchrun"]
    assert run["code"] == 0 and "Traceback" not in run["log"], run["log"]
    assert re.fullmatch(r"tetron: stopped by SIGTERM after step (\d+) of 5000: saved torchrun/checkpoints/step_\1; "
                        r"continue with the same command and --resume auto", run["log"].strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_a_killed_launcher_leaves_no_rank_and_a_checkpoint(launches):
    """SIGKILL of `tetron train` itself: the kernel sends its ranks their launcher's death signal, a stop
    request; they save, and end although nobody is left to collect their result."""
    assert launches["orphans"] and all(launches["orphans"].values()), launches["orphans"]
    latest = find_latest(launches["workdir"] / "killed")
    assert latest is not None and inspect_checkpoint(latest)["step"] == int(latest.name[5:])


# ----------------------------------------------------------------------------- refused before start


def test_what_a_rank_would_meet_is_refused_before_start(ck, tmp_path, tetron_cli, monkeypatch):
    """The issue's list: each one line, exit 2, no run folder, nothing launched; offline hub names fast."""
    _, raw = ck
    (tmp_path / "short.txt").write_text("too short for a global batch\n")
    (tmp_path / "plain.json").write_text(json.dumps({"hidden_size": 4096}))  # a config.json without model_type
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    config = write_yaml(tmp_path / "run.yaml", {**raw, "out": str(tmp_path / "out")})
    cases = [(["--data", tmp_path / "short.txt"], r"fewer than one global batch"),
             (["--data.max_bytes=50"], r"fewer than one global batch"),
             (["--micro-batch", "7000"], r"fewer than one global batch of 7000"),
             (["--train.eps=0"], r"train\.eps=0\.0 must be positive"), (["--lr", "inf"], r"train\.lr=inf must be"),
             (["--seed", "-1"], r"train\.seed=-1"), (["--model.initializer_range=0"], r"initializer_range=0\.0"),
             (["--model.rope_theta=0"], r"model\.rope_theta=0\.0 must be positive"),
             (["--parallel.timeout_s=inf"], r"parallel\.timeout_s=inf"),
             (["--model", tmp_path / "plain.json"], r"no model_type .*not a Llama config"),
             (["--model", tmp_path / "list.json"], r"expected a JSON object"),
             (["--model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 4}"],
              r"high_freq_factor must be above low_freq_factor"),
             (["--checkpoint.stop_signal=SIGKILL"], r"stop_signal='SIGKILL': use one of"),
             (["--model.eos_token_id=999"], r"eos_token_id=999: ids must be in \[0, vocab_size=256\)")]
    if not torch.cuda.is_available():
        cases.append((["--parallel.device=cuda"], r"no CUDA device is available"))
    for args, pattern in cases:
        code, _, err, launched = tetron_cli("train", config, *args)
        assert code == 2, (args, err)
        one_line(code, err, pattern, launched)
    for args, pattern in [(["--init-from", "someorg/somemodel"], r"init_from=someorg/somemodel: not a local path"),
                          (["--tokenizer", "someorg/sometokenizer"], r"data\.tokenizer=someorg/sometokenizer: not"),
                          (["--data", "hf:someorg/somedata"], r"hf:someorg/somedata: not a local path")]:
        start = time.monotonic()
        code, _, err, launched = tetron_cli("train", config, *args)
        one_line(code, err, pattern + r".*HF_HUB_OFFLINE=1", launched)
        assert time.monotonic() - start < 25  # did not retry: the hub client's retries take 27-50 s
    assert not (tmp_path / "out").exists()


def test_a_damaged_token_cache_is_made_again(ck, tmp_path, tetron_cli):
    """A truncated shard (or a damaged index) of the cached token store is tokenized again before start."""
    _, raw = ck
    raw = {**raw, "data": {**raw["data"], "cache_dir": str(tmp_path / "cache")}, "out": str(tmp_path / "out")}
    config = write_yaml(tmp_path / "run.yaml", raw)
    _, store = prepare_data(from_dict(raw))  # the cache entry: a token store folder
    shard = next(store.glob("*.bin"))
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    code, out, err, launched = tetron_cli("train", config)
    assert code == 0 and launched, err
    assert re.search(r"the token cache .* is truncated or missing .*; tokenizing again", out), out
    assert shard.stat().st_size == size
    (store / "index.json").write_text("{ not json")
    code, out, err, launched = tetron_cli("train", config)
    assert code == 0 and launched and "is unreadable" in out, out + err


# ----------------------------------------------------------------------------- files read defensively


def _write_parquet(path: Path, column) -> Path:
    pq.write_table(pa.table({"text": column}), path)
    return path


def test_bad_data_files_are_one_line_or_skipped_and_counted(ck, tmp_path, tetron_cli, monkeypatch):
    _, raw = ck
    config = write_yaml(tmp_path / "run.yaml", {**raw, "out": str(tmp_path / "out"),
                                                "data": {**raw["data"], "cache_dir": str(tmp_path / "cache")}})
    good = [json.dumps({"text": "def f(x):\n    return x * 2\n" * 40}).encode()] * 60
    files = {"utf8.jsonl": (good[:1] + [b'{"text": "caf\xe9"}'] + good, r"utf8\.jsonl line 2 is not valid UTF-8"),
             "deep.jsonl": (good[:1] + [b"[" * 2000 + b"]" * 2000] + good, r"line 2 is JSON nested too deeply"),
             "nostr.jsonl": (good[:2] + [b'{"text": 7}'] + good, r"line 3 has no string field 'text'"),
             "long.jsonl": (good[:3] + [json.dumps({"text": "x" * 5000}).encode()] + good,
                            r"line 4 is longer than 4096 bytes")}
    monkeypatch.setattr(tetron.data.files, "MAX_RECORD_BYTES", 4096)
    for name, (lines, pattern) in files.items():
        (tmp_path / name).write_bytes(b"\n".join(lines) + b"\n")
        code, _, err, launched = tetron_cli("train", config, "--data", tmp_path / name)
        one_line(code, err, pattern + r".*; data\.on_bad_record=skip skips such records$", launched)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1" + os.urandom(300) + b"PAR1")
    _write_parquet(tmp_path / "ints.parquet", list(range(50)))
    os.mkfifo(tmp_path / "fifo.txt")
    for name, pattern in [("broken.parquet", r"broken\.parquet is not a readable parquet file"),
                          ("ints.parquet", r"ints\.parquet row 0 has a int in 'text', not text"),
                          ("fifo.txt", r"fifo\.txt is a FIFO \(a named pipe\), not a file")]:
        code, _, err, launched = tetron_cli("train", config, "--data", tmp_path / name)
        one_line(code, err, pattern, launched)
    code, out, err, launched = tetron_cli("train", config, "--data", tmp_path / "utf8.jsonl",
                                          "--data.on_bad_record=skip")
    assert code == 0 and launched, err
    assert re.search(r"skipped 1 bad records \(data\.on_bad_record=skip\), the first at .*utf8\.jsonl line 2", out)


def test_checkpoint_files_are_read_bounded_and_defensively(ck, tmp_path, tetron_cli):
    """A `latest` that is a FIFO or a device, JSON nested 100,000 deep, a tokenizer description that is a
    FIFO: one line (or the fallback), never a hang or a traceback."""
    run, config, _ = fresh(ck, tmp_path)
    root = run / "checkpoints"
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    with time_limit(20):
        assert find_latest(run) == root / "step_4"  # the last complete one written
    (root / "latest").unlink()
    (root / "latest").symlink_to("/dev/zero")
    with time_limit(20):
        assert find_latest(run) == root / "step_4"
    state = root / "step_4" / "trainer_state.json"
    state.write_text("[" * 100000 + "]" * 100000)
    code, _, err, launched = tetron_cli("train", config, "--resume", "auto", "--steps", "6")
    one_line(code, err, r"step_4/trainer_state\.json: not valid JSON \(nested too deeply\)", launched)
    step2 = root / "step_2"
    (step2 / "tetron_tokenizer.json").unlink()
    os.mkfifo(step2 / "tetron_tokenizer.json")
    code, _, err, launched = tetron_cli("train", config, "--resume", step2, "--steps", "6")
    one_line(code, err, r"tetron_tokenizer\.json", launched)


# ----------------------------------------------------------------------------- tetron generate


def test_generate_refuses_bad_arguments_and_damaged_folders_in_one_line(ck, tmp_path, tetron_cli):
    run, _, _ = fresh(ck, tmp_path)
    for args, pattern in [(["--max-new-tokens", "-5"], r"--max-new-tokens=-5 must be >= 0"),
                          (["--max-new-tokens", "abc"], r"argument --max-new-tokens: invalid int value: 'abc'"),
                          (["--temperature", "nan"], r"--temperature=nan must be a finite number"),
                          (["--device", "bogus"], r"--device=bogus: use cpu, cuda or cuda:N"),
                          (["--top-k", "-1"], r"--top-k=-1 must be >= 0"), (["--seed", "-1"], r"--seed=-1"),
                          (["--bogus"], r"unrecognized arguments: --bogus")]:
        code, _, err, _ = tetron_cli("generate", run, *args)
        one_line(code, err, pattern)
    model = run / "model"
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "hidden_size": 64}))
    one_line(*tetron_cli("generate", run)[:3:2], r"model\.safetensors: tensor .* has shape .*, the model needs")
    (model / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if k not in ("model_type",
                                                                                            "architectures")}))
    one_line(*tetron_cli("generate", run)[:3:2], r"config\.json: no model_type")
    (model / "config.json").write_text(json.dumps(hf))
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    one_line(*tetron_cli("generate", run)[:3:2], r"model\.safetensors: truncated")
    code, out, err, _ = tetron_cli("generate", ck[0], "--max-new-tokens", "5")
    assert code == 0 and out.startswith("def "), err


def test_generate_on_a_stopped_run_samples_its_latest_checkpoint(ck, tmp_path, tetron_cli):
    """A run stopped before its end has no RUN/model: its latest checkpoint stands in, with a note, and samples
    what naming that checkpoint samples; a folder with neither is refused in one line."""
    run, _, _ = fresh(ck, tmp_path)
    shutil.rmtree(run / "model")
    args = ["--max-new-tokens", "8", "--temperature", "0"]
    code, out, err, _ = tetron_cli("generate", run, *args)
    assert code == 0 and err == (f"tetron: note: {run} has no final model (the run stopped before its last step): "
                                 f"sampling from its latest checkpoint, {run}/checkpoints/step_4\n")
    assert (code, out) == tetron_cli("generate", run / "checkpoints" / "step_4", *args)[:2]
    shutil.rmtree(run / "checkpoints")
    one_line(*tetron_cli("generate", run)[:3:2], r"no trained model here \(expected .*/model/config\.json, or a "
                                                   r"checkpoint under .*/checkpoints\)")


# ----------------------------------------------------------------------------- fuzz, through the CLI


BAD_VALUES = [("train", "lr", "nan"), ("train", "lr", "-inf"), ("train", "eps", "-1e-8"), ("train", "seed", str(2**64)),
              ("train", "warmup_steps", "-3"), ("train", "beta2", "1.5"), ("train", "grad_clip", "inf"),
              ("train", "micro_batch", "0"), ("train", "steps", "ten"), ("train", "dtype", "float8"),
              ("model", "hidden_size", "0"), ("model", "rope_theta", "nan"), ("model", "rms_norm_eps", "0"),
              ("model", "initializer_range", "-0.02"), ("model", "max_position_embeddings", "0"),
              ("model", "bos_token_id", "-1"), ("model", "rope_scaling", "[1, 2]"), ("model", "head_dim", "3"),
              ("parallel", "timeout_s", "0"), ("parallel", "timeout_s", "1e300"), ("parallel", "bucket_mb", "nan"),
              ("parallel", "dp", "-1"), ("parallel", "device", "tpu"), ("data", "seq_len", "100000"),
              ("data", "max_bytes", "0"), ("data", "on_bad_record", "maybe"), ("data", "tokenizer", "bpe:12"),
              ("checkpoint", "stop_signal", "NOPE"), ("checkpoint", "stop_signal", "SIGUSR2"),
              ("checkpoint", "keep", "0"), ("logging", "peak_tflops", "-1"), ("logging", "log_every", "0")]


def _bad_data(path: Path, rng: random.Random) -> Path:
    """A data file with one defect: bad UTF-8, a cut JSON line, a non-object, a number for text, deep nesting,
    a damaged or wrongly typed parquet file, or too little text for one global batch."""
    kind = rng.choice(["utf8", "cut", "array", "number", "deep", "parquet", "ints", "short"])
    good = [json.dumps({"text": "x = 1\n" * 100})] * 30
    lines = [line.encode() for line in good]
    at = rng.randrange(len(lines))
    if kind in ("parquet", "ints"):
        path = _write_parquet(path.with_suffix(".parquet"), ["text " * 100] * 20 if kind == "parquet" else [1, 2])
        if kind == "parquet":
            data = bytearray(path.read_bytes())
            for _ in range(20):
                data[rng.randrange(4, len(data) - 4)] = rng.randrange(256)
            path.write_bytes(bytes(data[: rng.randrange(8, len(data))]))
        return path
    if kind == "short":
        path.with_suffix(".txt").write_text("x" * rng.randrange(0, 60))
        return path.with_suffix(".txt")
    lines[at] = {"utf8": lines[at][:10] + b"\xff\xfe" + lines[at][10:], "cut": lines[at][: rng.randrange(1, 20)],
                 "array": b"[1, 2, 3]", "number": b'{"text": 12}', "deep": b"{\"a\":" * 50000}[kind]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.timeout(300)
def test_fuzz_bad_configs_data_and_checkpoints_through_the_cli(ck, tmp_path, tetron_cli):
    """Generated bad input through `tetron train`: a bad value (or two), a damaged data file, a damaged
    checkpoint. Each: exit 2, one line, nothing launched, no file changed, no run folder made; except bytes
    overwritten inside a tensor, which start-up does not read (they are caught where read, and by tetron check)."""
    run, raw = ck
    rng = random.Random(20240611)
    cache = {**raw["data"], "cache_dir": str(tmp_path / "cache")}
    for case in range(60):
        where = tmp_path / f"case{case}"
        where.mkdir()
        config = write_yaml(where / "run.yaml", {**raw, "out": str(where / "out"), "data": cache})
        kind = ("config", "data", "checkpoint")[case % 3]
        if kind == "config":
            picked = rng.sample(BAD_VALUES, rng.choice([1, 2]))
            args = [f"--{section}.{key}={value}" for section, key, value in picked]
        elif kind == "data":
            args = ["--data", _bad_data(where / "data.jsonl", rng)]
        else:
            shutil.copytree(run / "checkpoints" / "step_4", where / "step_4")
            _corrupt(where / "step_4", rng)
            args = ["--resume", where / "step_4", "--steps", "6"]
        before = hashes(where)
        code, _, err, launched = tetron_cli("train", config, *args)
        if kind == "checkpoint" and launched and verify_tensors(where / "step_4"):
            shutil.rmtree(where)  # tensor bytes overwritten: nothing reads them before start; reading them does
            continue
        assert code == 2 and not launched, (case, args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tetron: error: "), (case, args, err)
        assert hashes(where) == before and not (where / "out").exists(), (case, args)
        shutil.rmtree(where)


def test_fuzz_bad_values_one_by_one(ck, tmp_path, tetron_cli):
    """Every BAD_VALUES entry alone is refused (the fuzz above samples them)."""
    _, raw = ck
    config = write_yaml(tmp_path / "run.yaml", {**raw, "out": str(tmp_path / "out")})
    for section, key, value in BAD_VALUES:
        code, _, err, launched = tetron_cli("train", config, f"--{section}.{key}={value}")
        one_line(code, err, rf"{section}\.{key}|{key}", launched)


def test_validate_refuses_resume_below_the_checkpoint(ck):
    """validate() itself (the library entry point) refuses the request that cannot be honoured."""
    run, raw = ck
    with pytest.raises(ConfigError, match=r"train\.steps=3 is below step 4"):
        validate(from_dict({**raw, "train": {**raw["train"], "steps": 3}, "checkpoint": {"resume": "auto"}}))


def test_after_sighup_a_terminal_that_closed_gets_no_more_writes():
    """The terminal a SIGHUP reports closed fails every write (EIO), which would end the save that follows:
    stop.leave_lost_terminal points such a descriptor at /dev/null, and leaves a file or a live terminal."""
    from tetron.stop import leave_lost_terminal

    master, lost = os.openpty()
    live_master, live = os.openpty()
    os.close(master)  # the terminal closes: its other end hangs up
    with pytest.raises(OSError, match="Input/output error"):
        os.write(lost, b"x")
    with tempfile.TemporaryFile() as file:
        leave_lost_terminal((lost, live, file.fileno()))
        assert os.readlink(f"/proc/self/fd/{lost}") == os.devnull and os.write(lost, b"saved") == 5
        assert os.write(live, b"ok") == 2 and os.read(live_master, 2) == b"ok"
        assert os.write(file.fileno(), b"kept") == 4 and os.readlink(f"/proc/self/fd/{file.fileno()}") != os.devnull
    for fd in (lost, live, live_master):
        os.close(fd)
