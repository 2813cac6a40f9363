"""Llama's modules, transformers' names and numerics: the attention with the family's options (its config's
`attention_options`), the decoder layer with its norms where the family places them, the stack, and the causal
LM. The other dense families and the MoE families build the same modules from their own configs."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from tetron.models.attention import Documents, ProjectionRMSNorm, sdpa_attention
from tetron.models.blocks import MLP, NORM_PLACEMENTS, RMSNorm, layer_norm_names
from tetron.models.llama.config import LlamaConfig
from tetron.models.llama.rope import apply_rope, rope_cos_sin
from tetron.models.loss import head_cross_entropy


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; head counts come from the projections' sizes. The family's
    options for layer `index` (the module docstring, `config.attention_options`) add biases, q/k norms, a
    sliding window, a v head width of its own, sinks, a scale and soft-capping."""

    def __init__(self, config: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        opts = config.attention_options(index)
        h, hd, vd = config.hidden_size, opts.head_dim, opts.v_head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        qkv_bias, o_bias = config.attention_biases()
        self.head_dim, self.v_head_dim, self.qk_norm = hd, vd, opts.qk_norm
        self.q_proj = nn.Linear(h, heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(h, kv_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(h, kv_heads * vd, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * vd, h, bias=o_bias)
        self.q_norm = self.k_norm = None
        if opts.qk_norm == "head":
            # of the family's kind: (1 + weight) for Gemma 3, plain for Qwen3
            unit = config.norm_unit_offset
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, unit_offset=unit)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, unit_offset=unit)
        elif opts.qk_norm == "projection":
            self.q_norm = ProjectionRMSNorm(heads * hd, config.rms_norm_eps)
            self.k_norm = ProjectionRMSNorm(kv_heads * hd, config.rms_norm_eps)
        # one logit per query head (tensor parallelism splits it with the heads)
        self.sinks = nn.Parameter(torch.zeros(heads)) if opts.sinks else None
        self.sliding_window = opts.window
        self.attn_options = opts.extras()  # scale, softcap: the keywords attn_fn gets where set
        self.attn_fn = sdpa_attention  # context parallelism swaps in ring attention here

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, heads*head_dim], v [B, T, kv_heads*v_dim]
        if self.qk_norm == "projection":  # the whole projection normed, before RoPE (OLMo 3)
            q, k = self.q_norm(q), self.k_norm(k)
        # Heads are counted from q/k/v themselves, so tensor parallelism can shard the projections.
        B, T = q.shape[:2]
        q = q.view(B, T, -1, self.head_dim)  # [B, T, n_heads, head_dim]
        k = k.view(B, T, -1, self.head_dim)  # [B, T, n_kv_heads, head_dim]
        if self.qk_norm == "head":  # each head normed over its head_dim, before RoPE (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, heads, T, head_dim]
        v = v.view(B, T, -1, self.v_head_dim).transpose(1, 2)  # [B, n_kv_heads, T, v_head_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        extras = self.attn_options if self.sinks is None else {**self.attn_options, "sinks": self.sinks}
        out = self.attn_fn(q, k, v, docs, self.sliding_window, **extras)  # [B, n_heads, T, v_head_dim]
        out = out.transpose(1, 2).reshape(B, T, -1)  # [B, T, n_heads*v_head_dim]
        return self.o_proj(out)


def mlp_of(config: LlamaConfig) -> MLP:
    """The dense feed-forward of `config`'s family (models/blocks.py)."""
    return MLP(config.hidden_size, config.intermediate_size, act=config.hidden_act, gated=config.mlp_gated,
               bias=config.mlp_bias, limit=config.mlp_limit)


def norm_of(config: LlamaConfig, dim: int) -> RMSNorm:
    """An RMSNorm of the family's kind (plain or 1 + weight) over `dim`."""
    return RMSNorm(dim, config.rms_norm_eps, unit_offset=config.norm_unit_offset)


