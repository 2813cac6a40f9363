"""The planner's layer terms measured from each family's own layer (plan/probe.py): on fake tensors the same bytes
as on real ones, for every family and under tp, sp, cp and each recompute mode; measured once per shape."""

from __future__ import annotations

import dataclasses

import pytest

from tetron.config import from_dict, load_config
from tetron.plan import probe
from tetron.plan.activations import layer_kept, layer_none
from tetron.plan.sizes import Sizes

BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16}
FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen3": {"model_type": "qwen3"},  # q/k norms per head
    "olmo3": {"model_type": "olmo3"},  # q/k norms over the projection, norms after attention and the MLP
    "gemma3": {"model_type": "gemma3_text", "head_dim": 16},  # sandwich norms, GeGLU, alternating windows
    "deepseek_v3": {"model_type": "deepseek_v3", "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
                    "n_group": 2, "topk_group": 2, "rope_scaling": YARN},  # MLA: q/k heads of 24, v heads of 16
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}
LAYOUTS = {"one": {}, "tp2-sp": {"tp": 2, "sp": True}, "cp2-ring": {"cp": 2},
           "cp2-ulysses": {"cp": 2, "cp_impl": "ulysses"}}


def _config(family: str, parallel: dict, mode: str):
    return from_dict({"model": {**BASE, **FAMILIES[family]}, "parallel": parallel, "data": {"seq_len": 32},
                      "train": {"micro_batch": 2, "recompute": mode}})


# every family alone, and each layout with two families of different attention (the suite's time: a real layer's
# measurement takes a second or so, a fake one a tenth)
CASES = [(family, "one") for family in sorted(FAMILIES)] + [
    ("deepseek_v3", "tp2-sp"), ("qwen3", "tp2-sp"), ("olmo3", "cp2-ring"), ("qwen3_moe", "cp2-ring"),
    ("gemma3", "cp2-ulysses"), ("deepseek_v3", "cp2-ulysses")]


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_fake_layer_measures_as_the_real_one(family, layout):
    """The measurement on fake tensors (what the planner runs, at any size) equals the same code on real tensors
    to the byte: saved bytes of each kind of layer under each recompute mode (the layouts' collectives do nothing
    in either: the fake process group; the shapes are what they move)."""
    cfg = _config(family, LAYOUTS[layout], "none")
    for moe in (False, True) if hasattr(cfg.model, "num_experts") else (False,):
        p = probe.probe_of(cfg, moe)
        fake, real = probe._measure(p), probe._measure(p, fake=False)
        assert fake == real, moe
        assert 0 < fake["full"] < fake["selective"] <= fake["none"]


def test_a_small_layer_is_measured_on_real_tensors_a_large_one_on_fake(monkeypatch):
    """The planner measures a layer of a few thousand numbers on real tensors (faster than fake ones at that size;
    the bytes are the same, above and here in bf16), a real model's layer on fake ones."""
    seen = []
    real = probe._measure
    monkeypatch.setattr(probe, "_measure", lambda p, fake=True: seen.append(fake) or real(p, fake=fake))
    monkeypatch.setattr(probe, "_MEASURED", {})
    tiny = from_dict({"model": {**BASE, **FAMILIES["qwen3_moe"]}, "parallel": {"dp": 2, "ep": 2},
                      "data": {"seq_len": 32}, "train": {"micro_batch": 2, "dtype": "bfloat16"}})
    p = probe.probe_of(tiny, True)
    assert probe.saved_bytes(p, "none") == real(p)["none"] and seen == [False]
    large = load_config(None, ["--model", "llama-3-8b", "--seq-len", "8192", "--micro-batch", "1"])
    assert not probe._small(probe.probe_of(large, False))


def test_recompute_modes_keep_less_in_order():
    """Per kind of layer: full keeps the layer's input only ([B, T, H] in fp32 here), selective less than none."""
    cfg = _config("deepseek_v3", {}, "none")
    for moe in (False, True):
        s = Sizes.of(cfg)
        assert layer_kept(s, "full", moe) == 2 * 32 * 32 * 4
        assert layer_kept(s, "full", moe) < layer_kept(s, "selective", moe) < layer_none(s, moe)


