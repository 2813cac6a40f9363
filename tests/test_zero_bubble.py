"""Zero-bubble pipeline schedules (zbh1, zbv): their orders on their own, the B/W split of a backward
against a plain backward, and training against the single process (several layouts per launch)."""

from __future__ import annotations

import copy
import json
import weakref
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.errors import ConfigError
from tetron.models.llama import Llama, LlamaConfig
from tetron.parallel.pipeline_schedules import (
    peak_in_flight,
    rank_of,
    receives,
    schedule,
    sends,
    simulate,
    stage_of,
    style_of,
    theoretical_bubble,
    unit_duration,
)
from tetron.parallel.recompute import apply_recompute
from tetron.parallel.weight_grad import backward_input, backward_weight
from tetron.plan.hardware import gpu
from tetron.plan.memory import predict_rank
from tetron.plan.steptime import estimate
from tetron.validate import validate

from conftest import LAYOUT_LR, LOSS_RTOL, STEPS, WEIGHT_ATOL, tiny_config, train_rank
from harness import run_ranks

# ----------------------------------------------------------------------------- schedules, no processes

CASES = [(name, p, m) for name in ("zbh1", "zbv") for p in (2, 3, 4, 8)
         for m in sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p} - {0})]
CASES += [("dualpipev", p, m) for p in (2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 3 * p)]  # it needs 2p or more


def _virtual(name: str) -> int:
    return 2 if style_of(name) == "v" else 1


@pytest.mark.parametrize("name, p, m", CASES)
def test_zero_bubble_order(name, p, m):
    v = _virtual(name)
    style = style_of(name)
    sent, taken = Counter(), Counter()
    for rank in range(p):
        order = schedule(name, pp=p, virtual=v, micro_batches=m, rank=rank)
        # every (chunk, micro-batch) has one F, then one B, then one W
        assert Counter(order) == Counter(a for c in range(v) for i in range(m) for a in order
                                         if (a.chunk, a.micro) == (c, i))
        for c in range(v):
            for i in range(m):
                kinds = [a.kind for a in order if (a.chunk, a.micro) == (c, i)]
                assert kinds == ["F", "B", "W"], (rank, c, i, kinds)
        # memory: zbh1 holds at most p micro-batches from F to W on every rank (1F1B's rank 0), zbv at
        # most 2p chunk passes (p micro-batches of a rank's layers), both reached once m is large enough
        if name == "zbh1":
            assert peak_in_flight(order) == min(m, p)
        elif name == "zbv":
            assert peak_in_flight(order) <= 2 * p and (m < 2 * p - 1 or peak_in_flight(order) == 2 * p)
        else:  # DualPipeV: one pair more than zbv on the ranks that start a whole backward before their last F
            assert peak_in_flight(order) <= 2 * p + 1
        for a in order:
            if (out := sends(a, pp=p, virtual=v, rank=rank, style=style)) is not None:
                sent[(out[0], rank, out[1])] += 1
            if (need := receives(a, pp=p, virtual=v, rank=rank, style=style)) is not None:
                taken[(need[0], need[1], rank)] += 1
    # every message is sent once and taken once, by the rank it was sent to
    assert sent == taken and set(sent.values()) == {1}
    # no deadlock, and with F = B = W and free communication, exactly the idle time the docstring says
    bubble = simulate(name, pp=p, virtual=v, micro_batches=m, duration=unit_duration(name, v))
    assert max(bubble) == pytest.approx(theoretical_bubble(name, pp=p, virtual=v, micro_batches=m), abs=1e-12)
    if m >= p:
        # idle time in forward-times: 1F1B 3(p-1), ZB-H1 a third of it, ZB-V (p-1)/2 once the V is full
        idle = max(bubble) / (1 - max(bubble)) * 3 * m
        one_f_one_b = simulate("1f1b", pp=p, virtual=1, micro_batches=m, duration=unit_duration("1f1b", 1))
        assert max(one_f_one_b) / (1 - max(one_f_one_b)) * 3 * m == pytest.approx(3 * (p - 1))
        if name == "zbh1":
            assert idle == pytest.approx(p - 1)
        elif 2 * m >= 3 * p - 1:
            assert idle == pytest.approx((p - 1) / 2)


