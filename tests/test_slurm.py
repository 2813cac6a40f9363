"""tetron slurm: the job script it writes, and a real Slurm running it on two nodes.

The real test starts a Slurm cluster on this machine: munged on a socket of its own, slurmctld, and two
slurmd daemons, node1 and node2, both at 127.0.0.1 on ports of their own (Slurm runs several slurmd on one
host when each has its NodeName and port). Debian's slurmctld, slurmd, slurm-client and munge packages
(22.05) are installed first where they are missing (as root, through apt-get, which takes about 30 s on a
fresh machine); only where that is impossible (not root, no apt-get, no mirror) is the test skipped, with
that reason. The job trains dp2 over the two nodes, is requeued (`scontrol requeue`, as after a node
failure) and runs again from the run folder's latest checkpoint; the losses must be those of a forked
two-rank run of the same config. About 40 s here with the packages installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from conftest import LOSS_RTOL, cli_in_process, run_parallel, tiny_config

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
TOOLS = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged", "runuser")
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
INSTALL_TIMEOUT = 300  # s, apt-get update + install on a fresh machine
JOB_TIMEOUT = 240  # s, one run of the job (about 15 s here)


def _tool(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def ensure_slurm() -> str | None:
    """None when Slurm's daemons and commands are here (installing them if need be), else why they cannot be."""
    if all(_tool(t) for t in TOOLS):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and this user is not root, so it cannot install Debian's packages"
    if _tool("apt-get") is None:
        return "Slurm is not installed and there is no apt-get to install it with"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", *PACKAGES]
    for cmd in (install, ["apt-get", "update", "-q"], install):
        try:
            subprocess.run(cmd, env=env, capture_output=True, timeout=INSTALL_TIMEOUT)
        except subprocess.TimeoutExpired:
            return f"installing Slurm took longer than {INSTALL_TIMEOUT} s ({' '.join(cmd)})"
        if all(_tool(t) for t in TOOLS):
            return None
    return f"apt-get could not install {' '.join(PACKAGES)} (no package mirror reachable?)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=tetron{suffix}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={munge}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=node1 NodeHostname={host} NodeAddr=127.0.0.1 Port={port1} CPUs={cpus} RealMemory=2000 State=UNKNOWN
