"""Pipeline parallelism: the schedules' orders on their own, then every schedule (alone, with an uneven
split, tied embeddings, dp and tp) against a single-process run on the same global batches."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tetron.checkpoint.load import load_model
from tetron.config import from_dict
from tetron.errors import ConfigError
from tetron.parallel.pipeline_parallel import split_layers
from tetron.parallel.pipeline_schedules import (
    SCHEDULES,
    Action,
    ScheduleSpec,
    peak_in_flight,
    receives,
    register_schedule,
    schedule,
    sends,
    simulate,
    theoretical_bubble,
)
from tetron.plan.pipeline import walked_micro_batches
from tetron.validate import validate

from conftest import STEPS, reference_run, run_parallel, tiny_config

LOSS_RTOL = 1e-5  # per-step loss (every rank's, and metrics.jsonl's), relative
# Gradient norm in metrics.jsonl, relative. Step 1 starts from identical weights: only summation order
# differs, so a gradient scaled by the micro-batch count (m times off) cannot pass. Later steps follow
# the trajectory: grad-acc 8 without pp is 2.8e-4 off the single-process norm at step 10 here.
GRAD_NORM_RTOL_FIRST = 1e-5
GRAD_NORM_RTOL = 1e-3
WEIGHT_ATOL = 1e-5  # final weights, absolute, fp32
BF16_LOSS_RTOL = 5e-3  # bf16 parameters' first loss vs fp32's (as in test_train.py)
# AdamW moves a weight whose gradient is near zero (below eps) by up to about lr/2 on a rounding
# difference, so at the fixture's lr=1e-2 gradient accumulation alone (pp=1, grad_acc=4, 5 layers)
# or tp=2 alone ends 3e-5 from the single-process run after 10 steps. At 1e-3 every layout here
# stays within 4e-6 of it (the loss still falls, 5.55 to 5.19), and a pipeline matches pp=1 with
# the same micro-batches within 1e-6.
LR = 1e-3


# ----------------------------------------------------------------------------- schedules, no processes


CASES = [(name, p, v, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, p, 2 * p, 3 * p)
         for name, v in (("afab", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 2), ("interleaved", 3))
         if name != "interleaved" or m % p == 0]


@pytest.mark.parametrize("name, p, v, m", CASES)
def test_schedule_order(name, p, v, m):
    for rank in range(p):
        order = schedule(name, pp=p, virtual=v, micro_batches=m, rank=rank)
        # every (chunk, micro-batch) goes forward once, then backward once
        pairs = [(a.chunk, a.micro) for a in order]
        assert sorted(pairs) == sorted([(c, i) for c in range(v) for i in range(m)] * 2)
        for c in range(v):
            backwards = [a.micro for a in order if a.backward and a.chunk == c]
            assert backwards == list(range(m))  # ascending: micro-batch m-1 is the chunk's last (its DP sync)
            for i in range(m):
                assert pairs.index((c, i)) < len(pairs) - 1 - pairs[::-1].index((c, i))
        # activations held at once: 1F1B at most p - rank, AFAB all m, interleaved its longer warm-up + 1
        expected = {"afab": m, "1f1b": min(m, p - rank),
                    "interleaved": min(v * m, (v - 1) * p + 2 * (p - rank - 1) + 1)}[name]
        assert peak_in_flight(order) == expected
    # on each link, the receiver takes the messages in the order the sender sends them (NCCL's rule)
    for src in range(p):
        for dst in range(p):
            sent = [out[0] for a in schedule(name, pp=p, virtual=v, micro_batches=m, rank=src)
                    if (out := sends(a, pp=p, virtual=v, rank=src)) is not None and out[1] == dst]
            taken = [need[0] for a in schedule(name, pp=p, virtual=v, micro_batches=m, rank=dst)
                     if (need := receives(a, pp=p, virtual=v, rank=dst)) is not None and need[1] == src]
            assert sent == taken, (src, dst)
    # no deadlock, and with backward = 2 x forward (split over v chunks) and free communication the
    # idle time is exactly the textbook bubble
    bubble = simulate(name, pp=p, virtual=v, micro_batches=m, duration=lambda r, k, a: (2 if a.backward else 1) / v)
    assert max(bubble) == pytest.approx(theoretical_bubble(name, pp=p, virtual=v, micro_batches=m), abs=1e-12)


def test_split_layers():
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_layers(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError):
        split_layers(4, 2, [2, 3])


# ----------------------------------------------------------------------------- training runs


def reference(corpus, cache_dir, tmp_path, *, global_batch: int, model: dict) -> tuple[list[dict], dict]:
    """The single-process run: one micro-batch holding the whole global batch."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "ref", model=model,
                      train={"micro_batch": global_batch, "grad_acc": 1, "lr": LR})
    ref, written = reference_run(raw)
    return [ref], written


