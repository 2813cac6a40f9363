"""The `tetron` command: train and generate.

`tetron train CONFIG [--section.key=value ...]` validates the config and prepares the data in
this process, then starts dp*tp*pp*cp ranks through torch's elastic launcher, unless it already
runs inside a launched job (RANK is set, as under torchrun), where it is one of the ranks.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
from importlib.metadata import version
from pathlib import Path

# Loading torch takes seconds: a Ctrl-C meanwhile ends the command in one line, as one later does (main).
try:
    import yaml

    from tetron.config import SECTIONS, Config, cuda_dtype, from_dict, load_config, load_raw
    from tetron.data.loader import (
        check_tokenizer_pairing,
        data_specs,
        fit_vocab,
        load_tokens,
        prepare_data,
        start_folder,
        tokenizer_spec,
        yield_tokenizer,
    )
    from tetron.data.mixture import check_mixture
    from tetron.device import cuda_count
    from tetron.errors import ConfigError, DataError, UserError, check, failed, quoted
    from tetron.folder_lock import FolderLock
    from tetron.fs import (
        RUN_LOCK,
        STATE_FILE,
        aside_name,
        blocking_output,
        earlier_run,
        find_latest,
        has_control,
        read_json,
        set_aside,
    )
    from tetron.launch import launch
    from tetron.observe.evaluate import check_held_out, training_tokens
    from tetron.observe.metrics import say
    from tetron.observe.step_report import check_outputs
    from tetron.overrides import SHORT_FLAGS, OneLineParser, apply_overrides, field_docs
    from tetron.plan.fit import check_fits
    from tetron.schedule import schedule_change
    from tetron.validate import idle_options, validate
except KeyboardInterrupt:
    print("tetron: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

USAGE = """usage: tetron train [CONFIG] [--section.key=value ...] [short flags] [--print-config] [--dry-run]
                    (tetron train --help lists every field and short flag)
       tetron plan [CONFIG] [--model NAME] --nodes N --gpus-per-node G [--gpu NAME | --memory-gb X]
                   [--seq-len S] [--batch-tokens T] [axes] [--json] [--write CONFIG.yaml] [--measure K]
                   tetron plan CONFIG --dry-run [axes]: one step of each rank on fake tensors
                   (tetron plan --help: rank the layouts that fit, predicted memory and step time)
       tetron slurm CONFIG --nodes N --gpus-per-node G [--partition P --time T --account A] [--submit]
                    [--cpus-per-task C] [--sbatch OPT ...] [--setup FILE]   (tetron slurm --help)
       tetron convert SRC DST   (a checkpoint to a Hugging Face folder, or a HF folder to a checkpoint)
       tetron check RUN_OR_CHECKPOINT   (every byte of a run's checkpoints against their checksums)
       tetron tokenize SOURCE --tokenizer T --out STORE [--workers N] [--shard-mb M]   (a token store)
       tetron generate RUN [--prompt TEXT] [--max-new-tokens N] [--temperature X] [--top-k N] [--seed N]
       tetron report RUN [RUN ...] [--out FILE.png] [--x step|tokens]   (curves and a summary of runs)
       tetron --version"""


def _check_data(cfg: Config) -> list[str]:
    """Tokenize (or find the cache) before any rank starts; check the vocabulary fits the model, the data
    fills a global batch, and a resumed run goes on with the data it was trained on. Returns the notes to
    print (small data: what validation does)."""
    # the data in use, as messages name it: data.path is not read when data.sources is set
    field, specs = ("data.sources" if cfg.data.sources else "data.path"), ", ".join(data_specs(cfg))
    what = f"{field} ({specs})" if cfg.data.sources else f"{field}={specs}"
    try:
        tokenizer, token_path = prepare_data(cfg, say=say)
    except OSError as err:  # a cache folder that cannot be written, a data file that cannot be read
        raise DataError(f"data: {err.filename or specs}: {err.strerror or err} (check {field}, and that "
                        f"data.cache_dir is writable)") from None
    check_tokenizer_pairing(cfg, tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer={tokenizer_spec(cfg)} has {tokenizer.vocab_size} tokens, more than "
                          f"model.vocab_size={cfg.model.vocab_size}; raise model.vocab_size or use a smaller tokenizer")
    tokens, d = load_tokens(token_path), cfg.data
    if tokens.vocab_size > cfg.model.vocab_size:  # its index records the vocabulary its ids were written with
        raise ConfigError(f"{what}: its ids come from a vocabulary of {tokens.vocab_size:,} ({token_path}), more "
                          f"than model.vocab_size={cfg.model.vocab_size}; raise model.vocab_size or make the store "
                          f"again with the model's tokenizer")
    num_tokens = len(training_tokens(tokens, cfg))  # without a held-out tail
    notes = [note for note in [check_held_out(cfg, tokenizer, token_path)] if note]
    windows = max(num_tokens - 1, 0) // d.seq_len
    if windows < cfg.global_batch:
        raise ConfigError(f"{what}: {num_tokens:,} tokens make {windows:,} windows of data.seq_len+1="
                          f"{d.seq_len + 1}, fewer than one global batch of {cfg.global_batch} "
                          f"(micro_batch*grad_acc*dp); use more data, a shorter seq_len or a smaller batch")
    folder = start_folder(cfg) if cfg.checkpoint.resume is not None else None
    state = read_json(folder / STATE_FILE) if folder is not None and (folder / STATE_FILE).is_file() else None
    before = (state.get("loader") or {}).get("num_tokens") if isinstance(state, dict) else None
    if d.sources:
        check_mixture(cfg, token_path, state.get("loader") if isinstance(state, dict) else None)
    if before not in (None, num_tokens) and not (cfg.checkpoint.new_data or cfg.checkpoint.new_tokenizer):
        raise ConfigError(f"{what} gives {num_tokens:,} tokens, but {folder} was trained on {before:,}: "
                          f"other data, whose order the run cannot continue; use that data, or set "
                          f"checkpoint.new_data=true")
    return notes


def _fit_tokenizer(cfg: Config, args: list[str]) -> tuple[Config, list[str]]:
    """The tokenizer a store or the starting weights bring wins over the config file's (not over the command
    line's), and a bytes or bpe:N tokenizer sizes the model's vocabulary (not one the command line gives); a
    note for each change."""
    given = apply_overrides({}, list(args))
    model = given.get("model")
    cfg, yielded = yield_tokenizer(cfg, explicit="tokenizer" in (given.get("data") or {}))
    cfg, fitted = (cfg, None) if isinstance(model, dict) and "vocab_size" in model else fit_vocab(cfg)
    return cfg, [note for note in (yielded, fitted) if note]


def _lock_run_folder(cfg: Config) -> FolderLock:
    """Hold OUT/tetron.lock while the run lasts: a second run into the same folder is refused in one line
    (a lock left by a killed run is taken over: the kernel dropped it, and its process is gone)."""
    lock = FolderLock(Path(cfg.out).expanduser(), RUN_LOCK, run_id=os.environ.get("TORCHELASTIC_RUN_ID"))
    try:
        lock.acquire()
    except BlockingIOError as err:
        raise ConfigError(f"out={cfg.out}: {err.strerror}; give another out, or wait for that run to end") from None
    except OSError as err:
        raise ConfigError(f"out={cfg.out}: cannot lock the run folder ({err.strerror})") from None
    return lock


def _claim_run_folder(cfg: Config, *, inside_launch: bool) -> FolderLock:
    """Lock OUT; a run that does not resume must not mix its metrics with an earlier run's, nor replace its
    checkpoints and model: such a folder is refused, or with checkpoint.overwrite renamed aside first."""
    ck, out = cfg.checkpoint, Path(cfg.out).expanduser()
    check(not (ck.overwrite and ck.resume is not None), f"checkpoint.overwrite=true with checkpoint.resume="
          f"{ck.resume}: overwrite starts anew, resume continues; give one of them")
    lock = _lock_run_folder(cfg)
    # torchrun starts a failed job again with the same command line; that attempt resumes "auto" (launch.py)
    if ck.resume is not None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return lock
    found = earlier_run(out)
    if not found:
        return lock
    if not ck.overwrite or inside_launch:  # under torchrun the other ranks already write their logs into OUT
        lock.release()
        how = (", or move it aside before torchrun starts (its ranks already write there)" if inside_launch
               else f", or --overwrite to move it to {aside_name(out)}")
        raise ConfigError(f"out={cfg.out} holds an earlier run ({', '.join(found)}); continue it with --resume "
                          f"auto, or start anew with another --out{how}")
    try:
        aside = set_aside(out)  # with the lock held, so that no run is moved from under itself
    except OSError as err:
        lock.release()
        raise ConfigError(f"out={cfg.out}: cannot move the earlier run aside ({err.strerror}); give another "
                          f"--out") from None
    lock.release()  # its file moved along: it names nothing here any more
    (aside / RUN_LOCK).unlink(missing_ok=True)
    say(f"moved the earlier run in {cfg.out} to {aside}")
    return _lock_run_folder(cfg)


def train_command(args: list[str]) -> int:
    config_path = None
    if args and not args[0].startswith("--"):
        config_path, args = args[0], args[1:]
    if "--dry-run" in args:  # no rank, no data: one step of each pipeline rank on fake tensors (tetron plan's)
        from tetron.plan.commands import dry_run_config

        try:
            cfg = load_config(config_path, [a for a in args if a != "--dry-run"])
        except UserError as err:
            return failed(str(err))
        return dry_run_config(cfg)
    inside_launch = "RANK" in os.environ
    lock = None  # rank 0, or the launching process, holds the run folder while the run lasts
    notes: list[str] = []
    try:
        raw = load_raw(config_path, args)
        dtype = cuda_dtype(raw, device_type=_device_type(raw))
        if dtype is not None:  # every rank (under torchrun too) sees the same config and device kind
            raw["train"] = {**(raw.get("train") or {}), "dtype": dtype}
        cfg, notes = _fit_tokenizer(from_dict(raw), args)
        # every line that names the run folder (its logs, messages, job scripts) must stay one line
        check(not has_control(cfg.out), f"out={quoted(cfg.out)}: a run folder's path with a control character "
                                        f"(a newline, a tab) cannot be named on one line; choose another")
        if dtype is not None:
            notes.insert(0, f"train.dtype={dtype}: the default on CUDA when the config sets none "
                            f"(--train.dtype=float32 trains in fp32)")
        validate(cfg, world_size=int(os.environ["WORLD_SIZE"]) if inside_launch else None)
        notes += idle_options(cfg, {f"{section}.{key}" for section, values in raw.items() if isinstance(values, dict)
                                    for key in values})
        note = _schedule_note(cfg)  # reads the checkpoint's saved config: refused before anything is written
        # the memory model's peak per rank against this node's memory, before any rank allocates
        check_fits(cfg, ranks_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if inside_launch else cfg.world_size,
                   local_rank=int(os.environ.get("LOCAL_RANK", 0)))
        if not inside_launch or os.environ.get("RANK") == "0":
            lock = _claim_run_folder(cfg, inside_launch=inside_launch)
            notes += _check_data(cfg)
            check_outputs(cfg)
        notes.append(_schedule_note(cfg))
    except UserError as err:
        if lock is not None:
            lock.release()
        return failed(str(err))
    except KeyboardInterrupt:  # Ctrl-C while checking or tokenizing: nothing started, nothing to save
        if lock is not None:
            lock.release()
        print("tetron: interrupted before any rank started; nothing was trained", file=sys.stderr)
        return 130
    for note in notes:
        if note and os.environ.get("RANK", "0") == "0":
            print(f"tetron: note: {note}", flush=True)
    try:
        return launch(cfg)
    finally:
        if lock is not None:
            lock.release()


def _device_type(raw: dict) -> str:
    """"cuda" or "cpu": the device a raw config's parallel.device ("auto" by default) picks on this machine."""
    kind = (raw.get("parallel") or {}).get("device", "auto") if isinstance(raw.get("parallel"), dict) else "auto"
    return "cuda" if kind == "cuda" or (kind == "auto" and cuda_count() > 0) else "cpu"


def _schedule_note(cfg: Config) -> str | None:
    """When resuming: whether this run's schedule changes the learning rate of steps already taken."""
    ck = cfg.checkpoint
    if ck.resume is None:
        return None
    folder = find_latest(Path(cfg.out)) if ck.resume == "auto" else Path(ck.resume).expanduser()
    state = read_json(folder / STATE_FILE) if folder is not None else None
    if not state or not state.get("config"):
        return None  # nothing saved yet, or a converted model folder: no schedule to continue
    try:
        saved = from_dict(state["config"]).train
    except ConfigError as err:  # a checksum proves the file whole, not its config valid (it may be resealed)
        raise ConfigError(f"{folder / STATE_FILE}: the config saved there is not valid ({err}); resume from "
                          f"another checkpoint, or restore this one's file") from None
    return schedule_change(saved, cfg.train, state["step"])


def convert_command(args: list[str]) -> int:
    if len(args) != 2 or any(a.startswith("-") for a in args):
        return failed("usage: tetron convert SRC DST (a checkpoint folder to a HF folder, or back)")
    from tetron.checkpoint.convert import convert

    try:
        print(f"tetron: {convert(args[0], args[1])}")
    except UserError as err:
        return failed(str(err))
    return 0


MAX_NEW_TOKENS = 100_000  # tokens `tetron generate` samples at most: hours on a CPU already (10**20 never ended)


def _generate_args(args: list[str]) -> argparse.Namespace:
    """`tetron generate`'s arguments, each checked: one line naming the flag for a bad value."""
    parser = OneLineParser(prog="tetron generate", description="Sample text from a trained run.")
    parser.add_argument("run", help="a run folder (OUT) or a model folder")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (>= 0)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy; else >= 0")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ns = parser.parse_args(args)
    check(ns.max_new_tokens >= 0, f"--max-new-tokens={quoted(ns.max_new_tokens)} must be >= 0")
    check(ns.max_new_tokens <= MAX_NEW_TOKENS, f"--max-new-tokens={quoted(ns.max_new_tokens)}: at most "
                                               f"{MAX_NEW_TOKENS:,} (each token is one forward pass)")
    check(math.isfinite(ns.temperature) and ns.temperature >= 0,
          f"--temperature={ns.temperature} must be a finite number >= 0 (0: greedy)")
    check(ns.top_k >= 0, f"--top-k={quoted(ns.top_k)} must be >= 0 (0: no limit)")
    check(0 <= ns.seed < 2**63, f"--seed={quoted(ns.seed)} must be in [0, 2**63)")
    device = re.fullmatch(r"cpu|cuda(?::(\d+))?", ns.device)
    check(device is not None, f"--device={ns.device}: use cpu, cuda or cuda:N")
    if ns.device.startswith("cuda"):
        index, count = int(device.group(1) or 0), cuda_count()
        check(index < count, f"--device={ns.device}: {count} CUDA device(s) here; use cpu"
                             + (f" or cuda:0..{count - 1}" if count else ""))
    return ns


def check_command(args: list[str]) -> int:
    from tetron.checkpoint.check import check_command as run

    return run(args)


def generate_command(args: list[str]) -> int:
    from tetron.observe.generate import sample_from_run

    try:
        ns = _generate_args(args)
        text = sample_from_run(ns.run, prompt=ns.prompt, max_new_tokens=ns.max_new_tokens,
                               temperature=ns.temperature, top_k=ns.top_k, device=ns.device, seed=ns.seed,
                               note=lambda line: print(f"tetron: note: {line}", file=sys.stderr, flush=True))
    except (UserError, ValueError) as err:  # checked before loading: a damaged or mismatched model folder
        return failed(str(err))
    print(text)
    return 0


def tokenize_command(args: list[str]) -> int:
    from tetron.data.tokenize import tokenize_command as run  # its worker pool only when asked for

    return run(args)


def plan_command(args: list[str]) -> int:
    from tetron.plan.commands import plan_command as run  # the planner only when asked for

    return run(args)


def slurm_command(args: list[str]) -> int:
    from tetron.plan.commands import slurm_command as run

    return run(args)


def report_command(args: list[str]) -> int:
    from tetron.observe.report import report

    try:
        print(report(args))
    except UserError as err:
        return failed(str(err))
    return 0


MODEL_DEFAULT = "from the model"  # what --help and docs/config.md say of a model field's default


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
            # there is no default model: LlamaConfig's own defaults (Llama-7B's) would read as one
            shown = MODEL_DEFAULT if section == "model" else default
            lines.append(f"  --{key} {kind} [{shown}]{flag}")
            lines.append(f"      {doc}")
    lines += ["out:", f"  --out str [{Config().out!r}] (--out)",
              "      the run folder: metrics.jsonl, checkpoints/, model/", "",
              "--print-config prints the resolved config as YAML and exits.", "",
              "Also: tetron convert SRC DST; tetron generate RUN [options] (tetron generate --help)."]
    return "\n".join(lines)


def print_config(config_path: str | None, args: list[str]) -> int:
    """The config that these arguments resolve to, as YAML: what a run would train."""
    try:
        cfg, _ = _fit_tokenizer(load_config(config_path, args), args)
    except UserError as err:
        return failed(str(err))
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


COMMANDS = {"plan": plan_command, "slurm": slurm_command, "convert": convert_command, "check": check_command,
            "generate": generate_command, "tokenize": tokenize_command, "report": report_command}  # besides train


def main(argv: list[str] | None = None) -> int:
    blocking_output()
    try:
        code = _main(argv)
        sys.stdout.flush()  # a reader that went away shows here, inside the try, not at the interpreter's exit
        return code
    except KeyboardInterrupt:  # Ctrl-C before a run's own signal handling starts (or in any other command)
        print("tetron: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `tetron train --help | head -1`: stop quietly, as a command killed by SIGPIPE does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that exit's own flush fails no more
        return 128 + signal.SIGPIPE


def _main(argv: list[str] | None) -> int:
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
    handler = COMMANDS.get(command)
    if handler is None:
        return failed(f"unknown command {command!r}; use train, {', '.join(COMMANDS)}")
    return handler(rest)

if __name__ == "__main__":
    sys.exit(main())
