"""Qwen3-MoE (`Qwen3MoeForCausalLM`): a Llama whose feed-forwards are MoE blocks (models/moe.py), with
transformers' names and numerics; its config, model, parallel plan, the hub's names of its experts, and its
registration. Mixtral (models/mixtral.py) is this family with its own config and names.

It uses Llama's attention with Qwen3's options (models/llama/): a per-head RMSNorm on q and k before RoPE
(`qk_norm`, and biases with `attention_bias`). The config also offers DeepSeek-V3's routing (sigmoid scores,
the load-driven routing bias, group-limited top-k, shared experts, a scaling factor); such a model trains in
tetron but transformers' class of the family does not compute it. The experts' activation is the config's
`hidden_act`, as transformers' experts read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from torch import Tensor

from tetron.models.llama import LLAMA_PLAN, Llama, LlamaConfig
from tetron.models.moe import MoEBlock, add_batch_balance_loss, moe_blocks
from tetron.models.qwen import QWEN3_PLAN
from tetron.models.spec import ModelSpec, ParallelPlan, read_hf_config, register


@dataclass
class MoeConfig(LlamaConfig):
    """A Llama-style decoder with MoE feed-forwards; field names follow transformers' Qwen3MoeConfig."""

    model_type: str = "qwen3_moe"  # the model family (models/spec.py)
    num_experts: int = 8  # routed experts per MoE layer (num_local_experts in transformers 5's config.json)
    num_experts_per_tok: int = 2  # experts each token is routed to (top-k)
    moe_intermediate_size: int | None = None  # width of one expert's hidden layer; None: intermediate_size
    norm_topk_prob: bool = True  # renormalize each token's top-k weights to sum to 1 (Mixtral always does)
    decoder_sparse_step: int = 1  # every n-th layer is MoE (Qwen3-MoE); the others have a dense MLP
    mlp_only_layers: list[int] = field(default_factory=list)  # layers with a dense MLP of intermediate_size
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the objective; 0 disables it
    router_z_loss_coef: float = 0.0  # weight of the router z-loss (mean squared logsumexp of the logits)
    moe_capacity_factor: float | None = None  # None or 0: dropless; else an expert takes at most
    # factor * tokens * top_k / num_experts assignments per forward, the others are dropped (counted)
    moe_aux_loss: Literal["sequence", "batch"] = "sequence"  # per sequence (the same in every layout), or
    # transformers' formula over each forward's batch and all layers (to compare with transformers)
    scoring_func: Literal["softmax", "sigmoid"] = "softmax"  # router scores; sigmoid is DeepSeek-V3's
    n_group: int = 1  # expert groups; a token's experts come from its topk_group best groups (DeepSeek-V3)
    topk_group: int = 1  # groups each token may use
    n_shared_experts: int = 0  # experts every token goes through (one MLP of n * moe_intermediate_size)
    routed_scaling_factor: float = 1.0  # factor on the routed experts' weights
    moe_bias_update_rate: float = 0.0  # aux-loss-free balancing: the routing bias moves by this per step
    # toward balanced expert load (DeepSeek-V3 used 0.001); 0: no bias (a sigmoid router still has one)

    hf_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    qk_norm: ClassVar[bool] = True
    mlp_bias_option: ClassVar[bool] = False  # the experts (moe.py) have no biases
    norm_topk_always: ClassVar[bool] = False  # top-k weights renormalized whatever norm_topk_prob says (Mixtral)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        for name in ("num_experts", "decoder_sparse_step", "n_group", "moe_intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts={self.n_shared_experts} must be >= 0")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                             f"num_experts={self.num_experts}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                             f"topk_group={self.topk_group} be between 1 and n_group")
        per_group = self.num_experts // self.n_group
        # the router scores a group by its two best experts (moe.Router._best_groups), and a token's top_k
        # experts must come from its topk_group groups
        if self.n_group > 1 and (per_group < 2 or self.num_experts_per_tok > self.topk_group * per_group):
            raise ValueError(f"n_group={self.n_group} leaves {per_group} expert(s) per group of num_experts="
                             f"{self.num_experts}: group-limited routing needs at least 2 per group and "
                             f"num_experts_per_tok={self.num_experts_per_tok} <= topk_group={self.topk_group} x "
                             f"{per_group}; use fewer groups (n_group=1 turns it off)")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def layer_of_kind(self, moe: bool) -> MoeConfig:
        """This config with one decoder layer, an MoE layer or a dense one (what the planner builds to read each
        kind's shapes)."""
        return replace(self.one_layer(0), decoder_sparse_step=1, mlp_only_layers=[] if moe else [0])

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> MoeConfig:
        hf = cls._family_fields(dict(read_hf_config(path_or_dict)))
        if "num_local_experts" in hf:  # transformers 5 writes Qwen3-MoE's num_experts under this name too
            hf.setdefault("num_experts", hf["num_local_experts"])
        _check_moe_types(hf)
        return super().from_hf(hf)

    @classmethod
    def _family_fields(cls, hf: dict) -> dict:
        """A config.json's fields as this family's config reads them: what it refuses, what it renames."""
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported; use false")
        return hf

    def to_hf(self, dtype: str = "float32") -> dict:
        """A config dict transformers loads as the family's class (Qwen3MoeForCausalLM, MixtralForCausalLM)."""
        return {**super().to_hf(dtype), "output_router_logits": False, **self._hf_family_fields()}

    def _hf_family_fields(self) -> dict:
        """The fields of config.json only this family's transformers class has, or has otherwise."""
        return {"use_sliding_window": False, "sliding_window": None}

    def moe_block_options(self) -> dict:
        """MoEBlock's keywords beyond the shared ones (moe_block): a family's router name and bias, its experts
        built with their options (gpt-oss's); none for Qwen3-MoE and Mixtral."""
        return {}

    def _layer_params(self, experts: int) -> int:
        """Parameters of the decoder layers with `experts` experts counted per MoE layer."""
        h = self.hidden_size
        attention = self.attention_params()
        moe = self.num_experts * h + (experts + self.n_shared_experts) * 3 * h * self.moe_intermediate_size
        return sum(attention + (moe if self.is_moe_layer(i) else 3 * h * self.intermediate_size)
                   for i in range(self.num_hidden_layers))

    def num_params(self, *, include_embedding: bool = True, active: bool = False) -> int:
        """Exact parameter count (`active`: with each MoE layer's experts counted top_k times, not num_experts:
        the weights one token's forward multiplies by); without embedding it leaves out embed_tokens and lm_head."""
        n = self._layer_params(self.num_experts_per_tok if active else self.num_experts) + self.hidden_size
        if include_embedding:
            n += self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token from the ACTIVE parameters: 6 * N_active + 12*L*H*s (see LlamaConfig's)."""
        n = self.num_params(include_embedding=False, active=True) + self.vocab_size * self.hidden_size
        return 6.0 * n + self.attention_flops_per_token(seq_len)


_MOE_INTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "n_group",
             "topk_group", "n_shared_experts")
