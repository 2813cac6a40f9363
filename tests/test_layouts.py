"""Context parallelism in training, and every dimension combined, against a single-process run.

Each run writes what a user gets: metrics.jsonl (rank 0's log of the global loss) and OUT/model, the
full weights gathered from whatever layout trained them. Both are compared with the reference."""

from __future__ import annotations

import pytest
import torch

from tetron.config import from_dict
from tetron.mesh import Mesh
from tetron.parallel.init import seeded_model

from conftest import check_layout as check
from conftest import tiny_config
from harness import run_ranks, saved_bytes

GQA = {"num_attention_heads": 4, "num_key_value_heads": 2}


# ----------------------------------------------------------------------------- context parallelism


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp, kv_heads", [(2, 2), (4, 1)])
def test_cp_matches_single_process(corpus, cache_dir, tmp_path, cp, kv_heads, layout):
    check(corpus, cache_dir, tmp_path, parallel={"cp": cp, "cp_layout": layout},
          model={"num_key_value_heads": kv_heads}, micro_batch=2, grad_acc=1)


def test_dp2_cp2(corpus, cache_dir, tmp_path):
    check(corpus, cache_dir, tmp_path, parallel={"dp": 2, "cp": 2, "dp_impl": "naive"})


# ----------------------------------------------------------------------------- three dimensions, 8 ranks


THREE_D = {
    "dp2-tp2-pp2": {"dp": 2, "tp": 2, "pp": 2, "sp": True, "pp_schedule": "1f1b"},
    "dp2-tp2-cp2": {"dp": 2, "tp": 2, "cp": 2, "dp_impl": "naive"},
    "dp2-pp2-cp2": {"dp": 2, "pp": 2, "cp": 2, "pp_schedule": "afab", "cp_layout": "contiguous"},
    "tp2-pp2-cp2": {"tp": 2, "pp": 2, "cp": 2, "sp": True, "pp_schedule": "interleaved", "pp_virtual": 2},
}


@pytest.mark.parametrize("name", sorted(THREE_D))
def test_three_dimensions_on_8_ranks(corpus, cache_dir, tmp_path, name):
    check(corpus, cache_dir, tmp_path, parallel={**THREE_D[name], "bucket_mb": 0.01},
          model={"tie_word_embeddings": name == "dp2-tp2-pp2"})


@pytest.mark.slow
def test_four_dimensions_on_16_ranks(corpus, cache_dir, tmp_path):
    check(corpus, cache_dir, tmp_path,
          parallel={"dp": 2, "tp": 2, "pp": 2, "cp": 2, "sp": True, "pp_schedule": "1f1b", "bucket_mb": 0.01},
          model={"tie_word_embeddings": True, "vocab_size": 257})


# ----------------------------------------------------------------------------- memory


def _activation_bytes(raw: dict) -> int:
    """Bytes autograd keeps for the backward of one forward pass (activations, not weights)."""
    cfg = from_dict(raw)
    mesh = Mesh(cp=cfg.parallel.cp)
    model = seeded_model(cfg.model, seed=cfg.train.seed, device=torch.device("cpu"))
    from tetron.parallel.context_parallel import apply_context_parallel, shard_indices

    apply_context_parallel(model, mesh, layout="zigzag")
    seq, cp = cfg.data.seq_len, cfg.parallel.cp
    mine = shard_indices(seq, cp, mesh.local_rank("cp")) if cp > 1 else torch.arange(seq)
    ids = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with saved_bytes(model) as saved:
        logits = model(ids[:, mine], mine)
    logits.float().sum().backward()
    return sum(saved.values())


def test_activation_memory_falls_with_cp(corpus, cache_dir, tmp_path):
    seq = 512
    model = {**GQA, "max_position_embeddings": seq}
    measured = {}
    for cp in (1, 2, 4):
        raw = tiny_config(corpus, cache_dir, tmp_path / f"m{cp}", model=model, parallel={"cp": cp},
                          data={"seq_len": seq})
        measured[cp] = run_ranks(cp, _activation_bytes, raw)
    single = measured[1][0]
    for cp in (2, 4):
        for per_rank in measured[cp]:
            # Every saved activation is per token, so each rank keeps 1/cp of them; ring attention
            # keeps only its own q, k, v, output and log-sum-exp (no [T, T] scores). Allow 10% for
            # the small per-rank constants (RoPE tables of the local positions, index tensors).
            assert per_rank / single <= 1 / cp * 1.1, (cp, per_rank, single)
