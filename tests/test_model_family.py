"""The model-family seam (models/spec.py): a family registered from outside tetron, with parameters Llama has
not got, trains in every axis at once without a change to any axis's file, equal to the single process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from tetron.config import from_dict
from tetron.models import FAMILIES, ModelSpec, family, register
from tetron.models.llama import LLAMA, Llama, LlamaConfig
from tetron.parallel.init import seeded_model
from tetron.plan.state import layer_numels

from conftest import check_layout, tiny_config


@dataclasses.dataclass
class BiasedConfig(LlamaConfig):
    """Llama's fields; only the family differs."""

    model_type: str = "toy_biased_llama"  # the family (models/spec.py)


class BiasedLlama(Llama):
    """A Llama whose q, k, v projections (column-parallel under tp) and MLP down projection (row-parallel)
    carry biases, as Qwen2's q/k/v do."""

    def __init__(self, config: BiasedConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers.values():
            biased = [(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")] + [(layer.mlp, "down_proj")]
            for part, name in biased:
                old = getattr(part, name)
                setattr(part, name, nn.Linear(old.in_features, old.out_features, bias=True))


@pytest.fixture
def biased_family():
    spec = register(ModelSpec(name="toy_biased_llama", model_types=("toy_biased_llama",),
                              config_class=BiasedConfig, model_class=BiasedLlama, plan=LLAMA.plan))
    yield spec
    del FAMILIES["toy_biased_llama"]


def test_a_registered_family_is_chosen_by_model_type(biased_family, corpus, cache_dir, tmp_path):
    cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path, model={"model_type": "toy_biased_llama"}))
    assert type(cfg.model) is BiasedConfig and family(cfg.model.model_type) is biased_family
    model = seeded_model(cfg.model, seed=1, device=torch.device("cpu"))
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert len(biases) == 4 * cfg.model.num_hidden_layers and all(not p.any() for p in biases.values())
    # the planner counts the family's parameters from its module and plan: under tp2 the matmul weights and the
    # q/k/v biases are halved, the norms and down's bias (added after the row-parallel sum) stay whole
    h, q, kv, inter = 32, 32, 16, 64
    tp2 = from_dict(tiny_config(corpus, cache_dir, tmp_path, model={"model_type": "toy_biased_llama"},
                                parallel={"tp": 2}))
    matmuls = q * h + 2 * kv * h + h * q + 3 * inter * h
    assert sum(layer_numels(tp2)) == matmuls // 2 + 2 * h + (q + 2 * kv) // 2 + h


def test_an_unknown_family_is_one_line(corpus, cache_dir, tmp_path):
    from tetron.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.model_type='gpt9' is not a known model family; use one of \["):
        from_dict(tiny_config(corpus, cache_dir, tmp_path) | {"model": {"model_type": "gpt9"}})


def test_a_registered_family_trains_in_dp2_tp2_pp2_like_one_process(biased_family, corpus, cache_dir, tmp_path):
    """Biases the axes never heard of: sharded with their column-parallel rows, kept whole and summed over tp
    under sequence parallelism for the row-parallel one, cut by the pipeline, initialised (zeros), saved."""
    _, written = check_layout(corpus, cache_dir, tmp_path, model={"model_type": "toy_biased_llama"},
                              parallel={"dp": 2, "tp": 2, "pp": 2, "sp": True, "bucket_mb": 0.01})
    biases = {n: v for n, v in written["model"].items() if n.endswith(".bias")}
    assert len(biases) == 4 * 4 and all(v.abs().max() > 0 for v in biases.values())  # trained, saved, compared