def assert_matches(results: list[dict], written: dict, ref: tuple[list[dict], dict]) -> None:
    ref_results, ref_written = ref
    ref_losses = torch.tensor(ref_results[0]["losses"])
    assert len(ref_losses) == STEPS
    for result in results:  # every rank knows the true loss
        torch.testing.assert_close(torch.tensor(result["losses"]), ref_losses, rtol=LOSS_RTOL, atol=0)
    metrics, ref_metrics = written["metrics"], ref_written["metrics"]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in metrics]), ref_losses, rtol=LOSS_RTOL, atol=0)
    norms, ref_norms = (torch.tensor([r["grad_norm"] for r in ms]) for ms in (metrics, ref_metrics))
    torch.testing.assert_close(norms[0], ref_norms[0], rtol=GRAD_NORM_RTOL_FIRST, atol=0)
    torch.testing.assert_close(norms, ref_norms, rtol=GRAD_NORM_RTOL, atol=0)
    # the saved folder is complete whatever the layout
    assert written["model"].keys() == ref_written["model"].keys()
    for name, value in written["model"].items():
        torch.testing.assert_close(value, ref_written["model"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    # and each rank's own tensors (whole ones, without tp) are the same as well
    full = dict(ref_written["model"])
    full.setdefault("lm_head.weight", full["model.embed_tokens.weight"])  # tied: the last stage's copy
    for result in results:
        for name, value in result["state"].items():
            if value.shape == full[name].shape:
                torch.testing.assert_close(value, full[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def assert_schedule_ran(results: list[dict], name: str, *, pp: int, virtual: int, micro_batches: int) -> None:
    """Each rank ran its schedule's actions in order, held what the schedule says, and kept no sent output."""
    for result in results:
        trace = result["trace"]
        order = schedule(name, pp=pp, virtual=virtual, micro_batches=micro_batches, rank=trace.rank)
        assert [(kind == "B", c, i) for kind, c, i, _, _ in trace.events] == \
               [(a.backward, a.chunk, a.micro) for a in order]
        assert all(start <= end <= later for (_, _, _, start, end), (_, _, _, later, _)
                   in zip(trace.events, trace.events[1:]))
        assert trace.peak_in_flight == peak_in_flight(order)
        if name == "1f1b":
            assert trace.peak_in_flight <= pp
        if name == "afab":
            assert trace.peak_in_flight == micro_batches
        assert trace.peak_output_elements == 0  # every sent stage output was released


@pytest.mark.parametrize("per_stage", [1, 2], ids=["m=pp", "m=2pp"])
@pytest.mark.parametrize("name", ["afab", "1f1b", "interleaved"])
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(corpus, cache_dir, tmp_path, pp, name, per_stage):
    m = per_stage * pp
    virtual = 2 if name == "interleaved" else 1
    model = {"num_hidden_layers": 4 * virtual if pp == 4 else 4}
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=model,
                      parallel={"pp": pp, "pp_schedule": name, "pp_virtual": virtual},
                      train={"micro_batch": 1, "grad_acc": m, "lr": LR})
    results, written = run_parallel(raw, trace=True, timeout=120)
    assert_matches(results, written, reference(corpus, cache_dir, tmp_path, global_batch=m, model=model))
    assert_schedule_ran(results, name, pp=pp, virtual=virtual, micro_batches=m)


def _forwards_then_backwards_last_first(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """A schedule only this test knows: every forward, then the backwards from the last micro-batch down."""
    return ([Action(False, 0, i) for i in range(micro_batches)]
            + [Action(True, 0, i) for i in reversed(range(micro_batches))])


@pytest.fixture
def registered_schedule():
    """One function and one registration make a schedule; taken out again after the test."""
    spec = register_schedule(ScheduleSpec("last_first", _forwards_then_backwards_last_first,
                                          holds_every_micro_batch=True))
    yield spec.name
    del SCHEDULES[spec.name]


def test_a_schedule_registered_in_a_test_trains_like_one_process(corpus, cache_dir, tmp_path, registered_schedule):
    """The config accepts it, the checks before start read its declarations, the runner and its P2P plan run
    it, the planner walks it (all micro-batches: it declares it holds them all), and pp2 trains like one process."""
    name, model = registered_schedule, {"num_hidden_layers": 4}
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=model,
                      parallel={"pp": 2, "pp_schedule": name}, train={"micro_batch": 1, "grad_acc": 4, "lr": LR})
    assert walked_micro_batches(from_dict(raw)) == 4
    with pytest.raises(ConfigError,
                       match=r"pp_schedule='nope': use afab, 1f1b, interleaved, zbh1, zbv, dualpipev or last_first"):
        validate(from_dict({**raw, "parallel": {"pp": 2, "pp_schedule": "nope"}}))
    assert theoretical_bubble(name, pp=2, virtual=1, micro_batches=4) == pytest.approx(1 / 5)
    results, written = run_parallel(raw, trace=True, timeout=120)
    assert_matches(results, written, reference(corpus, cache_dir, tmp_path, global_batch=4, model=model))
    assert_schedule_ran(results, name, pp=2, virtual=1, micro_batches=4)
    with pytest.raises(ValueError, match="runs one chunk per rank, not 2"):
        schedule(name, pp=2, virtual=2, micro_batches=4, rank=0)


@pytest.mark.parametrize("layers, split", [(5, None), (4, [1, 3])], ids=["5-layers", "split-1-3"])
def test_uneven_split(corpus, cache_dir, tmp_path, layers, split):
    model = {"num_hidden_layers": layers}
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=model,
                      parallel={"pp": 2, "pp_split": split}, train={"micro_batch": 1, "grad_acc": 4, "lr": LR})
    results, written = run_parallel(raw, trace=True, timeout=120)
    assert_matches(results, written, reference(corpus, cache_dir, tmp_path, global_batch=4, model=model))
    expected = [[0, 1, 2], [3, 4]] if split is None else [[0], [1, 2, 3]]
    for rank, result in enumerate(results):
        layers_held = sorted({int(k.split(".")[2]) for k in result["state"] if k.startswith("model.layers.")})
        assert layers_held == expected[rank]


@pytest.mark.parametrize("pp, name", [(2, "1f1b"), (4, "interleaved")])
def test_tied_embeddings(corpus, cache_dir, tmp_path, pp, name):
    virtual = 2 if name == "interleaved" else 1
    model = {"num_hidden_layers": 8 if pp == 4 else 4, "tie_word_embeddings": True}
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=model,
                      parallel={"pp": pp, "pp_schedule": name, "pp_virtual": virtual},
                      train={"micro_batch": 1, "grad_acc": pp, "lr": LR})
    results, written = run_parallel(raw, trace=True, timeout=120)
    assert_matches(results, written, reference(corpus, cache_dir, tmp_path, global_batch=pp, model=model))
    first, last = results[0]["state"], results[-1]["state"]
    assert "lm_head.weight" not in first and "model.embed_tokens.weight" not in last
    assert torch.equal(first["model.embed_tokens.weight"], last["lm_head.weight"])  # the two copies stay equal
    # the saved folder is a HF model with the tie, and samples like the end of a run does
    loaded = load_model(Path(raw["out"]) / "model")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


@pytest.mark.parametrize("impl, name, tied", [("naive", "interleaved", False), ("bucket", "1f1b", True)])
def test_dp_and_pp(corpus, cache_dir, tmp_path, impl, name, tied):
    model = {"num_hidden_layers": 4, "tie_word_embeddings": tied}
    virtual = 2 if name == "interleaved" else 1
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=model,
                      parallel={"pp": 2, "dp": 2, "dp_impl": impl, "bucket_mb": 0.01, "pp_schedule": name,
                                "pp_virtual": virtual},
                      train={"micro_batch": 1, "grad_acc": 2, "lr": LR})
    results, written = run_parallel(raw, trace=True, timeout=120)
    assert_matches(results, written, reference(corpus, cache_dir, tmp_path, global_batch=4, model=model))
    assert_schedule_ran(results, name, pp=2, virtual=virtual, micro_batches=2)
    if impl == "naive":  # one all-reduce per parameter per step (each chunk's last backward), not per micro-batch
        for result in results:
            assert result["collectives"] == STEPS * result["num_params"]