def test_zbv_places_stages_in_a_v():
    p = 4
    assert [stage_of(c, r, pp=p, style="v") for r in range(p) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert [rank_of(s, pp=p, style="v") for s in range(2 * p)] == [0, 1, 2, 3, 3, 2, 1, 0]
    # rank p-1 hands its chunk 0's output to its own chunk 1, and gradients back the same way
    order = schedule("zbv", pp=p, virtual=2, micro_batches=8, rank=p - 1)
    assert {sends(a, pp=p, virtual=2, rank=p - 1, style="v")[1] for a in order if a.kind != "W"
            and (a.chunk, a.kind) in ((0, "F"), (1, "B"))} == {p - 1}


def test_plan_knows_the_zero_bubble_schedules():
    """tetron plan: the predicted bubble is the schedule's, and the activations held are 1F1B's at most
    (its rank 0's: ZB-H1 holds p micro-batches from F to W on every rank, ZB-V 2p half-chunks)."""
    hw = replace(gpu("H100"), latency_s=0.0, overhead_s=0.0, intra_gbs=1e12, inter_gbs=1e12)
    model = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
             "vocab_size": 8, "num_hidden_layers": 8}

    def plan(name: str, virtual: int):
        cfg = from_dict({"model": model, "train": {"grad_acc": 8},
                         "parallel": {"pp": 4, "pp_schedule": name, "pp_virtual": virtual}})
        return estimate(cfg, hw, gpus_per_node=8).bubble, [predict_rank(cfg, r).activations for r in range(4)]

    _, one_f_one_b = plan("1f1b", 1)
    for name, virtual in (("zbh1", 1), ("zbv", 2), ("dualpipev", 2)):
        bubble, held = plan(name, virtual)
        assert bubble == pytest.approx(theoretical_bubble(name, pp=4, virtual=virtual, micro_batches=8), abs=1e-9)
        if name == "dualpipev":  # 2p+1 half-chunks at its peak (zbv's 2p): 9/8 of the layers' (14% here, the
            # V's last stage and its logits on rank 0 too), none of it more than the planner walks
            assert one_f_one_b[0] * 9 / 8 <= held[0] <= 1.15 * one_f_one_b[0], held[0] / one_f_one_b[0]
            continue
        # within one [tokens, hidden] fp32 tensor (256 x 256 x 4 bytes: ZB-V's rank 0 also holds the last chunk;
        # was rel=1e-3 of 1F1B's, 303k bytes, before fused norms and MLPs shrank the layers' 1.5x)
        assert held[0] == pytest.approx(one_f_one_b[0], abs=256 * 256 * 4)
        assert max(held) <= 1.07 * one_f_one_b[0]  # the last rank keeps its loss's logits until W


@pytest.mark.parametrize("parallel, model, train, needle", [
    ({"pp_schedule": "zbv", "pp_virtual": 1}, {}, {}, "pp_virtual=2"),
    ({"pp_schedule": "zbh1"}, {}, {"compile": True}, "compile"),
    ({"pp_schedule": "zbv", "pp_virtual": 2}, {}, {}, ""),  # the controls: valid
    ({"pp_schedule": "zbh1", "dp": 2, "zero": 3}, {}, {"recompute": "selective"}, ""),
    ({"pp_schedule": "dualpipev", "pp_virtual": 2}, {}, {"grad_acc": 3}, "grad_acc=4 or more"),
    ({"pp_schedule": "dualpipev", "pp_virtual": 2}, {}, {"grad_acc": 4}, ""),
], ids=["zbv-one-chunk", "compile", "valid", "valid-zero3-recompute", "dualpipev-few-micro-batches",
        "valid-dualpipev"])
def test_zero_bubble_refusals(tmp_path, parallel, model, train, needle):
    raw = {"model": {"num_hidden_layers": 4, **model}, "parallel": {"pp": 2, **parallel}, "train": train,
           "data": {"path": str(tmp_path / "x.txt"), "tokenizer": "bytes"}, "out": str(tmp_path / "out")}
    (tmp_path / "x.txt").write_text("hello world " * 100)
    if not needle:
        validate(from_dict(raw))
        return
    with pytest.raises(ConfigError) as err:
        validate(from_dict(raw))
    message = str(err.value)
    assert needle in message and "pp_schedule=" in message and "\n" not in message


# ----------------------------------------------------------------------------- the B/W split


