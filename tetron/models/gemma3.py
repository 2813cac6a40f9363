"""Gemma 3's text model (transformers' Gemma3ForCausalLM, model_type gemma3_text): Llama's blocks with the
options that make it Gemma 3 (models/llama/'s docstring lists them), its config and its registration.

- Five local (sliding-window) layers to one global (`layer_types`, `sliding_window`); the local layers' RoPE base
  `rope_local_base_freq`, the global layers' `rope_theta` and `rope_scaling` (models/layer_types.py).
- RMSNorm with a (1 + weight) computed in fp32 everywhere, norms before and after both attention and the MLP
  (`norm_placement` "sandwich"), and on each q and k head (per-head q/k norm, as Qwen3's, of the same kind).
- GeGLU: the gated MLP with `gelu_pytorch_tanh` (transformers' config names it `hidden_activation`).
- The embedding's output times sqrt(hidden_size), rounded to the compute dtype first, as transformers does.
- The scores' scale query_pre_attn_scalar**-0.5, and soft-capping of the scores where
  `attn_logit_softcapping` is set (null in every Gemma 3), as Gemma 2 caps them: transformers 5.24's
  Gemma3Attention reads the cap but does not pass it to its attention, so there a set cap changes nothing.
  The final logits' soft-capping (`final_logit_softcapping`, null in every Gemma 3) is refused with one line:
  tetron's fused head and loss do not compute it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from tetron.models.attention import AttentionOptions
from tetron.models.blocks import layer_norm_names, standard_init
from tetron.models.layer_types import LayerTypesConfig
from tetron.models.llama import LLAMA_PLAN, Llama
from tetron.models.spec import ModelSpec, ParallelPlan, read_hf_config, register


@dataclass
class Gemma3TextConfig(LayerTypesConfig):
    """Gemma 3's text model: Llama's fields with transformers' Gemma3TextConfig defaults, and its own."""

    model_type: str = "gemma3_text"  # the model family (models/spec.py)
    vocab_size: int = 262208  # number of token ids (rows of the embedding)
    hidden_size: int = 2304  # width of the residual stream
    intermediate_size: int = 9216  # width of the MLP's hidden layer
    num_hidden_layers: int = 26  # number of decoder layers
    num_attention_heads: int = 8  # query heads per layer
    num_key_value_heads: int | None = 4  # key/value heads (GQA)
    head_dim: int | None = 256  # width of one head (Gemma's is not hidden_size / heads)
    max_position_embeddings: int = 131072  # longest sequence the model is meant for
    rope_theta: float = 1000000.0  # RoPE base of the global (full_attention) layers
    rope_local_base_freq: float | None = 10000.0  # RoPE base of the local (sliding_attention) layers
    tie_word_embeddings: bool = True  # lm_head shares the embedding's weight
    bos_token_id: int | None = 2  # beginning-of-sequence token id
    eos_token_id: int | list[int] | None = 1  # end-of-sequence token id(s)
    hidden_act: str = "gelu_pytorch_tanh"  # the MLP's activation (`hidden_activation` in config.json)
    query_pre_attn_scalar: float = 256  # the scores' scale is query_pre_attn_scalar**-0.5
    attn_logit_softcapping: float | None = None  # scores = cap * tanh(scores / cap) before the softmax; None: off
    final_logit_softcapping: float | None = None  # must be null: tetron's head does not soft-cap the logits

    hf_architecture: ClassVar[str] = "Gemma3ForCausalLM"
    mlp_bias_option: ClassVar[bool] = False  # Gemma3MLP has no biases
    qk_norm: ClassVar[bool] = True  # per-head q/k norms
    norm_placement: ClassVar[str] = "sandwich"
    norm_unit_offset: ClassVar[bool] = True
    scale_embeddings: ClassVar[bool] = True
    sliding_pattern: ClassVar[int] = 6  # five local layers, then a global one

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.final_logit_softcapping is not None:
            raise ValueError(f"final_logit_softcapping={self.final_logit_softcapping}: tetron's head does not "
                             "soft-cap the logits (every Gemma 3 has null); use null")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar} must be positive")

    def attention_options(self, index: int) -> AttentionOptions:
        return AttentionOptions(head_dim=self.head_dim, v_head_dim=self.head_dim, window=self.layer_window(index),
                                scale=self.query_pre_attn_scalar ** -0.5, softcap=self.attn_logit_softcapping,
                                qk_norm="head")

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> Gemma3TextConfig:
        hf = dict(read_hf_config(path_or_dict))
        if hf.get("model_type") == "gemma3":  # Gemma3ForConditionalGeneration (4B and up): its text model
            text = hf.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("model_type='gemma3' without a text_config mapping: not a Gemma 3 folder tetron "
                                 "reads; give a Gemma 3 model folder")
            hf = {**text, "model_type": "gemma3_text"}
        if hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true: tetron trains causal decoders; use false")
        if "hidden_activation" in hf:  # transformers' Gemma 3 reads this name, not hidden_act
            hf["hidden_act"] = hf["hidden_activation"]
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = hf.get(name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise ValueError(f"{name}={value!r}: expected a number")
        return super().from_hf(hf)

    def to_hf(self, dtype: str = "float32") -> dict:
        return {**super().to_hf(dtype), "hidden_activation": self.hidden_act}


GEMMA3_PLAN = ParallelPlan(blocks=LLAMA_PLAN.blocks, residual_norms=layer_norm_names("sandwich"),
                           kept_whole=("self_attn.q_norm", "self_attn.k_norm"))


def in_multimodal_folder(name: str, config: Gemma3TextConfig) -> str:
    """Where Gemma3ForConditionalGeneration's folder (the hub's gemma-3-4b and up, transformers' save_pretrained)
    keeps the text model's tensor `name`: under language_model., beside the vision tower that tetron leaves
    unread. A text-only folder holds them as named (read_as is asked only for a name the folder lacks)."""
    return f"language_model.{name}"


GEMMA3 = register(ModelSpec(name="gemma3_text", model_types=("gemma3_text",), config_class=Gemma3TextConfig,
                            model_class=Llama, plan=GEMMA3_PLAN, init=standard_init, holder_types=("gemma3",),
                            read_as=in_multimodal_folder, unread=("vision_tower.", "multi_modal_projector.")))
