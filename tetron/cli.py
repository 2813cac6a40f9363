"""The `tetron` command: train and generate.

`tetron train CONFIG [--section.key=value ...]` validates the config and prepares the data in
this process, then starts dp*tp*pp*cp ranks through torch's elastic launcher, unless it already
runs inside a launched job (RANK is set, as under torchrun), where it is one of the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tetron.checkpoint import STATE_FILE, find_latest
from tetron.checkpoint_load import read_json
from tetron.config import Config, from_dict, load_config
from tetron.data import check_tokenizer_pairing, prepare_data, tokenizer_spec
from tetron.errors import ConfigError, UserError
from tetron.launch import launch
from tetron.metrics import say
from tetron.schedule import schedule_change
from tetron.validate import validate

USAGE = """usage: tetron train [CONFIG] [--section.key=value ...] [--model M] [--data D] [--tokenizer T]
                    [--out DIR] [--dp N] [--tp N] [--pp N] [--cp N] [--steps N] [--seed N]
                    [--seq-len N] [--micro-batch N] [--grad-acc N] [--lr X] [--dp-impl naive|bucket]
                    [--save-every N] [--resume PATH|auto] [--init-from PATH_OR_HUB_NAME] [--max-restarts N]
       tetron convert SRC DST   (a checkpoint to a Hugging Face folder, or a HF folder to a checkpoint)
       tetron generate RUN [--prompt TEXT] [--max-new-tokens N] [--temperature X] [--top-k N] [--seed N]"""


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        if rest and rest[0] in ("-h", "--help"):
            print(USAGE)
            return 0
        return train_command(rest)
    if command == "generate":
        return generate_command(rest)
    if command == "convert":
        return convert_command(rest)
    return _fail(f"unknown command {command!r}; use train, convert or generate")


if __name__ == "__main__":
    sys.exit(main())
