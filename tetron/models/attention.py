"""Attention as the models call it: causal scaled-dot-product attention over grouped-query heads, and, for
packed windows (data.mask_documents), the mask that keeps each document to itself.

A window's documents are numbered (data/documents.py) over the whole window, so the mask is "same number
and not later"; a cp rank, which holds a share of the window's positions, still sees the numbers of the
whole window (ring and Ulysses attention build the mask of any pair of shards from them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None) -> Tensor:
    """Causal attention: q [B, n_heads, T, head_dim], k/v [B, n_kv_heads, T, head_dim] -> like q; with
    `docs` (documents.py) each position attends only within its document."""
    if k.shape[1] != q.shape[1]:
        # Repeat each kv head for its group of query heads; works with every SDPA backend.
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)  # [B, n_heads, T, head_dim]
        v = v.repeat_interleave(rep, dim=1)  # [B, n_heads, T, head_dim]
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)
    return document_attention(q, k, v, docs)


def document_mask(docs: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """[B, 1, Tq, Tk] bool, True where a query may attend: the key is in the query's document and not
    after it. `docs` [B, T] numbers the whole window; q_pos/k_pos are the window positions of the queries
    and keys ([Tq], [Tk])."""
    same = docs[:, q_pos, None] == docs[:, None, k_pos]  # [B, Tq, Tk]
    return (same & (q_pos[:, None] >= k_pos[None, :])).unsqueeze(1)


class Documents:
    """The documents of a forward pass's windows ([B, T] `ids`, the whole window even on a cp rank) and the
    additive mask of the whole sequence made from them once, when an attention first asks for it: every
    layer then uses, and saves for its backward, the same tensor (ring attention never asks; it masks each
    block from the ids)."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids
        self._bias: Tensor | None = None

    def bias(self, dtype: torch.dtype) -> Tensor:
        """[B, 1, T, T] in `dtype`: 0 where a query may attend, -inf elsewhere (what the fused kernels take)."""
        if self._bias is None or self._bias.dtype != dtype:
            pos = torch.arange(self.ids.shape[1], device=self.ids.device)
            allowed = document_mask(self.ids, pos, pos)
            self._bias = torch.zeros(allowed.shape, dtype=dtype, device=self.ids.device).masked_fill_(
                ~allowed, float("-inf"))
        return self._bias


class _CausalMaskedCPU(torch.autograd.Function):
    """The CPU's fused attention kernel told both: causal (so it skips the key blocks after each query
    block, as causal attention does) and the document mask. torch's scaled_dot_product_attention takes one
    or the other; with the mask alone the kernel scores every block (1.6x the attention time at 2048)."""

    @staticmethod
    def forward(ctx, q, k, v, bias):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=bias)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, True, attn_mask=bias)
        return dq, dk, dv, None


def document_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents) -> Tensor:
    """Causal attention within documents: q, k, v [B, H, T, D] (k and v with every query head) -> like q."""
    bias = docs.bias(q.dtype)
    if q.device.type == "cpu":
        return _CausalMaskedCPU.apply(q, k, v, bias)  # strided as they come, as torch passes them
    # CUDA: the memory-efficient kernel, which takes a mask (FlashAttention takes none)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=q.shape[-1] ** -0.5)
