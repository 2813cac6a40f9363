"""Slurm: a job script that runs `tetron train` on N nodes of G GPUs, and its submission.

`tetron slurm CONFIG --nodes N --gpus-per-node G` writes, under the run folder OUT:

    OUT/slurm/config.yaml   the resolved config (what every node trains; the run folder made absolute)
    OUT/slurm/job.sh        sbatch directives, then one `srun` task per node running node.sh
    OUT/slurm/node.sh       on each node: torchrun (G ranks) joining a c10d rendezvous hosted on the
                            allocation's first node, each rank's stdout and stderr under
                            OUT/logs/job_<id>/node_<i>/, `tetron train ... --resume auto`

so a job that Slurm requeues (node failure, preemption: the script asks for --requeue) continues from the
run folder's latest checkpoint. The run folder, the data and its token cache must be on storage every
node sees, and node.sh runs this checkout with this Python (the venv's): both must be at the same paths on
every node. Each node's task gets `--cpus-per-task` cores for its ranks (CORES_PER_RANK each unless given);
`--sbatch OPT` adds an sbatch option (checked, quoted), `--setup FILE` a shell script of the user's own that
every node sources before torchrun (module loads, NCCL settings), copied to OUT/slurm/setup.sh.
`--submit` hands job.sh to sbatch. node.sh reads only Slurm's variables (SLURM_JOB_ID,
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
from tetron.data.sources import source_of
from tetron.errors import ConfigError, check
from tetron.fs import CONTROL, read_bounded, write_text
from tetron.stop import parse_signal
from tetron.validate import validate

RDZV_PORT_BASE = 29500  # the rendezvous port is this plus the job id modulo 1000: jobs sharing a node differ
# Cores for each rank when --cpus-per-task is not given: its main thread, data loading, the collectives' and the
# checkpoint writer's threads. Without a count Slurm gives the node's one task a single core for all its ranks.
CORES_PER_RANK = 4
MAX_SETUP_BYTES = 1 << 20  # a --setup script larger than this is not a setup script


@dataclass(frozen=True)
class SlurmJob:
    """What the job asks Slurm for."""

    nodes: int
    gpus_per_node: int  # ranks per node (GPUs; CPU processes with parallel.device=cpu)
    partition: str | None = None
    time: str | None = None  # wall-clock limit, Slurm's format (HH:MM:SS, D-HH:MM)
    account: str | None = None
    cpus_per_task: int | None = None  # CPU cores for each node's task (all of its ranks); None: CORES_PER_RANK each
    job_name: str | None = None
    sbatch: tuple[str, ...] = ()  # more sbatch options, each `name` or `name=value` (--exclusive, --mem=64G, ...)
    setup: str | None = None  # a shell script of the user's, sourced on every node before torchrun

    @property
    def cores(self) -> int:
        """The cores each node's task (torchrun and its ranks) asks for."""
        return self.cpus_per_task if self.cpus_per_task is not None else CORES_PER_RANK * self.gpus_per_node


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
# sbatch options tetron writes itself (from its own flags, or because the job needs them as they are)
OWN_OPTIONS = {"nodes": "--nodes", "ntasks-per-node": "", "ntasks": "", "output": "", "error": "",
               "open-mode": "", "requeue": "", "no-requeue": "", "signal": "checkpoint.stop_signal",
               "gpus-per-node": "--gpus-per-node", "cpus-per-task": "--cpus-per-task", "partition": "--partition",
               "time": "--time", "account": "--account", "job-name": "--job-name"}


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
    for option in job.sbatch:
        sbatch_option(option)


def sbatch_option(option: str) -> tuple[str, str | None]:
    """`--sbatch OPT` as (name, value or None): a long sbatch option, `exclusive` or `mem=64G` (the leading
    `--` optional), on one line, and not one tetron writes itself."""
    match = re.fullmatch(r"(?:--)?([a-z][a-z0-9-]*)(?:=(.*))?", option, re.S)
    check(match is not None, f"--sbatch={_shown(option)}: give one long sbatch option, as name or name=value "
                             f"(e.g. exclusive, mem=64G, qos=high, constraint=a100)")
    name, value = match.group(1), match.group(2)
    check(not CONTROL.search(option), f"--sbatch={_shown(option)}: a control character (a newline, a tab) "
                                      f"cannot be in an #SBATCH line; give the value on one line")
    if name in OWN_OPTIONS:
        instead = f"; use {OWN_OPTIONS[name]}" if OWN_OPTIONS[name] else ""
        raise ConfigError(f"--sbatch={_shown(option)}: tetron writes --{name} itself{instead}")
    return name, value


def _shown(value: str | None, limit: int = 40) -> str:
    """A value for a one-line error: quoted, control characters escaped, cut to `limit` characters."""
    text = repr(value[:limit] if value else value)
    return text if value is None or len(value) <= limit else text + "..."


