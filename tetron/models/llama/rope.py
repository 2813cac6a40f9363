"""Rotary position embeddings as transformers computes them for Llama (the default, "linear" and Llama 3.1's
"llama3" scaling), rotating halves of each head (`rotate_half`), not interleaved pairs. A family whose layers
differ in RoPE (Gemma 3's local and global layers) says so per layer in its config's `layer_rope(index)`; a
layer's tables are those of its (theta, scaling)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tetron.models.llama.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig, *, device: torch.device | None = None, layer: int = 0) -> Tensor:
    """RoPE inverse frequencies [head_dim/2] in fp32 of decoder layer `layer`, as transformers computes them
    (incl. linear and llama3 scaling)."""
    dim = config.head_dim
    theta, s = config.layer_rope(layer)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":  # every wavelength stretched by `factor` (Gemma 3's global layers)
        return inv_freq / s["factor"]
    # Llama 3.1 scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def rope_cos_sin(config: LlamaConfig, position_ids: Tensor, *, dtype: torch.dtype,
                 layer: int = 0) -> tuple[Tensor, Tensor]:
    """cos and sin [B or 1, T, head_dim] of decoder layer `layer` for the given positions, computed in fp32 then
    cast."""
    inv_freq = rope_inv_freq(config, device=position_ids.device, layer=layer)
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

