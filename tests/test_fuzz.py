"""The layout fuzzer (tests/fuzz_layouts.py) in the suite: a fixed seed, a dozen draws of at most 4 ranks, every
accepted one equal to the single process (losses, final weights) and every refused one a one-line message naming
its fields; a share of them run again with an option off, which must change something. `make fuzz SEED=N
COUNT=K` runs any seed at any length. And the options that do nothing in a layout say so at start."""

from __future__ import annotations

import pytest
import yaml
from fuzz_layouts import campaign, draw_of, summary

from tetron import cli
from tetron.config import from_dict
from tetron.validate import idle_options

from conftest import tiny_config

SEED = 2026  # draws 0-11 of it: five families, dp/tp/pp/cp/ep up to 4 ranks, one refusal (docs/support.md lists them)
COUNT = 12
NOOPS = 0.3  # the share of them run again with an option off (recompute, sp, ZeRO, documents), which must matter


def test_fixed_seed_draws_match_the_single_process(corpus, cache_dir, tmp_path):
    outcomes = campaign(SEED, COUNT, data=tmp_path / "data", work=tmp_path / "work", max_world=4, noops=NOOPS,
                        log=lambda _: None)
    failed = [f"draw {o.index}: {o.detail}\n{o.sections}" for o in outcomes if o.status == "failed"]
    assert not failed, summary(SEED, outcomes) + "\n" + "\n".join(failed)
    statuses = {o.status for o in outcomes}
    assert statuses == {"passed", "refused"}, summary(SEED, outcomes)  # both halves of the fuzzer exercised


def test_a_draw_is_the_same_every_time():
    assert draw_of(7, 3) == draw_of(7, 3) and draw_of(7, 3) != draw_of(7, 4)


IDLE = [  # (parallel, data, train, the note's start): an option set where it does nothing
    ({"sp": True}, {}, {}, "parallel.sp=true does nothing at tp=1"),
    ({"cp_impl": "ulysses"}, {}, {}, "parallel.cp_impl=ulysses does nothing at cp=1"),
    ({"pp_schedule": "afab"}, {}, {}, "parallel.pp_schedule=afab does nothing at pp=1"),
    ({"zero": 2}, {}, {}, "parallel.zero=2 shards over dp*cp=1 rank"),
    ({"dp": 4, "zero": 1, "dp_shard": 1}, {}, {}, "parallel.zero=1 shards over dp_shard=1 rank"),
    ({"dp": 2, "zero": 1, "zero_accumulate": "full"}, {}, {"grad_acc": 2}, "parallel.zero_accumulate=full does "
                                                                          "nothing with zero=1"),
    ({"dp": 2, "zero": 2, "dp_shard": 2}, {}, {}, "parallel.dp_shard=2 is all of dp*cp"),
    ({"reduce_dtype": "bfloat16"}, {}, {}, "parallel.reduce_dtype=bfloat16 does nothing at dp*cp=1"),
    ({}, {"mask_documents": True, "reset_positions": True}, {}, "data.reset_positions=true does nothing with "
                                                               "data.mask_documents=true"),
    ({}, {}, {"eval_batches": 2}, "train.eval_batches does nothing with train.eval_every=0"),
]


@pytest.mark.parametrize("parallel, data, train, note", IDLE, ids=[n.split(" ")[0] for *_, n in IDLE])
def test_an_option_that_does_nothing_here_says_so(corpus, cache_dir, tmp_path, parallel, data, train, note):
    raw = tiny_config(corpus, cache_dir, tmp_path, parallel=parallel, data=data, train=train)
    given = {f"{section}.{key}" for section in ("parallel", "data", "train") for key in raw[section]}
    notes = idle_options(from_dict(raw), given)
    assert len(notes) == 1 and notes[0].startswith(note), notes
    assert idle_options(from_dict(raw), given - {note.split("=")[0].split(" ")[0]}) == []  # only where set


def test_the_notes_print_at_start(corpus, cache_dir, tmp_path, monkeypatch, capsys):
    """`tetron train` prints them (one line each) before it launches anything; an option that acts, none."""
    monkeypatch.setattr(cli, "launch", lambda cfg: 0)
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel={"sp": True})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", str(config)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "does nothing" in line]
    assert lines == ["tetron: note: parallel.sp=true does nothing at tp=1: sequence parallelism splits activations "
                     "over the tp ranks"]
