"""The config of a family whose layers come in kinds (transformers 5's `layer_types`): "sliding_attention"
layers attend within `sliding_window` positions, "full_attention" layers to the whole causal past, and each
kind has its own RoPE, as transformers 5 writes it in one `rope_parameters` dict per kind (OLMo 3, Gemma 3).

The full layers' RoPE is Llama's fields, `rope_theta` and `rope_scaling` (which transformers applies to the full
layers only; "linear" is read besides Llama 3.1's "llama3" and OLMo 3's YaRN); the sliding layers' base is
`rope_local_base_freq` (Gemma 3's name; None: rope_theta) and they are never scaled. Older config.json files
(rope_theta, rope_scaling, rope_local_base_freq at the top level) read the same.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar

from tetron.models.attention import LAYER_KINDS, layer_windows
from tetron.models.llama import LlamaConfig
from tetron.models.llama.config import _rope_number
from tetron.models.spec import read_hf_config


@dataclass
class LayerTypesConfig(LlamaConfig):
    """Llama's fields, a kind per layer, the sliding layers' window and their RoPE base."""

    sliding_window: int | None = 4096  # a windowed layer's query attends to this many latest positions, itself
    # included; None: no window (Mistral, Mixtral: every layer is windowed; Qwen: with use_sliding_window; OLMo 3,
    # Gemma 3: the sliding_attention layers)
    layer_types: list[str] | None = None  # "full_attention" or "sliding_attention" per layer; None: the family's
    # default (Qwen: from use_sliding_window and max_window_layers; OLMo 3: every 4th layer full; Gemma 3: 6th)
    rope_local_base_freq: float | None = None  # RoPE base of the sliding layers; None: rope_theta (their
    # rope_parameters' rope_theta in transformers 5's config.json)

    sliding_pattern: ClassVar[int] = 4  # without layer_types, every n-th layer is full, the others sliding

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.sliding_pattern == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be at least 1 (or null: no window)")
        layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)  # one line if bad
        if self.rope_local_base_freq is not None and not self.rope_local_base_freq > 0:
            raise ValueError(f"rope_local_base_freq={self.rope_local_base_freq} must be positive (or null: "
                             "rope_theta)")

    def _normalized_rope_scaling(self, scaling: dict) -> dict | None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind not in ("linear", "llama3", "yarn", "default", None):
            raise ValueError(f"rope_scaling type {kind!r} is not supported; use None, 'linear', 'llama3' or 'yarn'")
        if kind != "linear":
            return super()._normalized_rope_scaling(scaling)
        if "factor" not in scaling:
            raise ValueError("rope_scaling of type 'linear' lacks its factor")
        factor = _rope_number(scaling["factor"], "factor")
        if not factor > 0:
            raise ValueError(f"rope_scaling.factor={factor} must be positive")
        return {"rope_type": "linear", "factor": factor}

    def layer_window(self, index: int) -> int | None:
        return layer_windows(self.layer_types, self.sliding_window, self.num_hidden_layers)[index]

    def layer_rope(self, index: int) -> tuple[float, dict | None]:
        if self.layer_types[index] == "full_attention":
            return self.rope_theta, self.rope_scaling
        return (self.rope_theta if self.rope_local_base_freq is None else self.rope_local_base_freq), None

    def one_layer(self, index: int = 0) -> LayerTypesConfig:
        return dataclasses.replace(self, num_hidden_layers=1, layer_types=[self.layer_types[index]])

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> LayerTypesConfig:
        hf = dict(read_hf_config(path_or_dict))
        rope = hf.get("rope_parameters")
        if isinstance(rope, dict) and set(rope) & set(LAYER_KINDS):  # transformers 5: one dict per layer kind
            full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
            if not isinstance(full, dict) or not isinstance(local, dict):
                raise ValueError(f"rope_parameters={rope!r}: expected a mapping per layer type")
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.sliding_attention={local!r}: tetron scales the full layers' "
                                 "RoPE only (rope_type default for the sliding layers)")
            hf["rope_parameters"] = full or None
            full_theta = full.get("rope_theta", hf.get("rope_theta"))
            default = {f.name: f.default for f in dataclasses.fields(cls)}["rope_local_base_freq"]
            if "rope_theta" in local and (local["rope_theta"] != full_theta or default is not None):
                hf["rope_local_base_freq"] = local["rope_theta"]  # else None: rope_theta, as the family's default
        local_theta = hf.get("rope_local_base_freq")
        if local_theta is not None and (not isinstance(local_theta, (int, float)) or isinstance(local_theta, bool)):
            raise ValueError(f"rope_local_base_freq={local_theta!r}: expected a number")
        return super().from_hf(hf)

    def to_hf(self, dtype: str = "float32") -> dict:
        hf = super().to_hf(dtype)
        local = self.rope_theta if self.rope_local_base_freq is None else self.rope_local_base_freq
        hf["rope_parameters"] = {"full_attention": hf["rope_parameters"],
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        if self.rope_local_base_freq is not None:
            hf["rope_local_base_freq"] = local
        return hf