_MOE_NUMBERS = ("router_aux_loss_coef", "router_z_loss_coef", "moe_capacity_factor", "routed_scaling_factor",
                "moe_bias_update_rate")
_MOE_CHOICES = {"moe_aux_loss": ("sequence", "batch"), "scoring_func": ("softmax", "sigmoid")}


def _check_moe_types(hf: dict) -> None:
    """Each MoE field of a config.json has its type ("num_experts": "4" would fail far later, on every rank)."""
    for name in _MOE_INTS:
        value = hf.get(name)
        if name in hf and type(value) is not int and not (value is None and name == "moe_intermediate_size"):
            raise ValueError(f"{name}={value!r}: expected an integer")
    for name in _MOE_NUMBERS:
        value = hf.get(name)
        if name in hf and (not isinstance(value, (int, float)) or isinstance(value, bool)) and not (
                value is None and name == "moe_capacity_factor"):
            raise ValueError(f"{name}={value!r}: expected a number")
    for name, choices in _MOE_CHOICES.items():
        if name in hf and hf[name] not in choices:
            raise ValueError(f"{name}={hf[name]!r}: use one of {list(choices)}")
    if "norm_topk_prob" in hf and type(hf["norm_topk_prob"]) is not bool:
        raise ValueError(f"norm_topk_prob={hf['norm_topk_prob']!r}: expected true or false")
    only = hf.get("mlp_only_layers")
    if only is not None and not (isinstance(only, list) and all(type(i) is int for i in only)):
        raise ValueError(f"mlp_only_layers={only!r}: expected a list of layer indices")