def _chunk(first: bool) -> Llama:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Llama(config)
    if not first:
        model.model.embed_tokens = None
    return model


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
@pytest.mark.parametrize("first", [False, True], ids=["middle-stage", "first-stage"])
def test_split_backward_equals_backward(first, recompute):
    """B then W give the input gradient and every weight gradient of a plain backward, bit for bit; B
    accumulates nothing, W fires each weight's accumulation hook once (data parallelism's buckets).
    With recompute, B recomputes each layer and W reuses what B built. W of a stage with a B reads no
    parameter (ZeRO-3 frees them all after B): here their storage is empty while it runs."""
    model = _chunk(first)
    plain = copy.deepcopy(model)
    apply_recompute(model, recompute, split=True)
    params = list(model.parameters())
    fired = Counter()
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: fired.update([id(q)]))
    positions = torch.arange(16)
    torch.manual_seed(1)
    inputs = torch.randint(0, 64, (2, 16)) if first else torch.randn(2, 16, 32)
    grad_out = torch.randn(2, 16, 64)

    def run(split: bool):
        model.zero_grad(set_to_none=True)
        fired.clear()
        x = inputs if first else inputs.clone().requires_grad_()
        if not split:
            plain(x, positions).backward(grad_out)
            return None if first else x.grad, {n: p.grad.clone() for n, p in plain.named_parameters()}
        out = model(x, positions)
        dx, pending = backward_input(out, grad_out, None if first else x, params)
        assert all(p.grad is None for p in params) and not fired
        assert (dx is None) == first
        values = [p.detach().clone() for p in params]
        for p in params if not first else []:  # the first stage's W is its whole backward: it reads them
            p.untyped_storage().resize_(0)
        backward_weight(pending)
        for p, value in zip(params, values):
            p.untyped_storage().resize_(value.numel() * value.element_size())
            p.data.copy_(value)
        return dx, {n: p.grad.clone() for n, p in model.named_parameters()}

    dx, grads = run(False)
    dx_split, grads_split = run(True)
    assert sorted(fired.values()) == [1] * len(params)
    if not first:
        assert torch.equal(dx, dx_split)
    for name, g in grads.items():
        assert torch.equal(g, grads_split[name]), name


def test_split_backward_where_the_output_ignores_the_input():
    """No path back to the input: B returns a zero gradient and W still produces the weights' gradients."""
    w = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    out = (w * 2).sum() + 0 * x.detach().sum()
    dx, pending = backward_input(out, None, x, [w])
    assert torch.equal(dx, torch.zeros(3)) and w.grad is None
    backward_weight(pending)
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_a_weight_used_twice_on_the_input_path_is_refused():
    """(x W) W: W's two uses lie one below the other, so W's run from the upper one would count the lower
    one's gradient twice; B says so instead of returning wrong gradients."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="two depths"):
        backward_input((x @ w @ w).sum(), None, x, [w])
    side_by_side = (x @ w).sum() + (x.sin() @ w).sum()  # two uses, neither below the other: fine
    dx, pending = backward_input(side_by_side, None, x, [w])
    backward_weight(pending)
    x2 = x.detach().requires_grad_()
    w.grad, reference = None, w.grad.clone()
    ((x2 @ w).sum() + (x2.sin() @ w).sum()).backward()
    assert torch.allclose(w.grad, reference) and torch.allclose(x2.grad, dx)


def test_weight_pass_releases_the_graph():
    """What B keeps (the graph's saved activations) is gone once W has run and its record is dropped."""
    model = _chunk(False)
    x = torch.randn(2, 16, 32, requires_grad=True)
    saved: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        held = t.detach()  # what the graph holds; only the graph refers to it
        if not isinstance(t, torch.nn.Parameter):
            saved.append(weakref.ref(held))
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, torch.arange(16))
    _, pending = backward_input(out, torch.randn(2, 16, 64), x, list(model.parameters()))
    del out
    assert sum(r() is not None for r in saved) > 10  # B kept the activations for W
    backward_weight(pending)
    del pending
    assert [r() for r in saved if r() is not None] == []


def test_weight_pass_accumulates_in_one_order():
    """W accumulates the weights in the graph's order, whatever the objects' addresses (sets of nodes or
    parameters iterate by them): the order in which data parallelism's buckets fill and reduce, so it must
    be the same on every rank. Copies of one chunk (other addresses) fire their hooks in one order."""
    torch.manual_seed(0)
    base = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    base.model.embed_tokens = None
    orders = []
    for _ in range(3):
        model = apply_recompute(copy.deepcopy(base), "full", split=True)  # each layer's W nested in the stage's
        order: list[str] = []
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda q, name=name, order=order: order.append(name))
        x = torch.randn(2, 16, 32, requires_grad=True)
        _, pending = backward_input(model(x, torch.arange(16)), torch.randn(2, 16, 64), x, list(model.parameters()))
        backward_weight(pending)
        orders.append(order)
    assert orders[0] == orders[1] == orders[2] and sorted(orders[0]) == sorted(n for n, _ in base.named_parameters())