@pytest.mark.parametrize("sp, name", [(False, "1f1b"), (True, "interleaved")], ids=["tp", "tp+sp"])
def test_tp_and_pp(corpus, cache_dir, tmp_path, sp, name):
    model = {"num_hidden_layers": 4}
    virtual = 2 if name == "interleaved" else 1
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=model,
                      parallel={"pp": 2, "tp": 2, "sp": sp, "pp_schedule": name, "pp_virtual": virtual},
                      train={"micro_batch": 1, "grad_acc": 2, "lr": LR})
    results, written = run_parallel(raw, trace=True, timeout=120)
    assert_matches(results, written, reference(corpus, cache_dir, tmp_path, global_batch=2, model=model))
    assert_schedule_ran(results, name, pp=2, virtual=virtual, micro_batches=2)


def test_bfloat16_pipeline(corpus, cache_dir, tmp_path):
    """With bf16 parameters the residual stream crossing the stages is bf16 too (the P2P buffers follow)."""
    model = {"num_hidden_layers": 4}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        raw = tiny_config(corpus, cache_dir, tmp_path / dtype, model=model, parallel={"pp": 2},
                          train={"micro_batch": 1, "grad_acc": 2, "steps": 2, "dtype": dtype})
        runs[dtype] = run_parallel(raw, timeout=120)[0][0]["losses"]
    assert all(math.isfinite(x) for x in runs["bfloat16"])
    assert runs["bfloat16"][0] == pytest.approx(runs["float32"][0], rel=BF16_LOSS_RTOL)
    assert runs["bfloat16"][0] != runs["float32"][0]
