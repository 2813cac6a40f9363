"""DeepSeek-V3 (transformers' DeepseekV3ForCausalLM; Kimi-K2 has its shapes): multi-head latent attention (MLA),
`first_k_dense_replace` dense layers then MoE layers routed as DeepSeek-V3 routes (sigmoid scores, the correction
bias, group-limited top-k, shared experts: models/moe.py's router), transformers' names and numerics.

MLA (DeepSeek-V2, section 2.1): queries through a low-rank latent (`q_a_proj` to q_lora_rank, `q_a_layernorm`,
`q_b_proj` to every head; or one `q_proj` when q_lora_rank is null); keys and values through one shared latent
(`kv_a_proj_with_mqa` to kv_lora_rank, `kv_a_layernorm`, `kv_b_proj` to every head's qk_nope_head_dim key part
and v_head_dim value), plus a rotary key part of qk_rope_head_dim computed once from the hidden state and shared
by all heads (the "mqa" of the name). A query or key head is [nope | rope] (qk_nope + qk_rope wide), a value head
v_head_dim wide: the attention core takes q/k and v of other widths (models/attention.py). With `rope_interleave`
(transformers' default) the rotary part's dims are rotated in interleaved pairs (x0, x1), (x2, x3), ... and laid
out as [rotated evens | rotated odds], as transformers' apply_rotary_pos_emb_interleave does (the same permutation
of q's and k's dims, so the scores are the pairs' rotation's). YaRN scaling (`rope_scaling` of type yarn) scales
the scores by mscale(factor, mscale_all_dim)^2 on top of head_dim^-0.5, as transformers' yarn_apply_mscale.

Under tp the latent projections and their norms stay whole on every rank (the plan's `kept_whole`: their inputs
are whole after the block's f, their outputs feed every head), the up-projections (`q_b_proj` or `q_proj`,
`kv_b_proj`) are column-parallel by heads, `o_proj` row-parallel; the feed-forwards (dense and MoE) stay whole as
in every MoE family here (qwen3_moe.MOE_PLAN), the experts split by expert parallelism.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from tetron.models.attention import AttentionOptions, Documents, sdpa_attention
from tetron.models.blocks import RMSNorm
from tetron.models.llama import LLAMA_PLAN, apply_rope
from tetron.models.llama.model import DecoderLayer
from tetron.models.loss import head_cross_entropy
from tetron.models.moe import add_batch_balance_loss, moe_blocks
from tetron.models.mtp import add_mtp_parts, mtp_loss
from tetron.models.qwen3_moe import MOE_PLAN, MoeConfig, MoeForCausalLM, experts_one_by_one, moe_block
from tetron.models.spec import Block, ModelSpec, read_hf_config, refuse_quantized, register

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps


@dataclass
class DeepseekV3Config(MoeConfig):
    """DeepSeek-V3's fields (transformers' DeepseekV3Config's names and defaults: the 671B model's shapes)."""

    model_type: str = "deepseek_v3"  # the model family (models/spec.py)
    vocab_size: int = 129280  # number of token ids (rows of the embedding)
    hidden_size: int = 7168  # width of the residual stream
    intermediate_size: int = 18432  # width of the MLP's hidden layer
    num_hidden_layers: int = 61  # number of decoder layers
    num_attention_heads: int = 128  # query heads per layer
    max_position_embeddings: int = 4096  # longest sequence the model is meant for
    bos_token_id: int | None = 0  # beginning-of-sequence token id, for tokenizers and generation
    eos_token_id: int | list[int] | None = 1  # end-of-sequence token id(s)
    q_lora_rank: int | None = 1536  # width of the query latent (q_a_proj, q_a_layernorm, q_b_proj); None: one q_proj
    kv_lora_rank: int = 512  # width of the key/value latent (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj)
    qk_nope_head_dim: int = 128  # the part of a query/key head without rotary embedding (from the latents)
    qk_rope_head_dim: int = 64  # the rotary part of a query/key head (the keys' shared by all heads)
    v_head_dim: int = 128  # width of a value head
    rope_interleave: bool = True  # rotate the rotary dims in interleaved pairs (DeepSeek's layout), not halves
    first_k_dense_replace: int = 3  # the first k layers have a dense MLP (intermediate_size), the rest are MoE
    num_experts: int = 256  # routed experts per MoE layer (num_local_experts in transformers 5's config.json)
    num_experts_per_tok: int = 8  # experts each token is routed to (top-k)
    moe_intermediate_size: int | None = 2048  # width of one expert's hidden layer; None: intermediate_size
    n_shared_experts: int = 1  # experts every token goes through (one MLP of n * moe_intermediate_size)
    routed_scaling_factor: float = 2.5  # factor on the routed experts' weights
    n_group: int = 8  # expert groups; a token's experts come from its topk_group best groups (DeepSeek-V3)
    topk_group: int = 4  # groups each token may use
    scoring_func: Literal["softmax", "sigmoid"] = "sigmoid"  # router scores; sigmoid is DeepSeek-V3's
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the objective; 0 disables it
    num_nextn_predict_layers: int = 0  # multi-token prediction modules after the last layer (models/mtp.py); 0: none

    hf_architecture: ClassVar[str] = "DeepseekV3ForCausalLM"
    qk_norm: ClassVar[bool] = False
    mlp_bias_option: ClassVar[bool] = False  # the experts (moe.py) have no biases

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.q_lora_rank is not None and (type(self.q_lora_rank) is not int or self.q_lora_rank < 1):
            raise ValueError(f"q_lora_rank={self.q_lora_rank!r} must be a positive integer (or null: one q_proj)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary embeddings")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"num_key_value_heads={self.num_key_value_heads}: MLA expands its latent to every head; "
                             f"give num_attention_heads={self.num_attention_heads} (or leave it out)")
        self.head_dim = self.qk_rope_head_dim  # what RoPE's tables span, as transformers sets it
        super().__post_init__()
        if self.scoring_func != "sigmoid":
            raise ValueError(f"scoring_func={self.scoring_func!r}: DeepSeek-V3's router scores by sigmoid; use "
                             f"'sigmoid'")
        if type(self.first_k_dense_replace) is not int or self.first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace!r} must be an integer >= 0")
        if self.mlp_only_layers or self.decoder_sparse_step != 1:
            raise ValueError("mlp_only_layers, decoder_sparse_step: DeepSeek-V3 places its dense layers by "
                             "first_k_dense_replace; leave these out")
        if type(self.num_nextn_predict_layers) is not int or self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers={self.num_nextn_predict_layers!r} must be an integer >= 0")
        if type(self.rope_interleave) is not bool:
            raise ValueError(f"rope_interleave={self.rope_interleave!r}: expected true or false")

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def one_layer(self, index: int = 0) -> DeepseekV3Config:
        return dataclasses.replace(self, num_hidden_layers=1,
                                   first_k_dense_replace=0 if self.is_moe_layer(index) else 1)

    def layer_of_kind(self, moe: bool) -> DeepseekV3Config:
        return dataclasses.replace(self, num_hidden_layers=1, first_k_dense_replace=0 if moe else 1)

    def attention_scale(self) -> float:
        """The scores' scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers'
        yarn_apply_mscale: the same temperature on q and k as DeepSeek's reference applies to the softmax)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        s = self.rope_scaling
        if s is not None and s.get("mscale_all_dim"):
            m = 1.0 if s["factor"] <= 1 else 0.1 * s["mscale_all_dim"] * math.log(s["factor"]) + 1.0
            scale = scale * m * m
        return scale

    def attention_options(self, index: int) -> AttentionOptions:
        return AttentionOptions(head_dim=self.qk_nope_head_dim + self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                                scale=self.attention_scale())

    def attention_params(self) -> int:
        """MLA's parameters and the layer's two norms."""
        h, heads, bias = self.hidden_size, self.num_attention_heads, int(self.attention_bias)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = h * heads * qk
        else:
            q = (h + bias) * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        kv = ((h + bias) * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        o = heads * self.v_head_dim * h + h * bias
        return q + kv + o + 2 * h

    def flops_per_token(self, seq_len: int) -> float:
        """6 * N_active (MoeConfig's) + the attention's scores over qk_head_dim and weighted values over v_head_dim."""
        n = self.num_params(include_embedding=False, active=True) + self.vocab_size * self.hidden_size
        widths = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return 6.0 * n + 6.0 * self.num_hidden_layers * self.num_attention_heads * widths * seq_len

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> DeepseekV3Config:
        hf = dict(read_hf_config(path_or_dict))
        if "n_routed_experts" in hf:
            hf.setdefault("num_experts", hf["n_routed_experts"])
        return super().from_hf(hf)

    @classmethod
    def _family_fields(cls, hf: dict) -> dict:
        refuse_quantized(hf, "the hub's DeepSeek-V3 keeps them in FP8")
        return hf

    def _hf_family_fields(self) -> dict:
        return {"n_routed_experts": self.num_experts, "qk_head_dim": self.qk_nope_head_dim + self.qk_rope_head_dim}


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, d] by pairs (x0, x1), (x2, x3), ... (cos/sin [B or 1, T, d] as rope_cos_sin gives
    them, halves repeated), laid out as [rotated evens | rotated odds]: transformers' DeepSeek-V3 interleave."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)  # [B, 1, T, d/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention with transformers' names; heads are counted from the up-projections' outputs,
    so tensor parallelism can split them by heads."""

    def __init__(self, config: DeepseekV3Config, index: int = 0) -> None:
        super().__init__()
        opts = config.attention_options(index)
        h, heads, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.nope, self.rope, self.v_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.head_dim, self.kv_lora_rank = opts.head_dim, config.kv_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * self.head_dim, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, h, bias=bias)
        self.rotate = apply_rope_interleaved if config.rope_interleave else apply_rope
        self.sliding_window = None
        self.attn_options = opts.extras()  # the scale
        self.attn_fn = sdpa_attention  # context parallelism swaps in ring or Ulysses attention here

    def qk_clip_rule(self) -> tuple[int, int, list]:
        """QK-clip's rows (as parallel/qk_clip.py's clip_rows(groups, parts) reads them), Kimi-K2's MLA rule:
        per head, the q and k nope rows (k's out of kv_b_proj) times sqrt(eta), the q rotary rows times eta (the
        rotary key is shared by every head: untouched, as are the value rows), so each head's logits scale by eta.
        Heads counted from kv_b_proj: this rank's."""
        heads = self.kv_b_proj.weight.shape[0] // (self.nope + self.v_head_dim)
        q = self.q_proj if self.q_proj is not None else self.q_b_proj
        return heads, heads, [(q.weight, heads, [(self.nope, 0.5), (self.rope, 1.0)]),
                              (self.kv_b_proj.weight, heads, [(self.nope, 0.5), (self.v_head_dim, 0.0)])]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        B, T = x.shape[:2]
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B, heads, T, nope + rope]
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # [B, T, heads * (nope + v)]
        kv = kv.view(B, T, -1, self.nope + self.v_head_dim).transpose(1, 2)  # [B, heads, T, nope + v]
        k_pass, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        k_rot = self.rotate(k_rot.view(B, 1, T, self.rope), cos, sin)  # [B, 1, T, rope]: one for all heads
        q = torch.cat([q_pass, self.rotate(q_rot, cos, sin)], dim=-1)  # [B, heads, T, nope + rope]
        k = torch.cat([k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)], dim=-1)  # [B, heads, T, nope + rope]
        out = self.attn_fn(q, k, v.contiguous(), docs, self.sliding_window, **self.attn_options)  # [B, heads, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DeepseekV3ForCausalLM(MoeForCausalLM):
    """DeepseekV3ForCausalLM: Llama's body with MLA as its attention, dense MLPs in the first
    first_k_dense_replace layers and MoE blocks after; `state_dict()` has exactly transformers' keys, and with
    num_nextn_predict_layers the MTP modules' under `mtp.` (stored where DeepSeek keeps them: `stored_as`)."""

    attention_class: ClassVar[type[nn.Module]] = MLAttention

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config)
        L = config.num_hidden_layers
        self.mtp: nn.ModuleDict | None = None
        self.mtp_embed_tokens: nn.Module | None = None  # a pipeline's last stage: its copy of the embedding
        self.mtp_loss_weight = 0.1  # train.mtp_loss_weight, set by the trainer
        self.mtp_sum: Tensor | None = None  # the step's summed MTP loss so far (models/mtp.py), for the logs
        if config.num_nextn_predict_layers:
            self.mtp = nn.ModuleDict()
            for k in range(config.num_nextn_predict_layers):
                layer = DecoderLayer(config, L + k, attention=MLAttention)
                if config.is_moe_layer(L + k):
                    layer.mlp = moe_block(config)
                self.mtp[str(k)] = add_mtp_parts(layer, config.hidden_size, config.rms_norm_eps)
            blocks = moe_blocks(self)
            for block in blocks:
                block.loss_scale = 1.0 / len(blocks)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, docs: Tensor | None = None,
                targets: Tensor | None = None, mtp: Tensor | None = None) -> Tensor:
        """As Llama's; with `mtp` [B, D, 3, T] (data/batch.py's mtp_shifted) and targets, the MTP objective's
        gradient is added to the summed loss (its value stays the main loss's)."""
        if self.mtp is None or mtp is None or targets is None or self.lm_head is None:
            return super().forward(input_ids, position_ids, docs, targets)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        h = self.model(input_ids, position_ids, docs)  # [B, T, hidden], after the final norm
        out = head_cross_entropy(self.lm_head, h, targets, chunk_tokens=self.loss_chunk_tokens)
        out = mtp_loss(self, h, out, position_ids, docs, mtp)
        if self.config.moe_aux_loss == "batch":
            out = add_batch_balance_loss(out, moe_blocks(self))
        return out


