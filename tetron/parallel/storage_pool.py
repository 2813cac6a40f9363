"""Memory for ZeRO-3's gathered parameters (zero.py), reused from one gather to the next, as FSDP2 does.

A unit's parameters view one flat buffer whose storage is emptied between uses. Freed and allocated
again at every gather (twice a step per unit, forward and backward), that memory costs the CPU ranks
either way glibc serves it: from the heap, once freeing a large block has raised glibc's dynamic mmap
threshold, where the free space between blocks stays resident (the peak resident set of a 20-step
SmolLM-135M run wandered up to 10% above its second step's: docs/memory.md); or, under the fixed
threshold tetron's CPU ranks set (`tetron.device.map_large_allocations`), as fresh mappings whose pages
the kernel faults in and zeroes at every gather (22 ms for a 14 MB layer on the loaded 2-core test
machine, 0.7 ms reused). So a pool keeps the memory of emptied buffers, by size, and hands it to the
next unit of that size: as many buffers of a size as units of that size are ever gathered at once (the
unit that runs and the one prefetched; the rest of the chunk, embedding and head, is its own size),
allocated in the first step, never again. They stay allocated between steps (about 135 MB for
SmolLM-135M in fp32), which adds little to the peak (1.4% on that run), when they are all in use anyway.

The memory moves by swapping the data pointers of two storages (`UntypedStorage._swap_data_ptr_`, through
tetron.torch_private; the call FSDP2 and CUDA graph trees use): the unit's storage object stays the one its
parameters, and whatever autograd saved of them, refer to. On a GPU the caching allocator already reuses freed
blocks, so there (and on a torch without the call) a unit's storage is simply resized, as before.
"""

from __future__ import annotations

import torch

from tetron.torch_private import storage_swap_available, swap_storages


class StoragePool:
    """Idle storages by (bytes, device), lent to emptied storages and taken back from them."""

    def __init__(self, device: torch.device, *, reuse: bool | None = None) -> None:
        # reuse None: swap memory where torch_private can (the CPU); False: resize, the public path
        self.reuse = storage_swap_available(device) if reuse is None else reuse
        self._idle: dict[int, list[torch.UntypedStorage]] = {}
        self.allocations = 0  # storages this pool has allocated: flat after the first step

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty `storage` `nbytes` of memory (uninitialised): an idle storage's, else new."""
        if not self.reuse:
            storage.resize_(nbytes)
            return
        idle = self._idle.get(nbytes)
        spare = idle.pop() if idle else None
        if spare is None:
            spare = torch.UntypedStorage(nbytes, device=storage.device)
            self.allocations += 1
        swap_storages(storage, spare)  # `storage` holds the memory now, `spare` nothing: dropped

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory back (it is left with none) and keep it for the next `fill` of that size."""
        nbytes = storage.nbytes()
        if not self.reuse or nbytes == 0:
            storage.resize_(0)
            return
        keeper = torch.UntypedStorage(0, device=storage.device)
        swap_storages(storage, keeper)
        self._idle.setdefault(nbytes, []).append(keeper)
