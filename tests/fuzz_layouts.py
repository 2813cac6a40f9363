"""The layout fuzzer: random configurations from the space `validate` accepts, each trained on forked gloo ranks
and as the single process on the same model, data, seed and global batch; losses within LOSS_RTOL and final
weights within WEIGHT_ATOL of it (conftest.py's layout tolerances; bf16 tracks fp32 within 1%, as in
test_mixed_precision.py). A configuration `validate` refuses is counted, not run, and its message must be one
line naming the fields it is about.

    python tests/fuzz_layouts.py --seed N --count K [--failures DIR] [--max-world W] [--index I]
    make fuzz SEED=N COUNT=K

Draw I of seed N is the same configuration on every machine (tests/fuzz/draw.py); a failure is written to DIR as
ready-to-run YAML (the layout, and its single-process reference beside it), so that `tetron train FILE` runs it
again. tests/test_fuzz.py runs a fixed seed in the suite.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # conftest.py, harness.py, fuzz/ when run as a script

from fuzz.draw import comparable, draw  # noqa: E402
from fuzz.noops import checks_for, switched_off  # noqa: E402

from tetron.config import from_dict  # noqa: E402
from tetron.data.sources import iter_texts  # noqa: E402
from tetron.errors import ConfigError  # noqa: E402
from tetron.validate import idle_options, validate  # noqa: E402

from conftest import LOSS_RTOL, WEIGHT_ATOL, layout_configs, reference_run, run_parallel  # noqa: E402

BF16_TRACKS_FP32 = 0.01  # test_mixed_precision.py's bar: bf16 losses within 1% of fp32's, relative
DRAW_TIMEOUT_S = 300.0  # one run's time limit (forked ranks that hang fail the draw, not the campaign)
SECTION = re.compile(r"\b(model|parallel|data|train|optim|checkpoint|logging)\.[a-z_]+")


@dataclass
class Outcome:
    """What became of one draw: "refused" (validate's message), "passed", or "failed" (what differed)."""

    index: int
    status: str
    detail: str
    sections: dict
    raw: dict | None = None  # the layout's full config (when it got that far)
    ref_raw: dict | None = None  # its single-process reference's
    seconds: float = 0.0


def write_corpora(folder: Path) -> tuple[Path, Path]:
    """The fuzzer's two data sets in `folder`: ~200 KB of stdlib source as one text, and a .jsonl of short
    documents (several to a window, for mask_documents and reset_positions). Written once."""
    folder.mkdir(parents=True, exist_ok=True)
    text, docs = folder / "corpus.txt", folder / "docs.jsonl"
    if not text.exists():
        text.write_text("\n".join(iter_texts("stdlib", max_bytes=200_000)))
    if not docs.exists():
        rng = random.Random(0)
        words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
        docs.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(1, 9)))}) + "\n"
                                for _ in range(1500)))
    return text, docs


def draw_of(seed: int, index: int, *, max_world: int = 8) -> dict[str, dict]:
    """Draw `index` of `seed`: its own generator, so any one draw reproduces alone."""
    return draw(random.Random(f"tetron-fuzz:{seed}:{index}"), max_world=max_world)


def configs(sections: dict[str, dict], *, corpus: Path, docs: Path, cache: Path, out: Path) -> tuple[dict, dict]:
    """The layout's raw config and its single-process reference's (conftest.layout_configs: the same model, data,
    seed and global batch in one micro-batch); the reference trains in fp32 where the layout trains in bf16."""
    data, train = dict(sections["data"]), dict(sections["train"])
    documents = data.get("mask_documents") or data.get("reset_positions")
    if data.get("sources"):
        data["sources"] = [{**e, "path": str({"@corpus": corpus, "@docs": docs}[e["path"]])} for e in data["sources"]]
    micro_batch, grad_acc = train.pop("micro_batch"), train.pop("grad_acc")
    raw, ref_raw = layout_configs(docs if documents else corpus, cache, out, parallel=sections["parallel"],
                                  model=sections["model"], micro_batch=micro_batch, grad_acc=grad_acc, train=train,
                                  data=data, checkpoint=sections["checkpoint"] or None, optim=sections["optim"])
    if comparable(sections) == "bf16":
        ref_raw["train"] = {**ref_raw["train"], "dtype": "float32"}
    return raw, ref_raw


def refusal_problem(message: str) -> str | None:
    """What is wrong with a refusal's message (None: one line naming a field, as every refusal must be)."""
    if "\n" in message.strip():
        return "the refusal is more than one line"
    if not SECTION.search(message):
        return "the refusal names no field (section.key)"
    return None


