"""Slurm: a job script that runs `tetron train` on N nodes of G GPUs, and its submission.

`tetron slurm CONFIG --nodes N --gpus-per-node G` writes, under the run folder OUT:

    OUT/slurm/config.yaml   the resolved config (what every node trains; the run folder made absolute)
    OUT/slurm/job.sh        sbatch directives, then one `srun` task per node running node.sh
    OUT/slurm/node.sh       on each node: torchrun (G ranks) joining a c10d rendezvous hosted on the
                            allocation's first node, each rank's stdout and stderr under
                            OUT/logs/job_<id>/node_<i>/, `tetron train ... --resume auto`

so a job that Slurm requeues (node failure, preemption: the script asks for --requeue) continues from the
run folder's latest checkpoint. The run folder, the data and its token cache must be on storage every
node sees. `--submit` hands job.sh to sbatch. node.sh reads only Slurm's variables (SLURM_JOB_ID,
SLURM_NNODES, SLURM_NODEID) and the rendezvous host and port job.sh exports, so it can also be run by
hand with those set (tests/test_slurm.py does, for two nodes on one machine).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from tetron.config import Config
from tetron.errors import ConfigError, check
from tetron.fs import write_text
from tetron.validate import validate

RDZV_PORT_BASE = 29500  # the rendezvous port is this plus the job id modulo 1000: jobs sharing a node differ


@dataclass(frozen=True)
class SlurmJob:
    """What the job asks Slurm for."""

    nodes: int
    gpus_per_node: int  # ranks per node (GPUs; CPU processes with parallel.device=cpu)
    partition: str | None = None
    time: str | None = None  # wall-clock limit, Slurm's format (HH:MM:SS, D-HH:MM)
    account: str | None = None
    cpus_per_task: int | None = None  # CPU cores for each node's task (all of its ranks)
    job_name: str | None = None


# Each option's syntax (Slurm's sbatch manual): the value lands in an #SBATCH line that sbatch parses, so
# it is checked, not trusted; a newline there would end the comment and run the rest as shell code.
NAME = r"[A-Za-z0-9][A-Za-z0-9_.+@:-]{0,127}"
OPTION_SYNTAX = {
    "partition": (rf"{NAME}(,{NAME})*", "partition names joined by commas, e.g. gpu or gpu,debug"),
    "account": (NAME, "an account name of letters, digits and . _ - + @ :"),
    "job-name": (NAME, "letters, digits and . _ - + @ : (at most 128)"),
    # minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit
    "time": (r"[0-9]{1,6}(:[0-9]{1,2}){0,2}|[0-9]{1,4}-[0-9]{1,2}(:[0-9]{1,2}){0,2}|(?i:unlimited|infinite)",
             "HH:MM:SS, MM, D-HH:MM or D-HH:MM:SS, e.g. 02:00:00 or 1-12:00"),
}
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_job(job: SlurmJob) -> None:
    """Every option the job asks Slurm for, against its syntax, in one line naming the flag and the value."""
    check(job.nodes >= 1 and job.gpus_per_node >= 1, "--nodes and --gpus-per-node must be at least 1")
    check(job.cpus_per_task is None or job.cpus_per_task >= 1,
          f"--cpus-per-task={job.cpus_per_task} must be at least 1")
    for flag, value in (("partition", job.partition), ("account", job.account), ("job-name", job.job_name),
                        ("time", job.time)):
        pattern, works = OPTION_SYNTAX[flag]
        check(value is None or re.fullmatch(pattern, value) is not None,
              f"--{flag}={_shown(value)} is not a Slurm {flag}; use {works}")


def _shown(value: str | None, limit: int = 40) -> str:
    """A value for a one-line error: quoted, control characters escaped, cut to `limit` characters."""
    text = repr(value[:limit] if value else value)
    return text if value is None or len(value) <= limit else text + "..."


def _slurm_value(text: str) -> str:
    """`text` as one argument of an #SBATCH line: sbatch splits the line at blanks and honours double quotes
    and backslashes; in a file name `%` starts a pattern (%j: the job id) and `%%` is a percent sign."""
    if re.fullmatch(r"[A-Za-z0-9_./%:@+,=-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _directives(job: SlurmJob, cfg: Config, slurm_dir: Path) -> list[str]:
    gpus = cfg.parallel.device != "cpu"
    name = job.job_name or "tetron-" + re.sub(r"[^A-Za-z0-9_.+@:-]", "_", Path(cfg.out).name)
    log = _slurm_value(str(slurm_dir).replace("%", "%%") + "/job_%j.out")
    lines = [f"#SBATCH --job-name={name}",
             f"#SBATCH --nodes={job.nodes}",
             "#SBATCH --ntasks-per-node=1  # one torchrun per node; it starts the node's ranks",
             f"#SBATCH --output={log}",
             "#SBATCH --open-mode=append  # a requeued job appends to its log",
             "#SBATCH --requeue  # after a node failure or preemption: run again, resuming the run folder"]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.time is not None and cfg.checkpoint.stop_signal:
        # two minutes before the time limit: every rank finishes its step and saves (stop.py)
        lines.append(f"#SBATCH --signal={cfg.checkpoint.stop_signal.removeprefix('SIG')}@120")
    for flag, value in (("partition", job.partition), ("time", job.time), ("account", job.account),
                        ("cpus-per-task", job.cpus_per_task)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    return lines


def job_script(job: SlurmJob, cfg: Config, *, slurm_dir: Path) -> str:
    """job.sh: the sbatch directives, the rendezvous host and port, one srun task per node."""
    return "\n".join([
        "#!/bin/bash", *_directives(job, cfg, slurm_dir),
        f"# Written by `tetron slurm` for the run folder {cfg.out}; submit with: sbatch "
        f"{shlex.quote(str(slurm_dir / 'job.sh'))}",
        "set -euo pipefail",
        "# The c10d rendezvous is hosted by the first node's torchrun; every node's torchrun joins it, at the",
        "# address Slurm itself reaches that node by (its NodeAddr; the name when none is set).",
        'head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'addr="$(scontrol show node "$head" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')"',
        'export TETRON_RDZV_HOST="${addr:-$head}"',
        f"export TETRON_RDZV_PORT=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 1000 ))",
        'echo "tetron: job $SLURM_JOB_ID on $SLURM_NNODES node(s): $SLURM_JOB_NODELIST; '
        'rendezvous $TETRON_RDZV_HOST:$TETRON_RDZV_PORT"',
        f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash "
        f"{shlex.quote(str(slurm_dir / 'node.sh'))}", ""])


def node_script(job: SlurmJob, cfg: Config, *, slurm_dir: Path, workdir: Path) -> str:
    """node.sh: this node's torchrun, from Slurm's variables."""
    python = shlex.quote(sys.executable)
    logs = Path(cfg.out) / "logs"
    torchrun = [
        f"exec {python} -m tetron.launch",  # torchrun, exiting 0 after a stop signal the ranks saved on
        '--nnodes="$SLURM_NNODES"', f"--nproc-per-node={job.gpus_per_node}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$TETRON_RDZV_HOST:$TETRON_RDZV_PORT"', '--rdzv-id="$SLURM_JOB_ID"',
        f"--max-restarts={cfg.parallel.max_restarts}",
        '--log-dir="$log_dir" --redirects=3 --tee=3',  # each rank's stdout and stderr in a file, and here
        f"-m tetron.cli train {shlex.quote(str(slurm_dir / 'config.yaml'))} --resume auto",
    ]
    return "\n".join([
        "#!/bin/bash",
        "# One node of the job: torchrun starts this node's ranks; they meet the others at the rendezvous.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(workdir))}",
        "export PYTHONUNBUFFERED=1",
        f'log_dir={shlex.quote(str(logs))}/job_"$SLURM_JOB_ID"/node_"$SLURM_NODEID"',
        'mkdir -p "$log_dir"',
        " \\\n    ".join(torchrun), ""])


def _absolute(cfg: Config, workdir: Path) -> Config:
    """The run folder, and local data and cache paths, as absolute paths: the job may start elsewhere."""
    out = str((workdir / Path(cfg.out).expanduser()).resolve())
    data = cfg.data
    path = data.path
    if path not in ("stdlib",) and not path.startswith("hf:") and (workdir / path).exists():
        path = str((workdir / path).resolve())
    cache = str((workdir / Path(data.cache_dir).expanduser()).resolve()) if data.cache_dir else None
    return replace(cfg, out=out, data=replace(data, path=path, cache_dir=cache))


def write_job(cfg: Config, job: SlurmJob, *, workdir: Path | None = None) -> Path:
    """Check `cfg` for the job's world size and write OUT/slurm/{config.yaml, job.sh, node.sh}; returns job.sh."""
    _check_job(job)
    world = job.nodes * job.gpus_per_node
    check(cfg.world_size == world,
          f"dp*tp*pp*cp = {cfg.world_size} but the job has {job.nodes} node(s) x {job.gpus_per_node} = {world} "
          f"ranks; set the parallel sizes so their product is {world}")
    check(cfg.checkpoint.resume in (None, "auto"),
          f"checkpoint.resume={cfg.checkpoint.resume}: a Slurm job resumes its own run folder (auto); start "
          f"that run with --init-from, or copy the checkpoint into the run folder")
    validate(cfg, world_size=world)
    workdir = (workdir or Path.cwd()).resolve()
    for what, path in (("out", cfg.out), ("the current folder", str(workdir))):
        check(CONTROL.search(path) is None, f"{what}={_shown(path)}: a path with a control character (a newline, "
                                            f"a tab) cannot be named in a job script; choose another")
    cfg = _absolute(cfg, workdir)
    out = Path(cfg.out)
    slurm_dir = out / "slurm"
    slurm_dir.mkdir(parents=True, exist_ok=True)
    # tetron train runs only in a new or empty folder or a tetron run's (validate.py): an empty log marks
    # this folder as the run's, now that it holds the job's files (the run appends its steps to it).
    (out / "metrics.jsonl").touch()
    write_text(slurm_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    write_text(slurm_dir / "node.sh", node_script(job, cfg, slurm_dir=slurm_dir, workdir=workdir))
    write_text(slurm_dir / "job.sh", job_script(job, cfg, slurm_dir=slurm_dir))
    for name in ("job.sh", "node.sh"):
        os.chmod(slurm_dir / name, 0o755)
    return slurm_dir / "job.sh"


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("--submit: sbatch is not on PATH here; submit the script from a Slurm login node")
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        message = (result.stderr.strip() or result.stdout.strip()).splitlines()
        raise ConfigError(f"sbatch {script}: {message[-1] if message else f'exit {result.returncode}'}")
    match = re.match(r"\d+", result.stdout.strip())
    if match is None:
        raise ConfigError(f"sbatch {script}: unexpected answer {result.stdout.strip()!r}")
    return match.group(0)
