"""Qwen2 and Qwen3 (transformers' Qwen2ForCausalLM, Qwen3ForCausalLM): Llama's blocks with the options that
make them Qwen (models/llama/'s docstring lists them), a config each, and one registration each.

- Qwen2: biases on q, k and v (not o), always: transformers builds them whatever `attention_bias` says.
- Qwen3: an RMSNorm over each query and key head (`q_norm`, `k_norm`, one weight of head_dim shared by the
  heads); biases on all four projections only with `attention_bias`.
- Both: with `use_sliding_window` (off in transformers' configs and in every released dense Qwen2/3), the
  layers from `max_window_layers` on (or those `layer_types` names "sliding_attention") attend within
  `sliding_window` positions.

Under tensor parallelism the biases of q, k and v split with their rows (column-parallel), and a q/k norm's
weight, whole on every tp rank, gets from each only the gradient of that rank's heads: the plan names those
norms as kept whole inside the attention block (`kept_whole`) and their gradients are summed over tp
(parallel/tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from tetron.models.llama import LLAMA, Llama, LlamaConfig
from tetron.models.spec import ModelSpec, ParallelPlan, register

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class SlidingLayersConfig(LlamaConfig):
    """Llama's fields and Qwen's per-layer sliding windows (transformers' names and defaults)."""

    mlp_bias_option: ClassVar[bool] = False  # Qwen2MLP and Qwen3MLP have no biases

    use_sliding_window: bool = False  # the layers from max_window_layers on attend within sliding_window
    sliding_window: int | None = 4096  # a windowed layer's query attends to this many latest positions, itself
    # included; None: no window (Mistral, Mixtral: every layer is windowed; Qwen: with use_sliding_window)
    max_window_layers: int = 28  # with use_sliding_window, the layers below this index see the whole past
    layer_types: list[str] | None = None  # "full_attention" or "sliding_attention" per layer; None: from
    # use_sliding_window and max_window_layers, as transformers derives it

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be at least 1 (or null: no window)")
        if self.max_window_layers < 0:
            raise ValueError(f"max_window_layers={self.max_window_layers} must be at least 0")
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers
                                             or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"layer_types={self.layer_types!r}: give one of {LAYER_TYPES} per layer "
                             f"({self.num_hidden_layers}), or null")

    def layer_window(self, index: int) -> int | None:
        if not self.use_sliding_window or self.sliding_window is None:
            return None  # transformers sets sliding_window to None then, whatever layer_types says
        if self.layer_types is not None:
            windowed = self.layer_types[index] == "sliding_attention"
        else:
            windowed = index >= self.max_window_layers
        return self.sliding_window if windowed else None

    def one_layer(self, index: int = 0) -> SlidingLayersConfig:
        kinds = None if self.layer_types is None else [self.layer_types[index]]
        max_window = 0 if index >= self.max_window_layers else 1  # layer 0 windowed as layer `index` is
        return dataclasses.replace(self, num_hidden_layers=1, layer_types=kinds, max_window_layers=max_window)


@dataclass
class Qwen2Config(SlidingLayersConfig):
    """Qwen2: q, k and v with biases."""

    model_type: str = "qwen2"  # the model family (models/spec.py)
    attention_bias: bool = True  # Qwen2's q, k and v always carry biases (o never)

    hf_architecture: ClassVar[str] = "Qwen2ForCausalLM"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.attention_bias:
            raise ValueError("attention_bias=False: Qwen2's q, k and v always have biases; for a model "
                             "without them use model_type llama (or qwen3)")

    def attention_biases(self) -> tuple[bool, bool]:
        return True, False


@dataclass
class Qwen3Config(SlidingLayersConfig):
    """Qwen3: per-head q/k RMSNorm; biases only with attention_bias."""

    model_type: str = "qwen3"  # the model family (models/spec.py)

    hf_architecture: ClassVar[str] = "Qwen3ForCausalLM"
    qk_norm: ClassVar[bool] = True


QWEN2 = register(ModelSpec(name="qwen2", model_types=("qwen2",), config_class=Qwen2Config, model_class=Llama,
                           plan=LLAMA.plan))
QWEN3_PLAN = ParallelPlan(blocks=LLAMA.plan.blocks, residual_norms=LLAMA.plan.residual_norms,
                          kept_whole=("self_attn.q_norm", "self_attn.k_norm"))
QWEN3 = register(ModelSpec(name="qwen3", model_types=("qwen3",), config_class=Qwen3Config, model_class=Llama,
                           plan=QWEN3_PLAN))