def test_recomputed_layer_keeps_only_what_w_reads(monkeypatch):
    """With recompute under the split, B rebuilds each layer; from B to W the layer keeps of that graph only
    what W reads (the norms' inputs and 1/rms, the matmuls' inputs, the MLP's gate and up: 4h + hq + 2i values
    and two fp32 statistics a token here), and W frees that too."""
    from tetron.parallel import recompute

    kept: list[tuple[int, int, list]] = []
    keep_only = recompute._Boxes.keep_only

    def activation_bytes(boxes: list) -> int:  # storages of saved activations, once each (not weights' views)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        sizes = {b[0].untyped_storage().data_ptr(): b[0].untyped_storage().nbytes() for b in boxes
                 if isinstance(b[0], torch.Tensor)}
        return sum(n for ptr, n in sizes.items() if ptr not in weights)

    def spy(self, nodes):
        boxes, before = list(self.boxes), activation_bytes(self.boxes)
        keep_only(self, nodes)
        kept.append((before, activation_bytes(boxes), [weakref.ref(b[0]) for b in boxes if b[0] is not None]))

    monkeypatch.setattr(recompute._Boxes, "keep_only", spy)
    model = apply_recompute(_chunk(False), "full", split=True)
    x = torch.randn(2, 16, 32, requires_grad=True)
    _, pending = backward_input(model(x, torch.arange(16)), torch.randn(2, 16, 64), x, list(model.parameters()))
    h, hq, i, tokens = 32, 32, 64, 32
    assert [(before > 0, after) for before, after, _ in kept] == [(True, 4 * tokens * (4 * h + hq + 2 * i + 2))] * 2
    # less than all it saves (under half before the norms and MLPs saved only what their backward needs: the
    # attention's q, k, v and output, which B alone reads, are the rest now)
    assert all(after < 0.8 * before for before, after, _ in kept), kept
    backward_weight(pending)
    del pending
    assert [r for _, _, refs in kept for r in refs if r() is not None and not isinstance(r(), torch.nn.Parameter)] == []


# ----------------------------------------------------------------------------- training runs


def _train_all(raws: list[dict], trace: bool) -> list[dict]:
    """On one rank: train each raw config in turn (one launch for several layouts)."""
    return [train_rank(raw, trace=trace) for raw in raws]


def _run_many(raws: list[dict], *, trace: bool) -> list[tuple[list[dict], dict]]:
    """Every raw config (all of one world size), on one forked launch; per config every rank's result
    and what rank 0 wrote (metrics records, the saved model)."""
    cfgs = [from_dict(raw) for raw in raws]
    for cfg in cfgs:
        validate(cfg)
        prepare_data(cfg)
    world = {cfg.world_size for cfg in cfgs}
    assert len(world) == 1
    per_rank = run_ranks(world.pop(), _train_all, raws, trace, timeout=600)
    out = []
    for k, cfg in enumerate(cfgs):
        metrics = (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()
        out.append(([results[k] for results in per_rank],
                    {"metrics": [json.loads(line) for line in metrics],
                     "model": load_file(Path(cfg.out) / "model" / "model.safetensors")}))
    return out


def _assert_same(run: tuple[list[dict], dict], ref: tuple[list[dict], dict], what: str) -> None:
    (results, written), (ref_results, ref_written) = run, ref
    expected = torch.tensor(ref_results[0]["losses"])
    assert len(expected) == STEPS
    for losses in [*(r["losses"] for r in results), [m["loss"] for m in written["metrics"]]]:
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=LOSS_RTOL, atol=0, msg=what)
    assert written["model"].keys() == ref_written["model"].keys()
    for name, value in written["model"].items():
        torch.testing.assert_close(value, ref_written["model"][name], rtol=0, atol=WEIGHT_ATOL,
                                   msg=f"{what}: {name}")


