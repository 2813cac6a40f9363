"""Command-line overrides of a config: `--section.key=value`, `--section.key value`, and the short
flags of `tetron train` (`--dp 2`, `--sp`), applied in order to the raw config dict before it is typed; the
bound on what a raw value may expand to; the argument parsing the commands share."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from tetron.errors import ConfigError

MAX_VALUES = 100_000  # values a config may hold once YAML aliases are expanded (each alias counts each time)

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
    "ep": "parallel.ep",
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
    "async-save": "checkpoint.async_save",
    "init-from": "checkpoint.init_from",
    "max-restarts": "parallel.max_restarts",
    "zero": "parallel.zero",
    "recompute": "train.recompute",
    "force": "parallel.ignore_memory_limit",
    "profile": "logging.profile",
}
# Flags that may stand alone, meaning true: `--sp`, `--force`, `--overwrite`, `--async-save`.
BOOL_FLAGS = {"sp", "force", "overwrite", "async-save"}


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


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad argument is one ConfigError line, as everywhere in tetron (not usage + error)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def split_known(parser: argparse.ArgumentParser, args: list[str]) -> tuple[list[str], list[str]]:
    """(the parser's own options with their values, the rest): argparse's parse_known_args would take the
    value of an unknown --flag VALUE for a positional argument; the rest are config overrides."""
    takes = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings}
    mine, rest, i = [], [], 0
    while i < len(args):
        arg, name = args[i], args[i].split("=", 1)[0]
        if name in takes:
            mine.append(arg)
            if takes[name] and "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("--"):
                mine.append(args[i + 1])
                i += 1
        elif i == 0 and not arg.startswith("-"):
            mine.append(arg)  # the config
        else:
            rest.append(arg)
        i += 1
    return mine, rest


def check_expansion(raw: Any, where: str) -> None:
    """Refuse a value that expands to more than MAX_VALUES values, or contains itself: YAML aliases let a
    few lines stand for a billion items (each alias shares its anchor's object), which anything that walks
    or copies the config would expand. Counted per distinct object, so the count costs the lines it reads."""
    sizes: dict[int, int] = {}  # id -> expanded size, of the containers counted so far
    open_: set[int] = set()  # the containers being counted (one met again inside itself is a cycle)

    def size(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) in open_:
            raise ConfigError(f"{where}: a YAML alias that contains itself; write the value out")
        if id(node) not in sizes:
            open_.add(id(node))
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            total = 1
            for child in children:
                total += size(child)
                if total > MAX_VALUES:
                    raise ConfigError(f"{where}: expands to more than {MAX_VALUES:,} values (YAML aliases "
                                      f"repeat what they name); write a smaller config")
            open_.discard(id(node))
            sizes[id(node)] = total
        return sizes[id(node)]

    size(raw)
