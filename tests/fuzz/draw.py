"""Random configurations from the space `validate` accepts, drawn from a seed: the layout fuzzer's first half.

A draw is a dict of config sections (model, parallel, train, data, optim, checkpoint) without paths; the runner
(tests/fuzz_layouts.py) adds the corpus, the cache and the run folder. The families, schedules and optimizers come
from tetron's own registries, so a family, schedule or optimizer registered later is drawn without a change here.
Most draws are built to pass validation (sizes that divide); a share are "wild" (sizes drawn without regard to
each other), so that the fuzzer also meets the refusals and checks that each is one line naming its fields.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from tetron.models import FAMILIES
from tetron.optim import OPTIMIZERS
from tetron.parallel.pipeline_schedules import SCHEDULES

AXES = ("dp", "tp", "pp", "cp")
WILD = 0.15  # share of draws whose sizes ignore each other (most of them refused)


def _fields(family: str) -> set[str]:
    return {f.name for f in dataclasses.fields(FAMILIES[family].config_class)}


def is_moe(family: str) -> bool:
    """Whether the family's layers hold experts (its config has num_experts): ep applies to it."""
    return "num_experts" in _fields(family)


def _accepts(family: str, **fields: Any) -> bool:
    """Whether the family's config takes these fields (its own checks, e.g. Qwen2's q/k/v always have biases)."""
    try:
        FAMILIES[family].config_class(**fields)
    except ValueError:
        return False
    return True