def test_each_shape_is_measured_once(monkeypatch):
    """A search asks for the same layer shape for many layouts: the measurement runs once per (shape, mode)."""
    calls = []
    real = probe._measure
    monkeypatch.setattr(probe, "_measure", lambda p, **kw: calls.append(p) or real(p, **kw))
    monkeypatch.setattr(probe, "_MEASURED", {})
    for zero in (0, 1, 2, 3):
        for dp in (1, 2):
            cfg = from_dict({"model": {**BASE, "model_type": "llama"}, "parallel": {"tp": 2, "dp": dp, "zero": zero},
                             "data": {"seq_len": 32}, "train": {"micro_batch": 2}})
            layer_none(Sizes.of(cfg))
    assert len(calls) == 1
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=4))
    assert layer_none(Sizes.of(other)) == 2 * layer_none(Sizes.of(cfg))  # a micro-batch of 4 keeps twice 2's
    assert len(calls) == 2


@pytest.mark.parametrize("family, parallel", [("llama", {"cp": 2}), ("qwen3_moe", {"tp": 2, "sp": True}),
                                              ("qwen3_moe", {"dp": 2, "ep": 2}), ("deepseek_v3", {})],
                         ids=["llama-cp2", "qwen3_moe-tp2-sp", "qwen3_moe-ep2", "mla"])
def test_larger_micro_batches_are_read_off_two_measurements(family, parallel):
    """saved_bytes reads a micro-batch of 5 off the measurements of 1 and 2 sequences (2 and 3 under sequence
    parallelism): equal to measuring 5."""
    cfg = _config(family, parallel, "selective")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=5))
    for moe in (False, True) if hasattr(cfg.model, "num_experts") else (False,):
        p = probe.probe_of(cfg, moe)
        assert probe.saved_bytes(p, "selective") == probe._measure(p)["selective"]


@pytest.mark.parametrize("family, parallel", [("llama", {"cp": 8}), ("gemma3", {"cp": 4, "cp_layout": "contiguous"}),
                                              ("deepseek_v3", {"cp": 4, "tp": 2, "sp": True}),
                                              ("qwen3_moe", {"cp": 8, "dp": 2, "ep": 2})],
                         ids=["llama-cp8", "gemma3-cp4-contiguous", "mla-cp4-tp2-sp", "qwen3_moe-cp8-ep2"])
def test_a_ring_layer_is_measured_on_two_ranks_holding_as_many_tokens(family, parallel):
    """saved_bytes measures ring attention's layer on cp ranks as the same layer on 2 ranks of as many tokens each
    (probe.in_two_ranks: the ring's steps keep nothing for the backward past the last one's output): what the layer
    saves at its own cp, measured, equals that. A ring that kept something per step would fail here."""
    cfg = from_dict({"model": {**BASE, **FAMILIES[family]}, "parallel": parallel, "data": {"seq_len": 64},
                     "train": {"micro_batch": 1}})
    for moe in (False, True) if hasattr(cfg.model, "num_experts") else (False,):
        p = probe.probe_of(cfg, moe)
        two = probe.in_two_ranks(p)
        assert (two.cp, two.seq_len) == (2, 64 * 2 // p.cp)
        assert probe._measure(two) == probe._measure(p), moe
        assert probe.saved_bytes(p, "none") == probe._measure(p)["none"]


def test_a_real_run_after_a_measurement_computes_real_numbers():
    """What the model caches per shape (the sliding window's mask) is made afresh after a fake measurement: tetron
    train measures in the process that then forks its ranks, and a mask cached as a fake tensor made OLMo 3's
    layouts lose their loss (nan) or hang (CI, 2026-12-03). The same logits before and after, none of them fake."""
    import torch

    from tetron.device import clear_tensor_caches
    from tetron.models.llama import Llama
    from tetron.torch_private import is_fake

    cfg = from_dict({"model": {**BASE, "model_type": "olmo3", "sliding_window": 5}, "data": {"seq_len": 32},
                     "train": {"micro_batch": 2}})
    torch.manual_seed(0)
    model = Llama(cfg.model).eval()
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids)
        clear_tensor_caches()  # as a fresh process: the measurement below is the first to ask for the mask
        probe._measure(probe.probe_of(cfg, False))  # fake tensors; the same window mask's shape as the forward's
        after = model(ids)
    assert not is_fake(after)
    assert torch.equal(before, after)


def test_a_single_process_with_its_own_group_is_measured_in_it():
    """A process that already holds a group of one rank (bench/gpu_check.py plans the micro-batch beside its own
    training) is measured in that group, to the same bytes; a one-rank layer needs no fake group of its own."""
    import torch.distributed as dist

    cfg = _config("olmo3", {}, "none")
    p = probe.probe_of(cfg, False)
    alone = probe._measure(p)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert probe._measure(p) == alone
        with pytest.raises(RuntimeError, match="process group of its own"):
            probe._measure(probe.probe_of(_config("olmo3", {"tp": 2}, "none"), False))
    finally:
        dist.destroy_process_group()