def differences(results: list[dict], written: dict, ref: dict, ref_written: dict, *, bf16: bool) -> list[str]:
    """Where the layout's run parts from the single process's, by how much: each rank's losses and rank 0's
    metrics.jsonl against the reference's losses, and (fp32) OUT/model's tensors against the reference's."""
    found = []
    expected = torch.tensor(ref["losses"])
    rtol = BF16_TRACKS_FP32 if bf16 else LOSS_RTOL
    for who, losses in [*((f"rank {r}", res["losses"]) for r, res in enumerate(results)),
                        ("metrics.jsonl", [m["loss"] for m in written["metrics"]])]:
        got = torch.tensor(losses, dtype=expected.dtype)
        if got.shape != expected.shape:
            found.append(f"{who}: {len(losses)} losses, the reference {len(expected)}")
            continue
        rel = ((got - expected).abs() / expected.abs()).nan_to_num(nan=float("inf"))
        if not bool((rel <= rtol).all()):
            step = int(rel.argmax())
            found.append(f"{who}: loss of step {step + 1} {got[step].item():.7g}, the single process "
                         f"{expected[step].item():.7g} (relative {rel[step].item():.2e} > {rtol:g})")
    # AdamW's step is invariant to a gradient's scale (m/sqrt(v)), so a gradient off by a constant factor (a sum
    # where a mean belongs) leaves losses and weights alone: the global gradient norm of each step shows it
    norms, ref_norms = ([m["grad_norm"] for m in w["metrics"]] for w in (written, ref_written))
    worst = max((abs(a - b) / abs(b) if b else abs(a), i) for i, (a, b) in enumerate(zip(norms, ref_norms)))
    if len(norms) != len(ref_norms) or worst[0] > rtol:
        step = worst[1]
        found.append(f"gradient norm of step {step + 1} {norms[step]:.7g}, the single process {ref_norms[step]:.7g} "
                     f"(relative {worst[0]:.2e} > {rtol:g})")
    val, ref_val = ([m["val_loss"] for m in w["metrics"] if "val_loss" in m] for w in (written, ref_written))
    if len(val) != len(ref_val) or any(abs(a - b) > rtol * abs(b) for a, b in zip(val, ref_val)):
        found.append(f"validation losses {val}, the single process {ref_val} (relative {rtol:g})")
    if bf16:
        return found  # OUT/model is bf16: its rounding, not the layout, decides the last bits
    state, ref_state = written["model"], ref_written["model"]
    if state.keys() != ref_state.keys():
        found.append(f"OUT/model tensors differ: {sorted(state.keys() ^ ref_state.keys())[:4]}")
    worst = max(((float((state[k].float() - ref_state[k].float()).abs().max()), k)
                 for k in state.keys() & ref_state.keys() if state[k].shape == ref_state[k].shape),
                default=(0.0, ""))
    shapes = [k for k in state.keys() & ref_state.keys() if state[k].shape != ref_state[k].shape]
    if shapes:
        found.append(f"OUT/model shapes differ: {shapes[:4]}")
    if worst[0] > WEIGHT_ATOL:
        found.append(f"final weights: {worst[1]} differs by {worst[0]:.2e} (> {WEIGHT_ATOL:g})")
    return found


