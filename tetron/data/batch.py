"""What one forward pass takes: a micro-batch of token ids and targets, with the positions and documents
its attention needs (made by the loaders, data.py and mixture.py; cut for a rank by train.next_batch)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tetron.config import DataConfig
from tetron.data.documents import document_positions
from tetron.device import to_device


class MicroBatch(NamedTuple):
    """Token ids and next-token targets [B, T'] (T' = the positions a rank holds: all, or its cp share)."""

    inputs: Tensor
    targets: Tensor
    positions: Tensor | None = None  # RoPE position ids, [B, T'] or [T']; None: 0..T'-1
    docs: Tensor | None = None  # [B, T] the document of each position of the WHOLE window (data/documents.py);
    # None: each row is one causal sequence
    mtp: Tensor | None = None  # [B, D, 3, T'] multi-token prediction's depths (mtp_shifted): the id at p+k, the
    # target at p+k, and 1 where p's depth-k target counts; None without MTP


def mtp_kwargs(mb: MicroBatch) -> dict:
    """The keyword a model's forward takes the micro-batch's MTP depths by, where it has them (none: no keyword,
    so models without MTP keep their signature)."""
    return {} if mb.mtp is None else {"mtp": mb.mtp}


def mtp_shifted(inputs: Tensor, targets: Tensor, docs: Tensor | None, depth: int) -> Tensor:
    """[B, depth, 3, T] for a WHOLE window's inputs and targets [B, T] (docs [B, T] or None): at depth k
    (1..depth) and position p the input id at p+k, the target at p+k (the token p+k+1) and whether it counts:
    p+k < T, and within p's document. Computed before context parallelism cuts the window, so that a rank's
    chunk gets the right ids and targets across chunk boundaries (zigzag or contiguous)."""
    B, T = inputs.shape
    out = torch.zeros(B, depth, 3, T, dtype=inputs.dtype)
    for k in range(1, depth + 1):
        if k >= T:
            break
        out[:, k - 1, 0, :T - k] = inputs[:, k:]
        out[:, k - 1, 1, :T - k] = targets[:, k:]
        same = torch.ones(B, T - k, dtype=torch.bool) if docs is None else docs[:, k:] == docs[:, :T - k]
        out[:, k - 1, 2, :T - k] = same.to(inputs.dtype)
    return out


def rank_micro_batch(mb: MicroBatch, mine: Tensor, device_positions: Tensor, data: DataConfig,
                     device: torch.device, *, mtp_depth: int = 0) -> MicroBatch:
    """A loader's micro-batch cut to the positions this rank holds (`mine`: all, or its cp share) and put on
    the device. RoPE positions restart at each document under data.reset_positions, else they are
    `device_positions` (`mine` on the device); under data.mask_documents the window's documents go along
    whole. A micro-batch whose rows each hold one document needs neither (told on the host, no wait). With
    `mtp_depth` (multi-token prediction), its shifted ids and targets, made on the whole window, then cut."""
    one_doc = mb.docs is None or not bool(mb.docs.any())
    positions = device_positions
    if data.reset_positions and not one_doc:
        positions = to_device(document_positions(mb.docs)[:, mine].contiguous(), device)  # [B, T']
    docs = to_device(mb.docs, device) if data.mask_documents and not one_doc else None
    shifted = None
    if mtp_depth:
        # documents count only where they are masked: otherwise a target may cross a document end, as the main one does
        window_docs = mb.docs if data.mask_documents and not one_doc else None
        shifted = to_device(mtp_shifted(mb.inputs, mb.targets, window_docs, mtp_depth)[..., mine].contiguous(), device)
    return MicroBatch(to_device(mb.inputs[:, mine], device), to_device(mb.targets[:, mine], device), positions, docs,
                      shifted)