NodeName=node2 NodeHostname={host} NodeAddr=127.0.0.1 Port={port2} CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running two-node Slurm cluster on this machine; yields the environment its commands need."""
    reason = ensure_slurm()
    if reason is not None:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    # munged runs as the munge user, and wants its socket and seed in a folder of its own, that it can reach
    munge = Path(tempfile.mkdtemp(prefix="tetron-munge-"))
    shutil.chown(munge, "munge", "munge")
    os.chmod(munge, 0o755)
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(suffix=os.getpid(), host=socket.gethostname(), ctld_port=free_port(),
                                      port1=free_port(), port2=free_port(), cpus=os.cpu_count() or 1, dir=folder,
                                      munge=munge))
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": SBIN_PATH}
    daemons = []
    try:
        daemons.append(subprocess.Popen([_tool("runuser"), "-u", "munge", "--", _tool("munged"), "-F",
                                         f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                                         f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"]))
        _wait(lambda: (munge / "munge.socket").exists() or daemons[0].poll() is not None, 30, "munged did not start")
        assert daemons[0].poll() is None, "munged stopped (see its error above)"
        daemons.append(subprocess.Popen([_tool("slurmctld"), "-D", "-f", str(conf)], env=env))
        for node in ("node1", "node2"):
            daemons.append(subprocess.Popen([_tool("slurmd"), "-D", "-N", node, "-f", str(conf)], env=env))

        def idle() -> bool:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
            return states.stdout.split() == ["idle", "idle"]

        _wait(idle, 60, "the two Slurm nodes did not become idle")
        yield env
    finally:
        for daemon in reversed(daemons):  # only the processes this fixture started, by their ids
            daemon.terminate()
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(munge, ignore_errors=True)


def job_state(job: str, env: dict) -> tuple[str, int]:
    """(JobState, Restarts) of a job."""
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\w+)", text)
    restarts = re.search(r"Restarts=(\d+)", text)
    return (state.group(1) if state else "UNKNOWN"), int(restarts.group(1)) if restarts else 0


def test_a_two_node_job_runs_and_a_requeued_job_resumes(slurm, corpus, cache_dir, tmp_path, monkeypatch):
    train = {"steps": 30, "lr": 1e-3}
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel={"dp": 2, "device": "cpu"}, train=train,
                      checkpoint={"save_every": 5})
    ref_raw = tiny_config(corpus, cache_dir, tmp_path / "ref", parallel={"dp": 2}, train=train)
    (reference, _), _ = run_parallel(ref_raw)  # tokenizes into the cache the job reads too
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    # `tetron slurm --submit` in this process (sbatch is the real process here), in the environment sbatch
    # hands the job: Slurm's, and this checkout importable by the job's ranks
    for name, value in {**slurm, "PYTHONPATH": str(REPO)}.items():
        monkeypatch.setenv(name, value)
    # one core per node: the test's nodes have this machine's cores (CORES_PER_RANK would ask for more)
    submitted = cli_in_process(["slurm", "run.yaml", "--nodes", "2", "--gpus-per-node", "1", "--time", "00:10:00",
                                "--cpus-per-task", "1", "--submit"], tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    out = tmp_path / "run"

    # Requeue it (a node failure would), once it has saved a checkpoint: the second run resumes from it.
    _wait(lambda: (out / "checkpoints" / "latest").exists() or job_state(job, slurm)[0] in ("COMPLETED", "FAILED"),
          JOB_TIMEOUT, f"job {job} saved no checkpoint")
    subprocess.run(["scontrol", "requeue", job], env=slurm, check=True, capture_output=True)
    # Slurm holds a requeued job back for two minutes; once it is pending again, let it start now.
    _wait(lambda: job_state(job, slurm)[0] == "PENDING", 60, f"job {job} was not requeued")
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=slurm, check=True, capture_output=True)
    _wait(lambda: job_state(job, slurm) == ("COMPLETED", 1) or job_state(job, slurm)[0] == "FAILED",
          JOB_TIMEOUT, f"the requeued job {job} did not end")
    log = (out / "slurm" / f"job_{job}.out").read_text()
    assert job_state(job, slurm) == ("COMPLETED", 1), log
    assert "on 2 node(s): node[1-2]; rendezvous 127.0.0.1:" in log
    assert re.search(r"resumed from .*/checkpoints/step_\d+ at step \d+", log), log

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    losses = [r["loss"] for r in records]
    assert losses == pytest.approx(reference["losses"], rel=LOSS_RTOL, abs=0)
    assert (out / "model" / "model.safetensors").is_file()
    for node in ("node_0", "node_1"):  # each rank's output under the run folder, per job and node
        logs = list((out / "logs" / f"job_{job}" / node).glob("*/attempt_0/0/stderr.log"))
        assert logs, sorted(p.relative_to(out) for p in (out / "logs").rglob("*"))


# ------------------------------------------------------------------------------------ the script itself


def test_the_job_script(tmp_path, monkeypatch):
    """What `tetron slurm` writes, and its refusals; through tetron.cli.main in this process (the same code a
    user's command runs, without a torch import each: nothing here needs a process of its own)."""
    (tmp_path / "data.txt").write_text("x = 1\n" * 100)
    run = ["slurm", "demo", "--data", "data.txt", "--tokenizer", "bytes", "--out", "runs/a"]
    job_args = ["--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu", "--time", "02:00:00", "--account", "proj"]
    written = cli_in_process([*run, "--dp", "8", "--tp", "2", *job_args], tmp_path)
    assert written.returncode == 0, written.stderr
    slurm_dir = tmp_path / "runs" / "a" / "slurm"
    job, node = (slurm_dir / "job.sh").read_text(), (slurm_dir / "node.sh").read_text()
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu", "--time=02:00:00",
                      "--account=proj", "--requeue", f"--output={slurm_dir}/job_%j.out", "--signal=USR1@120"):
        assert f"#SBATCH {directive}" in job
    assert "srun --nodes=2 --ntasks-per-node=1" in job and 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in job
    for part in ('--nnodes="$SLURM_NNODES"', "--nproc-per-node=8", "--rdzv-backend=c10d", '--rdzv-id="$SLURM_JOB_ID"',
                 '--rdzv-endpoint="$TETRON_RDZV_HOST:$TETRON_RDZV_PORT"', "--redirects=3",
                 f"train {slurm_dir}/config.yaml --resume auto", f"log_dir={tmp_path}/runs/a/logs/job_"):
        assert part in node
    cfg = yaml.safe_load((slurm_dir / "config.yaml").read_text())
    assert cfg["out"] == str(tmp_path / "runs" / "a") and cfg["data"]["path"] == str(tmp_path / "data.txt")
    assert (cfg["parallel"]["dp"], cfg["parallel"]["tp"]) == (8, 2)

    # CPU ranks: no GPUs asked for
    cpu = cli_in_process([*run, "--parallel.device=cpu", "--dp", "2", "--nodes", "2", "--gpus-per-node", "1"],
                         tmp_path)
    assert cpu.returncode == 0, cpu.stderr
    assert "--gpus-per-node" not in (slurm_dir / "job.sh").read_text()

    wrong = cli_in_process([*run, "--dp", "8", "--tp", "2", "--nodes", "3", "--gpus-per-node", "8"], tmp_path)
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == ("tetron: error: dp*tp*pp*cp = 16 but the job has 3 node(s) x 8 = 24 ranks; set "
                                    "the parallel sizes so their product is 24")
    monkeypatch.setenv("PATH", str(tmp_path))  # shutil.which looks sbatch up on PATH as the command would
    no_sbatch = cli_in_process([*run, "--dp", "8", "--tp", "2", *job_args, "--submit"], tmp_path)
    assert no_sbatch.returncode == 2 and "sbatch is not on PATH" in no_sbatch.stderr


