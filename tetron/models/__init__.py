"""Model families: each a plain single-device model that knows nothing of parallelism, its config, and
one `ModelSpec` (spec.py) that tells the rest of tetron where its parts are and how they split.

    spec.py       ModelSpec and ParallelPlan; the registry of families by Hugging Face model_type
    llama.py      Llama (LlamaForCausalLM's names and numerics), the first family, whose blocks the others share
    qwen.py       Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms): Llama's blocks with options
    mistral.py    Mistral: Llama's blocks with a sliding window
    blocks.py     shared blocks: the MLP (activation by name, gated or not), RMSNorm (weight or 1 + weight),
                  norm placements (pre, post, sandwich), the standard init
    attention.py  causal grouped-query attention, and the document masks of packed windows
    loss.py       cross entropy with a one-pass backward
    moe.py        the mixture-of-experts layer: router, experts, dispatch, balancing
    moe_models.py Qwen3-MoE and Mixtral (a Llama whose feed-forwards are MoE blocks)

Imports only the ground floor (tetron/__init__.py's layers). Importing the package registers its families.
"""

from tetron.models import llama, mistral, moe_models, qwen  # noqa: F401  (registers the families)
from tetron.models.spec import FAMILIES, ModelSpec, ParallelPlan, config_from_hf, family, register, spec_of

__all__ = ["FAMILIES", "ModelSpec", "ParallelPlan", "config_from_hf", "family", "register", "spec_of"]
