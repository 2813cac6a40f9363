"""Fused attention that returns its log-sum-exp (lse), and the plain-math attention that stands in for it.

Ring attention merges blocks of attention by their lse, and recomputes each block's gradients from the
final output and lse; models/attention.py runs causal attention with a document mask through the CPU's
kernel. PyTorch has exactly that interface only as private ops:
- the CPU's `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`): lse [B, H, Tq] fp32, an
  additive mask accepted (`attn_mask`), `is_causal` applied on top of it;
- CUDA's `_scaled_dot_product_flash_attention` (+ `_backward`), fp16/bf16 on sm80+: lse [B, H, Tq] fp32;
- CUDA's `_scaled_dot_product_efficient_attention` (+ `_backward`), any float dtype: lse [B, H,
  ceil(Tq/32)*32], cut to [B, H, Tq] after the forward and padded again (values never read) for the backward.
Each is used when this torch has it (the op present, torch at least the version whose signature is called
here), else `math_attention`: matmuls in fp32 materialising [B, H, Tq, Tk] scores, also the reference of the
tests and the path of devices without a fused kernel. No dropout anywhere; the scale is head_dim**-0.5 unless a
call gives `scale` (Gemma's query_pre_attn_scalar**-0.5). Only the math path soft-caps the scores (`softcap`:
scores = softcap * tanh(scores / softcap), Gemma 2), as it alone materialises them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from tetron.torch_private.version import torch_at_least

LSE_ALIGN = 32  # the efficient kernel pads its lse's last dim to a multiple of this (torch's meta registration)
_FROM = (2, 4)  # the torch whose signatures of these ops (scale= and attn_mask= keywords) the calls follow


@functools.cache
def _has(name: str) -> bool:
    """Whether this torch has aten op `name` in the form called here (checked once per op)."""
    return torch_at_least(*_FROM) and hasattr(torch.ops.aten, name) and hasattr(torch.ops.aten, name + "_backward")


# ----------------------------------------------------------------------------- the public path: plain math


def _scale(q: Tensor, scale: float | None) -> float:
    """The scores' scale: `scale` where given, else 1/sqrt(the query's head width)."""
    return q.shape[-1] ** -0.5 if scale is None else scale


def _math_scores(q: Tensor, k: Tensor, causal: bool, mask: Tensor | None, bias: Tensor | None,
                 scale: float | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor | None]:
    """(the masked fp32 scores [B, H, Tq, Tk], with `softcap` the derivative of the cap at each score, else None)."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * _scale(q, scale)
    capped = None
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
        capped = 1.0 - (scores / softcap).square()  # d(cap*tanh(s/cap))/ds
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if bias is not None:
        scores = scores + bias.float()
    return scores, capped


def math_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None = None, *,
                   bias: Tensor | None = None, scale: float | None = None,
                   softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q [B, H, Tq, D] on k [B, H, Tk, D], v [B, H, Tk, Dv] -> (out [B, H, Tq, Dv] in q's dtype, lse
    [B, H, Tq] fp32); `mask` [B, 1, Tq, Tk] bool (True: attend), `bias` additive scores (0 or -inf), each where
    given."""
    scores, _ = _math_scores(q, k, causal, mask, bias, scale, softcap)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v.float()
    return out.to(q.dtype), lse


def math_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                            mask: Tensor | None = None, *, bias: Tensor | None = None, scale: float | None = None,
                            softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the FINAL out and lse of the whole attention (flash-style)."""
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    scores, capped = _math_scores(q, k, causal, mask, bias, scale, softcap)
    scale = _scale(q, scale)
    probs = (scores - lse.unsqueeze(-1)).exp()  # this block's share of the final softmax
    dv = probs.transpose(-1, -2) @ dof
    dprobs = dof @ vf.transpose(-1, -2)
    delta = (dof * out.float()).sum(-1, keepdim=True)  # [B, H, Tq, 1]
    dscores = probs * (dprobs - delta) * scale
    if capped is not None:
        dscores = dscores * capped
    return (dscores @ kf).to(q.dtype), (dscores.transpose(-1, -2) @ qf).to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- the private kernels


def cpu_flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, *, bias: Tensor | None = None,
                        scale: float | None = None, fallback: bool = False) -> tuple[Tensor, Tensor]:
    """(out like q, lse [B, H, Tq] fp32) by the CPU's fused kernel; `bias` an additive mask in q's dtype. The
    kernel takes v only as wide as q and k (callers pad a narrower v)."""
    if fallback or not _has("_scaled_dot_product_flash_attention_for_cpu"):
        return math_attention(q, k, v, causal, bias=bias, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                      scale=scale)


def cpu_flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 causal: bool, *, bias: Tensor | None = None, scale: float | None = None,
                                 fallback: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of cpu_flash_attention from the final out and lse."""
    if fallback or not _has("_scaled_dot_product_flash_attention_for_cpu"):
        return math_attention_backward(dout, q, k, v, out, lse, causal, bias=bias, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                               attn_mask=bias, scale=scale)


def cuda_flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, *, scale: float | None = None,
                         fallback: bool = False) -> tuple[Tensor, Tensor]:
    """(out like q, lse [B, H, Tq] fp32) by FlashAttention-2 (CUDA, fp16/bf16)."""
    if fallback or not _has("_scaled_dot_product_flash_attention"):
        return math_attention(q, k, v, causal, scale=scale)
    # -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                      scale=_scale(q, scale))
    return out, lse


def _no_dropout_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """The philox seed and offset a backward takes: read only under dropout, which tetron never uses."""
    return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def cuda_flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  causal: bool, *, scale: float | None = None,
                                  fallback: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of cuda_flash_attention from the final out and lse."""
    if fallback or not _has("_scaled_dot_product_flash_attention"):
        return math_attention_backward(dout, q, k, v, out, lse, causal, scale=scale)
    seed, offset = _no_dropout_rng(q.device)
    # cum_seq_q/k None: the dense (not variable-length) kernel, as the forward returned them
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
        scale=_scale(q, scale))
    return dq, dk, dv


def cuda_efficient_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, *, scale: float | None = None,
                             fallback: bool = False) -> tuple[Tensor, Tensor]:
    """(out like q, lse [B, H, Tq] fp32) by the memory-efficient kernel (CUDA, any float dtype)."""
    if fallback or not _has("_scaled_dot_product_efficient_attention"):
        return math_attention(q, k, v, causal, scale=scale)
    # -> (out, lse [B, H, padded Tq], philox_seed, philox_offset)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=_scale(q, scale))
    return out, lse[..., :q.shape[2]]


def cuda_efficient_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                      causal: bool, *, scale: float | None = None,
                                  fallback: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of cuda_efficient_attention from the final out and lse [B, H, Tq]."""
    if fallback or not _has("_scaled_dot_product_efficient_attention"):
        return math_attention_backward(dout, q, k, v, out, lse, causal, scale=scale)
    tq = q.shape[2]
    padded = -(-tq // LSE_ALIGN) * LSE_ALIGN
    lse = F.pad(lse, (0, padded - tq)).contiguous()  # the forward kernel's layout again
    # out in the forward's memory order, [B, T, H, D]: the bf16 kernel reads it so whatever its strides say (an
    # H200, torch 2.11: a [B, H, T, D]-contiguous out gave gradients 1.6-3.8x off, NaN, an illegal address)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    seed, offset = _no_dropout_rng(q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=_scale(q, scale))
    return dq, dk, dv