def test_every_local_data_path_is_made_absolute_for_the_job(tmp_path):
    """The job may start in another folder: data.path (here a glob), data.val_path, each mixture source (a file, a
    local hf: dataset folder with its split) become absolute; stdlib, a hub name and an absent path stay as given."""
    from tetron.config import from_dict
    from tetron.plan.slurm import _absolute

    for name in ("a.txt", "b.txt", "held.txt"):
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "ds").mkdir()
    specs = ["a.txt", "hf:ds:validation", "hf:org/name", "stdlib", "gone.txt"]
    cfg = from_dict({"data": {"path": "*.txt", "val_path": "held.txt",
                              "sources": [{"path": spec, "weight": 1.0} for spec in specs]}})
    data = _absolute(cfg, tmp_path).data
    assert data.path == f"{tmp_path}/*.txt" and data.val_path == str(tmp_path / "held.txt")
    assert [s["path"] for s in data.sources] == [str(tmp_path / "a.txt"), f"hf:{tmp_path / 'ds'}:validation",
                                                 "hf:org/name", "stdlib", "gone.txt"]


STUBS = {  # Slurm's commands and the node's python, recording what they were given (STUB_LOG) instead
    "srun": '#!/bin/bash\nprintf "%s\\n" "$@" > "$STUB_LOG/srun.args"\nwhile [[ "$1" == --* ]]; do shift; done\n'
            'SLURM_NODEID=0 exec "$@"\n',
    "scontrol": '#!/bin/bash\nif [ "$2" = hostnames ]; then echo node1; else echo "NodeName=node1 NodeAddr=10.0.0.1"; '
                'fi\n',
    "python": '#!/bin/bash\nprintf "%s\\0" "$@" > "$STUB_LOG/python.args"\npwd > "$STUB_LOG/cwd"\n'
              'printf "%s" "${TETRON_TEST_SETUP-unset}" > "$STUB_LOG/setup"\n',
}


