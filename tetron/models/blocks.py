"""Shared building blocks of the decoder families: the MLP with its activations, the RMSNorm, and the
standard initialisation of both. A family composes them through its config (models/llama/'s docstring lists
the options); the blocks know nothing of parallelism.

- MLP: gated, down(act(gate(x)) * up(x)) (Llama's SwiGLU, Gemma's GeGLU), or plain, down(act(up(x)))
  (Nemotron's); the activation named as transformers' ACT2FN names it (`hidden_act`); optional biases on the
  three linears (`mlp_bias`); an optional `limit` clamping the activation's inputs as gpt-oss does (gate from
  above, up on both sides); gpt-oss's whole gated activation of its experts (ClampedSwiGLU: the clamp, an
  alpha in the sigmoid, up + 1), which models/moe.py's Experts take as their `glu`.
- RMSNorm: y = x / rms(x) * weight (Llama), or * (1 + weight) computed in fp32 (Gemma's, `unit_offset`).
- Init: how each tensor of these blocks starts, as transformers' `_init_weights` does: N(0,
  initializer_range) for linears and embeddings, ones for a norm's weight, zeros for a (1 + weight) norm's and
  for biases. A family may name its own function in its ModelSpec (`init`); parallel/init.py draws the normal
  values from a seed per tensor name, so every layout starts bit-identical.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tetron.models.attention import ProjectionRMSNorm
from tetron.models.fused import gated_linear, rms_norm
from tetron.models.spec import Init


def _relu2(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


def _gelu_new(x: Tensor) -> Tensor:  # transformers' NewGELUActivation (GPT-2's), written as it writes it
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: Tensor) -> Tensor:  # transformers' FastGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _quick_gelu(x: Tensor) -> Tensor:  # transformers' QuickGELUActivation
    return x * torch.sigmoid(1.702 * x)


# hidden_act -> the function, with transformers' ACT2FN semantics for each name (read-only)
ACTIVATIONS: types.MappingProxyType[str, Callable[[Tensor], Tensor]] = types.MappingProxyType({
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": _relu2,
})


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation function transformers names `name`, or a ValueError naming hidden_act and what works."""
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """The feed-forward: gated, down(act(gate(x)) * up(x)), or not, down(act(up(x))); transformers' names."""

    def __init__(self, hidden: int, intermediate: int, *, act: str = "silu", gated: bool = True, bias: bool = False,
                 limit: float | None = None) -> None:
        super().__init__()
        if limit is not None and not gated:
            raise ValueError("an MLP's limit clamps a gated MLP's gate and up (gpt-oss); this one is not gated")
        self.act_fn = activation(act)
        if gated:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gated, self.limit = gated, limit

    def forward(self, x: Tensor) -> Tensor:
        if not self.gated:
            return self.down_proj(self.act_fn(self.up_proj(x)))
        gate, up = self.gate_proj(x), self.up_proj(x)  # [B, T, intermediate] each
        # fused.gated_linear keeps gate and up for the backward, not act(gate) nor the product. A down projection
        # whose output needs finishing (tensor parallelism's row-parallel linear: the sum over ranks, then its
        # bias) says so with `finish`; a plain Linear adds its bias itself.
        # Compiled, the composite: AOTAutograd's partitioner chooses what to save itself (it recomputes
        # element-wise ops), and Dynamo does not trace the autograd.grad that gated_linear's backward calls.
        if torch.compiler.is_compiling():
            up = up if self.limit is None else self.bound(up)
            return self.down_proj(self.activate(gate) * up)
        down = self.down_proj
        bound = None if self.limit is None else self.bound
        finish = getattr(down, "finish", None)
        if finish is None:
            return gated_linear(gate, up, down.weight, down.bias, self.activate, bound)
        return finish(gated_linear(gate, up, down.weight, None, self.activate, bound))

    def activate(self, gate: Tensor) -> Tensor:
        """act(gate), gpt-oss's clamp from above first where `limit` is set."""
        return self.act_fn(gate if self.limit is None else gate.clamp(max=self.limit))

    def bound(self, up: Tensor) -> Tensor:
        """up clamped on both sides at `limit` (gpt-oss)."""
        return up.clamp(min=-self.limit, max=self.limit)


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated activation (gate, up) -> (up + 1) * gate * sigmoid(alpha * gate), the gate clamped from above
    and up on both sides at `limit` first: transformers' GptOssExperts._apply_gate, in its order of operations."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def mlp_params(hidden: int, intermediate: int, *, gated: bool, bias: bool) -> int:
    """Parameters of one MLP."""
    linears = 3 if gated else 2
    return linears * hidden * intermediate + bias * ((linears - 1) * intermediate + hidden)


class RMSNorm(nn.Module):
    """Root-mean-square norm. With a plain weight it is computed in fp32 and cast back before the weight
    (transformers' LlamaRMSNorm); with `unit_offset` the weight is a (1 + weight) multiplied in fp32 before the
    cast (Gemma3RMSNorm: a zero weight is the identity)."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: Tensor) -> Tensor:
        # fused.rms_norm: the same arithmetic as written out above, keeping for the backward only x and one fp32
        # 1/rms per row (autograd would keep an fp32 copy of x and the normalised x besides)
        return rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)


# Where a decoder layer's norms sit, by placement, with transformers' names: (before attention, on attention's
# output, before the MLP, on the MLP's output); None: no norm there.
NORM_PLACEMENTS: types.MappingProxyType[str, tuple[str | None, ...]] = types.MappingProxyType({
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),  # Llama
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),  # OLMo 2 and 3
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),  # Gemma 2 and 3
})


def layer_norm_names(placement: str) -> tuple[str, ...]:
    """The norms of a decoder layer with this placement, in their order (what a plan lists as residual norms)."""
    return tuple(name for name in NORM_PLACEMENTS[placement] if name is not None)


ONES, ZEROS = Init("ones"), Init("zeros")


def init_by_type(module: nn.Module, name: str, *, std: float) -> Init:
    """How parameter `name` of `module` (a module of the plain model) starts, as transformers' _init_weights
    starts it: a norm's weight ones (zeros where it is a 1 + weight), biases zeros, anything else N(0, std)."""
    if isinstance(module, RMSNorm):
        return ZEROS if module.unit_offset else ONES
    if isinstance(module, ProjectionRMSNorm):  # OLMo 3's q/k norms over the whole projection
        return ONES
    if name == "bias":
        return ZEROS
    return Init("normal", std)


def standard_init(module: nn.Module, name: str, config: Any) -> Init:
    """The init of the families built from these blocks (ModelSpec.init): init_by_type, std initializer_range."""
    return init_by_type(module, name, std=config.initializer_range)
