"""`tetron plan` and `tetron slurm`: their arguments, each checked into one line, and what they run."""

from __future__ import annotations

import argparse
import sys
import typing

from tetron.config import Config, Recompute, ZeroAccumulate, cuda_dtype, from_dict, load_config, load_raw
from tetron.errors import UserError, check, failed
from tetron.fs import check_new_file, write_output
from tetron.overrides import OneLineParser, split_known
from tetron.parallel.pipeline_schedules import SCHEDULES
from tetron.plan.report import PlanRequest, check_plan_numbers, fixed_axes, run
from tetron.plan.slurm import CORES_PER_RANK, SlurmJob, submit, write_job
from tetron.validate import validate


def plan_args(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = OneLineParser(prog="tetron plan", description=(
        "Rank the layouts that fit: every dp/tp/pp/cp/ep, ZeRO stage, recomputation, micro-batch, pipeline "
        "schedule and sequence parallelism validate() accepts, with each rank's predicted peak memory and the "
        "predicted step time (tetron/plan/). Other --section.key=value and short flags (--model, --seq-len, "
        "--data, --train.dtype=bfloat16, ...) set the base config."))
    parser.add_argument("config", nargs="?", help="a base config (YAML file or configs/ name)")
    parser.add_argument("--nodes", type=int, help="nodes (required, but with --dry-run)")
    parser.add_argument("--gpus-per-node", type=int, help="ranks per node (CPU: processes; required, but with "
                                                          "--dry-run)")
    parser.add_argument("--gpu", help="a known GPU: H200, H100, A100-80GB, A100-40GB, L40S, B200 (default: this "
                                      "machine's GPU, else its CPU)")
    parser.add_argument("--memory-gb", type=float, help="memory per device in GiB (overrides the GPU's)")
    parser.add_argument("--batch-tokens", type=int, help="global batch in tokens (default: the config's)")
    for axis, kind in (("dp", int), ("tp", int), ("pp", int), ("cp", int), ("ep", int), ("zero", int),
                       ("micro-batch", int), ("pp-virtual", int)):
        parser.add_argument(f"--{axis}", type=kind, help="keep this axis as given")
    parser.add_argument("--recompute", choices=typing.get_args(Recompute), help="keep this axis as given")
    parser.add_argument("--pp-schedule", choices=tuple(SCHEDULES), help="keep this axis as given")
    parser.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None, help="sequence parallelism")
    parser.add_argument("--zero-accumulate", choices=typing.get_args(ZeroAccumulate),
                        help="keep this axis as given (ZeRO-2/3 with gradient accumulation)")
    parser.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
    parser.add_argument("--json", action="store_true", help="print the ranked layouts as JSON")
    parser.add_argument("--write", metavar="CONFIG.yaml", help="write the chosen layout as a config for tetron train")
    parser.add_argument("--pick", type=int, default=1, help="which ranked layout --write writes (default 1)")
    parser.add_argument("--measure", type=int, nargs="?", const=3, default=0, metavar="K",
                        help="run the best K layouts here for a few steps: predicted beside measured (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="steps --measure runs before timing (default 3)")
    parser.add_argument("--dry-run", action="store_true",
                        help="the config's own layout (with the axes given here): one real step of each pipeline "
                             "rank at full size on fake tensors, its peak memory, FLOPs and collectives beside the "
                             "planner's (tetron/plan/dry_run.py)")
    mine, rest = split_known(parser, args)
    ns = parser.parse_args(mine)
    if not ns.dry_run:
        for flag, value in (("--nodes", ns.nodes), ("--gpus-per-node", ns.gpus_per_node)):
            if value is None:
                parser.error(f"the following arguments are required: {flag}")
    # --dry-run needs no --nodes: the other numbers are checked all the same
    check_plan_numbers(argparse.Namespace(**{**vars(ns), "nodes": ns.nodes or 1,
                                             "gpus_per_node": ns.gpus_per_node or 1}))
    if ns.write is not None:
        check_new_file(ns.write, "--write")  # before the search: refused in a moment, not after it
    return ns, rest


def plan_command(args: list[str]) -> int:
    try:
        ns, overrides = plan_args(args)
        if ns.dry_run:
            return dry_run_command(ns, overrides)
        fixed = fixed_axes({"dp": ns.dp, "tp": ns.tp, "pp": ns.pp, "cp": ns.cp, "ep": ns.ep, "zero": ns.zero,
                            "recompute": ns.recompute, "micro_batch": ns.micro_batch, "pp_schedule": ns.pp_schedule,
                            "pp_virtual": ns.pp_virtual, "sp": ns.sp, "zero_accumulate": ns.zero_accumulate})
        request = PlanRequest(config=ns.config, overrides=overrides, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node,
                              gpu=ns.gpu, memory_gb=ns.memory_gb, batch_tokens=ns.batch_tokens, fixed=fixed,
                              top=ns.top, json=ns.json, write=ns.write, pick=ns.pick, measure=ns.measure,
                              steps=ns.steps)
        # progress for whoever watches a terminal; a log or a captured output gets the result alone
        progress = (lambda line: print(line, file=sys.stderr, flush=True)) if sys.stderr.isatty() else None
        text, code = run(request, progress=progress)
    except FileExistsError:  # made meanwhile, by another process: still never replaced
        return failed(f"--write {ns.write}: already exists; give a new file name (nothing is overwritten)")
    except (UserError, ValueError) as err:
        return failed(str(err))
    write_output(text)  # after --measure's ranks, whatever they left the pipe's flags at
    return code


def job_config(path: str, overrides: list[str]) -> tuple[Config, str | None]:
    """A Slurm job's config, and a note when it trains in bf16 because nothing set train.dtype: a job on GPUs
    (parallel.device other than cpu: job.sh asks for them) trains as `tetron train` would on one, and its
    config.yaml, resolved here, says so to every node."""
    raw = load_raw(path, overrides)
    kind = raw["parallel"].get("device", "auto") if isinstance(raw.get("parallel"), dict) else "auto"
    dtype = cuda_dtype(raw, device_type="cpu" if kind == "cpu" else "cuda")
    if dtype is None:
        return from_dict(raw), None
    raw["train"] = {**(raw.get("train") or {}), "dtype": dtype}
    note = f"train.dtype={dtype}: the default on GPUs when the config sets none (--train.dtype=float32 trains in fp32)"
    return from_dict(raw), note


def dry_run_command(ns: argparse.Namespace, overrides: list[str]) -> int:
    """`tetron plan CONFIG --dry-run`: the config's layout, the axes given as flags set in it, checked as
    `tetron train` checks it (one line, exit 2), then dry_run's table."""
    axes = {"dp": ns.dp, "tp": ns.tp, "pp": ns.pp, "cp": ns.cp, "ep": ns.ep, "zero": ns.zero,
            "pp_schedule": ns.pp_schedule, "pp_virtual": ns.pp_virtual, "sp": ns.sp,
            "zero_accumulate": ns.zero_accumulate}
    given = [f"--parallel.{k}={v}" for k, v in axes.items() if v is not None]
    given += [f"--train.{k}={v}" for k, v in (("recompute", ns.recompute), ("micro_batch", ns.micro_batch))
              if v is not None]
    cfg = load_config(ns.config, [*overrides, *given])
    return dry_run_config(cfg, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node)


def dry_run_config(cfg: Config, *, nodes: int | None = None, gpus_per_node: int | None = None) -> int:
    """Validate `cfg` (and that nodes x gpus_per_node, where given, is its world size), then print the dry run."""
    from tetron.plan.dry_run import dry_run  # fake tensors and torch's private tools only when asked for
    from tetron.torch_private.fake import DryRunUnavailable

    try:
        if nodes is not None and gpus_per_node is not None:
            check(nodes * gpus_per_node == cfg.world_size,
                  f"--nodes {nodes} x --gpus-per-node {gpus_per_node} = {nodes * gpus_per_node} ranks, but the "
                  f"layout has {cfg.world_size} (dp*tp*pp*cp); give a layout of that many ranks (--dp, ...)")
        validate(cfg)
        text = dry_run(cfg)
    except (UserError, DryRunUnavailable) as err:
        return failed(str(err))
    write_output(text)  # whole, whatever the pipe's flags (fs.write_output)
    return 0


def slurm_command(args: list[str]) -> int:
    parser = OneLineParser(prog="tetron slurm", description=(
        "Write OUT/slurm/job.sh (and node.sh, config.yaml): one srun task per node starting torchrun with a "
        "c10d rendezvous on the first node, per-rank logs under OUT/logs, --resume auto; --submit runs sbatch. "
        "Every node runs this checkout with this Python: both must be at the same paths on every node. "
        "Other --section.key=value and short flags override the config."))
    parser.add_argument("config", help="the run's config (YAML file or configs/ name)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node")
    parser.add_argument("--partition")
    parser.add_argument("--time", help="wall-clock limit (HH:MM:SS or D-HH:MM)")
    parser.add_argument("--account")
    parser.add_argument("--cpus-per-task", type=int,
                        help=f"CPU cores for each node's ranks, all together (default {CORES_PER_RANK} per rank)")
    parser.add_argument("--job-name")
    parser.add_argument("--sbatch", action="append", default=[], metavar="OPT",
                        help="one more sbatch option, as name or name=value: --sbatch exclusive --sbatch mem=64G "
                             "--sbatch qos=high --sbatch constraint=a100 (repeat the flag for each)")
    parser.add_argument("--setup", metavar="FILE",
                        help="a shell script of yours that every node sources before torchrun (module load, "
                             "NCCL_* settings); copied to OUT/slurm/setup.sh and run as it is")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    try:
        mine, overrides = split_known(parser, args)
        ns = parser.parse_args(mine)
        cfg, dtype_note = job_config(ns.config, overrides)
        job = SlurmJob(nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, partition=ns.partition, time=ns.time,
                       account=ns.account, cpus_per_task=ns.cpus_per_task, job_name=ns.job_name,
                       sbatch=tuple(ns.sbatch), setup=ns.setup)
        script = write_job(cfg, job)
        print(f"tetron: wrote {script} (and node.sh, config.yaml beside it)")
        if dtype_note:
            print(f"tetron: note: {dtype_note}")
        if ns.submit:
            job_id = submit(script)
            print(f"tetron: submitted job {job_id}; logs in {script.parent} and {script.parent.parent / 'logs'}")
    except UserError as err:
        return failed(str(err))
    return 0
