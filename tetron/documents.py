"""Document boundaries inside packed windows: which document each position belongs to, the attention
mask that keeps each document to itself (data.mask_documents), and RoPE positions that restart at each
document (data.reset_positions).

A window is cut from one stream of tokens with EOS after each document, so it may hold the end of one
document, some whole ones and the start of another. A token store records where every document ends
(token_store.py); a window's documents are numbered from 0 at its first position. The numbers are only
compared within a window, so the mask is "same number and not later", and a cp rank, which holds a share
of the window's positions, still sees the numbers of the whole window (ring and Ulysses attention build
the mask of any pair of shards from them).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from tetron.errors import DataError


def stream_ends(tokens) -> np.ndarray:
    """Where each document of a token stream ends (exclusive offsets, increasing): from a token store or
    a slice of one (a plain array records no documents)."""
    ends = getattr(tokens, "doc_ends", None)
    if ends is None:
        raise DataError("data.mask_documents and data.reset_positions need the data as a token store, which "
                        "records where documents end")
    return ends()


def window_documents(ends: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """[rows, seq_len] int64: the document of each input position of the windows beginning at `starts`,
    numbered from 0 at each window's first position. Document k spans [ends[k-1], ends[k])."""
    pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len, dtype=np.int64)  # [rows, T]
    ids = np.searchsorted(ends, pos, side="right")  # how many documents end at or before each position
    return ids - ids[:, :1]


def document_positions(docs: Tensor) -> Tensor:
    """RoPE positions that count from 0 at each document's first position in the window ([B, T] like
    `docs`); a document continued from before the window counts from the window's start."""
    T = docs.shape[-1]
    index = torch.arange(T, device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[..., 1:] = docs[..., 1:] != docs[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values  # each position's doc start
    return index - first


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
