"""Rotary position embeddings as transformers computes them (the default, "linear", Llama 3.1's "llama3" and
gpt-oss's YaRN scaling), rotating halves of each head (`rotate_half`), not interleaved pairs. A family whose layers
differ in RoPE (Gemma 3's local and global layers) says so per layer in its config's `layer_rope(index)`; a
layer's tables are those of its (theta, scaling)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tetron.models.llama.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig, *, device: torch.device | None = None, layer: int = 0) -> Tensor:
    """RoPE inverse frequencies [head_dim/2] in fp32 of decoder layer `layer`, as transformers computes them
    (incl. linear, llama3 and yarn scaling)."""
    dim = config.head_dim
    theta, s = config.layer_rope(layer)
    if s is not None and s["rope_type"] == "yarn":
        return _yarn_inv_freq(s, dim, theta, device=device)
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


def _yarn_inv_freq(s: dict, dim: int, base: float, *, device: torch.device | None) -> Tensor:
    """YaRN (Peng et al. 2023): each frequency blended between itself (fast ones, extrapolated) and itself divided by
    `factor` (slow ones, interpolated), by a linear ramp over the dims between the beta_fast and beta_slow
    rotations of the original length; transformers' _compute_yarn_parameters, step for step."""
    original = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original length
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1 - ramp  # 1 for the fast dims: kept as they are
    return (1.0 / (s["factor"] * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(config: LlamaConfig, layer: int = 0) -> float:
    """The factor on cos and sin of decoder layer `layer` (YaRN's attention temperature, transformers'
    `attention_scaling`); 1 otherwise."""
    _, s = config.layer_rope(layer)
    if s is None or s["rope_type"] != "yarn":
        return 1.0
    if s["attention_factor"] is not None:
        return s["attention_factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s["mscale"] and s["mscale_all_dim"]:
        return float(mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"]))
    return mscale(s["factor"])


def rope_cos_sin(config: LlamaConfig, position_ids: Tensor, *, dtype: torch.dtype,
                 layer: int = 0) -> tuple[Tensor, Tensor]:
    """cos and sin [B or 1, T, head_dim] of decoder layer `layer` for the given positions, computed in fp32 (times
    YaRN's attention factor where it has one) then cast."""
    inv_freq = rope_inv_freq(config, device=position_ids.device, layer=layer)
    freqs = position_ids[..., None].float() * inv_freq  # [B, T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, head_dim]: halves layout, as HF's rotate_half
    factor = rope_attention_factor(config, layer)
    if factor == 1.0:  # the default and llama3: no multiplication, so their bits stay as they were
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim (HF's layout, not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, head_dim] by the position angles in cos/sin [B or 1, T, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, head_dim], broadcast over heads
    return x * cos + rotate_half(x) * sin