# MLA under tp: the latent projections and norms whole on every rank, the up-projections column-parallel by heads
# (q_proj where there is no query latent, q_b_proj where there is: a layer has one of them), o_proj row-parallel
DEEPSEEK_V3_PLAN = dataclasses.replace(
    MOE_PLAN, blocks=(Block("self_attn", column=("q_proj", "q_b_proj", "kv_b_proj"), row="o_proj"),),
    residual_norms=LLAMA_PLAN.residual_norms,
    kept_whole=("self_attn.q_a_proj", "self_attn.q_a_layernorm", "self_attn.kv_a_proj_with_mqa",
                "self_attn.kv_a_layernorm"))



def stored_as(name: str, config: DeepseekV3Config) -> str | list[list[str]] | None:
    """Where DeepSeek's folders keep a tensor: the experts one by one, and MTP module k's parts (`mtp.{k}.`) as the
    layer past the last, `model.layers.{num_hidden_layers + k}.` (transformers skips those, as for DeepSeek's own)."""
    if name.startswith("mtp."):
        k, _, rest = name[len("mtp."):].partition(".")
        name = f"model.layers.{config.num_hidden_layers + int(k)}.{rest}"
        return experts_one_by_one(name, config) or name
    return experts_one_by_one(name, config)


def shared_copies(config: DeepseekV3Config) -> tuple[str, ...]:
    """DeepSeek's folders also keep, in each MTP layer, copies of the embedding and the output head, which tetron's
    MTP modules share with the model: left unread."""
    return tuple(f"model.layers.{config.num_hidden_layers + k}.{part}" for k in range(config.num_nextn_predict_layers)
                 for part in ("embed_tokens.", "shared_head.head."))


DEEPSEEK_V3 = register(ModelSpec(name="deepseek_v3", model_types=("deepseek_v3",),
                                 config_class=DeepseekV3Config, model_class=DeepseekV3ForCausalLM,
                                 plan=DEEPSEEK_V3_PLAN, stored_as=stored_as, unread=shared_copies))
