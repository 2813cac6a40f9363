"""Attention as the models call it: causal scaled-dot-product attention over grouped-query heads, and, for
packed windows (data.mask_documents), the mask that keeps each document to itself.

A sliding window (Mistral's, Mixtral's, Qwen's `sliding_window`) is one more condition on the same mask: a
query at position i attends to keys at i-window+1 .. i (transformers' `kv_idx > q_idx - sliding_window`). Every
attention function takes it as `window` (None: the whole causal past); a window as long as the sequence masks
nothing, so the plain causal kernel runs.

A window's documents are numbered (data/documents.py) over the whole window, so the mask is "same number
and not later"; a cp rank, which holds a share of the window's positions, still sees the numbers of the
whole window (ring and Ulysses attention build the mask of any pair of shards from them).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from tetron.torch_private import cpu_flash_attention, cpu_flash_attention_backward


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None,
                   window: int | None = None) -> Tensor:
    """Causal attention: q [B, n_heads, T, head_dim], k/v [B, n_kv_heads, T, head_dim] -> like q; with
    `docs` (documents.py) each position attends only within its document, with `window` only to the
    `window` latest positions (itself included)."""
    if k.shape[1] != q.shape[1]:
        # Repeat each kv head for its group of query heads; works with every SDPA backend.
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)  # [B, n_heads, T, head_dim]
        v = v.repeat_interleave(rep, dim=1)  # [B, n_heads, T, head_dim]
    if window is not None and window >= q.shape[2]:
        window = None  # no query is further than T-1 from a key: the window masks nothing
    if docs is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)
    bias = docs.bias(q.dtype, window) if docs is not None else _window_bias(q.shape[2], window, q.dtype, q.device)
    return masked_attention(q, k, v, bias)


def causal_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """[Tq, Tk] bool, True where the key is not after the query (and, with `window`, fewer than `window`
    positions before it); q_pos/k_pos are the window positions of the queries and keys ([Tq], [Tk])."""
    behind = q_pos[:, None] - k_pos[None, :]  # [Tq, Tk]: how far each key lies before each query
    allowed = behind >= 0
    return allowed if window is None else allowed & (behind < window)


def document_mask(docs: Tensor, q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """[B, 1, Tq, Tk] bool, True where a query may attend: the key is in the query's document and not
    after it (nor, with `window`, as far back as the window). `docs` [B, T] numbers the whole window;
    q_pos/k_pos are the window positions of the queries and keys ([Tq], [Tk])."""
    same = docs[:, q_pos, None] == docs[:, None, k_pos]  # [B, Tq, Tk]
    return (same & causal_mask(q_pos, k_pos, window)).unsqueeze(1)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as the scores to add that the fused kernels take: 0 where a query may attend, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@functools.lru_cache(maxsize=2)
def _window_bias(length: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[1, 1, T, T] additive causal sliding-window mask, made once for every layer of every step (the
    layers save one tensor for their backward, not one each); two kept: training's, and one more."""
    pos = torch.arange(length, device=device)
    return _additive(causal_mask(pos, pos, window), dtype)[None, None]


class Documents:
    """The documents of a forward pass's windows ([B, T] `ids`, the whole window even on a cp rank) and the
    additive mask of the whole sequence made from them once per window length, when an attention first asks
    for it: every layer then uses, and saves for its backward, the same tensor (ring attention never asks; it
    masks each block from the ids)."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids
        self._bias: dict[tuple[torch.dtype, int | None], Tensor] = {}

    def bias(self, dtype: torch.dtype, window: int | None = None) -> Tensor:
        """[B, 1, T, T] in `dtype`: 0 where a query may attend, -inf elsewhere (what the fused kernels take)."""
        if (dtype, window) not in self._bias:
            pos = torch.arange(self.ids.shape[1], device=self.ids.device)
            self._bias[dtype, window] = _additive(document_mask(self.ids, pos, pos, window), dtype)
        return self._bias[dtype, window]


class _CausalMaskedCPU(torch.autograd.Function):
    """The CPU's fused attention kernel told both: causal (so it skips the key blocks after each query
    block, as causal attention does) and the document mask. torch's scaled_dot_product_attention takes one
    or the other; with the mask alone the kernel scores every block (1.6x the attention time at 2048)."""

    @staticmethod
    def forward(ctx, q, k, v, bias):
        out, lse = cpu_flash_attention(q, k, v, True, bias=bias)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias = ctx.saved_tensors
        dq, dk, dv = cpu_flash_attention_backward(dout.contiguous(), q, k, v, out, lse, True, bias=bias)
        return dq, dk, dv, None


def document_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents, window: int | None = None) -> Tensor:
    """Causal attention within documents: q, k, v [B, H, T, D] (k and v with every query head) -> like q."""
    return masked_attention(q, k, v, docs.bias(q.dtype, window))


def masked_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
    """Causal attention with an additive mask `bias` [B or 1, 1, T, T] on top: q, k, v [B, H, T, D] -> like q."""
    if q.device.type == "cpu":
        return _CausalMaskedCPU.apply(q, k, v, bias)  # strided as they come, as torch passes them
    # CUDA: the memory-efficient kernel, which takes a mask (FlashAttention takes none)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=q.shape[-1] ** -0.5)
