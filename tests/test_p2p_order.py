"""P2P orders that cannot deadlock on NCCL: the pipeline's posting plan for every schedule, and the batches
the pipeline and ring attention really post (recorded on gloo), replayed under NCCL's rules
(tests/nccl_order.py)."""

from __future__ import annotations

import pytest
from nccl_order import Recorder, deadlocked

from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.mesh import Mesh
from tetron.parallel.p2p_order import orders_posting_plan, posting_plan
from tetron.parallel.pipeline_schedules import forward_only, receives, schedule, style_of
from tetron.train import train

from conftest import tiny_config
from harness import run_ranks


def _recorded_rank(raw: dict) -> list:
    recorder = Recorder()
    recorder.install()
    cfg = from_dict(raw)
    p = cfg.parallel
    train(cfg, Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp))
    return recorder.events


def _programs(corpus, cache_dir, tmp_path, parallel: dict, grad_acc: int = 1) -> dict[int, list]:
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel=parallel,
                      model={"num_hidden_layers": 4}, train={"steps": 1, "grad_acc": grad_acc})
    cfg = from_dict(raw)
    prepare_data(cfg)
    return dict(enumerate(run_ranks(cfg.world_size, _recorded_rank, raw, timeout=300)))


def test_the_replay_finds_a_deadlock():
    """Two ranks that each post a receive before the send the other waits for: fine on gloo, a hang on NCCL."""
    comm = (0, 1)
    programs = {0: [("post", comm, [("recv", 1)]), ("post", comm, [("send", 1)])],
                1: [("post", comm, [("recv", 0)]), ("post", comm, [("send", 0)])]}
    assert len(deadlocked(programs)) == 4
    paired = {0: [("post", comm, [("recv", 1), ("send", 1)])], 1: [("post", comm, [("recv", 0), ("send", 0)])]}
    assert deadlocked(paired) == []


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_order(corpus, cache_dir, tmp_path, cp):
    programs = _programs(corpus, cache_dir, tmp_path, {"cp": cp})
    assert all(any(e[0] == "post" for e in events) for events in programs.values())
    assert deadlocked(programs) == []


# What the Pipeline really posts, for the schedules whose orders are the hardest (interleaved: a link
# carries two chunks' messages; zbv: the turn at the V's tip is no P2P); every schedule's plan is
# checked above without ranks. The order before p2p_order.py failed this (afab at pp=2 already).
@pytest.mark.parametrize("schedule, pp, virtual", [("1f1b", 4, 1), ("interleaved", 2, 2), ("zbv", 2, 2)])
def test_pipeline_order(corpus, cache_dir, tmp_path, schedule, pp, virtual):
    programs = _programs(corpus, cache_dir, tmp_path, {"pp": pp, "pp_schedule": schedule, "pp_virtual": virtual},
                         grad_acc=4)
    assert all(any(e[0] == "post" for e in events) for events in programs.values())
    assert deadlocked(programs) == []


def _planned_programs(name: str, pp: int, virtual: int, m: int, *, forward: bool = False) -> dict[int, list]:
    """Each rank's program under posting_plan (`forward`: of the forward-only pass, validation's, with the
    schedule's placement): a batch at each point, then the wait for the next action's input (its compute
    follows the wait; the next batch follows the compute)."""
    style = style_of(name)
    programs = {}
    for rank in range(pp):
        if forward:
            actions = forward_only(virtual, m)
            plan = orders_posting_plan([actions] * pp, pp=pp, virtual=virtual, rank=rank, style=style, split=False)
        else:
            plan = posting_plan(name, pp=pp, virtual=virtual, micro_batches=m, rank=rank)
            actions = schedule(name, pp=pp, virtual=virtual, micro_batches=m, rank=rank)
        events, posted_in, index = [], {}, 0
        for point, batch in enumerate(plan):
            if batch:
                events.append(("post", tuple(range(pp)), [(op.kind, op.peer) for op in batch]))
                posted_in.update({op.message: index for op in batch if op.kind == "recv"})
                index += 1
            need = receives(actions[point], pp=pp, virtual=virtual, rank=rank, style=style) \
                if point < len(actions) else None
            if need is not None and need[1] != rank:
                events.append(("wait", posted_in[need[0]]))  # posted by now, or KeyError
        programs[rank] = events
    return programs


PLANNED = [("afab", 2, 1), ("afab", 4, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 2, 2),
           ("interleaved", 4, 2), ("interleaved", 2, 3), ("zbh1", 2, 1), ("zbh1", 4, 1), ("zbv", 2, 2), ("zbv", 4, 2)]


@pytest.mark.parametrize("name, pp, virtual", PLANNED)
def test_posting_plan_cannot_deadlock(name, pp, virtual):
    """Every schedule, under several micro-batch counts, replayed under NCCL's rules: every batch finishes."""
    for m in sorted({1, pp, 2 * pp, 2 * pp + 1} if name != "interleaved" else {pp, 2 * pp, 3 * pp}):
        if name == "zbv" and m < pp:
            continue
        for forward in (False, True):
            programs = _planned_programs(name, pp, virtual, m, forward=forward)
            assert deadlocked(programs) == [], (name, pp, virtual, m, forward)
        sends = sum(kind == "send" for e in programs.values() for ev in e if ev[0] == "post" for kind, _ in ev[2])
        assert sends > 0