def _assert_ran(results: list[dict], name: str, *, pp: int, virtual: int, m: int) -> None:
    """Each rank ran its schedule's F, B and W in order, held what the schedule says, kept no sent output."""
    for result in results:
        trace = result["trace"]
        order = schedule(name, pp=pp, virtual=virtual, micro_batches=m, rank=trace.rank)
        assert [(kind, c, i) for kind, c, i, _, _ in trace.events] == [(a.kind, a.chunk, a.micro) for a in order]
        assert trace.peak_in_flight == peak_in_flight(order)
        assert trace.peak_output_elements == 0


MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# (name, parallel, model, micro-batches[, train]): pp 2 and 4, m = pp and 2pp, with dp (naive; buckets under ZeRO
# 1, 2 and 3), tp (+sp), cp, tied embeddings, recompute (full, selective; B recomputes, W reuses what B built)
LAYOUTS = {
    2: [
        ("zbh1", {"pp": 2}, {}, 2),
        ("zbh1", {"pp": 2}, {"tie_word_embeddings": True}, 4, {"recompute": "full"}),
        ("zbv", {"pp": 2}, {}, 2),
        ("zbv", {"pp": 2}, {}, 4, {"recompute": "selective"}),
        ("zbv", {"pp": 2}, {"tie_word_embeddings": True}, 4),  # both copies on rank 0: summed there
        ("dualpipev", {"pp": 2}, {"tie_word_embeddings": True}, 4),
        ("dualpipev", {"pp": 2}, {}, 5, {"recompute": "full"}),
    ],
    4: [
        ("zbh1", {"pp": 4}, {}, 4),
        ("zbh1", {"pp": 4}, {}, 8),
        ("zbv", {"pp": 4}, {"num_hidden_layers": 8}, 4),
        ("zbv", {"pp": 4}, {"num_hidden_layers": 8}, 8),
        ("zbv", {"pp": 2, "dp": 2, "zero": 3}, {"tie_word_embeddings": True}, 2),  # B frees, W reads no weight
        ("zbh1", {"pp": 2, "dp": 2, "dp_impl": "naive"}, {}, 4),
        ("zbv", {"pp": 2, "dp": 2, "zero": 2, "bucket_mb": 0.01}, {}, 4),
        ("zbv", {"pp": 2, "dp": 2, "zero": 1}, {"tie_word_embeddings": True}, 2),
        # two layers a chunk: their W's accumulate (and ZeRO-3's buckets reduce) in one order on every rank
        ("zbh1", {"pp": 2, "dp": 2, "zero": 3}, {}, 4, {"recompute": "selective"}),
        ("zbv", {"pp": 2, "tp": 2, "sp": True}, {}, 2),
        ("zbh1", {"pp": 2, "cp": 2}, {}, 4),
        ("dualpipev", {"pp": 4}, {"num_hidden_layers": 8}, 8),
        ("dualpipev", {"pp": 2, "dp": 2, "zero": 3}, {}, 4, {"recompute": "selective"}),
        ("dualpipev", {"pp": 2, "dp": 2, "zero": 2, "bucket_mb": 0.01}, {}, 4),
        ("dualpipev", {"pp": 2, "dp": 2, "zero": 1}, {}, 4),
        ("dualpipev", {"pp": 2, "dp": 2, "ep": 2, "zero": 1}, MOE, 4),
    ],
}


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_zero_bubble_matches_single_process(corpus, cache_dir, tmp_path, world):
    cases, raws, refs = LAYOUTS[world], [], []
    for k, (name, parallel, model, m, *train) in enumerate(cases):
        model = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, **model}
        virtual = _virtual(name)
        dp = parallel.get("dp", 1)
        raws.append(tiny_config(corpus, cache_dir, tmp_path / f"run{k}", model=model,
                                parallel={**parallel, "pp_schedule": name, "pp_virtual": virtual},
                                train={"micro_batch": 1, "grad_acc": m, "lr": LAYOUT_LR, **(train or [{}])[0]}))
        refs.append(tiny_config(corpus, cache_dir, tmp_path / f"ref{k}", model=model,
                                train={"micro_batch": m * dp, "grad_acc": 1, "lr": LAYOUT_LR}))
    runs = _run_many(raws, trace=True)
    expected = _run_many(refs, trace=False)
    for (name, parallel, _, m, *train), run, ref in zip(cases, runs, expected):
        what = f"{name} {parallel} m={m} {train}"
        _assert_same(run, ref, what)
        _assert_ran(run[0], name, pp=parallel["pp"], virtual=_virtual(name), m=m)
