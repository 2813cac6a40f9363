"""A plain single-device Llama whose names and numerics match transformers' LlamaForCausalLM.

Parallel strategies live elsewhere and transform this model: they swap its linears and
embedding, drop layers, or replace each attention module's `attn_fn`.

Its blocks are shared by the families that differ from Llama only in their attention (qwen.py, mistral.py,
and the MoE families), each a config subclass of LlamaConfig that sets the options the blocks read:
- `attention_bias` (a field, transformers' name): q, k, v and o carry biases; `attention_biases()` says
  which, (q/k/v, o): Qwen2 overrides it to biases on q, k and v only;
- `qk_norm` (a class attribute, no config field: a family has it or not): an RMSNorm over head_dim of each
  query and key head before RoPE, one weight shared by all heads (`self_attn.q_norm`, `k_norm`: Qwen3);
- `layer_window(i)`: layer i's sliding window (None: the whole causal past), passed to `attn_fn` as its
  `window` (models/attention.py); Mistral's is `sliding_window` in every layer, Qwen's per `layer_types`;
- `attention_options(i)`: all of layer i's attention options (models/attention.py's AttentionOptions: the
  above, and v's head width, the scale, soft-capping, sinks, QK-norm over the whole projection); a family
  whose attention differs in more than the above overrides it.
- the MLP (models/blocks.py): its activation `hidden_act` and biases `mlp_bias` (fields, transformers' names),
  gated or not (`mlp_gated`), clamped (`mlp_limit`); the activations and biases a family's transformers class
  reads (`mlp_activations`, `mlp_bias_option`);
- the norms (models/blocks.py): where they sit (`norm_placement`: "pre", Llama's; "post", OLMo's; "sandwich",
  Gemma's, with transformers' names for each), a plain or a (1 + weight) weight (`norm_unit_offset`), and the
  embedding's output scaled by sqrt(hidden_size) (`scale_embeddings`, Gemma's).
Llama's own config sets none of them but attention_bias, hidden_act and mlp_bias, which Llama checkpoints may
have; with none set, the blocks compute exactly what they did without the options.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tetron.models.attention import AttentionOptions, Documents, ProjectionRMSNorm, sdpa_attention
from tetron.models.blocks import ACTIVATIONS, MLP, NORM_PLACEMENTS, RMSNorm, activation, layer_norm_names, mlp_params
from tetron.models.loss import head_cross_entropy
from tetron.models.spec import Block, ModelSpec, ParallelPlan, read_hf_config, register

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass
class LlamaConfig:
    """Architecture of a Llama-style decoder; field names follow transformers' LlamaConfig."""

    model_type: str = "llama"  # the model family (models/spec.py): a registered Hugging Face model_type
    vocab_size: int = 32000  # number of token ids (rows of the embedding)
    hidden_size: int = 4096  # width of the residual stream
    intermediate_size: int = 11008  # width of the MLP's hidden layer
    num_hidden_layers: int = 32  # number of decoder layers
    num_attention_heads: int = 32  # query heads per layer
    num_key_value_heads: int | None = None  # key/value heads (GQA); None: same as query heads
    head_dim: int | None = None  # width of one head; None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048  # longest sequence the model is meant for
    rms_norm_eps: float = 1e-6  # epsilon added to the mean square in RMSNorm
    rope_theta: float = 10000.0  # RoPE base wavelength
    rope_scaling: dict | None = None  # None, or HF's {"rope_type": "llama3", ...} (Llama 3.1/3.2)
    tie_word_embeddings: bool = False  # lm_head shares the embedding's weight
    initializer_range: float = 0.02  # std of the normal init of linear and embedding weights
    bos_token_id: int | None = None  # beginning-of-sequence token id, for tokenizers and generation
    eos_token_id: int | list[int] | None = None  # end-of-sequence token id(s)
    attention_bias: bool = False  # q, k, v and o projections carry biases (Qwen2: q, k, v always)
    hidden_act: str = "silu"  # the MLP's activation, as transformers names it: silu, gelu, gelu_pytorch_tanh, ...
    mlp_bias: bool = False  # the MLP's linears carry biases (Llama's option)

    hf_architecture: ClassVar[str] = "LlamaForCausalLM"  # transformers' class, written to config.json
    qk_norm: ClassVar[bool] = False  # an RMSNorm over each query and key head (Qwen3's q_norm, k_norm)
    mlp_gated: ClassVar[bool] = True  # down(act(gate(x)) * up(x)); False: down(act(up(x)))
    mlp_limit: ClassVar[float | None] = None  # clamp the gate from above and up on both sides (gpt-oss)
    mlp_activations: ClassVar[tuple[str, ...]] = tuple(ACTIVATIONS)  # the hidden_act values the family takes
    mlp_bias_option: ClassVar[bool] = True  # the family's transformers class reads mlp_bias (Llama's does)
    norm_placement: ClassVar[str] = "pre"  # where a layer's norms sit: "pre", "post" or "sandwich" (blocks.py)
    norm_unit_offset: ClassVar[bool] = False  # RMSNorm multiplies by (1 + weight) (Gemma), not by weight
    scale_embeddings: ClassVar[bool] = False  # the embedding's output times sqrt(hidden_size) (Gemma)

    def attention_biases(self) -> tuple[bool, bool]:
        """(q, k and v have biases, o has a bias), as transformers' attention of the family builds them."""
        return self.attention_bias, self.attention_bias

    def layer_window(self, index: int) -> int | None:
        """The sliding window of decoder layer `index` (None: the whole causal past); Llama has none."""
        return None

    def one_layer(self, index: int = 0) -> LlamaConfig:
        """This config with only decoder layer `index`, as layer 0 (what the planner builds to read a layer's
        shapes): a family with per-layer fields cuts them to that layer's entry."""
        return dataclasses.replace(self, num_hidden_layers=1)

    def attention_options(self, index: int) -> AttentionOptions:
        """Decoder layer `index`'s attention: Llama's, with the family's window and per-head q/k norms."""
        return AttentionOptions(head_dim=self.head_dim, v_head_dim=self.head_dim, window=self.layer_window(index),
                                qk_norm="head" if self.qk_norm else None)

    def __post_init__(self) -> None:
        activation(self.hidden_act)  # one line naming hidden_act and the supported names
        if self.hidden_act not in self.mlp_activations:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported by tetron's {self.hf_architecture}; "
                             f"use one of {', '.join(self.mlp_activations)}")
        if self.mlp_bias and not self.mlp_bias_option:
            raise ValueError(f"mlp_bias=True: {self.hf_architecture}'s MLP has no biases; use false")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement={self.norm_placement!r}: use one of {', '.join(NORM_PLACEMENTS)}")
        for name in ("num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.rope_scaling is not None:
            self.rope_scaling = self._normalized_rope_scaling(self.rope_scaling)

    def _normalized_rope_scaling(self, scaling: dict) -> dict | None:
        """Accept HF's spellings ("type" or "rope_type", optional original length); keep one form."""
        if not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling={scaling!r}: expected a mapping (e.g. {{rope_type: llama3, factor: 8, "
                             f"...}}) or null")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type != "llama3":
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use None or 'llama3'")
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise ValueError(f"rope_scaling of type 'llama3' lacks {missing}; it needs {list(_LLAMA3_KEYS)}")
        original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
        if type(original) is float and original.is_integer():
            original = int(original)
        if type(original) is not int:
            raise ValueError(f"rope_scaling.original_max_position_embeddings={original!r}: expected a positive "
                             f"integer (or leave it out: max_position_embeddings)")
        return {
            "rope_type": "llama3",
            **{k: _rope_number(scaling[k], k) for k in _LLAMA3_KEYS},
            "original_max_position_embeddings": original,
        }

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> LlamaConfig:
        """Read a transformers config.json (its path, its folder, or the dict); other HF keys are ignored."""
        hf = read_hf_config(path_or_dict)
        if hf.get("model_type", cls.model_type) != cls.model_type:
            raise ValueError(f"model_type={hf['model_type']!r} is not {cls.model_type!r}; read it with "
                             "models.config_from_hf, which picks its family")
        names = {f.name for f in dataclasses.fields(cls)} - {"rope_theta", "rope_scaling"}
        kwargs = {k: v for k, v in hf.items() if k in names}
        _check_hf_types(kwargs)
        # transformers 5 writes RoPE as one "rope_parameters" dict; 4.x as rope_theta + rope_scaling.
        rope = hf.get("rope_parameters")
        if rope is not None and not isinstance(rope, dict):
            raise ValueError(f"rope_parameters={rope!r}: expected a mapping (rope_type, rope_theta, ...) or null")
        if rope:
            if any(isinstance(v, dict) for v in rope.values()):
                raise ValueError("per-layer-type rope_parameters are not supported for Llama")
            kwargs["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", cls.rope_theta))
            kwargs["rope_scaling"] = rope
        else:
            kwargs["rope_theta"] = hf.get("rope_theta", cls.rope_theta)
            kwargs["rope_scaling"] = hf.get("rope_scaling")
        if not isinstance(kwargs["rope_theta"], (int, float)) or isinstance(kwargs["rope_theta"], bool):
            raise ValueError(f"rope_theta={kwargs['rope_theta']!r}: expected a number")
        if not isinstance(kwargs["rope_scaling"], (dict, type(None))):
            raise ValueError(f"rope_scaling={kwargs['rope_scaling']!r}: expected a mapping or null")
        config = cls(**kwargs)
        _check_is_family(hf, cls)  # after building, so that a rope or head error names itself first
        return config

    def to_hf(self, dtype: str = "float32") -> dict:
        """A config dict that transformers (4.x and 5.x) loads as the family's class (LlamaForCausalLM, ...), its
        weights in `dtype`."""
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return {
            **dataclasses.asdict(self),  # asdict deep-copies, so transformers can't mutate our dicts
            "rope_parameters": rope_parameters,  # transformers 5 reads this; 4.x reads rope_theta/scaling
            "architectures": [self.hf_architecture],
            "dtype": dtype,
        }

    def attention_params(self) -> int:
        """Parameters of one decoder layer but its feed-forward: attention (biases, q/k norms, sinks) and its
        norms (the options that size parameters are the same in every layer)."""
        opts = self.attention_options(0)
        h, heads, kv_heads = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        q, k = heads * opts.head_dim, kv_heads * opts.head_dim
        v, o_in = kv_heads * opts.v_head_dim, heads * opts.v_head_dim
        qkv_bias, o_bias = self.attention_biases()
        qk_norms = {None: 0, "head": 2 * opts.head_dim, "projection": q + k}[opts.qk_norm]
        norms = len(layer_norm_names(self.norm_placement)) * h
        return (h * (q + k + v) + o_in * h + norms + (q + k + v) * qkv_bias + h * o_bias + qk_norms
                + heads * opts.sinks)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Exact parameter count; without embedding it leaves out embed_tokens and lm_head."""
        h = self.hidden_size
        mlp = mlp_params(h, self.intermediate_size, gated=self.mlp_gated, bias=self.mlp_bias)
        n = self.num_hidden_layers * (self.attention_params() + mlp) + h
        if include_embedding:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6*N + 12*L*H*s (PaLM, appendix B), for MFU.

        N = num_params(include_embedding=False) + vocab_size*hidden_size: every matmul weight,
        the output projection included even when tied (the embedding lookup is no matmul);
        6 = 2 forward + 4 backward FLOPs per weight. 12*L*H*s counts the attention scores and
        weighted values, with L layers, H = num_attention_heads*head_dim (the mean of the q/k and v widths
        where they differ), s = seq_len, the training sequence length. Causal masking is not discounted (not
        halved): PaLM, Megatron-LM and torchtitan count it this way, so MFUs compare across reports; the
        fused kernels skip most masked blocks, so the FLOPs actually run are about 6*L*H*s fewer (5% of the total for
        SmolLM-1.7B at s=2048), and MFU counts those as done. Recomputation is not counted either:
        MFU is the model's FLOPs, not the hardware's.
        """
        n = self.num_params(include_embedding=False) + self.vocab_size * self.hidden_size
        opts = self.attention_options(0)
        if opts.v_head_dim == opts.head_dim:
            return 6.0 * n + 12.0 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        # scores over head_dim, weighted values over v_head_dim: half of the 12 each
        widths = opts.head_dim + opts.v_head_dim
        return 6.0 * n + 6.0 * self.num_hidden_layers * self.num_attention_heads * widths * seq_len


def _rope_number(value: object, key: str) -> float:
    """A rope_scaling number: a number, or text that reads as one (YAML 1.1 keeps `1e3` as text)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"rope_scaling.{key}={value!r}: expected a number")
    return float(value)


_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_HF_INTS = {*_HF_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id",
            "sliding_window", "max_window_layers"}
_HF_ZERO_OK = ("bos_token_id", "max_window_layers")  # the integers that may be 0


def _check_hf_types(kwargs: dict) -> None:
    """Each config.json field tetron reads has its type (a string for a size would fail far later)."""
    for name, value in kwargs.items():
        if name in _HF_INTS and not (value is None and name not in _HF_REQUIRED) and (
                type(value) is not int or (value < 1 and name not in _HF_ZERO_OK)):
            raise ValueError(f"{name}={value!r}: expected a positive integer")
        if name in ("rms_norm_eps", "initializer_range") and (
                not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"{name}={value!r}: expected a number")
        if name in ("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias") and (
                type(value) is not bool):
            raise ValueError(f"{name}={value!r}: expected true or false")
        if name == "eos_token_id" and not (value is None or type(value) is int or (
                isinstance(value, list) and all(type(v) is int for v in value))):
            raise ValueError(f"{name}={value!r}: expected an integer, a list of integers or null")
    vocab = kwargs.get("vocab_size")
    for name in ("bos_token_id", "eos_token_id"):  # ids of the vocabulary, as validate asks of a run's config
        ids = kwargs.get(name)
        ids = ids if isinstance(ids, list) else [] if ids is None else [ids]
        if vocab is not None and any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"{name}={kwargs[name]!r}: expected ids below vocab_size={vocab}")


def _check_is_family(hf: dict, cls: type[LlamaConfig]) -> None:
    """A config of the family, not any JSON: its model_type (or, in older Llama files, a Llama architecture)
    and every size given, so that nothing falls back to a default (transformers' is a 6.9B model)."""
    archs = hf.get("architectures")
    named = isinstance(archs, list) and any(isinstance(a, str) and a.startswith("Llama") for a in archs)
    if "model_type" not in hf and not named:
        raise ValueError("no model_type (nor a Llama architecture): not a Llama config.json")
    missing = [k for k in _HF_REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"{missing[0]} is missing: a {cls.hf_architecture} config gives {', '.join(_HF_REQUIRED)}")


def rope_inv_freq(config: LlamaConfig, *, device: torch.device | None = None) -> Tensor:
    """RoPE inverse frequencies [head_dim/2] in fp32, as transformers computes them (incl. llama3)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if config.rope_scaling is None:
        return inv_freq
    # Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    s = config.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(config: LlamaConfig, position_ids: Tensor, *, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [B or 1, T, head_dim] for the given positions, computed in fp32 then cast."""
    inv_freq = rope_inv_freq(config, device=position_ids.device)
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, head_dim]: halves layout, as HF's rotate_half
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim (HF's layout, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, head_dim] by the position angles in cos/sin [B or 1, T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, head_dim], broadcast over heads
    return x * cos + rotate_half(x) * sin


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
            self.q_norm, self.k_norm = RMSNorm(hd, config.rms_norm_eps), RMSNorm(hd, config.rms_norm_eps)
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

    def __init__(self, config: LlamaConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, index)
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

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        # A dict keyed "0", "1", ... gives HF's names, and keeps them when a pipeline stage drops layers.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(config.num_hidden_layers)})
        self.norm: RMSNorm | None = norm_of(config, config.hidden_size)

    def forward(self, x: Tensor, position_ids: Tensor, docs: Tensor | None = None) -> Tensor:
        # A pipeline stage sets the parts it does not own to None; then x is hidden states.
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # [B, T, hidden]
        if self.embed_tokens is not None and self.config.scale_embeddings:
            # Gemma's sqrt(hidden), rounded to the embedding's dtype first, as transformers does
            h = h * torch.tensor(self.config.hidden_size ** 0.5, device=h.device).to(h.dtype)
        # RoPE is recomputed each call rather than cached in a buffer: no state to lose on the
        # meta device, and position ids may be arbitrary (offsets, context-parallel chunks).
        cos, sin = rope_cos_sin(self.config, position_ids, dtype=h.dtype)
        # one object for every layer: the mask its attention needs is made once, the first time
        docs = Documents(docs) if docs is not None else None
        for layer in self.layers.values():
            h = layer(h, cos, sin, docs)
        return self.norm(h) if self.norm is not None else h


class Llama(nn.Module):
    """Llama causal LM: `Llama(cfg).state_dict()` has exactly LlamaForCausalLM's keys."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
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


LLAMA = register(ModelSpec(
    name="llama", model_types=("llama",), config_class=LlamaConfig, model_class=Llama,
    plan=ParallelPlan(
        blocks=(Block("self_attn", column=("q_proj", "k_proj", "v_proj"), row="o_proj"),
                Block("mlp", column=("gate_proj", "up_proj"), row="down_proj")),
        residual_norms=("input_layernorm", "post_attention_layernorm"),
    ),
))
