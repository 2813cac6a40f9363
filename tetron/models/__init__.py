"""Model families: each a plain single-device model that knows nothing of parallelism, its config, and
one `ModelSpec` (spec.py) that tells the rest of tetron where its parts are and how they split.

The families, each a folder or a module of its own (its config, modules, parallel plan, Hugging Face names,
init and registration):
    llama/        Llama (LlamaForCausalLM's names and numerics), the first family, whose modules the others share
    qwen.py       Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms): Llama's modules with options
    mistral.py    Mistral: Llama's modules with a sliding window
    qwen3_moe.py  Qwen3-MoE: Llama's modules with MoE blocks as the feed-forwards
    mixtral.py    Mixtral: Qwen3-MoE's model with Mixtral's config and names
    gemma3.py     Gemma 3's text model: sandwich (1 + weight) norms, GeGLU, 5 local : 1 global layers, each with its
                  RoPE base, per-head q/k norms, query_pre_attn_scalar, scaled embeddings
    olmo3.py      OLMo 3: Llama's modules with post-norms, q/k norms over the whole projection, 3 sliding : 1 full
    gpt_oss.py    gpt-oss: Qwen3-MoE's model with sinks, alternating windows, YaRN, biased routers and experts
    deepseek_v3.py  DeepSeek-V3 (and Kimi-K2's shapes): Qwen3-MoE's model with multi-head latent attention, dense
                  first layers, DeepSeek's routing

The shared pieces they compose:
    spec.py       ModelSpec and ParallelPlan; the registry of families by Hugging Face model_type
    blocks.py     the MLP (activation by name, gated or not), RMSNorm (weight or 1 + weight), norm placements
                  (pre, post, sandwich), the standard init
    attention.py  causal grouped-query attention with its options, and the document masks of packed windows
    moe.py        the mixture-of-experts layer: router, dispatch, balancing
    experts.py    the routed experts (fused 3D tensors, their layouts and biases): loop and grouped paths
    loss.py       cross entropy with a one-pass backward
    layer_types.py  the config of families whose layers come in kinds (sliding, full), each kind with its RoPE

Imports only the ground floor (tetron/__init__.py's layers). Importing the package registers its families.
"""

from tetron.models import deepseek_v3, gemma3, gpt_oss, llama, mistral, mixtral, olmo3, qwen, qwen3_moe  # noqa: F401  (registers the families)
from tetron.models.spec import FAMILIES, ModelSpec, ParallelPlan, config_from_hf, family, register, spec_of

__all__ = ["FAMILIES", "ModelSpec", "ParallelPlan", "config_from_hf", "family", "register", "spec_of"]
