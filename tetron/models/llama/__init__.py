"""Llama (transformers' LlamaForCausalLM), the first family, whose blocks the others share:

    config.py   LlamaConfig: transformers' fields, config.json in and out, parameter and FLOP counts
    rope.py     rotary position embeddings (incl. Llama 3.1's scaling)
    model.py    the modules: attention with the family's options, decoder layer, stack, causal LM
    family.py   its parallel plan, weight names, init and registration (models/spec.py's ModelSpec)

Parallel strategies live elsewhere and transform this model: they swap its linears and embedding, drop layers,
or replace each attention module's `attn_fn`.

Its blocks are shared by the families that differ from Llama only in their attention (qwen.py, mistral.py,
and the MoE families), each a config subclass of LlamaConfig that sets the options the blocks read:
- `attention_bias` (a field, transformers' name): q, k, v and o carry biases; `attention_biases()` says
  which, (q/k/v, o): Qwen2 overrides it to biases on q, k and v only;
- `qk_norm` (a class attribute, no config field: a family has it or not): an RMSNorm over head_dim of each
  query and key head before RoPE, one weight shared by all heads (`self_attn.q_norm`, `k_norm`: Qwen3);
- `layer_window(i)`: layer i's sliding window (None: the whole causal past), passed to `attn_fn` as its
  `window` (models/attention.py); Mistral's is `sliding_window` in every layer, Qwen's per `layer_types`;
- `layer_rope(i)`: layer i's RoPE, (theta, scaling): the model computes one cos/sin table per distinct one
  (Gemma 3's local and global layers differ; models/layer_types.py);
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
from tetron.models.llama.config import LlamaConfig
from tetron.models.llama.family import LLAMA, LLAMA_PLAN
from tetron.models.llama.model import Attention, DecoderLayer, Llama, LlamaModel, mlp_of, norm_of
from tetron.models.llama.rope import apply_rope, rope_cos_sin, rope_inv_freq, rotate_half

__all__ = ["LLAMA", "LLAMA_PLAN", "Attention", "DecoderLayer", "Llama", "LlamaConfig", "LlamaModel", "apply_rope",
           "mlp_of", "norm_of", "rope_cos_sin", "rope_inv_freq", "rotate_half"]
