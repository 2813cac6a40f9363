"""The parallel plan as data (models/spec.py's ParallelPlan): which parameters of a layer tensor parallelism
splits, which stay whole with a tp-partial gradient (a share of the heads inside a block, a share of the tokens
outside every block under sequence parallelism), read by every axis from the plan alone. A toy family defined
only here, with an attention like DeepSeek-V3's MLA (x -> a whole low-rank a_proj -> a whole norm -> a
column-parallel b_proj per head), trains in tp2, with and without sp, equal to one process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from torch import Tensor, nn

from tetron.models.attention import Documents, sdpa_attention
from tetron.models.blocks import RMSNorm
from tetron.models.llama import LLAMA_PLAN, Llama, LlamaConfig, apply_rope
from tetron.models.qwen import QWEN3_PLAN
from tetron.models.spec import FAMILIES, Block, ModelSpec, ParallelPlan, register

from conftest import check_layout

H, KVH = 4, 2
LATENT_PATHS = ("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.kv_a_proj", "self_attn.kv_a_layernorm")


def test_the_plan_says_which_parameters_are_tp_partial():
    """Kept whole inside a block: always (a share of the heads); outside every block (residual norms, replicated
    parts): only under sp (a share of the tokens); what the plan splits or leaves alone: never."""
    moe = ParallelPlan(blocks=LLAMA_PLAN.blocks[:1], residual_norms=LLAMA_PLAN.residual_norms, replicated=("mlp",))
    for sp in (False, True):
        assert QWEN3_PLAN.tp_partial("self_attn.q_norm.weight", sequence_parallel=sp)
        assert _LATENT_PLAN.tp_partial("self_attn.kv_a_proj.weight", sequence_parallel=sp)
        assert LLAMA_PLAN.tp_partial("input_layernorm.weight", sequence_parallel=sp) == sp
        assert moe.tp_partial("mlp.experts.gate_up_proj", sequence_parallel=sp) == sp
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight",
                     "self_attn.q_norm_extra.weight"):  # a path's prefix alone is not the module
            assert not QWEN3_PLAN.tp_partial(name, sequence_parallel=sp), name
    assert _LATENT_PLAN.tp_dim("self_attn.q_a_proj.weight") is None  # whole, not split
    assert _LATENT_PLAN.tp_dim("self_attn.q_b_proj.weight") == 0


@dataclass
class _LatentConfig(LlamaConfig):
    """A family only this file knows: queries, keys and values from low-rank latents, as MLA makes them."""

    model_type: str = "toy_latent"
    q_lora_rank: int = 12  # width of the query latent (DeepSeek-V3's name)
    kv_lora_rank: int = 8  # width of the key/value latent

    hf_architecture: ClassVar[str] = "ToyLatentForCausalLM"

    def attention_params(self) -> int:
        h, q_rank, kv_rank = self.hidden_size, self.q_lora_rank, self.kv_lora_rank
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return (h + 1 + q) * q_rank + (h + 1 + 2 * kv) * kv_rank + q * h + 2 * h


class _LatentAttention(nn.Module):
    """q = q_b(norm(q_a(x))), k and v = k_b, v_b of norm(kv_a(x)); the a's and their norms whole under tp, the
    b's column-parallel (each rank its heads), o row-parallel."""

    def __init__(self, config: _LatentConfig, index: int = 0) -> None:
        super().__init__()
        h, hd, eps = config.hidden_size, config.head_dim, config.rms_norm_eps
        self.head_dim = hd
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, config.num_attention_heads * hd, bias=False)
        self.kv_a_proj = nn.Linear(h, config.kv_lora_rank, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps)
        self.k_b_proj = nn.Linear(config.kv_lora_rank, config.num_key_value_heads * hd, bias=False)
        self.v_b_proj = nn.Linear(config.kv_lora_rank, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, h, bias=False)
        self.attn_fn = sdpa_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        B, T = x.shape[:2]
        latent = self.kv_a_layernorm(self.kv_a_proj(x))  # [B, T, kv_lora_rank]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_b_proj(latent).view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, kv_heads, T, head_dim]
        v = self.v_b_proj(latent).view(B, T, -1, self.head_dim).transpose(1, 2)
        out = self.attn_fn(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, docs, None)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class _LatentModel(Llama):
    attention_class = _LatentAttention


_LATENT_PLAN = ParallelPlan(blocks=(Block("self_attn", column=("q_b_proj", "k_b_proj", "v_b_proj"), row="o_proj"),
                                    LLAMA_PLAN.blocks[1]),
                            residual_norms=LLAMA_PLAN.residual_norms, kept_whole=LATENT_PATHS)


@pytest.fixture
def latent_family():
    """The toy registered for one test (forked ranks inherit it), then removed."""
    assert "toy_latent" not in FAMILIES
    register(ModelSpec(name="toy_latent", model_types=("toy_latent",), config_class=_LatentConfig,
                       model_class=_LatentModel, plan=_LATENT_PLAN))
    yield
    del FAMILIES["toy_latent"]


def test_the_toy_counts_its_parameters():
    cfg = _LatentConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size=64,
                        num_attention_heads=H, num_key_value_heads=KVH)
    assert cfg.num_params() == sum(p.numel() for p in _LatentModel(cfg).parameters())


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_whole_latent_projections_train_in_tp_equal_to_one_process(latent_family, corpus, cache_dir, tmp_path, sp):
    _, written = check_layout(corpus, cache_dir, tmp_path, model={"model_type": "toy_latent", "num_hidden_layers": 2},
                              parallel={"tp": 2, "sp": sp, "bucket_mb": 0.01})
    state = written["model"]
    assert state["model.layers.0.self_attn.q_a_proj.weight"].shape == (12, 32)  # saved whole
    assert state["model.layers.1.self_attn.k_b_proj.weight"].shape == (KVH * 8, 8)
    assert (state["model.layers.0.self_attn.kv_a_layernorm.weight"] - 1).abs().max() > 1e-4  # the norm trained
