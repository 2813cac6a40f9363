"""Mistral (transformers' MistralForCausalLM): Llama's blocks with a sliding window in every layer.

Each query attends to itself and the `sliding_window - 1` positions before it (transformers' default 4096;
Mistral 7B v0.1 has 4096, v0.2 and later null: no window, which is Llama). The window is applied in the
attention mask (models/attention.py), also within packed documents, and by ring and Ulysses attention under
context parallelism; the rest is Llama's, so every axis splits it as it splits Llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tetron.models.llama import LLAMA, Llama, LlamaConfig
from tetron.models.spec import ModelSpec, register


@dataclass
class MistralConfig(LlamaConfig):
    """Mistral: Llama's fields and a sliding window."""

    model_type: str = "mistral"  # the model family (models/spec.py)
    sliding_window: int | None = 4096  # a windowed layer's query attends to this many latest positions, itself
    # included; None: no window (Mistral, Mixtral: every layer is windowed; Qwen: with use_sliding_window)

    hf_architecture: ClassVar[str] = "MistralForCausalLM"
    mlp_bias_option: ClassVar[bool] = False  # MistralMLP has no biases

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window_without_bias(self, "Mistral")

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window


def check_window_without_bias(config: LlamaConfig, family: str) -> None:
    """Mistral's and Mixtral's attention: one sliding window (or none) for every layer, and no biases."""
    if config.sliding_window is not None and config.sliding_window < 1:
        raise ValueError(f"sliding_window={config.sliding_window} must be at least 1 (or null: no window)")
    if config.attention_bias:
        raise ValueError(f"attention_bias=True: {family}'s projections have no biases (transformers builds none)")


MISTRAL = register(ModelSpec(name="mistral", model_types=("mistral",), config_class=MistralConfig,
                             model_class=Llama, plan=LLAMA.plan))
