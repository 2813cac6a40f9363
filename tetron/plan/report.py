"""`tetron plan`'s work: the base config and hardware from the command line, the search, and what it
prints, writes (--json, --write) and measures (--measure: predicted beside measured, layout by layout)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from tetron.config import CONFIGS_DIR, Config, cuda_dtype, from_dict, is_set, load_raw
from tetron.data.loader import prepare_data
from tetron.errors import ConfigError, check, quoted
from tetron.fs import write_text
from tetron.models import family
from tetron.overrides import apply_overrides
from tetron.parallel.pipeline_schedules import SCHEDULES
from tetron.plan import hardware as hwlib
from tetron.plan.hardware import GiB, Hardware
from tetron.plan.memory import predict_rank
from tetron.plan.search import CPU_PROCESS_BYTES, GPU_RESERVE, LEGEND, Plan, as_json, memory_limit, rank, search, table
from tetron.plan.sizes import is_moe


@dataclass
class PlanRequest:
    """What `tetron plan` was asked, parsed."""

    config: str | None  # a base config file (or configs/ name); None: defaults
    overrides: list[str]  # --section.key=value and short flags for the base config
    nodes: int
    gpus_per_node: int
    gpu: str | None = None  # a known GPU name; None: this machine's GPU, or its CPU
    memory_gb: float | None = None  # memory per device, GiB (overrides the GPU's)
    batch_tokens: int | None = None  # global batch in tokens; None: the base config's
    fixed: dict[str, Any] = field(default_factory=dict)  # axes the search keeps as given
    top: int = 10
    json: bool = False
    write: str | None = None
    pick: int = 1
    measure: int = 0  # measure this many of the best layouts here (0: none)
    steps: int = 3


def hardware(req: PlanRequest) -> Hardware:
    """The device the plan is for: a named GPU, this machine's GPU, or this CPU; --memory-gb overrides.
    --memory-gb without --gpu on a machine without one means GPUs of that memory (an H100's speed): whoever
    gives GPU memory plans for GPUs, not for this CPU's processes."""
    if req.gpu is not None:
        hw = hwlib.gpu(req.gpu)
    elif torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        match = max((k for k in hwlib.GPUS if k.split("-")[0] in name), key=len, default="H100")
        hw = dataclasses.replace(hwlib.GPUS[match], memory=torch.cuda.get_device_properties(0).total_memory)
    elif req.memory_gb:
        hw = dataclasses.replace(hwlib.GPUS["H100"], name=f"GPU of {req.memory_gb:g} GiB (H100 speed)")
    else:
        hw = hwlib.cpu(req.gpus_per_node)
    return hwlib.with_memory(hw, req.memory_gb) if req.memory_gb else hw


def config_source(req: PlanRequest) -> str | None:
    """The base config: the one given, else for `--model NAME` the whole configs/NAME.yaml (its sequence
    length, dtype and batch too), so that `tetron plan --model X` plans the run `tetron plan configs/X.yaml`
    plans; else none (defaults)."""
    if req.config is not None:
        return req.config
    model = apply_overrides({}, list(req.overrides)).get("model")
    return model if isinstance(model, str) and (CONFIGS_DIR / f"{model}.yaml").is_file() else None


def base_config(req: PlanRequest, hw: Hardware | None = None) -> tuple[Config, int, list[str]]:
    """The config every layout starts from, the global batch in sequences, and a note for each figure the
    plan assumed because nothing set it (the sequence length, the batch, the dtype): defaults made for this
    CPU's demo runs, which a plan for GPUs should not take silently. On a GPU an unset train.dtype is
    bfloat16, as `tetron train` would make it there."""
    raw = load_raw(config_source(req), req.overrides)
    dtype = cuda_dtype(raw, device_type="cuda" if hw is not None and not hw.cpu else "cpu")
    if dtype is not None:
        raw["train"] = {**(raw.get("train") or {}), "dtype": dtype}
    cfg = from_dict(raw)
    check(cfg.model is not None, "tetron plan needs a model: --model NAME (configs/ or a Hugging Face config)")
    seq = cfg.data.seq_len
    tokens = req.batch_tokens or cfg.global_batch * seq
    check(tokens % seq == 0, f"--batch-tokens={tokens} is not a multiple of data.seq_len={seq}; "
                             f"use {max(1, round(tokens / seq)) * seq}")
    assumed = []
    if not is_set(raw, "data", "seq_len"):
        assumed.append(f"seq {seq} (--seq-len)")
    if req.batch_tokens is None and not any(is_set(raw, "train", k) for k in ("micro_batch", "grad_acc")):
        assumed.append(f"a batch of {tokens:,} tokens (--batch-tokens)")
    if dtype is not None:
        assumed.append(f"{dtype}, the default on GPUs (--train.dtype=float32 for fp32)")
    elif not is_set(raw, "train", "dtype"):
        assumed.append(f"{cfg.train.dtype} (--train.dtype=bfloat16)")
    notes = [f"note: the config sets none of these, so the plan assumed: {'; '.join(assumed)}"] if assumed else []
    return cfg, tokens // seq, notes


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


def mtp_params(model: object) -> int:
    """The parameters of a model's multi-token prediction modules (models/mtp.py; published counts leave them out,
    as DeepSeek-V3's 671B does): read off the family's module built on the meta device."""
    if not getattr(model, "num_nextn_predict_layers", 0):
        return 0
    with torch.device("meta"):
        built = family(model.model_type).model_class(dataclasses.replace(model, vocab_size=1))
    return sum(p.numel() for name, p in built.named_parameters() if name.startswith("mtp."))


def header(cfg: Config, hw: Hardware, req: PlanRequest, batch: int, plans: list[Plan], fit: list[Plan]) -> str:
    m, world = cfg.model, req.nodes * req.gpus_per_node
    where = f"{req.nodes} x {req.gpus_per_node} {hw.name}" if not hw.cpu else f"{world} CPU ranks"
    memory = f"{_size(hw.memory)} available to all" if hw.cpu else f"{_size(hw.memory)} per device"
    limit = plans[0].limit if plans else 0
    # an MoE model: its active parameters too, those one token's forward multiplies by (its MFU counts them)
    active = f", {m.num_params(active=True):,} active" if is_moe(m) else ""
    mtp = mtp_params(m)
    active += f"; + {mtp:,} in multi-token prediction" if mtp else ""
    return (f"tetron plan: {m.num_params():,} parameters{active} ({m.num_hidden_layers} layers, hidden "
            f"{m.hidden_size}) on "
            f"{where}, {memory} ({_size(limit)} per rank for tensors); seq {cfg.data.seq_len}, "
            f"{batch} sequences ({batch * cfg.data.seq_len:,} tokens) a step, {cfg.train.dtype}\n"
            f"{len(plans)} layouts valid, {len(fit)} fit" + (f"; the fastest {min(req.top, len(fit))}:" if fit else ""))


def run(req: PlanRequest, *, progress: Callable[[str], None] | None = None) -> tuple[str, int]:
    """Search, and the text to print (or JSON), and the exit code: 0, or 1 when nothing fits. `progress`
    gets a line now and then while the search runs (the command prints them on stderr)."""
    hw = hardware(req)
    if memory_limit(hw, req.gpus_per_node) <= 0:  # what a rank keeps aside leaves nothing for tensors
        aside, what = (CPU_PROCESS_BYTES, "the interpreter and torch") if hw.cpu else (GPU_RESERVE, "the CUDA "
                                                                                         "context and NCCL")
        given = f"--memory-gb={req.memory_gb:g}" if req.memory_gb else f"the {hw.name}"
        raise ConfigError(f"{given}: {hw.memory / GiB:.3g} GiB per device leaves nothing for tensors once each rank "
                          f"sets aside {aside / GiB:.3g} GiB ({what}); give more memory")
    cfg, batch, notes = base_config(req, hw)
    if req.measure:
        # the layouts run here: on this CPU, or on this machine's GPUs, one rank each
        here = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check(req.gpu is None or here > 0, f"--measure runs the layouts on this machine, which has no {req.gpu}; "
                                           f"leave out --gpu to plan (and measure) for this machine")
        check(hw.cpu or (req.nodes == 1 and req.gpus_per_node <= here),
              f"--measure runs the layouts here: {req.nodes * req.gpus_per_node} ranks need as many GPUs on one "
              f"node, and this machine has {here}")
    plans = search(cfg, hw, nodes=req.nodes, gpus_per_node=req.gpus_per_node, batch=batch, fixed=req.fixed,
                   progress=progress)
    fit = rank(plans)
    if req.write is not None:
        check(len(fit) >= req.pick, f"--write: {len(fit)} layouts fit, no layout #{req.pick} to write")
        chosen = fit[req.pick - 1]
        write_text(Path(req.write).expanduser(), written_config(chosen, pick=req.pick), replace=False)
    if req.json:
        data = as_json(fit, hw=hw, nodes=req.nodes, gpus_per_node=req.gpus_per_node, considered=len(plans))
        data["notes"] = notes
        if req.measure:
            data["measured"] = [measured_row(p, req.steps) for p in fit[:req.measure]]
        return json.dumps(data, indent=1, default=str), 0 if fit else 1
    lines = [header(cfg, hw, req, batch, plans, fit)]
    if fit:
        lines += [table(fit, top=req.top), LEGEND]
    elif plans:
        least = min(plans, key=lambda p: p.memory.total)
        lines.append(f"nothing fits: the least memory, {_size(least.memory.total)} per rank ({least.layout.label()}), "
                     f"is over {_size(least.limit)}; use more GPUs, a smaller batch or sequence")
    lines += notes
    if req.write is not None and fit:
        lines.append(f"wrote {req.write}: layout #{req.pick}, {fit[req.pick - 1].layout.label()}; before training, "
                     f"edit what it marks EDIT (the data, the steps, the run folder)")
    if req.measure and fit:
        lines.append(measure_table([measured_row(p, req.steps) for p in fit[:req.measure]]))
    return "\n".join(lines), 0 if fit else 1


# The fields a written config keeps from the base config that a real run almost always changes: the base's
# defaults train the demo corpus for 100 steps into runs/default.
TO_EDIT = {("data", "path"): "the data to train on (a folder, file, hf:NAME or several data.sources)",
           ("train", "steps"): "how long to train: steps x the batch's tokens = the run's tokens",
           ("out",): "the run folder: checkpoints, logs, the final model"}


def written_config(plan: Plan, *, pick: int) -> str:
    """The YAML `--write` writes: the whole config with the plan's layout, the fields a real run needs to
    change marked `# EDIT` with what they hold now."""
    data = plan.config.to_dict()
    text = yaml.safe_dump(data, sort_keys=False)
    lines, section = [], None
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if not line.startswith(" "):
            section = key
        where = (key,) if section == key else (section, key)
        if where in TO_EDIT:
            line = f"{line}  # EDIT: {TO_EDIT[where]}"
        lines.append(line)
    marked = ", ".join(".".join(k) for k in TO_EDIT)
    return (f"# tetron plan #{pick}: {plan.layout.label()}\n"
            f"# Before training, edit the lines marked EDIT ({marked}): the plan keeps them as the base\n"
            f"# config had them (the defaults train the demo corpus for 100 steps into runs/default).\n"
            + "\n".join(lines) + "\n")


def measured_row(plan: Plan, steps: int) -> dict[str, Any]:
    """Run `plan` here for a few steps; predicted and measured peak memory (worst rank) and step time."""
    from tetron.plan.measure import measure

    cfg = plan.config
    prepare_data(cfg)
    ranks = measure(cfg, steps=steps)
    per_rank = [{"rank": r["rank"], "measured": r["peak_bytes"],
                 "predicted": predict_rank(cfg, r["pp"], dp_rank=r["dp"] * cfg.parallel.cp + r["cp"]).total}
                for r in ranks]
    return {"label": plan.layout.label(), "predicted_bytes": max(r["predicted"] for r in per_rank),
            "measured_bytes": max(r["measured"] for r in per_rank), "predicted_step_s": plan.time.step_s,
            "measured_step_s": max(r["step_s"] for r in ranks), "ranks": per_rank}


def measure_table(rows: list[dict[str, Any]]) -> str:
    """Predicted beside measured: the worst rank's peak memory, and the step time."""
    lines = ["measured here (peak: tensors allocated by the worst rank; step: median of the timed steps):",
             f"{'#':>3}  {'layout':<40} {'peak predicted':>15} {'measured':>12} {'error':>7}   "
             f"{'step predicted':>14} {'measured':>9}"]
    for i, r in enumerate(rows, 1):
        error = (r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
        lines.append(f"{i:>3}  {r['label']:<40} {_size(r['predicted_bytes']):>15} {_size(r['measured_bytes']):>12} "
                     f"{error:>+7.1%}   {r['predicted_step_s']:>12.3g} s {r['measured_step_s']:>7.3g} s")
    return "\n".join(lines)


def fixed_axes(values: dict[str, Any]) -> dict[str, Any]:
    """The axes given on the command line (None: free), as Layout fields."""
    fixed = {k: v for k, v in values.items() if v is not None}
    for name, v in fixed.items():
        if name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "pp_virtual"):
            check(isinstance(v, int) and v >= 1, f"--{name.replace('_', '-')}={v} must be at least 1")
    if "zero" in fixed and fixed["zero"] not in (0, 1, 2, 3):
        raise ConfigError(f"--zero={fixed['zero']}: use 0, 1, 2 or 3")
    return fixed


MAX_RANKS = 2**17  # what `tetron plan` searches over at most: beyond any cluster, and a search of seconds


def check_plan_numbers(ns: argparse.Namespace) -> None:
    """`tetron plan`'s numbers, each in the range that means something (a negative --top would print all but
    one row; a NaN --memory-gb would reach int()); the axes are checked by fixed_axes."""
    check(1 <= ns.nodes <= MAX_RANKS and 1 <= ns.gpus_per_node <= MAX_RANKS
          and ns.nodes * ns.gpus_per_node <= MAX_RANKS,
          f"--nodes={quoted(ns.nodes)} x --gpus-per-node={quoted(ns.gpus_per_node)}: each at least 1, together at "
          f"most {MAX_RANKS:,} ranks")
    check(ns.memory_gb is None or (math.isfinite(ns.memory_gb) and 0 < ns.memory_gb <= 2**20),
          f"--memory-gb={ns.memory_gb}: give the memory per device in GiB, a number above 0 (e.g. 80)")
    check(ns.batch_tokens is None or 1 <= ns.batch_tokens < 2**63,
          f"--batch-tokens={quoted(ns.batch_tokens)} must be at least 1 (a multiple of data.seq_len)")
    for flag, value, least in (("--top", ns.top, 1), ("--pick", ns.pick, 1), ("--measure", ns.measure, 0),
                               ("--steps", ns.steps, 1)):
        check(least <= value < 2**63, f"{flag}={quoted(value)} must be at least {least}")
    check(not ns.measure or ns.steps >= 2,
          f"--steps={ns.steps} with --measure: the peak is measured from the second step on (the first has no "
          f"optimizer state yet); use --steps 2 or more")
    check(ns.pp_virtual in (None, 1) or ns.pp_schedule is None or SCHEDULES[ns.pp_schedule].virtual != 1,
          f"--pp-virtual={quoted(ns.pp_virtual)} needs --pp-schedule interleaved (or zbv, with 2): "
          f"{ns.pp_schedule} runs one layer chunk per pipeline rank; leave out --pp-virtual with it")