def test_hostile_values_never_run_as_shell_code(tmp_path, monkeypatch, capsys):
    """A run folder full of shell syntax is one path everywhere job.sh and node.sh name it (run here with stub
    srun, scontrol and python); Slurm options off their syntax, and control characters, are one line each."""
    from tetron.cli import main
    from tetron.plan.slurm import SlurmJob, _check_job

    env = _stubbed(tmp_path, monkeypatch)
    stubs = tmp_path / "stubs"
    canary = tmp_path / "pwned"
    out = f"runs/x $(touch {canary}) `touch {canary}` ';' \"q\" 50%j"
    run = ["slurm", "demo", "--data", "data.txt", "--tokenizer", "bytes", "--parallel.device=cpu", "--dp", "2",
           "--nodes", "2", "--gpus-per-node", "1", "--time", "1-12:00"]
    assert main([*run, "--out", out]) == 0, capsys.readouterr().err
    slurm_dir = tmp_path / out / "slurm"
    job = (slurm_dir / "job.sh").read_text()
    result = subprocess.run(["bash", str(slurm_dir / "job.sh")], cwd=stubs, env=env, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    assert not canary.exists()
    assert (tmp_path / "srun.args").read_text().splitlines()[-2:] == ["bash", str(slurm_dir / "node.sh")]
    args = (tmp_path / "python.args").read_text().split("\0")[:-1]
    assert args[-5:] == ["tetron.cli", "train", str(slurm_dir / "config.yaml"), "--resume", "auto"], args
    assert f"--log-dir={tmp_path / out}/logs/job_7/node_0" in args and (tmp_path / out / "logs" / "job_7").is_dir()
    assert "--rdzv-endpoint=10.0.0.1:29507" in args
    assert (tmp_path / "cwd").read_text().strip() == str(tmp_path)
    output = next(line for line in job.splitlines() if line.startswith("#SBATCH --output="))
    # sbatch reads an #SBATCH value as one word, with double quotes and backslashes as a POSIX shell does
    assert shlex.split(output.removeprefix("#SBATCH --output=")) == [str(slurm_dir).replace("%", "%%") + "/job_%j.out"]
    assert re.search(r"^#SBATCH --job-name=tetron-[\w.+@:-]+$", job, re.M) and "#SBATCH --time=1-12:00" in job

    capsys.readouterr()
    for flag, value, pattern in [("--partition", "gpu\nrm -rf ~", r"--partition='gpu\\nrm -rf ~' is not a Slurm"),
                                 ("--job-name", "a$(id)", r"--job-name='a\$\(id\)' is not a Slurm job-name"),
                                 ("--time", "abc; rm -rf /", r"--time='abc; rm -rf /' is not a Slurm time; use HH"),
                                 ("--account", "a b", r"--account='a b' is not a Slurm account"),
                                 ("--out", "runs/y\n$(id)", r"out='runs/y\\n\$\(id\)': a path with a control")]:
        assert main([*run, flag, value] if flag == "--out" else [*run, "--out", "runs/z", flag, value]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and re.match(rf"tetron: error: {pattern}", err), err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["x $(touch "]  # nothing else written
    for time_limit in ("90", "30:00", "02:00:00", "2-0", "1-12:00", "1-00:00:00", "UNLIMITED"):
        _check_job(SlurmJob(nodes=1, gpus_per_node=1, time=time_limit, partition="gpu,debug", job_name="my.job-1"))


def _stubbed(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """Stub srun, scontrol and python (STUBS) in tmp_path/stubs, this process's python the stub; returns the
    environment job.sh runs in."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(stubs / "python"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.txt").write_text("x = 1\n" * 100)
    return {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(tmp_path),
            "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]"}


CPU_JOB = ["slurm", "demo", "--data", "data.txt", "--tokenizer", "bytes", "--parallel.device=cpu", "--dp", "2",
           "--nodes", "2", "--gpus-per-node", "1", "--time", "01:00:00"]


def _one_error(code: int, err: str, pattern: str) -> None:
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.match(rf"tetron: error: {pattern}", err), err


def test_a_linked_run_folder_or_a_stop_signal_cannot_add_lines_to_the_job(tmp_path, monkeypatch, capsys):
    """A run folder that is a link to a path holding a newline and shell code is refused as its target (the
    scripts name the resolved path); so is `--checkpoint.stop_signal=$'USR1\\n'`, which would have put a bare
    `@120` line among the directives, where sbatch stops reading them; the signal is written as Slurm names it."""
    from tetron.cli import main

    _stubbed(tmp_path, monkeypatch)
    canary = tmp_path / "pwned"
    target = tmp_path / "t\ntouch pwned\n"  # job.sh runs where it is submitted from, here
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    capsys.readouterr()
    _one_error(main([*CPU_JOB, "--out", "link"]), capsys.readouterr().err,
               r"out='link' \(the path it names: \.\.\..*/t\\ntouch pwned\\n'\): a path with a control character")
    assert not any(target.iterdir()) and not canary.exists()
    _one_error(main([*CPU_JOB, "--out", "runs/s", "--checkpoint.stop_signal=USR1\n"]), capsys.readouterr().err,
               r"checkpoint.stop_signal='USR1\\n': use one of")
    assert not (tmp_path / "runs").exists()

    assert main([*CPU_JOB, "--out", "runs/s", "--checkpoint.stop_signal=sigterm", "--partition", "cpu"]) == 0
    lines = (tmp_path / "runs" / "s" / "slurm" / "job.sh").read_text().splitlines()
    directives = [line for line in lines if line.startswith("#SBATCH")]
    assert lines[1:1 + len(directives)] == directives  # all of them before the script's first other line
    assert {"#SBATCH --signal=TERM@120", "#SBATCH --partition=cpu", "#SBATCH --time=01:00:00"} <= set(directives)
    # the last guard, whatever checked a value before: no value with a control character reaches a script
    from tetron.errors import ConfigError
    from tetron.plan.slurm import _slurm_value, _word

    for value in ("USR1\n", "a\rb", "x\x1b[2J", "tab\there"):
        for quote in (_slurm_value, _word):
            with pytest.raises(ConfigError, match="a control character"):
                quote(value)


def test_the_job_gives_ranks_cores_and_takes_sbatch_options_and_a_setup_script(tmp_path, monkeypatch, capsys):
    """Each node's task asks for cores for its ranks (CORES_PER_RANK each, or --cpus-per-task), in sbatch's
    directives and in srun's (which does not inherit them); `--sbatch` adds checked, quoted options; `--setup`
    is the user's script, copied beside the job and sourced on every node before torchrun (under `set +u`)."""
    from tetron.cli import main
    from tetron.plan.slurm import CORES_PER_RANK

    env = _stubbed(tmp_path, monkeypatch)
    (tmp_path / "setup.sh").write_text('export TETRON_TEST_SETUP="from setup"\nunset_is_fine="$NOT_SET_ANYWHERE"\n')
    extra = ["--sbatch", "exclusive", "--sbatch=--mem=64G", "--sbatch", "constraint=a100&ib", "--setup", "setup.sh"]
    assert main([*CPU_JOB, "--out", "runs/c", *extra]) == 0, capsys.readouterr().err
    slurm_dir = tmp_path / "runs" / "c" / "slurm"
    job, node = (slurm_dir / "job.sh").read_text(), (slurm_dir / "node.sh").read_text()
    for line in (f"#SBATCH --cpus-per-task={CORES_PER_RANK}", "#SBATCH --exclusive", "#SBATCH --mem=64G",
                 '#SBATCH --constraint="a100&ib"'):
        assert re.search(rf"^{re.escape(line)}( |$)", job, re.M), (line, job)
    assert f"srun --nodes=2 --ntasks-per-node=1 --cpus-per-task={CORES_PER_RANK} " in job
    assert "same paths on every node" in node and "same paths on each" in job
    assert (slurm_dir / "setup.sh").read_text() == (tmp_path / "setup.sh").read_text()
    result = subprocess.run(["bash", str(slurm_dir / "job.sh")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "setup").read_text() == "from setup"  # what the setup exported reached the launcher

    assert main([*CPU_JOB, "--out", "runs/d", "--cpus-per-task", "16"]) == 0
    job = (tmp_path / "runs" / "d" / "slurm" / "job.sh").read_text()
    assert "#SBATCH --cpus-per-task=16 " in job and " --cpus-per-task=16 " in job.splitlines()[-1]
    capsys.readouterr()
    for option, pattern in (("nodes=3", r"--sbatch='nodes=3': tetron writes --nodes itself; use --nodes"),
                            ("mem=1G\n#SBATCH --x", r"--sbatch='mem=1G\\n#SBATCH --x': a control character"),
                            ("-N3", r"--sbatch='-N3': give one long sbatch option"),
                            ("signal=USR2", r"--sbatch='signal=USR2': tetron writes --signal itself")):
        _one_error(main([*CPU_JOB, "--out", "runs/e", f"--sbatch={option}"]), capsys.readouterr().err, pattern)
    _one_error(main([*CPU_JOB, "--out", "runs/e", "--setup", "missing.sh"]), capsys.readouterr().err,
               r"--setup missing.sh: cannot read it")
    assert not (tmp_path / "runs" / "e").exists()
