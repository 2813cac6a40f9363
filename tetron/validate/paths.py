"""The checks of what a run configuration names outside itself, each looked at without changing it: the checkpoint
it resumes or starts from (read: JSON, headers, hashes), a hub name it would download, each data source (resolved,
not read), and the run folder it writes. validate() calls them; `FileChecks` lets a caller that validates many
configs of the same paths (tetron plan's search) look at each once."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Callable

from tetron.checkpoint.check import inspect_checkpoint, read_model_config
from tetron.checkpoint.load import optimizer_problem
from tetron.config import CONFIGS_DIR, Config
from tetron.data.hub import hub_problem
from tetron.data.sources import source_of
from tetron.errors import CheckpointError, ConfigError, DataError, quoted
from tetron.errors import check as _check
from tetron.fs import find_latest, is_run_folder
from tetron.stop import parse_signal


class FileChecks:
    """Each filesystem check (the run folder, a data source) looked at once and its outcome reused, for a caller that
    validates many configs of the same paths: `tetron plan` validates tens of thousands of layouts of one config,
    whose paths do not change during the search, and looking again for each was a tenth of its time."""

    def __init__(self) -> None:
        # by what was checked (("out", path) or ("source", path)): None (passed) or the error's class and line
        self.outcomes: dict[tuple[str, str], tuple[type, str] | None] = {}

    def look(self, key: tuple[str, str], look: Callable[[], None]) -> None:
        """Run `look` (raising ConfigError or DataError) the first time; later, its outcome again: the same error
        line, or nothing."""
        if key not in self.outcomes:
            try:
                look()
                self.outcomes[key] = None
            except (ConfigError, DataError) as err:
                self.outcomes[key] = (type(err), str(err))
        if self.outcomes[key] is not None:
            kind, line = self.outcomes[key]
            raise kind(line)


def looked(key: tuple[str, str], look: Callable[[], None], seen: FileChecks | None) -> None:
    """`look`, or through `seen` where the caller keeps the outcomes."""
    if seen is None:
        look()
    else:
        seen.look(key, look)


def validate_checkpoint(cfg: Config) -> None:
    """The checkpoint section, and any checkpoint it names: read (JSON, headers, hashes), never written."""
    c = cfg.checkpoint
    _check(c.save_every >= 0, f"checkpoint.save_every={c.save_every} must be >= 0 (0: only at the end)")
    _check(c.keep >= 1, f"checkpoint.keep={c.keep} must be at least 1")
    _check(c.shard_mb >= 1, f"checkpoint.shard_mb={c.shard_mb} must be at least 1")
    if c.stop_signal is not None:
        try:
            parse_signal(c.stop_signal)
        except ValueError as err:
            raise ConfigError(f"checkpoint.stop_signal={quoted(c.stop_signal)}: {err}") from None
    try:
        if c.resume is not None:
            _validate_resume(cfg)
        if c.init_from is not None:
            path = Path(c.init_from).expanduser()
            if path.exists():
                _check(path.is_dir(), f"checkpoint.init_from={c.init_from}: not a folder")
                read_model_config(path)
                inspect_checkpoint(path, cfg.model, require_state=False, settings=not c.new_model_settings)
            else:  # a hub name: cached, or downloadable (rank 0 downloads it); refused at once when offline
                _check_hub_name(c.init_from)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None


def _check_hub_name(init_from: str) -> None:
    """checkpoint.init_from that is no local folder: a hub name, cached or downloadable (not offline)."""
    _check(re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", init_from) is not None,
           f"checkpoint.init_from={init_from}: no such folder, and not a hub name (org/name)")
    problem = hub_problem(init_from, "model")
    _check(problem is None, f"checkpoint.init_from={init_from}: {problem}")


def validate_no_model(cfg: Config) -> None:
    """No model section: the model comes from the folder a run starts from, so where that folder is not
    there, that is what to say (not that no model was given)."""
    c = cfg.checkpoint
    names = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
    if c.init_from is not None and c.resume in (None, "auto") and not Path(c.init_from).expanduser().exists():
        _check_hub_name(c.init_from)
        _check(False, f"model: none given, and checkpoint.init_from={c.init_from} is a hub name, whose config.json "
                      f"is read only from a local folder: pass --model with that folder (or its config.json)")
    if c.resume not in (None, "auto"):
        _check(Path(c.resume).expanduser().is_dir(),
               f"checkpoint.resume={c.resume}: no such folder (give a checkpoint folder or auto)")
    _check(False, f"model: none given; pass --model with one of {names}, a Hugging Face config.json or model "
                  f"folder, or a config file with a model section")


def _validate_resume(cfg: Config) -> None:
    """The checkpoint a run resumes from: whole, the same model (shapes, and the settings that give the
    weights their meaning), the same data order, and not past the steps this run is asked for."""
    c = cfg.checkpoint
    folder = find_latest(Path(cfg.out)) if c.resume == "auto" else Path(c.resume).expanduser()
    _check(c.resume == "auto" or folder.is_dir(),
           f"checkpoint.resume={c.resume}: no such folder (give a checkpoint folder or auto)")
    if folder is None:
        return  # auto, and nothing saved yet: the run starts from the beginning
    state = inspect_checkpoint(folder, cfg.model, settings=not c.new_model_settings)
    step = state["step"] if state else 0
    _check(step <= cfg.train.steps,
           f"train.steps={cfg.train.steps} is below step {step} of {folder}, where this run would resume: "
           f"use train.steps >= {step} (or resume from an earlier checkpoint)")
    problem = optimizer_problem(state, cfg, folder) if state else None
    _check(problem is None, problem)
    loader = state.get("loader") if state else None
    if loader is not None:
        for name, mine in (("seq_len", cfg.data.seq_len), ("global_batch", cfg.global_batch),
                           ("seed", cfg.train.seed)):
            _check(loader[name] == mine, f"{folder}/trainer_state.json: {name}={loader[name]} there, "
                                         f"{mine} in this run; use the same to continue the data order")


def validate_sources(cfg: Config, seen: FileChecks | None) -> None:
    """data.path, or each entry of data.sources: {path, weight, epochs}, each path resolvable (not read)."""
    d = cfg.data
    entries = d.sources if d.sources is not None else [{"path": d.path}]
    _check(len(entries) > 0, "data.sources is empty: give [{path: ..., weight: ...}, ...] or null (data.path)")
    _check(not d.sources or (d.val_fraction <= 0 and d.max_bytes is None),
           "data.sources: data.val_fraction and data.max_bytes apply to data.path only; give data.val_path "
           "for validation data")
    for i, e in enumerate(entries):
        where = f"data.sources[{i}]" if d.sources is not None else "data.path"
        _check(isinstance(e, dict) and isinstance(e.get("path"), str) and not set(e) - {"path", "weight", "epochs"},
               f"{where}={e!r}: give {{path: STORE_OR_SPEC, weight: W, epochs: E (optional)}}")
        weight, epochs = e.get("weight", 1.0), e.get("epochs")
        _check(d.sources is None or (type(weight) in (int, float) and math.isfinite(weight) and weight > 0),
               f"{where}.weight={weight!r} must be a positive number")
        _check(epochs is None or (type(epochs) in (int, float) and math.isfinite(epochs) and epochs > 0),
               f"{where}.epochs={epochs!r} must be a positive number (or absent: no limit)")
        path = e["path"]
        try:
            looked(("source", path), lambda path=path: source_of(path).check(), seen)
        except DataError as err:
            raise ConfigError(f"{where}={path}: {err}") from None


def validate_out(cfg: Config) -> None:
    """The run folder: new, empty, or an earlier tetron run's (never any folder whose model/ a run would
    replace), and every part of it the run writes writable, checked before the run rather than at its end."""
    _check(cfg.out.strip() != "", "out='': give a run folder (a new or empty folder, or an earlier run's)")
    out = Path(cfg.out).expanduser()
    if not (out.exists() or out.is_symlink()):
        resolved = out.resolve()
        existing = next((q for q in [resolved, *resolved.parents] if q.exists()), None)
        _check(existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK),
               f"out={cfg.out}: cannot create or write this folder (choose a writable path)")
        return
    _check(out.is_dir(), f"out={cfg.out}: exists and is not a folder; give a new or empty folder, or an earlier run's")
    _check(is_run_folder(out), f"out={cfg.out}: a folder that is neither empty nor a tetron run (it has no "
                               f"metrics.jsonl, checkpoints/ or model/ that tetron wrote); give a new or empty folder")
    for path in (out, out / "checkpoints", out / "model", out / "metrics.jsonl"):
        if path.exists():
            mode = os.W_OK | os.X_OK if path.is_dir() else os.W_OK
            _check(os.access(path, mode), f"out={cfg.out}: {path} is not writable, and the run writes there "
                                          f"(checkpoints, the model, the log); make it writable or choose another out")


def validate_val_path(cfg: Config) -> None:
    """data.val_path, where given: resolvable (not read)."""
    if cfg.data.val_path is not None:
        try:
            source_of(cfg.data.val_path).check()
        except DataError as err:
            raise ConfigError(f"data.val_path={cfg.data.val_path}: {err}") from None