def moe_block(config: MoeConfig) -> MoEBlock:
    """One MoE feed-forward of `config`'s shape and routing rules."""
    return MoEBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                    config.num_experts_per_tok, capacity_factor=config.moe_capacity_factor,
                    aux_loss_coef=config.router_aux_loss_coef, z_loss_coef=config.router_z_loss_coef,
                    aux_loss=config.moe_aux_loss, n_shared_experts=config.n_shared_experts, act=config.hidden_act,
                    scoring=config.scoring_func,
                    norm_topk_prob=config.norm_topk_prob or config.norm_topk_always,
                    n_group=config.n_group, topk_group=config.topk_group,
                    routed_scaling_factor=config.routed_scaling_factor,
                    bias_update_rate=config.moe_bias_update_rate, **config.moe_block_options())


class MoeForCausalLM(Llama):
    """Qwen3MoeForCausalLM (and MixtralForCausalLM): Llama's body (its attention options set by the config) with MoE
    blocks as the feed-forwards; `state_dict()` has exactly transformers' keys."""

    def __init__(self, config: MoeConfig) -> None:
        super().__init__(config)
        for i, layer in self.model.layers.items():
            if config.is_moe_layer(int(i)):
                layer.mlp = moe_block(config)
        blocks = moe_blocks(self)
        for block in blocks:  # one forward's objective: the per-sequence sums averaged over the MoE layers
            block.loss_scale = 1.0 / len(blocks)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, docs: Tensor | None = None,
                targets: Tensor | None = None) -> Tensor:
        out = super().forward(input_ids, position_ids, docs, targets)  # logits, or with targets the summed loss
        if self.config.moe_aux_loss == "batch":
            out = add_batch_balance_loss(out, moe_blocks(self))
        return out


def experts_one_by_one(name: str, config: MoeConfig, *, block: str = "mlp",
                       pieces: tuple[tuple[str, ...], tuple[str, ...]] = (("gate_proj", "up_proj"), ("down_proj",))
                       ) -> str | list[list[str]] | None:
    """Where the hub's checkpoints (and transformers' save_pretrained, 4.x and 5.x, and tetron's writers) keep a
    tensor tetron holds fused or renamed (ModelSpec.stored_as): the experts one by one under `block`
    (`mlp.experts.N.gate_proj.weight`, `up_proj`, then `down_proj`: `pieces` names them, those of gate_up_proj and
    those of down_proj), the router as `{block}.gate.weight`. None for every other tensor."""
    layer, sep, rest = name.partition(".mlp.")
    if not sep:
        return None
    where = f"{layer}.{block}."
    if rest == "gate.weight":
        return None if block == "mlp" else f"{where}gate.weight"
    names = dict(zip(("experts.gate_up_proj", "experts.down_proj"), pieces)).get(rest)
    if names is None:
        return None
    return [[f"{where}experts.{e}.{piece}.weight" for piece in names] for e in range(config.num_experts)]


# Under tp only attention splits: each MoE layer's mlp stays whole on every tp rank (Megatron's expert-tensor-
# parallel size 1; expert parallelism splits the experts instead). Without sp every tp rank runs it on the same
# tokens; with sp on its own share of them. A dense layer's mlp (mlp_only_layers) stays whole too.
MOE_PLAN = ParallelPlan(blocks=LLAMA_PLAN.blocks[:1], residual_norms=LLAMA_PLAN.residual_norms, replicated=("mlp",))
QWEN3_MOE = register(ModelSpec(name="qwen3_moe", model_types=("qwen3_moe",), config_class=MoeConfig,
                               model_class=MoeForCausalLM, plan=replace(MOE_PLAN, kept_whole=QWEN3_PLAN.kept_whole),
                               stored_as=experts_one_by_one))
