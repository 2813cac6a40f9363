"""The layout search: every layout validate() accepts for a model on some GPUs, predicted and ranked.

A layout is the parallel sizes (dp, tp, pp, cp), ZeRO stage (and under ZeRO-2/3 with accumulation,
whether it accumulates sharded or in full buffers), recomputation, micro-batch (and with it the
gradient accumulation that keeps the global batch), pipeline schedule and virtual stages, and
sequence parallelism. `search` builds each as a Config from a base config, keeps those validate()
accepts, and predicts per-rank peak memory (memory.py) and step time (steptime.py); `rank` orders the
ones that fit by step time. `table`, `as_json` and `layout_config` present them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from tetron.config import Config
from tetron.errors import ConfigError
from tetron.parallel.pipeline_schedules import SCHEDULES
from tetron.plan.hardware import GiB, Hardware
from tetron.plan.memory import MemoryEstimate, floor, heaviest_ranks, predict
from tetron.plan.sizes import is_moe
from tetron.plan.steptime import TimeEstimate, estimate
from tetron.plan.workers import run_dealt, workers_for
from tetron.validate import validate
from tetron.validate.paths import FileChecks

# Besides the device's own: the CUDA context, NCCL's buffers and the caching allocator's rounding.
GPU_RESERVE = GiB
# A CPU rank's interpreter, torch and its libraries, resident before any tensor (measured here: ~0.4 GB).
CPU_PROCESS_BYTES = 400 * 2**20

PROGRESS_EVERY_S = 5.0  # a progress line this often while a search runs

# What a layout's label says (Layout.label), printed under the table and in docs/planning.md.
LEGEND = """\
legend: dpN tpN ppN cpN epN: ranks along data, tensor, pipeline, context and expert parallelism (ep: an MoE
          model's experts split over that many of the dp*cp ranks); sp: sequence parallelism
        ppN(S): the pipeline schedule S (afab, 1f1b, zbh1, zbv, dualpipev, interleaved; xV: V virtual stages per rank)
        z0..z3: the ZeRO stage; z2f, z3f: ZeRO-2/3 accumulating gradients in full buffers (z2, z3: in slices)
        -, sel, full: activation recomputation none, selective (keeps what none keeps but the attention
          kernel's own, reruns the kernel) or full (keeps each layer's input only)
        mbMxA: micro-batches of M sequences, A of them accumulated a step, per dp rank
        bubble: the pipeline's idle share of a step; MFU: model FLOPs over the devices' peak\
"""

AXES = ("dp", "tp", "pp", "cp", "ep", "zero", "recompute", "micro_batch", "pp_schedule", "pp_virtual", "sp",
        "zero_accumulate")


@dataclass(frozen=True)
class Layout:
    """How one training step is laid out over the ranks."""

    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    recompute: str
    micro_batch: int
    grad_acc: int
    pp_schedule: str
    pp_virtual: int
    sp: bool
    zero_accumulate: str = "sharded"  # ZeRO-2/3 with grad_acc > 1: "sharded" (slices only) or "full" (whole buffers)
    ep: int = 1  # expert-parallel ranks out of dp*cp (an MoE model's)

    def apply(self, base: Config) -> Config:
        """`base` with this layout."""
        parallel = replace(base.parallel, dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, zero=self.zero,
                           pp_schedule=self.pp_schedule, pp_virtual=self.pp_virtual, sp=self.sp, pp_split=None,
                           zero_accumulate=self.zero_accumulate)
        train = replace(base.train, recompute=self.recompute, micro_batch=self.micro_batch, grad_acc=self.grad_acc)
        return replace(base, parallel=parallel, train=train)

    def label(self) -> str:
        """A short name: dp4 tp2 pp2(1f1b) cp1 sp z1 sel mb2x4 (z3f: ZeRO-3 accumulating in full buffers; an
        MoE model's expert parallelism after cp: dp8 tp1 pp1 cp1 ep4 z1 ...)."""
        pp = f"pp{self.pp}" + (f"({self.pp_schedule}{'x' + str(self.pp_virtual) if self.pp_virtual > 1 else ''})"
                               if self.pp > 1 else "")
        recompute = {"none": "-", "selective": "sel", "full": "full"}[self.recompute]
        full = "f" if self.zero_accumulate == "full" else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"dp{self.dp} tp{self.tp}{' sp' if self.sp else ''} {pp} cp{self.cp}{ep} z{self.zero}{full} "
                f"{recompute} mb{self.micro_batch}x{self.grad_acc}")


@dataclass
class Plan:
    """One layout with its predictions."""

    layout: Layout
    config: Config
    memory: MemoryEstimate
    time: TimeEstimate | None  # None where the layout does not fit: it is not ranked, so not timed
    limit: int  # the bytes a rank may use on this hardware

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.limit


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_limit(hw: Hardware, ranks_per_node: int) -> int:
    """The bytes one rank may fill: a GPU's memory less its reserve; on the CPU an equal share of what the
    machine has available, less each process's own baseline."""
    if hw.cpu:
        return hw.memory // max(1, ranks_per_node) - CPU_PROCESS_BYTES
    return hw.memory - GPU_RESERVE


def _sizes(base: Config, world: int, gpus_per_node: int, batch: int, fixed: dict) -> Iterator[tuple[int, ...]]:
    """(dp, tp, pp, cp, micro_batch) with dp*tp*pp*cp = world, the shapes' divisibility and the batch."""
    m = base.model
    for tp, cp, pp in itertools.product(divisors(world), repeat=3):
        if world % (tp * cp * pp) or tp > gpus_per_node or pp > m.num_hidden_layers:
            continue
        dp = world // (tp * cp * pp)
        if batch % dp or any(fixed.get(k, v) != v for k, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp))):
            continue
        # micro-batches of powers of two (or as fixed): the sizes kernels and schedules are tuned for
        for micro_batch in [fixed["micro_batch"]] if "micro_batch" in fixed else divisors(batch // dp):
            if (batch // dp) % micro_batch == 0 and ("micro_batch" in fixed or micro_batch & (micro_batch - 1) == 0):
                yield dp, tp, pp, cp, micro_batch


def expert_parallel_sizes(base: Config, dp_cp: int) -> list[int]:
    """The ep sizes to try for dp*cp ranks: those dividing dp*cp and the MoE model's num_experts (1 for a
    dense model). Whatever else limits ep (ZeRO stages, schedules, HSDP) is validate()'s to say: the search
    takes every layout it accepts, so a combination it lifts is searched with no change here."""
    if not is_moe(base.model):
        return [1]
    return [e for e in divisors(dp_cp) if base.model.num_experts % e == 0]


def pipeline_schedules(base: Config, *, pp: int, grad_acc: int) -> list[tuple[str, int]]:
    """The registered schedules a layout of pp > 1 ranks may run, as (name, chunks per rank): those with a fixed
    number of chunks, then those taking any number with 2 and 4 where the layers fill them and the micro-batches
    suit them."""
    fixed = [(name, s.virtual) for name, s in SCHEDULES.items() if s.virtual is not None and pp >= s.min_pp
             and grad_acc >= s.min_micro_batches_per_pp * pp]
    return fixed + [(name, v) for name, s in SCHEDULES.items() if s.virtual is None and pp >= s.min_pp
                    for v in (2, 4) if pp * v <= base.model.num_hidden_layers
                    and (grad_acc % pp == 0 or not s.micro_batches_per_pp)]


def candidates(base: Config, *, world: int, gpus_per_node: int, batch: int, fixed: dict) -> Iterator[Layout]:
    """Every layout of `world` ranks for a global batch of `batch` sequences; `fixed` pins any of AXES."""
    for dp, tp, pp, cp, mb in _sizes(base, world, gpus_per_node, batch, fixed):
        grad_acc = batch // (dp * mb)
        schedules = [("1f1b", 1)] if pp == 1 else pipeline_schedules(base, pp=pp, grad_acc=grad_acc)
        # sequence parallelism only lowers memory (same traffic): taken wherever it applies
        sp = tp > 1 and (base.data.seq_len // cp) % tp == 0
        for (schedule, virtual), zero, recompute, ep in itertools.product(
                schedules, (0, 1, 2, 3) if dp * cp > 1 else (0,), ("none", "selective", "full"),
                expert_parallel_sizes(base, dp * cp)):
            # ZeRO-2/3 with accumulation: full (fewer collectives) unless pinned; search() falls back to sharded
            accumulate = fixed.get("zero_accumulate", "full") if zero >= 2 and grad_acc > 1 else "sharded"
            layout = Layout(dp, tp, pp, cp, zero, recompute, mb, grad_acc, schedule, virtual, fixed.get("sp", sp),
                            accumulate, ep)
            if all(getattr(layout, k) == v for k, v in fixed.items()):
                yield layout


def search(base: Config, hw: Hardware, *, nodes: int, gpus_per_node: int, batch: int,
           fixed: dict[str, Any] | None = None, progress: Callable[[str], None] | None = None,
           every_s: float | None = None, workers: int | None = None) -> list[Plan]:
    """Every valid layout, predicted; see `rank` for the order. `progress` gets a line every `every_s` seconds
    (PROGRESS_EVERY_S by default) of the search (a large model's takes a while: each layout is predicted layer
    by layer on fake tensors); a search quicker than that says nothing. `workers`: processes to predict in (default:
    this machine's cores for a large search, workers.py)."""
    world = nodes * gpus_per_node
    every_s = PROGRESS_EVERY_S if every_s is None else every_s
    fixed = fixed or {}
    layouts = list(candidates(base, world=world, gpus_per_node=gpus_per_node, batch=batch, fixed=fixed))
    seen = FileChecks()  # the run folder and the data are the same for every layout: looked at once
    limit = memory_limit(hw, gpus_per_node)
    start = time.monotonic()

    def tick(done: int, valid: int) -> None:
        progress(f"tetron plan: {done:,} of {len(layouts):,} layouts of {world} ranks checked and predicted, "
                 f"{valid:,} valid so far ({time.monotonic() - start:.0f} s)")

    def one(i: int) -> tuple[Layout, MemoryEstimate, TimeEstimate | None] | str:
        return _predicted(base, layouts[i], hw, world=world, gpus_per_node=gpus_per_node, limit=limit, fixed=fixed,
                          seen=seen)

    workers = workers_for(len(layouts)) if workers is None else workers
    outcomes = run_dealt(one, [(x.tp, x.cp) for x in layouts], workers, tick=tick if progress else None,
                         every_s=every_s)
    refused = [o for o in outcomes if isinstance(o, str)]
    plans = [Plan(layout, layout.apply(base), memory, step, limit) for layout, memory, step in
             (o for o in outcomes if not isinstance(o, str))]
    if not plans:  # say why: the first refusal, or that the sizes leave nothing to try
        raise ConfigError(f"no layout of {world} ranks is valid: {refused[0]}" if refused else
                          f"no layout of {world} ranks divides the model (heads, layers) and the batch of {batch} "
                          f"sequences{' with ' + str(fixed) if fixed else ''}")
    return plans


def _predicted(base: Config, layout: Layout, hw: Hardware, *, world: int, gpus_per_node: int, limit: int,
               fixed: dict[str, Any], seen: FileChecks) -> tuple[Layout, MemoryEstimate, TimeEstimate | None] | str:
    """One layout's peak memory and (where it fits) step time, or why validate() refuses it."""
    cfg = layout.apply(base)
    try:
        validate(cfg, world_size=world, seen=seen)
    except ConfigError as err:
        return str(err)
    memory = _memory(cfg, limit)
    if memory.total > limit and layout.zero_accumulate == "full" and "zero_accumulate" not in fixed:
        # Full accumulation is the faster (one reduction a step) and sharded the smaller: so the layout is
        # ranked as full where that fits, as sharded where only that fits (as ranking both would)
        layout = replace(layout, zero_accumulate="sharded")
        cfg = layout.apply(base)
        memory = _memory(cfg, limit)
    # a layout over the limit is not ranked: timing it would walk every layer of a model far too large
    return layout, memory, estimate(cfg, hw, gpus_per_node=gpus_per_node) if memory.total <= limit else None


def _memory(cfg: Config, limit: int) -> MemoryEstimate:
    """The predicted peak, or a lower bound of it by arithmetic alone where that is over `limit` already
    (a layout far over the limit is not walked layer by layer)."""
    memory = floor(cfg)
    return memory if memory.total > limit else predict(cfg, ranks=heaviest_ranks(cfg))


def rank(plans: list[Plan]) -> list[Plan]:
    """The plans that fit, fastest first (then the least memory)."""
    return sorted((p for p in plans if p.fits), key=lambda p: (p.time.step_s, p.memory.total))


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}" if n < 10 * GiB else f"{n / GiB:.1f}"


def table(plans: list[Plan], *, top: int) -> str:
    """The ranked plans as a text table: layout, peak memory per rank and its largest parts, step time."""
    shown = plans[:top]
    terms = [", ".join(f"{k} {_gib(v)}" for k, v in p.memory.largest(3)) for p in shown]
    width = max([40, *map(len, terms)])  # the longest row's terms: the columns after it stay aligned
    labels = [p.layout.label() for p in shown]
    named = max([40, *map(len, labels)])  # likewise the longest layout (interleaved with ep: past 40)
    moe = any(is_moe(p.config.model) for p in shown)  # an MoE model's table adds the all-to-alls' seconds
    head = (f"{'#':>3}  {'layout':<{named}} {'mem/rank GiB':>12}  {'largest terms (GiB)':<{width}} {'step s':>8} "
            f"{'tokens/s':>10} {'MFU':>5} {'bubble':>6}" + (f" {'ep s':>7}" if moe else ""))
    lines = [head]
    for i, (p, label, largest) in enumerate(zip(shown, labels, terms), 1):
        lines.append(f"{i:>3}  {label:<{named}} {_gib(p.memory.total):>12}  {largest:<{width}} "
                     f"{p.time.step_s:>8.3g} {p.time.tokens_per_s:>10,.0f} {p.time.mfu:>5.0%} {p.time.bubble:>6.0%}"
                     + (f" {p.time.ep_s:>7.3g}" if moe else ""))
    return "\n".join(lines)


def as_json(plans: list[Plan], *, hw: Hardware, nodes: int, gpus_per_node: int, considered: int) -> dict:
    """The ranked plans as data."""
    return {
        "hardware": dataclasses.asdict(hw), "nodes": nodes, "gpus_per_node": gpus_per_node,
        "limit_bytes": plans[0].limit if plans else None, "considered": considered, "fit": len(plans),
        "plans": [{"layout": dataclasses.asdict(p.layout), "label": p.layout.label(),
                   "memory": {**p.memory.terms(), "total": p.memory.total, "moment": p.memory.moment,
                              "pp_rank": p.memory.pp_rank},
                   "time": dataclasses.asdict(p.time)} for p in plans],
    }


def layout_config(plan: Plan) -> dict[str, Any]:
    """The plan as a config dict for `tetron train` (the whole resolved config, this layout in it)."""
    return plan.config.to_dict()
