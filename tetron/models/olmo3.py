"""OLMo 3 (transformers' Olmo3ForCausalLM): Llama's blocks with the options that make it OLMo 3 (models/llama/'s
docstring lists them), its config and its registration.

- Norms after attention and after the MLP, on their outputs before the residual adds (`norm_placement`
  "post": `post_attention_layernorm`, `post_feedforward_layernorm`), none before them.
- q/k RMSNorm over the whole q and k projections, not per head (`q_norm` over num_attention_heads*head_dim,
  `k_norm` over num_key_value_heads*head_dim): under tensor parallelism each rank holds its heads' slice of
  the weights and the sum of squares is summed over tp (the plan's `projection_norms`).
- Three sliding-window layers to one full one (`layer_types`, `sliding_window`), each kind with its RoPE
  (models/layer_types.py): transformers applies `rope_scaling` to the full layers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tetron.models.attention import AttentionOptions
from tetron.models.blocks import layer_norm_names, standard_init
from tetron.models.layer_types import LayerTypesConfig
from tetron.models.llama import LLAMA_PLAN, Llama
from tetron.models.spec import ModelSpec, ParallelPlan, register


@dataclass
class Olmo3Config(LayerTypesConfig):
    """OLMo 3: Llama's fields with transformers' Olmo3Config defaults, post-norms, whole-projection q/k norms."""

    model_type: str = "olmo3"  # the model family (models/spec.py)
    vocab_size: int = 50304  # number of token ids (rows of the embedding)
    rms_norm_eps: float = 1e-5  # epsilon added to the mean square in RMSNorm
    rope_theta: float = 500000.0  # RoPE base wavelength (of every layer unless rope_local_base_freq is set)
    eos_token_id: int | list[int] | None = 50279  # end-of-sequence token id(s)

    hf_architecture: ClassVar[str] = "Olmo3ForCausalLM"
    mlp_bias_option: ClassVar[bool] = False  # Olmo3MLP has no biases
    norm_placement: ClassVar[str] = "post"
    sliding_pattern: ClassVar[int] = 4  # transformers' default: every fourth layer full

    def attention_options(self, index: int) -> AttentionOptions:
        return AttentionOptions(head_dim=self.head_dim, v_head_dim=self.head_dim, window=self.layer_window(index),
                                qk_norm="projection")


OLMO3_PLAN = ParallelPlan(blocks=LLAMA_PLAN.blocks, residual_norms=layer_norm_names("post"),
                          projection_norms=("self_attn.q_norm", "self_attn.k_norm"))
OLMO3 = register(ModelSpec(name="olmo3", model_types=("olmo3",), config_class=Olmo3Config, model_class=Llama,
                           plan=OLMO3_PLAN, init=standard_init))
