"""gpt-oss (transformers' GptOssForCausalLM): Qwen3-MoE's model (models/qwen3_moe.py) with gpt-oss's options set,
transformers' names and numerics, its config, parallel plan, init and registration.

- attention: Llama's shared attention with biases on q, k, v and o, a learned sink per head (one logit in each
  softmax's denominator, `self_attn.sinks`), and layers alternating between a sliding window and the whole past
  (`layer_types`, `sliding_window`: transformers' default starts with a sliding layer);
- RoPE with YaRN scaling (`rope_scaling` of type yarn: models/llama/rope.py), base 150000;
- MoE in every layer: the router `mlp.router` with a bias, softmax over the top-k logits (the full softmax's top k
  renormalized); the experts as transformers stores them (models/moe.py's Experts options): `gate_up_proj`
  [E, H, 2*I] with gate and up interleaved, `down_proj` [E, I, H], applied as x @ w, each with a bias per expert;
  their activation gpt-oss's clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`: models/blocks.py's ClampedSwiGLU),
  not the config's hidden_act.

A model folder holds its tensors under the names tetron's modules have (no mapping). The hub's own release keeps
the experts in MXFP4 (`quantization_config`): such a folder is refused in one line; a bf16/fp32 copy (transformers'
from_pretrained with Mxfp4Config(dequantize=True), then save_pretrained) loads.

Under tp the sinks split with their heads (the plan's head_params); the MoE feed-forward stays whole on every tp
rank (MOE_PLAN), its experts split by expert parallelism, biases with their experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from tetron.models.attention import AttentionOptions, layer_windows
from tetron.models.blocks import ZEROS, ClampedSwiGLU, standard_init
from tetron.models.moe import Experts, Router
from tetron.models.qwen3_moe import MOE_PLAN, MoeConfig, MoeForCausalLM
from tetron.models.spec import Init, ModelSpec, refuse_quantized, register

# transformers' GptOssConfig's rope when a config gives none (gpt-oss-20b's and -120b's)
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


@dataclass
class GptOssConfig(MoeConfig):
    """gpt-oss: every layer MoE with biased routers and experts, sinks, alternating windows, YaRN."""

    model_type: str = "gpt_oss"  # the model family (models/spec.py)
    rope_theta: float = 150000.0  # RoPE base wavelength
    rope_scaling: dict | None = field(default_factory=lambda: dict(GPT_OSS_YARN))  # gpt-oss's YaRN (transformers'
    # default); null: plain RoPE
    rms_norm_eps: float = 1e-5  # epsilon added to the mean square in RMSNorm
    attention_bias: bool = True  # q, k, v and o projections carry biases (gpt-oss: all four)
    sliding_window: int | None = 128  # a windowed layer's query attends to this many latest positions, itself
    # included; None: no window (Mistral, Mixtral: every layer is windowed; Qwen: with use_sliding_window; gpt-oss:
    # the layers layer_types names sliding_attention)
    layer_types: list[str] | None = None  # "full_attention" or "sliding_attention" per layer; None: Qwen's from
    # use_sliding_window and max_window_layers, gpt-oss's alternating from a sliding layer, as transformers derives them
    swiglu_alpha: float = 1.702  # gpt-oss's experts compute (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    swiglu_limit: float = 7.0  # gpt-oss's experts clamp the gate from above at this, and up on both sides, first

    hf_architecture: ClassVar[str] = "GptOssForCausalLM"
    qk_norm: ClassVar[bool] = False
    norm_topk_always: ClassVar[bool] = True  # softmax over the top k: the weights always sum to 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        if self.sliding_window is not None and (type(self.sliding_window) is not int or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive integer (or null: no window)")
        layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)  # one line naming a bad list
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a positive number")

    def layer_window(self, index: int) -> int | None:
        return layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)[index]

    def attention_options(self, index: int) -> AttentionOptions:
        return AttentionOptions(head_dim=self.head_dim, v_head_dim=self.head_dim, window=self.layer_window(index),
                                sinks=True)

    def one_layer(self, index: int = 0) -> GptOssConfig:
        return dataclasses.replace(self, num_hidden_layers=1, layer_types=[self.layer_types[index]])

    def moe_block_options(self) -> dict:
        experts = Experts(self.num_experts, self.hidden_size, self.moe_intermediate_size, transposed=True,
                          interleaved=True, bias=True, glu=ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit))
        return {"router_name": "router", "bias": True, "experts": experts}

    @classmethod
    def _family_fields(cls, hf: dict) -> dict:
        refuse_quantized(hf, "the hub's gpt-oss keeps its experts in MXFP4", how=" (transformers: from_pretrained(..., "
                         "quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained)")
        if "rope_parameters" not in hf and "rope_scaling" not in hf:
            hf = {**hf, "rope_parameters": {**GPT_OSS_YARN, "rope_theta": hf.get("rope_theta", cls.rope_theta)}}
        return {**hf, "moe_intermediate_size": hf.get("intermediate_size")}  # its experts' width

    def _hf_family_fields(self) -> dict:
        return {"num_local_experts": self.num_experts, "intermediate_size": self.moe_intermediate_size,
                "sliding_window": self.sliding_window, "layer_types": list(self.layer_types)}

    def _layer_params(self, experts: int) -> int:
        """MoeConfig's count and gpt-oss's biases: the router's (E) and each counted expert's (2I + H)."""
        per_layer = self.num_experts + experts * (2 * self.moe_intermediate_size + self.hidden_size)
        return super()._layer_params(experts) + self.num_hidden_layers * per_layer


def gpt_oss_init(module: nn.Module, name: str, config: Any) -> Init:
    """transformers' GptOssPreTrainedModel._init_weights: the router's weight and bias drawn, the experts' biases
    zeros (their weights drawn), the sinks drawn; everything else as the shared blocks start."""
    if isinstance(module, Router):
        return Init("normal", config.initializer_range)
    if isinstance(module, Experts) and name.endswith("_bias"):
        return ZEROS
    return standard_init(module, name, config)


GPT_OSS = register(ModelSpec(name="gpt_oss", model_types=("gpt_oss",), config_class=GptOssConfig,
                             model_class=MoeForCausalLM,
                             plan=dataclasses.replace(MOE_PLAN, head_params=("self_attn.sinks",)),
                             init=gpt_oss_init))
