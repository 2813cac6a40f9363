"""Llama as tetron knows a family (models/spec.py): its parallel plan, where a Hugging Face folder keeps its
tensors (under the names its modules have: no mapping), its init (transformers' LlamaPreTrainedModel's:
models/blocks.py's standard_init) and its registration."""

from __future__ import annotations

from tetron.models.blocks import standard_init
from tetron.models.llama.config import LlamaConfig
from tetron.models.llama.model import Llama
from tetron.models.spec import Block, ModelSpec, ParallelPlan, register

# Megatron's split of a layer: q, k, v and gate, up column-parallel, o and down row-parallel; the two norms on
# the residual stream
LLAMA_PLAN = ParallelPlan(
    blocks=(Block("self_attn", column=("q_proj", "k_proj", "v_proj"), row="o_proj"),
            Block("mlp", column=("gate_proj", "up_proj"), row="down_proj")),
    residual_norms=("input_layernorm", "post_attention_layernorm"),
)

LLAMA = register(ModelSpec(name="llama", model_types=("llama",), config_class=LlamaConfig, model_class=Llama,
                           plan=LLAMA_PLAN, init=standard_init))
