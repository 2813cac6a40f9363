"""`tetron report RUN [RUN ...] [--out FILE.png] [--x step|tokens]`: the curves of one or more runs, and a
summary table.

The picture has a panel per figure, every run overlaid and labelled with its layout (and, given several runs, the
config fields whose values differ between them: "muon (dp2; optim.name=muon)" against "adamw (dp2; optim.name=adamw)"):
loss (training, and the
validation loss where measured, dashed), learning rate, gradient norm, tokens/s, peak memory; where a step's
time goes (the median seconds per category), only when some run had logging.timers on; for MoE models their
balance (the auxiliary loss, the max/mean expert load). Each launch of a run (its start, a resume) writes its
layout on its first record of metrics.jsonl: a resume is marked on the curves by a dotted line at its first
step, and a run that changed layout on resuming is labelled by every layout it ran ("pp2 -> dp2"). A run
whose records name no layout (written before tetron did) takes its latest checkpoint's
(trainer_state.json), else its Slurm config's. A run still in progress is read as far as its metrics.jsonl
goes. matplotlib draws off-screen (Agg), nothing opens a window.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import yaml

from tetron.errors import ConfigError, UserError
from tetron.fs import STATE_FILE, check_new_file, find_latest, read_bounded, read_json, write_bytes
from tetron.parallel.timers import CATEGORIES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"  # the first bytes of every PNG file

# (panel title, y label, metrics drawn, log scale)
PANELS = [("loss", "loss", ("loss", "val_loss", "mtp_loss"), False),
          ("learning rate", "lr", ("lr",), False),
          ("gradient norm (before clipping)", "grad norm", ("grad_norm",), True),
          ("throughput", "tokens/s", ("tokens_per_s",), False),
          ("peak memory of rank 0", "MiB", ("peak_mem_mb",), False)]
# drawn when a run trained an MoE model (parallel/moe_balance.py): both near 1 when experts share the load
# (the auxiliary loss bottoms out at top_k)
MOE_PANEL = ("MoE balance", "aux loss; max/mean expert load", ("moe_aux_loss", "moe_load_imbalance"), False)
TIME_PANEL = "time per step (median; max over ranks)"
TIME_COLORS = {"compute": "0.75", "dp": "tab:blue", "tp": "tab:orange", "pp": "tab:green", "cp": "tab:red",
               "ep": "tab:purple"}  # one per timers.CATEGORIES
MAX_METRICS_BYTES = 1 << 30


@dataclass
class Launch:
    """One start of a run (the first, or a resume): the first step it recorded and its layout (None: its
    records do not say)."""

    step: int
    layout: str | None


@dataclass
class RunData:
    folder: Path
    layout: str  # "dp2 tp2", "pp2 -> dp2" (resumed in another layout), "1 process", or "layout unknown"
    records: list[dict[str, Any]]
    launches: list[Launch] = field(default_factory=list)  # in step order; the first starts the run
    differs: str = ""  # among several runs, the config fields where this run's differ ("optim.name=muon")

    @property
    def label(self) -> str:
        return f"{self.folder.name} ({self.layout}{'; ' + self.differs if self.differs else ''})"

    @property
    def resumes(self) -> list[Launch]:
        """The launches that went on from an earlier one's checkpoint, each with its layout."""
        return self.launches[1:]

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x, value) of every record that has a finite number for `key` (a skipped step's NaN loss has none)."""
        points = [(r[x], r[key]) for r in self.records
                  if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return [p[0] for p in points], [p[1] for p in points]


def describe_layout(parallel: dict[str, Any]) -> str:
    """The axes above 1 and the ZeRO stage: "dp2 pp2 (x2 virtual) zero1", "dp2 ep2"; "1 process" when none."""
    parts = [f"{a}{parallel[a]}" for a in ("dp", "tp", "pp", "cp", "ep") if parallel.get(a, 1) > 1]
    if parallel.get("pp", 1) > 1 and parallel.get("pp_virtual", 1) > 1:
        parts.append(f"(x{parallel['pp_virtual']} virtual)")
    if parallel.get("zero"):
        parts.append(f"zero{parallel['zero']}")
    return " ".join(parts) or "1 process"


def run_config(folder: Path) -> dict[str, Any] | None:
    """A run's config, from its latest checkpoint's trainer state, else its Slurm config; None if neither."""
    latest = find_latest(folder)
    state = read_json(latest / STATE_FILE) if latest is not None else None
    if isinstance(state, dict) and isinstance(state.get("config"), dict):
        return state["config"]
    slurm = folder / "slurm" / "config.yaml"
    if slurm.is_file():
        raw = yaml.safe_load(read_bounded(slurm, 16 << 20)) or {}
        return raw if isinstance(raw, dict) else None
    return None


def _layout(folder: Path) -> str:
    """The layout of a run, from its config (run_config's)."""
    cfg = run_config(folder)
    return describe_layout(cfg.get("parallel") or {}) if cfg is not None else "layout unknown"


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


SAME_RUN_FIELDS = ("out", "parallel.")  # where each run writes, and the layout its label already names
MAX_DIFFERENCES = 4  # fields named in a label: the picture's legend stays readable


def mark_differences(runs: list[RunData]) -> None:
    """With several runs, set each one's `differs`: the config fields (up to MAX_DIFFERENCES, sorted) whose
    values are not the same in every run whose config is known, so two curves of the same layout say what
    sets them apart ("optim.name=adamw" against "optim.name=muon")."""
    configs = [run_config(run.folder) for run in runs]
    flats = [_flat(c) for c in configs if c is not None]
    if len(runs) < 2 or len(flats) < 2:
        return
    keys = sorted({k for f in flats for k in f if not k.startswith(SAME_RUN_FIELDS)})
    differing = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1]
    optimizers = {f.get("optim.name") for f in flats}
    for run, cfg in zip(runs, configs):
        if cfg is not None:
            flat = _flat(cfg)
            # another optimizer's settings (an AdamW run's optim.muon_*) set nothing apart in this run
            own = [k for k in differing if not (k.startswith("optim.") and k[6:].split("_")[0] in optimizers
                                                 and k[6:].split("_")[0] != flat.get("optim.name") and "_" in k[6:])]
            run.differs = ", ".join(f"{k}={flat.get(k)}" for k in own[:MAX_DIFFERENCES])


def launches(records: list[dict[str, Any]]) -> list[Launch]:
    """Where each launch of the run begins: a record that names its layout (tetron writes it on a launch's
    first record), else, in older logs, one carrying the memory figures that only a launch's first step
    measures."""
    found = []
    for i, r in enumerate(records):
        layout = r.get("layout") if isinstance(r.get("layout"), str) else None
        if i == 0 or layout is not None or "mem_params_mb" in r:
            found.append(Launch(r["step"], layout))
    return found


def label_layout(found: list[Launch]) -> str | None:
    """Every layout the launches ran, in order, repeats merged: "dp2", "pp2 -> dp2"; None where the
    records name none."""
    named = [launch.layout for launch in found if launch.layout is not None]
    if not named:
        return None
    merged = [named[0], *(b for a, b in zip(named, named[1:]) if b != a)]
    return " -> ".join(merged)


def read_run(folder: str | Path) -> RunData:
    """A run folder's records (a line torn by a kill is skipped), its launches and layout."""
    folder = Path(folder).expanduser()
    log = folder / "metrics.jsonl"
    if not log.is_file():
        raise ConfigError(f"{folder}: no metrics.jsonl there (give a run folder, the out of tetron train)")
    records = []
    for line in read_bounded(log, MAX_METRICS_BYTES).decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    if not records:
        raise ConfigError(f"{log}: no step recorded yet")
    found = launches(records)
    return RunData(folder, label_layout(found) or _layout(folder), records, found)


# ------------------------------------------------------------------------------------ the picture


def median_times(run: RunData) -> dict[str, float]:
    """The median over steps of each time_<category>_s the run logged (the first step left out: it
    includes start-up work, when there are others)."""
    records = run.records[1:] if len(run.records) > 1 else run.records
    out = {}
    for c in CATEGORIES:
        values = [r[f"time_{c}_s"] for r in records if isinstance(r.get(f"time_{c}_s"), (int, float))]
        if values:
            out[c] = statistics.median(values)
    return out


def _time_panel(ax: Any, runs: list[RunData]) -> None:
    """One horizontal bar per run that had timers, its median seconds per category stacked."""
    timed = [run for run in runs if median_times(run)]
    ax.set_title(TIME_PANEL)
    seen = set()
    widest = max(sum(median_times(run).values()) for run in timed)
    for row, run in enumerate(timed):
        times = median_times(run)
        left, total = 0.0, sum(times.values())
        for category, seconds in times.items():
            label = None if category in seen else category
            seen.add(category)
            ax.barh(row, seconds, left=left, color=TIME_COLORS[category], label=label, height=0.6)
            if seconds > 0.08 * widest:  # wide enough on the axis to carry its share
                ax.text(left + seconds / 2, row, f"{seconds / total:.0%}", ha="center", va="center", fontsize=8)
            left += seconds
    ax.set_yticks(range(len(timed)), [run.label for run in timed], fontsize=8)
    ax.set_ylim(max(len(timed), 3) - 0.5, -0.5)  # first run on top; one bar stays a bar, not a wall
    ax.set_xlabel("seconds per step")
    ax.legend(fontsize=8, loc="lower right", ncols=len(seen))


def _mark_resumes(ax: Any, run: RunData, color: str, *, x: str) -> None:
    """A dotted vertical line where each resume of `run` begins, in its colour, titled with the layout it
    resumed in when that changed (the lines' labels start with "_": no legend entry)."""
    by_step = {r["step"]: r for r in run.records}
    previous = run.launches[0].layout if run.launches else None
    for launch in run.resumes:
        where = by_step[launch.step][x]
        changed = launch.layout is not None and launch.layout != previous
        ax.axvline(where, color=color, linestyle=":", linewidth=1,
                   label=f"_resume {run.folder.name} {launch.step}" + (f" {launch.layout}" if changed else ""))
        text = f"resumed ({launch.layout})" if changed else "resumed"
        ax.annotate(text, (where, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                    fontsize=7, color=color)
        previous = launch.layout or previous


def _grid(fig: Any, n: int) -> list[Any]:
    """`n` axes in two rows, the top row one wider when `n` is odd (every panel drawn, none left empty)."""
    top = (n + 1) // 2
    bottom = n - top
    cols = math.lcm(top, bottom) if bottom else top
    grid = fig.add_gridspec(2, cols)
    return ([fig.add_subplot(grid[0, i * cols // top:(i + 1) * cols // top]) for i in range(top)]
            + [fig.add_subplot(grid[1, i * cols // bottom:(i + 1) * cols // bottom]) for i in range(bottom)])


def figure(runs: list[RunData], *, x: str = "step") -> Any:
    """The report's matplotlib Figure (not shown, not saved): its axes hold exactly the runs' numbers, and
    a panel is drawn only where some run has its figures (the time panel: timers; MoE balance: an MoE model)."""
    from matplotlib.figure import Figure

    moe = any(run.series("moe_load_imbalance")[0] for run in runs)
    timed = any(median_times(run) for run in runs)
    panels = [*PANELS, MOE_PANEL] if moe else PANELS
    n = len(panels) + timed
    fig = Figure(figsize=(5 * ((n + 1) // 2), 8.5), layout="constrained")
    axes = _grid(fig, n)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, ylabel, keys, log) in zip(axes, panels):
        for run, color in zip(runs, colors):
            for key in keys:
                xs, ys = run.series(key, x)
                if not xs:
                    continue
                val = key.startswith("val_")
                suffix = " val" if val else f" {key[4:]}" if key.startswith("moe_") else " mtp" if key == "mtp_loss" \
                    else ""
                dashed = val or key in ("moe_load_imbalance", "mtp_loss")
                ax.plot(xs, ys, color=color, linestyle="--" if dashed else "-",
                        marker="o" if val else None, markersize=3, linewidth=1.2, label=f"{run.label}{suffix}")
            _mark_resumes(ax, run, color, x=x)
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    if moe:
        axes[len(panels) - 1].legend(fontsize=8)
    if timed:
        _time_panel(axes[len(panels)], runs)
    names = ", ".join(str(run.folder) for run in runs)
    fig.suptitle(f"tetron report: {names}", fontsize=11)
    return fig


# ------------------------------------------------------------------------------------ the table


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary(run: RunData) -> dict[str, Any]:
    """Final and best losses, median tokens/s and MFU (the first step left out), peak memory."""
    losses, vals = run.series("loss")[1], run.series("val_loss")[1]
    later = run.records[1:] if len(run.records) > 1 else run.records
    tps = [r["tokens_per_s"] for r in later if isinstance(r.get("tokens_per_s"), (int, float))]
    mfus = [r["mfu"] for r in later if isinstance(r.get("mfu"), (int, float))]
    mems = run.series("peak_mem_mb")[1]
    return {"run": run.label, "steps": run.records[-1]["step"],
            "loss": losses[-1] if losses else None, "best loss": min(losses) if losses else None,
            "val loss": vals[-1] if vals else None, "best val": min(vals) if vals else None,
            "tokens/s": statistics.median(tps) if tps else None,
            "MFU": statistics.median(mfus) if mfus else None, "peak MiB": max(mems) if mems else None}


def table(runs: list[RunData]) -> str:
    """The summary per run, then the time breakdown of the runs with timers, as aligned text."""
    specs = {"steps": "d", "loss": ".4f", "best loss": ".4f", "val loss": ".4f", "best val": ".4f",
             "tokens/s": ",.0f", "MFU": ".1%", "peak MiB": ",.0f"}
    rows = [[s["run"]] + [_fmt(s[k], spec) for k, spec in specs.items()] for s in map(summary, runs)]
    text = _align(["run", *specs], rows)
    timed = [(run, median_times(run)) for run in runs if median_times(run)]
    if timed:
        heads = [c for c in CATEGORIES if any(c in t for _, t in timed)]
        rows = []
        for run, times in timed:
            total = sum(times.values())
            rows.append([run.label] + [f"{times[c]:.4f} ({times[c] / total:.0%})" if c in times else "-"
                                       for c in heads])
        text += "\n\nmedian seconds per step (max over ranks):\n" + _align(["run", *heads], rows)
    return text


def _align(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head, *rows]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the command


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def report(args: list[str]) -> str:
    """Run `tetron report` with `args`: write the picture, return the text to print."""
    parser = _Parser(prog="tetron report", description="Plot and summarise runs (their metrics.jsonl).")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders (the out of tetron train)")
    parser.add_argument("--out", help="the PNG to write (default: the first RUN's report.png)")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="the x axis (default: step)")
    ns = parser.parse_args(args)
    runs = [read_run(folder) for folder in ns.runs]
    mark_differences(runs)
    out = Path(ns.out).expanduser() if ns.out else runs[0].folder / "report.png"
    fig = figure(runs, x=ns.x)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # a picture tetron wrote is drawn again; anything else there (a user's file, a folder, a device) is kept
        replace = check_new_file(str(out), "--out", replaces=PNG_MAGIC)
        picture = io.BytesIO()
        fig.savefig(picture, dpi=100, format="png")
        write_bytes(out, picture.getvalue(), replace=replace)
    except UserError:
        raise
    except FileExistsError:  # made meanwhile, by another process: still never replaced
        raise UserError(f"--out {out}: already exists; give a new file name (nothing is overwritten)") from None
    except (OSError, ValueError) as err:
        raise UserError(f"--out {out}: cannot write the picture ({getattr(err, 'strerror', None) or err})") from None
    return f"{table(runs)}\n\ntetron: wrote {out}"
