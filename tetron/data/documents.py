"""Document boundaries inside packed windows: which document each position belongs to (the attention mask
built from these numbers is in models/attention.py, data.mask_documents), and RoPE positions that restart
at each document (data.reset_positions).

A window is cut from one stream of tokens with EOS after each document, so it may hold the end of one
document, some whole ones and the start of another. A token store records where every document ends
(token_store.py); a window's documents are numbered from 0 at its first position, and the numbers are
only compared within a window.
"""

from __future__ import annotations

import numpy as np
import torch
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
