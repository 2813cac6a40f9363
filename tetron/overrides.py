"""A config's raw values, before and as they are typed: command-line overrides (`--section.key=value`,
`--section.key value`, and the short flags of `tetron train`: `--dp 2`, `--sp`), applied in order to the raw
dict; the bound on what a raw value may expand to; the argument parsing the commands share; then each value
checked and converted by its dataclass field's type (`coerce`, `build_section`), and the fields' documentation
read from their comments (`field_docs`, for `tetron train --help-config` and docs/config.md)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import re
import types
import typing
from typing import Any, Literal, NoReturn

import yaml

from tetron.errors import ConfigError, quoted, quoted_key

INT_LIMIT = 2**63  # every integer field fits int64, as the tensors and files that hold them do
MAX_TEXT = 4096  # characters of a text field (PATH_MAX): a longer one is refused before any message quotes it
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


def _nearest(name: str, known: list[str]) -> str | None:
    """The known name a mistyped one meant: the same but for - and _ (`seq_len`: seq-len), else the closest."""
    spelled = {k.replace("-", "_"): k for k in known}
    return spelled.get(name.replace("-", "_")) or next(iter(difflib.get_close_matches(name, known, n=1)), None)


def did_you_mean(name: str, known: list[str]) -> str:
    """" (did you mean X?)" for the known name nearest a mistyped one (`stpes`: steps), or ""."""
    near = _nearest(name, known)
    return f" (did you mean {near}?)" if near else ""


def _near_flag(key: str, sections: dict[str, type] | None) -> str:
    """" (did you mean X?)" for the flag a mistyped `--key` meant: a short flag, or a config field by its name
    (`--warmup_steps`: --train.warmup_steps), an exact spelling of either first."""
    fields = {f.name: f"--{section}.{f.name}" for section, cls in (sections or {}).items() if section != "model"
              for f in dataclasses.fields(cls)}
    flags = {f: f"--{f}" for f in SHORT_FLAGS}
    normal = key.replace("-", "_")
    exact = next((spelled for name, spelled in [*flags.items(), *fields.items()]
                  if name.replace("-", "_") == normal), None)
    near = exact or flags.get(_nearest(key, list(flags)) or "") or fields.get(_nearest(key, list(fields)) or "")
    return f" (did you mean {near}?)" if near else ""


def apply_overrides(raw: dict[str, Any], args: list[str], *, sections: dict[str, type] | None = None) -> dict[str, Any]:
    """Apply `--a.b=v`, `--a.b v` and the short flags, in order, to the raw config dict (`sections`: the config's
    dataclasses, whose fields an unknown flag's suggestion is drawn from besides the short flags)."""
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
            raise ConfigError(f"unknown flag --{key}{_near_flag(key, sections)}: use a dotted key (--train.lr=...) "
                              f"or one of {flags}")
        set_dotted(raw, key, value)  # kept as text: coerce converts it by the field's type
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


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: YAML keeps the last silently, so a file
    that says `steps: 5000` and further down `steps: 2` would train 2 steps."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden, by design
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise ConfigError(f"key {quoted_key(key)} is given twice in one mapping (lines {seen[key]} "
                                      f"and {line}); keep one")
                seen[key] = line
            except TypeError:  # an unhashable key: the safe loader's own error says so
                break
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str) -> Any:
    """A YAML document, safely (no Python objects), refusing duplicate keys."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


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


def one_of(choices: tuple[str, ...]) -> str:
    """"a, b or c"."""
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check and convert one value against a dataclass field annotation.

    Text (every command-line value, and YAML scalars such as `3e-4` that YAML keeps as strings)
    is converted by the field's type, so `--out 007` stays "007" and `--train.lr=3e-4` is a float."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}={quoted(value)}: use {one_of(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if type(None) in options and (value is None or (isinstance(value, str) and value.lower() in ("null", "none"))):
            return None
        last: ConfigError | None = None
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ConfigError as err:
                last = err
        raise last or ConfigError(f"{where}={quoted(value)} is not valid")
    text = isinstance(value, str)
    if origin in (dict, list) or annotation in (dict, list):
        kind = dict if dict in (origin, annotation) else list
        if text:
            try:
                value = read_yaml(value)
            except ConfigError as err:  # a key given twice
                raise ConfigError(f"{where}: {err}") from None
            except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an int of over 4,300 digits
                pass
            check_expansion(value, where)
        if not isinstance(value, kind):
            raise ConfigError(f"{where}={quoted(value)}: expected a {'mapping' if kind is dict else 'list'}")
        item = typing.get_args(annotation)
        if kind is list and item:  # list[int]: each element checked and converted like a field
            return [coerce(v, item[0], f"{where}[{i}]") for i, v in enumerate(value)]
        return value
    if annotation is bool:
        if text and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={quoted(value)}: expected true or false")
        return value
    if annotation in (int, float):
        return _number(value, annotation, where)
    if annotation is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}={quoted(value)}: expected a string")
        if len(str(value)) > MAX_TEXT:
            raise ConfigError(f"{where}={quoted(value)}: {len(str(value)):,} characters; at most {MAX_TEXT:,}")
        return str(value)
    return value


def _number(value: Any, kind: type, where: str) -> int | float:
    """An int or float field's value: text converted, integers in int64's range (a 400-digit step count
    would overflow every tensor and float it meets), whole floats accepted as integers. Non-finite floats
    pass here and are refused by validate, which names them as such."""
    if isinstance(value, str):
        try:
            value = float(value) if kind is float else int(value)
        except ValueError:  # not a number, or an integer of more than 4,300 digits
            pass
    if isinstance(value, float) and kind is int and value.is_integer():
        value = int(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (kind is int and isinstance(value, float)):
        raise ConfigError(f"{where}={quoted(value)}: expected {'an integer' if kind is int else 'a number'}")
    if isinstance(value, int) and not -INT_LIMIT < value < INT_LIMIT:
        raise ConfigError(f"{where}={quoted(value)}: out of range; use a number between -2**63 and 2**63")
    return kind(value)


def build_section(cls: type, raw: Any, where: str) -> Any:
    """A config dataclass from its raw section: unknown keys and wrongly typed values raise ConfigError."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a section of key: value pairs, got {quoted(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields), key=str)  # (YAML keys may be numbers too)
    if unknown:
        near = did_you_mean(str(unknown[0]), list(fields))
        raise ConfigError(f"{where}.{quoted_key(unknown[0])}: unknown key{near}; known keys are {', '.join(fields)}")
    types_ = typing.get_type_hints(cls)  # the annotations are strings (future import): resolve them
    kwargs = {name: coerce(value, types_[name], f"{where}.{name}") for name, value in raw.items()}
    try:
        return cls(**kwargs)
    except ValueError as err:  # LlamaConfig checks its heads and rope_scaling as it is built
        raise ConfigError(f"{where}.{err}") from None  # its messages start with the field name


def field_docs(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, doc line) of each field of a config dataclass, the doc being the comment
    that follows the field in its source (continued on comment-only lines below it)."""
    docs: dict[str, str] = {}
    last = None
    # base classes first, so that a subclass's comment on a field it redefines wins
    sources = [c for c in reversed(cls.__mro__) if dataclasses.is_dataclass(c)]
    for line in (line for c in sources for line in inspect.getsource(c).splitlines()):
        field_line = re.match(r"\s+(\w+): [^=]+=[^#]*(?:#\s*(.*))?$", line)
        if field_line and field_line.group(1) in {f.name for f in dataclasses.fields(cls)}:
            last = field_line.group(1)
            docs[last] = field_line.group(2) or ""
        elif last and re.match(r"\s+#", line):
            docs[last] += " " + line.strip().lstrip("#").strip()
        else:
            last = None
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        kind = ("|".join(typing.get_args(hint)) if typing.get_origin(hint) is Literal
                else re.sub(r"typing\.|<class '(\w+)'>", r"\1", str(hint)))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append((f.name, kind, repr(default), docs.get(f.name, "")))
    return out
