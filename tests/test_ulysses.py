"""Ulysses (all-to-all) context parallelism: attention and its gradients against full-sequence attention,
training against the single process, the config field, its flag and its one-line refusal."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetron.config import ConfigError, from_dict, load_config
from tetron.mesh import Mesh
from tetron.overrides import SHORT_FLAGS
from tetron.parallel.context_parallel import apply_context_parallel, ring_attention, shard_indices
from tetron.parallel.init import seeded_model
from tetron.parallel.recompute import apply_recompute
from tetron.parallel.ulysses import all_to_all, kv_repeats, ulysses_attention
from tetron.plan.activations import layer_activations
from tetron.plan.hardware import gpu
from tetron.plan.sizes import Sizes
from tetron.plan.steptime import estimate
from tetron.validate import validate

from conftest import check_layout, tiny_config
from harness import run_ranks, saved_bytes

# (query heads, kv heads) per tp rank: MHA, GQA with kv heads divisible by cp, and fewer kv heads than
# cp or not divisible by it (repeated): at cp 2, 6/3 repeats each kv head twice; at cp 4, 4/1 four times.
HEADS = {2: [(4, 4), (4, 2), (6, 3), (2, 1)], 4: [(4, 4), (8, 2), (4, 1), (12, 3)]}


def _full_attention(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)


def _attention_rank(T: int, layout: str) -> list[dict]:
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(cp=cp)
    shards = functools.partial(shard_indices, layout=layout)
    idx = shard_indices(T, cp, rank, layout=layout)
    results = []
    for heads, kv_heads in HEADS[cp]:
        g = torch.Generator().manual_seed(heads * 100 + kv_heads)  # the same full tensors on every rank
        q = torch.randn(2, heads, T, 16, generator=g, dtype=torch.float64)
        k = torch.randn(2, kv_heads, T, 16, generator=g, dtype=torch.float64)
        v = torch.randn(2, kv_heads, T, 16, generator=g, dtype=torch.float64)
        dout = torch.randn(2, heads, T, 16, generator=g, dtype=torch.float64)
        # Ulysses in fp32 on this rank's positions, the reference in fp64 on the whole sequence
        local = [t[:, :, idx].float().requires_grad_(True) for t in (q, k, v)]
        out = ulysses_attention(*local, mesh=mesh, shards=shards)
        out.backward(dout[:, :, idx].float())
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = _full_attention(*full)
        ref.backward(dout)
        results.append({"heads": (heads, kv_heads), "out": out.detach().double(),
                        "ref": ref.detach()[:, :, idx], "grads": [t.grad.double() for t in local],
                        "ref_grads": [t.grad[:, :, idx] for t in full]})
    return results


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_attention_equals_full_attention(cp, layout):
    """Forward and the gradients of q, k and v, for MHA, GQA and kv heads repeated to reach cp."""
    for per_rank in run_ranks(cp, _attention_rank, 32, layout):
        for r in per_rank:
            # fp32 against an fp64 reference: 1e-5 covers fp32 rounding over 32 keys
            torch.testing.assert_close(r["out"], r["ref"], rtol=1e-5, atol=1e-5, msg=str(r["heads"]))
            for name, got, want in zip("qkv", r["grads"], r["ref_grads"]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"d{name} {r['heads']}")


def _all_to_all_rank() -> dict:
    cp, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 3 * cp, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = all_to_all(x, group, scatter_dim=1, gather_dim=2)  # [2, 3, 5*cp, 4]
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (y * w).sum().backward()
    # what the backward must be: the inverse all-to-all of w (the map is a permutation across ranks)
    back = all_to_all(w, group, scatter_dim=2, gather_dim=1)
    # the forward by hand: rank j receives the j-th head group of every rank, in rank order
    everyone = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(everyone, x.detach())
    expected = torch.cat([e.chunk(cp, dim=1)[rank] for e in everyone], dim=2)
    return {"y": y.detach(), "expected": expected, "grad": x.grad, "back": back, "round_trip":
            all_to_all(y.detach(), group, scatter_dim=2, gather_dim=1), "x": x.detach()}


def test_all_to_all_and_its_inverse():
    for r in run_ranks(4, _all_to_all_rank):
        assert r["y"].shape == (2, 3, 20, 4)
        torch.testing.assert_close(r["y"], r["expected"], rtol=0, atol=0)
        torch.testing.assert_close(r["round_trip"], r["x"], rtol=0, atol=0)
        torch.testing.assert_close(r["grad"], r["back"], rtol=0, atol=0)


def test_kv_repeats_keep_each_query_head_on_its_kv_head():
    """Repeating each kv head r times must leave query head h on kv head h // group, and make cp divide
    the kv heads: checked by mapping every query head through the split that each cp rank gets."""
    for heads in range(1, 33):
        for kv_heads in (k for k in range(1, heads + 1) if heads % k == 0):
            for cp in (c for c in range(1, 17) if heads % c == 0):
                r = kv_repeats(heads, kv_heads, cp)
                assert (kv_heads * r) % cp == 0 and (heads // kv_heads) % r == 0
                assert r == 1 or kv_heads % cp  # no repetition where cp already divides
                q_local, kv_local, group = heads // cp, kv_heads * r // cp, heads // (kv_heads * r)
                for h in range(heads):
                    rank, i = divmod(h, q_local)
                    repeated = rank * kv_local + i // group  # the kv head the kernel pairs it with
                    assert repeated // r == h // (heads // kv_heads), (heads, kv_heads, cp, h)
    with pytest.raises(ValueError, match="divisible by cp"):
        kv_repeats(6, 2, 4)


# ----------------------------------------------------------------------------- config, flag, refusal


def test_cp_impl_field_flag_and_refusal(corpus, cache_dir, tmp_path):
    assert from_dict({}).parallel.cp_impl == "ring"
    assert SHORT_FLAGS["cp-impl"] == "parallel.cp_impl"
    for args in (["--cp-impl", "ulysses"], ["--cp-impl=ulysses"]):
        assert load_config(None, args).parallel.cp_impl == "ulysses"
    with pytest.raises(ConfigError, match=r"parallel.cp_impl='allgather'.*ring or ulysses"):
        load_config(None, ["--cp-impl", "allgather"])
    # 4 query heads: tp 2 leaves 2 per rank, which cp 4 does not divide
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel={"tp": 2, "cp": 4, "cp_impl": "ulysses"})
    with pytest.raises(ConfigError) as info:
        validate(from_dict(raw))
    message = str(info.value)
    assert "\n" not in message
    for needle in ("parallel.cp_impl=ulysses", "num_attention_heads=4", "tp=2", "= 2", "cp=4", "cp_impl=ring"):
        assert needle in message, message
    validate(from_dict({**raw, "parallel": {"tp": 2, "cp": 4}}))  # ring attention takes any cp
    validate(from_dict({**raw, "parallel": {"tp": 2, "cp": 2, "cp_impl": "ulysses"}}))


# ----------------------------------------------------------------------------- training


LAYOUTS = {
    # cp 2 zigzag, GQA 4/2 (kv heads divide cp), activations recomputed (the all-to-alls run again)
    "cp2-full-recompute": ({"cp": 2}, {}, {"recompute": "full"}),
    # cp 4, 4 query heads over 1 kv head: the kv head is repeated to every cp rank; contiguous layout
    "cp4-mqa-contiguous": ({"cp": 4, "cp_layout": "contiguous"}, {"num_key_value_heads": 1}, {}),
    # tp 2 leaves 2 query heads and 1 kv head per rank: cp 2 splits the queries, repeats the kv head
    "cp2-tp2-sp": ({"cp": 2, "tp": 2, "sp": True}, {}, {}),
    "cp2-pp2": ({"cp": 2, "pp": 2, "pp_schedule": "1f1b"}, {}, {}),
    "dp2-cp2-zero2": ({"dp": 2, "cp": 2, "zero": 2, "bucket_mb": 0.01}, {}, {}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ulysses_training_matches_single_process(corpus, cache_dir, tmp_path, name):
    parallel, model, train = LAYOUTS[name]
    check_layout(corpus, cache_dir, tmp_path, parallel={**parallel, "cp_impl": "ulysses"}, model=model,
                 train=train)


# ----------------------------------------------------------------------------- the planner


def _saved_storage_bytes(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> int:
    """Bytes autograd saves in one forward, weights left out, by storage (q, k and v as views into one
    all-to-all buffer count that buffer once)."""
    with saved_bytes(model, by_storage=True) as found:
        logits = model(ids, positions)
    logits.sum().backward()
    return sum(found.values())


def _layer_saved_bytes(cases: list[dict]) -> list[int]:
    """Per case: the bytes autograd saves for one decoder layer under Ulysses attention on this cp rank
    (a 2-layer model's saved bytes less a 1-layer model's: embedding, RoPE tables, head cancel)."""
    results = []
    for raw in cases:
        cfg = from_dict(raw)
        mesh = Mesh(cp=cfg.parallel.cp)
        seq, cp = cfg.data.seq_len, cfg.parallel.cp
        mine = shard_indices(seq, cp, mesh.local_rank("cp"), layout=cfg.parallel.cp_layout)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, seq),
                            generator=torch.Generator().manual_seed(0))
        saved = []
        for layers in (1, 2):
            model = seeded_model(replace(cfg.model, num_hidden_layers=layers), seed=0, device=torch.device("cpu"))
            apply_context_parallel(model, mesh, layout=cfg.parallel.cp_layout, impl=cfg.parallel.cp_impl)
            apply_recompute(model, cfg.train.recompute)
            saved.append(_saved_storage_bytes(model, ids[:, mine], mine))
        results.append(saved[1] - saved[0])
    return results


def test_planner_knows_what_ulysses_keeps(corpus, cache_dir, tmp_path):
    """What a layer keeps under Ulysses differs from ring attention (k and v repeated to the query heads for
    the kernel; under the contiguous layout the kernel's q is a view that keeps the all-to-all's k and v
    too): the memory model's layer_none, to the byte, for grouped and ungrouped heads in both layouts; under
    selective recomputation layer_kept (the kernel's output and log-sum-exp not kept: o_proj keeps the
    all-to-all's copy)."""
    cases = []
    for layout, kv_heads, mode in (("zigzag", 2, "none"), ("contiguous", 2, "none"), ("contiguous", 4, "none"),
                                   ("zigzag", 1, "none"), ("zigzag", 2, "selective"), ("contiguous", 2, "selective")):
        cases.append(tiny_config(corpus, cache_dir, tmp_path / "run", data={"seq_len": 64},
                                 model={"num_key_value_heads": kv_heads, "max_position_embeddings": 64},
                                 parallel={"cp": 2, "cp_impl": "ulysses", "cp_layout": layout},
                                 train={"recompute": mode}))
    for per_rank in run_ranks(2, _layer_saved_bytes, cases):
        for raw, measured in zip(cases, per_rank):
            cfg = from_dict(raw)
            assert measured == layer_activations(Sizes.of(cfg), cfg.train.recompute), (
                cfg.parallel.cp_layout, cfg.model.num_key_value_heads, cfg.train.recompute)


def test_planner_counts_ulysses_all_to_all_bytes():
    """Step time's cp term under Ulysses: per layer and micro-batch, q, k, v (kv heads repeated to cp) and
    the output cross (cp-1)/cp forward and the same backward, at the link's bandwidth, nothing hidden."""
    hw = replace(gpu("H100"), latency_s=0.0)
    raw = {"model": {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 4096},
           "data": {"seq_len": 4096}, "train": {"micro_batch": 1, "grad_acc": 3}}
    for cp in (2, 4, 8):
        cfg = from_dict({**raw, "parallel": {"cp": cp, "cp_impl": "ulysses"}})
        tokens, hd = 4096 // cp, 32
        kv_heads = 2 * kv_repeats(8, 2, cp)  # 2 at cp 2, 4 at cp 4, 8 at cp 8
        per_layer = 2 * (cp - 1) / cp * tokens * 4 * hd * (2 * 8 + 2 * kv_heads) / (hw.intra_gbs * 1e9)
        got = estimate(cfg, hw, gpus_per_node=8).cp_s
        assert got == pytest.approx(3 * 2 * per_layer, rel=1e-9), cp


# ----------------------------------------------------------------------------- the benchmark's byte counts


def _sent_bytes_rank(seq: int, heads: int, kv_heads: int) -> dict[str, int]:
    """Bytes this rank really sends in one forward+backward of each implementation, counted in the
    collectives they call (an all-to-all keeps the part addressed to this rank)."""
    cp = dist.get_world_size()
    mesh = Mesh(cp=cp)
    counted = {"sent": 0}
    real_a2a, real_p2p = dist.all_to_all_single, dist.batch_isend_irecv

    def a2a(output, input, *args, **kwargs):
        counted["sent"] += input.numel() * input.element_size() * (cp - 1) // cp
        return real_a2a(output, input, *args, **kwargs)

    def p2p(ops):
        counted["sent"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_p2p(ops)

    dist.all_to_all_single, dist.batch_isend_irecv = a2a, p2p
    try:
        result = {}
        for name, fn in (("ring", functools.partial(ring_attention, mesh=mesh, layout="zigzag")),
                         ("ulysses", functools.partial(ulysses_attention, mesh=mesh,
                                                       shards=functools.partial(shard_indices, layout="zigzag")))):
            counted["sent"] = 0
            q = torch.randn(1, heads, seq // cp, 16, requires_grad=True)
            k, v = (torch.randn(1, kv_heads, seq // cp, 16, requires_grad=True) for _ in range(2))
            fn(q, k, v).sum().backward()
            result[name] = counted["sent"]
        return result
    finally:
        dist.all_to_all_single, dist.batch_isend_irecv = real_a2a, real_p2p


def test_bench_sent_bytes_are_what_is_sent():
    """bench/context_parallel.py's per-rank byte counts (the README's table) against the bytes the two
    implementations hand to their collectives, at cp 4 with MHA and with kv heads repeated."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from context_parallel import sent_bytes

    for heads, kv_heads in ((4, 4), (8, 2)):
        for counted in run_ranks(4, _sent_bytes_rank, 32, heads, kv_heads):
            for impl in ("ring", "ulysses"):
                assert counted[impl] == sent_bytes(impl, cp=4, seq=32, heads=heads, kv_heads=kv_heads, head_dim=16)