def _split_world(rng: random.Random, world: int) -> dict[str, int]:
    """dp, tp, pp, cp whose product is `world` (a power of two): each factor 2 to a random axis."""
    sizes = dict.fromkeys(AXES, 1)
    while world > 1:
        sizes[rng.choice(AXES)] *= 2
        world //= 2
    return sizes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _model(rng: random.Random, family: str, *, tp: int, cp: int, ulysses: bool, layers: int, wild: bool) -> dict:
    """A tiny model of `family`: hidden 32 or 64, heads and kv heads that tp divides (not always when wild), a
    vocabulary of at least 256 (bytes) often not divisible by tp, and the family's own options drawn."""
    fields = _fields(family)
    heads_ok = [h for h in (2, 4, 8) if wild or (h % tp == 0 and (not ulysses or (h // tp) % cp == 0))]
    heads = rng.choice(heads_ok or [8])
    kv = rng.choice([k for k in _divisors(heads) if wild or k % tp == 0] or [heads])
    if not wild and not _accepts(family, num_attention_heads=heads, num_key_value_heads=kv):
        kv = heads  # MLA (DeepSeek-V3) expands its latent to every head
    model: dict[str, Any] = {
        "model_type": family, "hidden_size": rng.choice([32, 48, 64]), "intermediate_size": rng.choice([48, 64]),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": rng.choice([256, 257, 259, 262, 264, 300]), "max_position_embeddings": 64,
        "tie_word_embeddings": rng.random() < 0.3,
    }
    if rng.random() < 0.15:  # heads of their own width: q/k/v/o project to heads*head_dim, not hidden
        model["head_dim"] = rng.choice([8, 12])
    if rng.random() < 0.1:
        model["rope_scaling"] = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    options = {"mlp_bias": True, "attention_bias": not FAMILIES[family].config_class().attention_bias,
               "hidden_act": rng.choice(["gelu", "gelu_pytorch_tanh"])}
    for name, value in options.items():  # what the family's config takes (a wild draw: perhaps what it refuses)
        if name in fields and rng.random() < 0.2 and (wild or _accepts(family, **{name: value})):
            model[name] = value
    if "sliding_window" in fields and rng.random() < 0.5:
        model["sliding_window"] = rng.choice([3, 5, 8, 16])
        if "use_sliding_window" in fields:
            model["use_sliding_window"] = True
        if "max_window_layers" in fields:
            model["max_window_layers"] = rng.randint(0, layers)
    if is_moe(family):
        experts = rng.choice([2, 4, 8])
        model.update(num_experts=experts, num_experts_per_tok=rng.randint(1, min(4, experts)),
                     moe_intermediate_size=rng.choice([16, 32]), norm_topk_prob=rng.random() < 0.7,
                     router_aux_loss_coef=rng.choice([0.0, 0.01]), router_z_loss_coef=rng.choice([0.0, 1e-3]),
                     moe_bias_update_rate=rng.choice([0.0, 0.0, 1e-2]),
                     scoring_func=rng.choice(["softmax", "sigmoid"]), n_shared_experts=rng.choice([0, 0, 1]),
                     decoder_sparse_step=rng.choice([1, 1, 2]), routed_scaling_factor=rng.choice([1.0, 2.5]))
        if experts >= 4 and rng.random() < 0.3:  # group-limited routing: 2 groups of >= 2 experts
            topk_group = rng.choice([1, 2])
            model.update(n_group=2, topk_group=topk_group,
                         num_experts_per_tok=min(model["num_experts_per_tok"], topk_group * experts // 2))
        if rng.random() < 0.15:
            model["mlp_only_layers"] = [0]
        for name in ("scoring_func", "decoder_sparse_step", "mlp_only_layers"):  # what the family decides itself
            if name in model and not wild and not _accepts(family, **{name: model[name]}):
                del model[name]
        if "n_group" not in model and not _accepts(family, num_experts=experts):
            model.update(n_group=1, topk_group=1)  # the family's default groups (DeepSeek-V3's 8) need more experts
    if "kv_lora_rank" in fields:  # multi-head latent attention: tiny latents, q/k heads wider than v heads
        model.update(q_lora_rank=rng.choice([None, 16]), kv_lora_rank=rng.choice([8, 16]), qk_nope_head_dim=8,
                     qk_rope_head_dim=rng.choice([4, 8]), v_head_dim=rng.choice([8, 12]),
                     first_k_dense_replace=rng.choice([0, 1]))
    return model


def _schedule(rng: random.Random, pp: int, wild: bool) -> tuple[str, int]:
    """A registered schedule and its chunks per rank (the fixed number it declares, else 1 or 2)."""
    if pp == 1 and not wild:
        return "1f1b", 1
    name = rng.choice(sorted(SCHEDULES))
    spec = SCHEDULES[name]
    if wild:
        return name, rng.choice([1, 2])
    virtual = spec.virtual if spec.virtual is not None else rng.choice([1, 2])
    if pp < spec.min_pp:
        return "1f1b", 1
    return name, virtual


def draw(rng: random.Random, *, max_world: int = 8) -> dict[str, dict]:
    """One configuration's sections (no paths): model, parallel, train, data, optim, checkpoint."""
    wild = rng.random() < WILD
    family = rng.choice(sorted(FAMILIES))
    worlds = [w for w in (1, 2, 2, 2, 4, 4, 4, 8) if w <= max_world]
    sizes = _split_world(rng, rng.choice(worlds))
    if wild and rng.random() < 0.5:  # a size that is no power of two
        sizes[rng.choice(AXES)] = 3
    dp, tp, pp, cp = (sizes[a] for a in AXES)
    schedule, virtual = _schedule(rng, pp, wild)
    stages = pp * virtual
    # layers: at least the stages (wild: perhaps fewer), often one more (not divisible by them)
    layers = rng.randint(1, 3) if wild else rng.choice([max(2, stages), stages + 1, max(3, stages)])
    ulysses = cp > 1 and rng.random() < 0.4
    model = _model(rng, family, tp=tp, cp=cp, ulysses=ulysses, layers=layers, wild=wild)
    sp = tp > 1 and rng.random() < 0.5
    layout = rng.choice(["zigzag", "contiguous"])
    chunks = 2 * cp if layout == "zigzag" and cp > 1 else cp
    seqs = [s for s in (16, 24, 32, 48, 64) if wild or (s % chunks == 0 and (not sp or (s // cp) % tp == 0))]
    seq = rng.choice(seqs or [64])
    parallel: dict[str, Any] = {**sizes, "pp_schedule": schedule, "pp_virtual": virtual, "sp": sp,
                                "cp_layout": layout, "cp_impl": "ulysses" if ulysses else "ring",
                                "bucket_mb": rng.choice([0.01, 25.0]), "vocab_pad_multiple": rng.choice([1, 1, 4])}
    if is_moe(family):
        ep_ok = [e for e in _divisors(dp * cp) if wild or model["num_experts"] % e == 0]
        parallel["ep"] = rng.choice(ep_ok) if rng.random() < 0.7 else 1
    shards = dp * cp
    if rng.random() < 0.15 and not wild:
        parallel["dp_impl"] = "naive"
    else:
        parallel["zero"] = rng.choice([0, 1, 2, 3]) if shards > 1 or wild else rng.choice([0, 0, 3])
        parallel["zero_accumulate"] = rng.choice(["sharded", "full"])
        ep = parallel.get("ep", 1)
        hsdp = [d for d in _divisors(shards) if d < shards and (wild or d % ep == 0)]
        if parallel["zero"] >= 1 and hsdp and rng.random() < 0.35:
            parallel["dp_shard"] = rng.choice(hsdp)
    if pp > 1 and layers >= stages and rng.random() < 0.3:  # an uneven split of its own, stage by stage
        cuts = sorted(rng.sample(range(1, layers), stages - 1))
        parallel["pp_split"] = [b - a for a, b in zip([0, *cuts], [*cuts, layers])]
    if rng.random() < 0.05:  # gradients averaged in bf16: compared at bf16's tolerance
        parallel["reduce_dtype"] = "bfloat16"
    micro_batch = rng.choice([1, 2])
    grad_acc = rng.choice([1, 2, 3])
    if SCHEDULES[schedule].micro_batches_per_pp and pp > 1 and not wild:
        grad_acc = pp * rng.choice([1, 2]) if pp <= 2 else pp
    least = SCHEDULES[schedule].min_micro_batches_per_pp * pp
    if grad_acc < least and not wild:  # dualpipev: its least (sometimes one more), else only ever refused
        grad_acc = least + rng.choice([0, 1])
    local = micro_batch * seq // max(cp, 1)  # tokens of one micro-batch on one rank: the chunking's edges
    train: dict[str, Any] = {
        "steps": rng.choice([2, 3]), "warmup_steps": 1, "micro_batch": micro_batch, "grad_acc": grad_acc,
        "recompute": rng.choice(["none", "selective", "full"]), "seed": rng.randint(0, 1000),
        "loss_chunk_tokens": rng.choice([0, local, local - 1, local + 1, max(1, local // 2), 5, 1024]),
        # AdamW's step g/(sqrt(v)+eps) turns the last-bit rounding of a gradient near eps into a weight step of up
        # to lr (1.5e-5 at lr 1e-3 in one of 1,024 elements, seed 0 draw 4, with eps 1e-8): an eps of 1e-6 keeps
        # that amplifier out of the weight comparison while a gradient of 1e-4 or more still steps by ~lr
        "eps": 1e-6,
        "grad_clip": rng.choice([1.0, 1.0, 0.05, 0.0]),  # 0.05: every step clipped; 0: never
        "schedule": rng.choice(["cosine", "cosine", "wsd", "constant"]),
        "weight_decay": rng.choice([0.1, 0.0]),
    }
    if rng.random() < 0.06:  # bf16 costs ~100x a matmul here: rare, and compared at bf16's tolerance
        train["dtype"] = "bfloat16"
    data: dict[str, Any] = {"seq_len": seq}
    if rng.random() < 0.15:  # validation loss at the last step, on held-out windows
        data["val_fraction"] = 0.1
        train.update(eval_every=train["steps"], eval_batches=1)
    if rng.random() < 0.12:  # a mixture of the two data sets (the runner puts their paths for the @names)
        data["sources"] = [{"path": "@corpus", "weight": 2}, {"path": "@docs", "weight": 1}]
    if rng.random() < 0.25:
        data["mask_documents"] = True
    if rng.random() < 0.2:
        data["reset_positions"] = True
    if wild and is_moe(family) and cp > 1 and rng.random() < 0.5:  # refused where sequences are split (and
        model["moe_aux_loss"] = "batch"  # layout-dependent by definition elsewhere: not drawn there)
    checkpoint: dict[str, Any] = {}
    if rng.random() < 0.1:
        checkpoint = {"save_every": train["steps"], "async_save": True}
    optim = {"name": rng.choice(sorted(OPTIMIZERS))}
    if optim["name"] == "muon":  # its Newton-Schulz in fp32: in bf16 (torch's default) a layout's differently
        # ordered sums, ~1e-7 apart, round to 5e-5-1e-4 apart in the weights (measured); test_muon compares bf16's
        # with torch.optim.Muon in one process, and its layout tests run fp32 as here
        optim["muon_ns_dtype"] = "float32"
    return {"model": model, "parallel": parallel, "train": train, "data": data, "optim": optim,
            "checkpoint": checkpoint}


def comparable(sections: dict[str, dict]) -> str | None:
    """Why an accepted draw's numbers may rightly differ from the single process's (then it runs, compared at
    that looser bar), or None where they must match within the layout tolerances."""
    if sections["train"].get("dtype") == "bfloat16" or sections["parallel"].get("reduce_dtype") == "bfloat16":
        return "bf16"
    return None
