"""Write a safetensors file one tensor at a time, so a writer never holds more than one tensor.

The format is an 8-byte little-endian header length, a JSON header naming every tensor's dtype,
shape and byte range, then the raw bytes. Shapes and dtypes are known before any tensor arrives
(from the model config), so the header is written first and the tensors streamed after it. The
files are read by `safetensors` (and transformers) like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from pathlib import Path

import torch

from tetron.fs import start_writeback

DTYPE_NAMES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # torch dtype -> the safetensors header's name
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # and back
WRITE_BLOCK = 1 << 20  # summed, then written, while it is in the CPU's cache (L2 is 1-2 MiB a core)
WRITEBACK_BYTES = 32 << 20  # the disk is handed what was written in steps of this (fs.start_writeback)


class SafetensorsWriter:
    """`write` each tensor named in `specs`, in that order; `close` checks all arrived and syncs."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], *,
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {"__metadata__": metadata or {}}
        offset = 0
        self.expected: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in specs:
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            self.expected.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path = Path(path)
        self.file = open(self.path, "wb")
        try:
            self.file.write(struct.pack("<Q", len(raw)) + raw)
        except OSError as err:
            err.filename = err.filename or str(self.path)
            self.abort()
            raise
        self.next = 0
        self.synced = 0  # bytes handed to the disk so far

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Append `tensor` (the next one named in the specs); returns the crc32 of its bytes, summed block by
        block as each is written, while the block is still in the CPU's cache (one pass over memory, not two)."""
        want_name, dtype, shape = self.expected[self.next]
        if name != want_name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: expected {want_name} {dtype} {list(shape)}, "
                             f"got {name} {tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().contiguous().cpu()
        # bytes of any dtype (numpy has no bfloat16): view the storage as uint8, no copy
        raw = memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else memoryview(b"")
        crc32 = 0
        try:
            for start in range(0, len(raw), WRITE_BLOCK):
                block = raw[start:start + WRITE_BLOCK]
                crc32 = zlib.crc32(block, crc32)
                self.file.write(block)
            if self.file.tell() - self.synced >= WRITEBACK_BYTES:
                self.file.flush()
                start_writeback(self.file.fileno(), self.synced, self.file.tell() - self.synced)
                self.synced = self.file.tell()
        except OSError as err:  # a full disk: name the file (a failed write() names none)
            err.filename = err.filename or str(self.path)
            raise
        self.next += 1
        return crc32

    def close(self) -> None:
        if self.next != len(self.expected):
            missing = self.expected[self.next][0]
            self.abort()
            raise ValueError(f"{self.path}: closed before {missing} was written")
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as err:
            err.filename = err.filename or str(self.path)
            self.abort()
            raise
        self.file.close()

    def abort(self) -> None:
        """Close the file after a failed write, without raising: the bytes still buffered fail again on a
        full disk or past a file-size limit (the descriptor is closed all the same), and the caller reports
        the first error and removes the file."""
        with contextlib.suppress(OSError):
            self.file.close()
