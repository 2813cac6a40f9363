"""Command-line overrides of a config: `--section.key=value`, `--section.key value`, and the short
flags of `tetron train` (`--dp 2`, `--sp`), applied in order to the raw config dict before it is typed."""

from __future__ import annotations

from typing import Any

from tetron.errors import ConfigError

# Short flags of `tetron train`, each an alias of one dotted key.
SHORT_FLAGS = {
    "model": "model",
    "data": "data.path",
    "tokenizer": "data.tokenizer",
    "out": "out",
    "dp": "parallel.dp",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "cp": "parallel.cp",
    "steps": "train.steps",
    "seed": "train.seed",
    "seq-len": "data.seq_len",
    "micro-batch": "train.micro_batch",
    "grad-acc": "train.grad_acc",
    "lr": "train.lr",
    "dp-impl": "parallel.dp_impl",
    "sp": "parallel.sp",
    "pp-schedule": "parallel.pp_schedule",
    "pp-virtual": "parallel.pp_virtual",
    "cp-layout": "parallel.cp_layout",
    "cp-impl": "parallel.cp_impl",
    "save-every": "checkpoint.save_every",
    "resume": "checkpoint.resume",
    "overwrite": "checkpoint.overwrite",
    "init-from": "checkpoint.init_from",
    "max-restarts": "parallel.max_restarts",
    "zero": "parallel.zero",
    "recompute": "train.recompute",
    "force": "parallel.ignore_memory_limit",
    "profile": "logging.profile",
}
# Flags that may stand alone, meaning true: `--sp`, `--force`, `--overwrite`.
BOOL_FLAGS = {"sp", "force", "overwrite"}


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `a.b.c` in a nested dict; a string model section becomes {"name": ...} when a field is set under it."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str) and part == "model":
            child = {"name": child}
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--{key}: {part} is not a section")
        node[part] = child
        node = child
    node[parts[-1]] = value


def apply_overrides(raw: dict[str, Any], args: list[str]) -> dict[str, Any]:
    """Apply `--a.b=v`, `--a.b v` and the short flags, in order, to the raw config dict."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --train.lr=3e-4")
        key, eq, value = arg[2:].partition("=")
        if not eq and key in BOOL_FLAGS and (i + 1 >= len(args) or args[i + 1].startswith("--")):
            eq, value = "=", "true"
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        if key in SHORT_FLAGS:
            key = SHORT_FLAGS[key]
        elif "." not in key and key != "out":
            flags = ", ".join("--" + f for f in SHORT_FLAGS)
            raise ConfigError(f"unknown flag --{key}: use a dotted key (--train.lr=...) or one of {flags}")
        set_dotted(raw, key, value)  # kept as text: _coerce converts it by the field's type
    return raw
