"""A save's writer gathers tensors into buffers lent again to later tensors of their size (shards.Staging,
issue 40): none is overwritten while the tensor it holds is being written, and none is allocated anew per
tensor (on ZeRO-3's CPU ranks each would be a fresh mapping, faulted in page by page)."""

from __future__ import annotations

import time
import zlib

import torch

from tetron.checkpoint import shards
from tetron.checkpoint.shards import Shard, ShardWriter, Staging

CPU = torch.device("cpu")


def test_staging_lends_two_buffers_per_size_in_turn():
    staging = Staging()
    first, second, third, fourth = (staging.take(1000, CPU) for _ in range(4))
    assert first.data_ptr() != second.data_ptr()
    assert third.data_ptr() == first.data_ptr() and fourth.data_ptr() == second.data_ptr()
    other = staging.take(500, CPU)
    assert other.data_ptr() not in (first.data_ptr(), second.data_ptr())
    big = Staging.REUSE_MAX_BYTES // 4 + 1  # above it: a buffer of its own each time, as glibc would map anyway
    staging.take(big, CPU)
    assert (big, CPU) not in staging._turns  # nothing kept


def test_a_buffer_is_not_reused_while_its_tensor_is_written(monkeypatch):
    """Tensors of one size gathered into the staging buffers while a slow writer writes the one before:
    each tensor's crc32, taken on the writer's thread, is that of the values it was gathered with."""
    crc = shards.tensor_crc32

    def slow_crc(tensor):
        time.sleep(0.02)  # the gather of the next tensor runs meanwhile
        return crc(tensor)

    monkeypatch.setattr(shards, "tensor_crc32", slow_crc)
    n, count = 4096, 6
    specs = [(f"t{k}", f"t{k}", torch.float32, (n,)) for k in range(count)]
    staging = Staging()

    def stream():
        for k in range(count):
            buf = staging.take(n, CPU)
            buf.fill_(float(k))
            yield f"t{k}", buf

    writer = ShardWriter(None, [Shard("x.safetensors", 0, specs)], 0)
    writer.consume(stream())
    assert writer.error is None
    want = {f"t{k}": zlib.crc32(torch.full((n,), float(k)).numpy()) for k in range(count)}
    assert writer.crc32 == want
    assert len(staging._turns[(n, CPU)]) == 2  # two buffers for six tensors