def _control_part(text: str, around: int = 20) -> str:
    """The stretch of `text` around its first control character, quoted: what an error line shows of a long path."""
    match = CONTROL.search(text)
    i = match.start() if match else 0
    start, end = max(0, i - around), i + around
    return ("..." if start else "") + repr(text[start:end]) + ("..." if end < len(text) else "")


def _slurm_value(text: str) -> str:
    """`text` as one argument of an #SBATCH line: sbatch splits the line at blanks and honours double quotes
    and backslashes; in a file name `%` starts a pattern (%j: the job id) and `%%` is a percent sign. A
    control character (a newline ends the directive, and sbatch reads no directive after a line that is not
    one) is refused, whatever checked the value before."""
    if CONTROL.search(text):
        raise ConfigError(f"{_shown(text)}: a control character (a newline, a tab) cannot be in an #SBATCH line")
    if re.fullmatch(r"[A-Za-z0-9_./%:@+,=-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _word(text: str) -> str:
    """`text` as one word of a shell line (shlex.quote), refused if it holds a control character: a newline
    inside quotes is still a new line of the script for whoever reads it, and ends a comment."""
    if CONTROL.search(text):
        raise ConfigError(f"{_shown(text)}: a control character (a newline, a tab) cannot be in a job script")
    return shlex.quote(text)


def _directive(flag: str, value: object = None) -> str:
    return f"#SBATCH --{flag}" + ("" if value is None else f"={_slurm_value(str(value))}")


def _directives(job: SlurmJob, cfg: Config, slurm_dir: Path) -> list[str]:
    gpus = cfg.parallel.device != "cpu"
    name = job.job_name or "tetron-" + re.sub(r"[^A-Za-z0-9_.+@:-]", "_", Path(cfg.out).name)
    lines = [_directive("job-name", name),
             _directive("nodes", job.nodes),
             _directive("ntasks-per-node", 1) + "  # one torchrun per node; it starts the node's ranks",
             _directive("cpus-per-task", job.cores) + "  # the cores of that task: all of its ranks'",
             _directive("output", str(slurm_dir).replace("%", "%%") + "/job_%j.out"),
             _directive("open-mode", "append") + "  # a requeued job appends to its log",
             _directive("requeue") + "  # after a node failure or preemption: run again, resuming the run folder"]
    if gpus:
        lines.append(_directive("gpus-per-node", job.gpus_per_node))
    if job.time is not None and cfg.checkpoint.stop_signal:
        # two minutes before the time limit: every rank finishes its step and saves (stop.py); the name as
        # parse_signal reads it, never the text as given
        lines.append(_directive("signal", parse_signal(cfg.checkpoint.stop_signal).name.removeprefix("SIG") + "@120"))
    for flag, value in (("partition", job.partition), ("time", job.time), ("account", job.account)):
        if value is not None:
            lines.append(_directive(flag, value))
    lines += [_directive(*sbatch_option(option)) for option in job.sbatch]
    return lines


def job_script(job: SlurmJob, cfg: Config, *, slurm_dir: Path) -> str:
    """job.sh: the sbatch directives, the rendezvous host and port, one srun task per node."""
    return "\n".join([
        "#!/bin/bash", *_directives(job, cfg, slurm_dir),
        f"# Written by `tetron slurm` for the run folder {_word(cfg.out)}; submit with: sbatch "
        f"{_word(str(slurm_dir / 'job.sh'))}",
        "# Every node runs node.sh: the tetron checkout and its Python (the venv) must be at the same paths on each.",
        "set -euo pipefail",
        "# The c10d rendezvous is hosted by the first node's torchrun; every node's torchrun joins it, at the",
        "# address Slurm itself reaches that node by (its NodeAddr; the name when none is set).",
        'head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'addr="$(scontrol show node "$head" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')"',
        'export TETRON_RDZV_HOST="${addr:-$head}"',
        f"export TETRON_RDZV_PORT=$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % 1000 ))",
        'echo "tetron: job $SLURM_JOB_ID on $SLURM_NNODES node(s): $SLURM_JOB_NODELIST; '
        'rendezvous $TETRON_RDZV_HOST:$TETRON_RDZV_PORT"',
        # the cores again: srun does not take the job's --cpus-per-task from the environment (Slurm 22.05-23.02)
        f"srun --nodes={job.nodes} --ntasks-per-node=1 --cpus-per-task={job.cores} --kill-on-bad-exit=1 bash "
        f"{_word(str(slurm_dir / 'node.sh'))}", ""])


def node_script(job: SlurmJob, cfg: Config, *, slurm_dir: Path, workdir: Path) -> str:
    """node.sh: this node's torchrun, from Slurm's variables (and the user's setup script, if given)."""
    python = _word(sys.executable)
    logs = Path(cfg.out) / "logs"
    torchrun = [
        f"exec {python} -m tetron.launch",  # torchrun, exiting 0 after a stop signal the ranks saved on
        '--nnodes="$SLURM_NNODES"', f"--nproc-per-node={job.gpus_per_node}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$TETRON_RDZV_HOST:$TETRON_RDZV_PORT"', '--rdzv-id="$SLURM_JOB_ID"',
        f"--max-restarts={cfg.parallel.max_restarts}",
        '--log-dir="$log_dir" --redirects=3 --tee=3',  # each rank's stdout and stderr in a file, and here
        f"-m tetron.cli train {_word(str(slurm_dir / 'config.yaml'))} --resume auto",
    ]
    setup = [] if job.setup is None else [
        "# The user's setup (tetron slurm --setup, copied here when the job was written), run as it is: tetron",
        "# does not read it. Sourced, so that what it exports (modules, NCCL_*) reaches torchrun and the ranks;",
        "# without -u, which module and conda scripts often trip.",
        "set +u", f"source {_word(str(slurm_dir / 'setup.sh'))}", "set -u"]
    return "\n".join([
        "#!/bin/bash",
        "# One node of the job: torchrun starts this node's ranks; they meet the others at the rendezvous.",
        f"# It runs in {_word(str(workdir))} with this Python ({python}) and the tetron it imports (the checkout,",
        "# for an editable install): all must be at these same paths on every node (shared storage, or the same",
        "# install on each), as must the run folder and the data.",
        "set -euo pipefail",
        f"cd {_word(str(workdir))}",
        *setup,
        "export PYTHONUNBUFFERED=1",
        f'log_dir={_word(str(logs))}/job_"$SLURM_JOB_ID"/node_"$SLURM_NODEID"',
        'mkdir -p "$log_dir"',
        " \\\n    ".join(torchrun), ""])


def read_setup(name: str) -> str:
    """The text of a --setup script: a regular file of UTF-8 text, at most MAX_SETUP_BYTES."""
    try:
        data = read_bounded(Path(name).expanduser(), MAX_SETUP_BYTES)
        return data.decode("utf-8")
    except OSError as err:
        raise ConfigError(f"--setup {name}: cannot read it ({err.strerror or err}); give a shell script") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--setup {name}: not UTF-8 text; give a shell script") from None


def _absolute(cfg: Config, workdir: Path) -> Config:
    """The run folder, the cache and every local data path (data.path, data.val_path, a mixture's sources) as
    absolute paths, each as its kind of source says (`Source.anchored`): the job may start elsewhere."""
    out = str((workdir / Path(cfg.out).expanduser()).resolve())
    data = cfg.data
    cache = str((workdir / Path(data.cache_dir).expanduser()).resolve()) if data.cache_dir else None
    val_path = source_of(data.val_path).anchored(workdir) if data.val_path else None
    sources = None if data.sources is None else [
        {**s, "path": source_of(s["path"]).anchored(workdir)} if isinstance(s.get("path"), str) else s
        for s in data.sources]
    return replace(cfg, out=out, data=replace(data, path=source_of(data.path).anchored(workdir), cache_dir=cache,
                                              val_path=val_path, sources=sources))


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
    setup = read_setup(job.setup) if job.setup is not None else None
    resolved = _absolute(cfg, workdir)
    # checked as the scripts name them, after symbolic links are resolved: a link's target is text too
    for what, given, path in (("out", cfg.out, cfg.out), ("out", cfg.out, resolved.out),
                              ("the current folder", str(workdir), str(workdir)),
                              ("this Python", sys.executable, sys.executable)):
        where = "" if path == given or CONTROL.search(given) else f" (the path it names: {_control_part(path)})"
        check(CONTROL.search(path) is None, f"{what}={_shown(given)}{where}: a path with a control character (a "
                                            f"newline, a tab) cannot be named in a job script; choose another")
    cfg = resolved
    out = Path(cfg.out)
    slurm_dir = out / "slurm"
    scripts = {"node.sh": node_script(job, cfg, slurm_dir=slurm_dir, workdir=workdir),
               "job.sh": job_script(job, cfg, slurm_dir=slurm_dir)}  # both checked before anything is written
    slurm_dir.mkdir(parents=True, exist_ok=True)
    # tetron train runs only in a new or empty folder or a tetron run's (validate.py): an empty log marks
    # this folder as the run's, now that it holds the job's files (the run appends its steps to it).
    (out / "metrics.jsonl").touch()
    write_text(slurm_dir / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    if setup is not None:
        write_text(slurm_dir / "setup.sh", setup)
    for name, text in scripts.items():
        write_text(slurm_dir / name, text)
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
