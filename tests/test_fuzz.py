"""The layout fuzzer (tests/fuzz_layouts.py) in the suite: a fixed seed, a dozen draws of at most 4 ranks, every
accepted one equal to the single process (losses, final weights) and every refused one a one-line message naming
its fields. `make fuzz SEED=N COUNT=K` runs any seed at any length."""

from __future__ import annotations

from fuzz_layouts import campaign, draw_of, summary

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
