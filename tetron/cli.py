"""The `tetron` command: train and generate.

`tetron train CONFIG [--section.key=value ...]` validates the config and prepares the data in
this process, then starts dp*tp*pp*cp ranks through torch's elastic launcher, unless it already
runs inside a launched job (RANK is set, as under torchrun), where it is one of the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version
from pathlib import Path

import yaml

from tetron.checkpoint import STATE_FILE, find_latest
from tetron.checkpoint_load import read_json
from tetron.config import SECTIONS, SHORT_FLAGS, Config, field_docs, from_dict, load_config
from tetron.data import check_tokenizer_pairing, prepare_data, tokenizer_spec
from tetron.errors import ConfigError, UserError
from tetron.launch import launch
from tetron.metrics import say
from tetron.schedule import schedule_change
from tetron.validate import validate

USAGE = """usage: tetron train [CONFIG] [--section.key=value ...] [short flags] [--print-config]
                    (tetron train --help lists every field and short flag)
       tetron convert SRC DST   (a checkpoint to a Hugging Face folder, or a HF folder to a checkpoint)
       tetron generate RUN [--prompt TEXT] [--max-new-tokens N] [--temperature X] [--top-k N] [--seed N]
       tetron --version"""


def _fail(message: str) -> int:
    print(f"tetron: error: {message}", file=sys.stderr)
    return 2


def _check_data(cfg: Config) -> None:
    """Tokenize (or find the cache) before any rank starts, and check the vocabulary fits the model."""
    tokenizer, _ = prepare_data(cfg, say=say)
    check_tokenizer_pairing(cfg, tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer={tokenizer_spec(cfg)} has {tokenizer.vocab_size} tokens, more than "
                          f"model.vocab_size={cfg.model.vocab_size}; raise model.vocab_size or use a smaller tokenizer")


def train_command(args: list[str]) -> int:
    config_path = None
    if args and not args[0].startswith("--"):
        config_path, args = args[0], args[1:]
    inside_launch = "RANK" in os.environ
    try:
        cfg = load_config(config_path, args)
        validate(cfg, world_size=int(os.environ["WORLD_SIZE"]) if inside_launch else None)
        if not inside_launch or os.environ.get("RANK") == "0":
            _check_data(cfg)
        note = _schedule_note(cfg)
    except UserError as err:
        return _fail(str(err))
    if note and os.environ.get("RANK", "0") == "0":
        print(f"tetron: note: {note}", flush=True)
    return launch(cfg)


def _schedule_note(cfg: Config) -> str | None:
    """When resuming: whether this run's schedule changes the learning rate of steps already taken."""
    ck = cfg.checkpoint
    if ck.resume is None:
        return None
    folder = find_latest(Path(cfg.out)) if ck.resume == "auto" else Path(ck.resume).expanduser()
    state = read_json(folder / STATE_FILE) if folder is not None else None
    if not state or not state.get("config"):
        return None  # nothing saved yet, or a converted model folder: no schedule to continue
    return schedule_change(from_dict(state["config"]).train, cfg.train, state["step"])


def convert_command(args: list[str]) -> int:
    if len(args) != 2 or any(a.startswith("-") for a in args):
        return _fail("usage: tetron convert SRC DST (a checkpoint folder to a HF folder, or back)")
    from tetron.convert import convert

    try:
        print(f"tetron: {convert(args[0], args[1])}")
    except UserError as err:
        return _fail(str(err))
    return 0


def generate_command(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tetron generate", description="Sample text from a trained run.")
    parser.add_argument("run", help="a run folder (OUT) or a model folder")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    ns = parser.parse_args(args)
    from tetron.generate import sample_from_run

    try:
        text = sample_from_run(ns.run, prompt=ns.prompt, max_new_tokens=ns.max_new_tokens,
                               temperature=ns.temperature, top_k=ns.top_k, device=ns.device, seed=ns.seed)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    print(text)
    return 0


def train_help() -> str:
    """`tetron train --help`: the usage, then every config field with its type, default and doc line,
    generated from the config dataclasses (so it cannot miss one), then the short flags."""
    short = {key: flag for flag, key in SHORT_FLAGS.items()}
    lines = ["usage: tetron train [CONFIG] [--section.key=value ...] [short flags] [--print-config]",
             "", "Train on dp*tp*pp*cp ranks. Every field below can be set in the YAML file's section or",
             "overridden as --section.key=VALUE (or --section.key VALUE); defaults in brackets.", ""]
    for section, cls in SECTIONS.items():
        title = {"model": "model (--model): a name from configs/, a HF config.json or model folder, or these fields"}
        lines.append(title.get(section, f"{section}:"))
        for name, kind, default, doc in field_docs(cls):
            key = f"{section}.{name}"
            flag = f" (--{short[key]})" if key in short else ""
            lines.append(f"  --{key} {kind} [{default}]{flag}")
            lines.append(f"      {doc}")
    lines += ["out:", f"  --out str [{Config().out!r}] (--out)",
              "      the run folder: metrics.jsonl, checkpoints/, model/", "",
              "--print-config prints the resolved config as YAML and exits.", "",
              "Also: tetron convert SRC DST; tetron generate RUN [options] (tetron generate --help)."]
    return "\n".join(lines)


def print_config(config_path: str | None, args: list[str]) -> int:
    """The config that these arguments resolve to, as YAML: what a run would train."""
    try:
        cfg = load_config(config_path, args)
    except UserError as err:
        return _fail(str(err))
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"tetron {version('tetron')}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        if "-h" in rest or "--help" in rest:
            print(train_help())
            return 0
        if "--print-config" in rest:
            rest = [a for a in rest if a != "--print-config"]
            config_path = rest.pop(0) if rest and not rest[0].startswith("--") else None
            return print_config(config_path, rest)
        return train_command(rest)
    if command == "generate":
        return generate_command(rest)
    if command == "convert":
        return convert_command(rest)
    return _fail(f"unknown command {command!r}; use train, convert or generate")


if __name__ == "__main__":
    sys.exit(main())