def run_draw(index: int, sections: dict[str, dict], *, corpus: Path, docs: Path, cache: Path, work: Path,
             noop: random.Random | None = None) -> Outcome:
    """Validate one draw; train it and its single-process reference when accepted, and compare them. With `noop`,
    a draw that passed and has an option on (fuzz/noops.py) trains again with one of them (drawn) off, and the
    option must have changed what it is for."""
    start = time.perf_counter()
    out = work / f"draw-{index}"
    try:
        raw, ref_raw = configs(sections, corpus=corpus, docs=docs, cache=cache, out=out)
        validate(from_dict(raw))
    except ConfigError as err:
        problem = refusal_problem(str(err))
        return Outcome(index, "failed" if problem else "refused", f"{problem}: {err}" if problem else str(err),
                       sections, seconds=time.perf_counter() - start)
    except Exception:  # noqa: BLE001 (a traceback where a one-line refusal belongs is what the fuzzer reports)
        return Outcome(index, "failed", "validation raised instead of refusing: " + _last_line(traceback.format_exc()),
                       sections, seconds=time.perf_counter() - start)
    try:
        ref, ref_written = reference_run(ref_raw)
        results, written = run_parallel(raw, timeout=DRAW_TIMEOUT_S)
        found = differences(results, written, ref, ref_written, bf16=comparable(sections) == "bf16")
        # an option the start-up notes call idle in this layout (validate.idle_options) is not expected to act
        notes = idle_options(from_dict(raw), {f"{k}.{key}" for k, v in sections.items() for key in v})
        checks = [c for c in checks_for(sections) if not any(n.startswith(c.option) for n in notes)]
        checks, checked = checks if noop is not None and not found else [], ""
        if checks:
            check = noop.choice(checks)
            off_raw, _ = configs(switched_off(sections, check), corpus=corpus, docs=docs, cache=cache,
                                 out=work / f"draw-{index}-without")
            acts, said = check.verdict(written, run_parallel(off_raw, timeout=DRAW_TIMEOUT_S)[1])
            found += [] if acts else [f"a silent no-op: {said}"]
            checked = said
    except Exception:  # noqa: BLE001 (a rank's error or hang: the draw fails, the campaign goes on)
        found, checked = ["the run failed: " + _last_line(traceback.format_exc())], ""
    return Outcome(index, "failed" if found else "passed", "; ".join(found) or checked, sections, raw, ref_raw,
                   time.perf_counter() - start)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def write_failure(outcome: Outcome, folder: Path, *, seed: int) -> Path:
    """The failed draw as ready-to-run YAML in `folder` (seedN-drawI.yaml, its reference beside it as
    seedN-drawI.reference.yaml): `tetron train FILE` trains it again, into runs/fuzz/."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"seed{seed}-draw{outcome.index}"
    path = folder / f"{name}.yaml"
    header = (f"# tetron layout fuzzer, seed {seed} draw {outcome.index} (python tests/fuzz_layouts.py --seed {seed} "
              f"--index {outcome.index}): {outcome.detail}\n")
    if outcome.raw is None:  # refused badly, or never a whole config: the drawn sections
        path.write_text(header + yaml.safe_dump(outcome.sections, sort_keys=False))
        return path
    raw = {**outcome.raw, "out": f"runs/fuzz/{name}"}
    ref = {**outcome.ref_raw, "out": f"runs/fuzz/{name}.reference"}
    path.write_text(header + f"# the single-process run it is compared with: {name}.reference.yaml\n"
                    + yaml.safe_dump(raw, sort_keys=False))
    (folder / f"{name}.reference.yaml").write_text(
        f"# the single-process reference of {name}.yaml\n" + yaml.safe_dump(ref, sort_keys=False))
    return path


def campaign(seed: int, count: int, *, data: Path, work: Path, failures: Path | None = None, max_world: int = 8,
             first: int = 0, noops: float = 0.0, log: Callable[[str], None] = print) -> list[Outcome]:
    """Draws first..first+count-1 of `seed`, each validated and (accepted) run and compared, and a `noops` share of
    them checked for options that do nothing (run_draw); one log line each."""
    corpus, docs = write_corpora(data)
    outcomes = []
    for index in range(first, first + count):
        noop = random.Random(f"tetron-fuzz-noop:{seed}:{index}")
        outcome = run_draw(index, draw_of(seed, index, max_world=max_world), corpus=corpus, docs=docs,
                           cache=data / "cache", work=work, noop=noop if noop.random() < noops else None)
        outcomes.append(outcome)
        p = outcome.sections["parallel"]
        shape = " ".join(f"{k}{p[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if p.get(k, 1) != 1) or "single"
        where = ""
        if outcome.status == "failed" and failures is not None:
            where = f" -> {write_failure(outcome, failures, seed=seed)}"
        log(f"fuzz seed {seed} draw {index}: {outcome.status} ({outcome.sections['model']['model_type']} {shape}, "
            f"{outcome.seconds:.1f} s) {outcome.detail[:300]}{where}")
    return outcomes


def summary(seed: int, outcomes: list[Outcome]) -> str:
    """One line: drawn / refused / ran / passed / failed."""
    n = {s: sum(o.status == s for o in outcomes) for s in ("refused", "passed", "failed")}
    ran = len(outcomes) - n["refused"] - sum(o.status == "failed" and o.raw is None for o in outcomes)
    return (f"fuzz seed {seed}: drawn {len(outcomes)}, refused {n['refused']}, ran {ran}, passed {n['passed']}, "
            f"failed {n['failed']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--index", type=int, default=None, help="run only this draw of the seed")
    parser.add_argument("--max-world", type=int, default=8)
    parser.add_argument("--noops", type=float, default=0.5,
                        help="share of draws also run with one of their options off, which must change something")
    parser.add_argument("--failures", default="fuzz-failures", help="folder for the failing configs' YAML")
    parser.add_argument("--data", default=None, help="corpora and token cache (default: FAILURES/data)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    failures = Path(args.failures).resolve()
    data = Path(args.data).resolve() if args.data else failures / "data"
    first, count = (args.index, 1) if args.index is not None else (0, args.count)
    with tempfile.TemporaryDirectory(prefix="tetron-fuzz-") as work:
        outcomes = campaign(args.seed, count, data=data, work=Path(work), failures=failures,
                            max_world=args.max_world, first=first, noops=args.noops,
                            log=lambda line: print(line, flush=True))
    print(summary(args.seed, outcomes) + (f"; failing configs in {failures}" if any(
        o.status == "failed" for o in outcomes) else ""), flush=True)
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