class DecoderLayer(nn.Module):
    """x + attn(x), then + mlp(x), with norms where the family places them (blocks.NORM_PLACEMENTS): before
    each (pre, Llama), on each output before the residual add (post, OLMo), or both (sandwich, Gemma)."""

    def __init__(self, config: LlamaConfig, index: int = 0, *, attention: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.self_attn = (attention or Attention)(config, index)
        self.mlp = mlp_of(config)
        # (attention's input, its output, the MLP's input, its output): transformers' names, None where none
        self.norm_names = NORM_PLACEMENTS[config.norm_placement]
        for name in layer_norm_names(config.norm_placement):
            setattr(self, name, norm_of(config, config.hidden_size))

    def _norm(self, slot: int, x: Tensor) -> Tensor:
        name = self.norm_names[slot]
        return x if name is None else getattr(self, name)(x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        x = x + self._norm(1, self.self_attn(self._norm(0, x), cos, sin, docs))
        return x + self._norm(3, self.mlp(self._norm(2, x)))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm: HF's `model.` prefix."""

    def __init__(self, config: LlamaConfig, *, attention: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        # A dict keyed "0", "1", ... gives HF's names, and keeps them when a pipeline stage drops layers.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i, attention=attention)
                                     for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = norm_of(config, config.hidden_size)

    def forward(self, x: Tensor, position_ids: Tensor, docs: Tensor | None = None) -> Tensor:
        # A pipeline stage sets the parts it does not own to None; then x is hidden states.
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # [B, T, hidden]
        if self.embed_tokens is not None and self.config.scale_embeddings:
            # Gemma's sqrt(hidden), rounded to the embedding's dtype first, as transformers does
            h = h * torch.tensor(self.config.hidden_size ** 0.5, device=h.device).to(h.dtype)
        # RoPE is recomputed each call rather than cached in a buffer: no state to lose on the
        # meta device, and position ids may be arbitrary (offsets, context-parallel chunks).
        # One table per distinct RoPE among the held layers (one for Llama; Gemma 3's local and global differ).
        tables: dict[str, tuple[Tensor, Tensor]] = {}
        # one object for every layer: the mask its attention needs is made once, the first time
        docs = Documents(docs) if docs is not None else None
        for index, layer in self.layers.items():
            rope = repr(self.config.layer_rope(int(index)))
            if rope not in tables:
                tables[rope] = rope_cos_sin(self.config, position_ids, dtype=h.dtype, layer=int(index))
            h = layer(h, *tables[rope], docs)
        return self.norm(h) if self.norm is not None else h


class Llama(nn.Module):
    """Llama causal LM: `Llama(cfg).state_dict()` has exactly LlamaForCausalLM's keys. A family whose attention is
    a module of its own (`(config, layer index) -> nn.Module` with an `attn_fn`, models/spec.py) names it in a
    subclass's `attention_class`; the layers, norms, MLP, embedding and head stay these."""

    attention_class: ClassVar[type[nn.Module]] = Attention

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attention=self.attention_class)
        self.lm_head: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.loss_chunk_tokens = 0  # tokens per chunk of the loss with targets (0: one chunk); set by the trainer
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tie_word_embeddings, make lm_head.weight the embedding's Parameter (one object, two names).

        Call again after `to_empty()`: moving off the meta device replaces each name's Parameter.
        """
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, docs: Tensor | None = None,
                targets: Tensor | None = None) -> Tensor:
        """Logits [B, T, vocab] for input_ids [B, T]; position_ids [B, T] or [T], default 0..T-1; `docs`
        [B, T] keeps attention within each document of a packed row (models/attention.py). With `targets`
        [B, T]: the cross entropy summed over them instead, the head and the loss computed
        `loss_chunk_tokens` tokens at a time (models/loss.py), so the logits never exist whole."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)  # [1, T], broadcast over the batch
        h = self.model(input_ids, position_ids, docs)  # [B, T, hidden]
        if self.lm_head is None:
            return h
        if targets is None:
            return self.lm_head(h)  # [B, T, vocab]
        return head_cross_entropy(self.lm_head, h, targets, chunk_tokens=self.loss_chunk_tokens)

