"""Llama's config (transformers' LlamaConfig's fields and defaults), read from and written to a config.json, with
the parameter and FLOP counts; the base of the configs of the families built from Llama's blocks, which set the
options the blocks read (the package's docstring lists them)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar

from tetron.models.attention import AttentionOptions
from tetron.models.blocks import ACTIVATIONS, NORM_PLACEMENTS, activation, layer_norm_names, mlp_params
from tetron.models.spec import read_hf_config

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
    rope_scaling: dict | None = None  # None, or HF's {"rope_type": "llama3", ...} (Llama 3.1/3.2) or
    # {"rope_type": "yarn", "factor": ..., ...} (gpt-oss)
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

    def layer_rope(self, index: int) -> tuple[float, dict | None]:
        """Decoder layer `index`'s RoPE: (theta, scaling or None); Llama's is the same in every layer."""
        return self.rope_theta, self.rope_scaling

    def one_layer(self, index: int = 0) -> LlamaConfig:
        """This config with only decoder layer `index`, as layer 0 (what the planner builds to read a layer's
        shapes): a per-layer list (`layer_types`, transformers' name in every family that has one) is cut to that
        layer's entry, so a family need not say so itself."""
        kinds = getattr(self, "layer_types", None)
        if isinstance(kinds, (list, tuple)):
            return dataclasses.replace(self, num_hidden_layers=1, layer_types=[kinds[index]])
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
        if rope_type not in ("llama3", "yarn"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use None, 'llama3' or 'yarn'")
        required = _LLAMA3_KEYS if rope_type == "llama3" else ("factor",)
        missing = [k for k in required if scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks {missing}; it needs {list(required)}")
        original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
        if type(original) is float and original.is_integer():
            original = int(original)
        if type(original) is not int:
            raise ValueError(f"rope_scaling.original_max_position_embeddings={original!r}: expected a positive "
                             f"integer (or leave it out: max_position_embeddings)")
        if rope_type == "llama3":
            return {"rope_type": "llama3", **{k: _rope_number(scaling[k], k) for k in _LLAMA3_KEYS},
                    "original_max_position_embeddings": original}
        return {"rope_type": "yarn", **_yarn_fields(scaling), "original_max_position_embeddings": original}

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
        weighted values (`attention_flops_per_token`). Recomputation is not counted: MFU is the model's
        FLOPs, not the hardware's.
        """
        n = self.num_params(include_embedding=False) + self.vocab_size * self.hidden_size
        return 6.0 * n + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the attention scores and weighted values, 12*H*s a layer, with H =
        num_attention_heads*head_dim (the mean of the q/k and v widths where they differ) and s the keys a query
        reaches: the training sequence length, or a sliding-window layer's window where shorter (ring attention and
        the fused kernels skip what lies outside it). Causal masking is not discounted (not halved): PaLM,
        Megatron-LM and torchtitan count it this way, so MFUs compare across reports; the fused kernels skip most
        masked blocks, so the FLOPs actually run are about 6*L*H*s fewer (5% of the total for SmolLM-1.7B at
        s=2048), and MFU counts those as done."""
        total = 0.0
        for index in range(self.num_hidden_layers):
            opts = self.attention_options(index)
            reach = seq_len if opts.window is None else min(opts.window, seq_len)
            total += 6.0 * self.num_attention_heads * (opts.head_dim + opts.v_head_dim) * reach
        return total


# YaRN's numbers and transformers' defaults for them (modeling_rope_utils._compute_yarn_parameters); None:
# attention_factor derived from factor (and mscale, mscale_all_dim where both are given)
_YARN_DEFAULTS = {"factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None,
                  "mscale_all_dim": None}


def _yarn_fields(scaling: dict) -> dict:
    """YaRN's settings (gpt-oss's rope_scaling), every one present: numbers, and `truncate` (true: the correction
    range rounded to whole dims, transformers' default)."""
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"rope_scaling.partial_rotary_factor={scaling['partial_rotary_factor']!r} is not "
                         f"supported; use 1.0")
    fields = {k: default if scaling.get(k) is None else _rope_number(scaling[k], k)
              for k, default in _YARN_DEFAULTS.items()}
    truncate = scaling.get("truncate", True)
    if type(truncate) is not bool:
        raise ValueError(f"rope_scaling.truncate={truncate!r}: expected true or false")
    return {**fields, "truncate": truncate}


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

