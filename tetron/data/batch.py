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


def rank_micro_batch(mb: MicroBatch, mine: Tensor, device_positions: Tensor, data: DataConfig,
                     device: torch.device) -> MicroBatch:
    """A loader's micro-batch cut to the positions this rank holds (`mine`: all, or its cp share) and put on
    the device. RoPE positions restart at each document under data.reset_positions, else they are
    `device_positions` (`mine` on the device); under data.mask_documents the window's documents go along
    whole. A micro-batch whose rows each hold one document needs neither (told on the host, no wait)."""
    one_doc = mb.docs is None or not bool(mb.docs.any())
    positions = device_positions
    if data.reset_positions and not one_doc:
        positions = to_device(document_positions(mb.docs)[:, mine].contiguous(), device)  # [B, T']
    docs = to_device(mb.docs, device) if data.mask_documents and not one_doc else None
    return MicroBatch(to_device(mb.inputs[:, mine], device), to_device(mb.targets[:, mine], device), positions, docs)
