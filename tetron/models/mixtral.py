"""Mixtral (transformers' MixtralForCausalLM): Qwen3-MoE's model (models/qwen3_moe.py) with Mixtral's config and
the hub's names: every layer MoE, experts of intermediate_size, top-k weights always renormalized, no q/k norms,
Mistral's `sliding_window` in every layer (null in its released configs), the experts kept under
`block_sparse_moe` as `w1` (gate), `w3` (up), `w2` (down) and the router as `block_sparse_moe.gate`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from tetron.models.mistral import check_window_without_bias
from tetron.models.qwen3_moe import MOE_PLAN, MoeConfig, MoeForCausalLM, experts_one_by_one
from tetron.models.spec import ModelSpec, register


@dataclass
class MixtralConfig(MoeConfig):
    """Mixtral: every layer MoE, experts of intermediate_size, top-k weights always renormalized."""

    model_type: str = "mixtral"  # the model family (models/spec.py)
    sliding_window: int | None = None  # a windowed layer's query attends to this many latest positions, itself
    # included; None: no window (Mistral, Mixtral: every layer is windowed; Qwen: with use_sliding_window)

    hf_architecture: ClassVar[str] = "MixtralForCausalLM"
    qk_norm: ClassVar[bool] = False
    norm_topk_always: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window_without_bias(self, "Mixtral")

    def layer_window(self, index: int) -> int | None:
        return self.sliding_window

    @classmethod
    def _family_fields(cls, hf: dict) -> dict:
        if hf.get("router_jitter_noise"):
            raise ValueError("router_jitter_noise is not supported; use 0")
        return {**hf, "moe_intermediate_size": hf.get("intermediate_size")}  # its experts' width

    def _hf_family_fields(self) -> dict:
        return {"num_local_experts": self.num_experts, "intermediate_size": self.moe_intermediate_size,
                "router_jitter_noise": 0.0}


MIXTRAL = register(ModelSpec(
    name="mixtral", model_types=("mixtral",), config_class=MixtralConfig, model_class=MoeForCausalLM, plan=MOE_PLAN,
    stored_as=functools.partial(experts_one_by_one, block="block_sparse_moe", pieces=(("w1", "w3"), ("w2",)))))
