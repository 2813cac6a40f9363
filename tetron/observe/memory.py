"""Measured memory of one rank: the bytes of its training state, and of the activations autograd holds.

Every number here is the sum of the byte sizes of distinct tensor *storages* (the allocations behind
tensors), counted once however many tensors view them: a `.grad` that is a view into a data-parallel
bucket counts the bucket once, tied embeddings count once, a slice of a flat buffer counts the whole
buffer (the memory is held as long as any view is). These are the bytes the tensors ask for, not what
the allocator holds for them (CUDA's caching allocator rounds blocks up to multiples of 512 B and
keeps freed ones reserved; the CPU allocator has headers and arenas). Never counted here: an op's
short-lived temporaries, communication buffers, the CUDA context, the interpreter. The device's peak
(`tetron.device.peak_memory_mb`) sees some of these: allocated blocks, temporaries included, on a
GPU; the whole resident set on the CPU. Its gap to state plus activations is the rest.

- `tensor_bytes`: the distinct storage bytes behind any tensors.
- `state_bytes` -> `StateBytes`: parameters, gradients, optimizer state and buffers, each counted
  once, a storage already counted in an earlier category not counted again (in that order, so a
  master weight that *is* the parameter, as in fp32 training without sharding, is a parameter).
- `optimizer_tensors`: every tensor an optimizer holds, for `state_bytes`.
- `memory_figures`: a training rank's state by kind and its activations' peak, as a step's record holds them.
- `ActivationMeter`: the bytes autograd has saved for the backward pass and not yet released,
  live and peak, through saved-tensor hooks; parameters are left out (they are state, above).

Storages on different devices are added together: pass one device's tensors to get that device's
bytes (AdamW's `step` counters, for one, are 4-byte CPU tensors unless the optimizer is fused or
capturable).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch import Tensor

from tetron.torch_private import is_fake, version, view_base, wrapped_tensors

if TYPE_CHECKING:
    from tetron.parallel.parallelize import ParallelModel

# (device, address): CPU and accelerator addresses could in principle coincide, so the device is part of the key.
StorageKey = tuple[torch.device, int]


def _storages(t: Tensor) -> list[tuple[StorageKey, int]]:
    """(key, bytes) of each storage behind `t`: one for a plain tensor, the inner tensors' for a
    wrapper subclass (DTensor: its local shard), none for meta tensors or layouts without one storage."""
    inner = wrapped_tensors(t)
    if inner is not None:
        return [s for part in inner for s in _storages(part)]
    if t.is_meta:
        return []  # no memory behind it
    try:
        storage = t.untyped_storage()
        if is_fake(t):  # no address (all are 0): the storage object's own, alive as long as a tensor holds it
            return [((t.device, storage._cdata), storage.nbytes())]
        return [((t.device, storage.data_ptr()), storage.nbytes())]
    except (RuntimeError, NotImplementedError):
        return []  # sparse, nested tensors: no single storage to read


def _count(tensors: Iterable[Tensor | None], seen: set[StorageKey]) -> int:
    """Bytes of the storages behind `tensors` not already in `seen`; adds them to `seen`."""
    total = 0
    for t in tensors:
        if t is None:  # a parameter without a gradient yet
            continue
        for key, nbytes in _storages(t):
            if nbytes == 0:
                continue  # freed by resize_(0): no memory, and its address (0) means nothing
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def tensor_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views, tied parameters and None skipped)."""
    return _count(tensors, set())


@dataclass(frozen=True)
class StateBytes:
    """One rank's training state in bytes, by category; no storage in two categories."""

    params: int
    grads: int
    optimizer: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers

    def as_dict(self) -> dict[str, int]:
        """The four categories and the total, e.g. for a metrics record."""
        return {**asdict(self), "total": self.total}


def state_bytes(*, params: Iterable[Tensor], grads: Iterable[Tensor | None] = (),
                optimizer_tensors: Iterable[Tensor] = (), buffers: Iterable[Tensor] = ()) -> StateBytes:
    """Bytes of parameters, gradients, optimizer state and buffers, in that order of precedence:
    a storage counted in one category is not counted again in a later one (the optimizer's
    param_groups hold the model's own parameters when there are no separate master weights)."""
    seen: set[StorageKey] = set()
    return StateBytes(
        params=_count(params, seen),
        grads=_count(grads, seen),
        optimizer=_count(optimizer_tensors, seen),
        buffers=_count(buffers, seen),
    )


def _tensors_in(obj: Any) -> Iterable[Tensor]:
    """Tensors anywhere inside nested dicts, lists and tuples (optimizer state is such a tree)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor `optimizer` holds: its per-parameter state (AdamW: exp_avg, exp_avg_sq, step) and
    the parameters it updates (master weights where they are not the model's own parameters)."""
    found = list(_tensors_in(list(optimizer.state.values())))
    for group in optimizer.param_groups:
        found.extend(_tensors_in(group["params"]))
    return found


class _Saved:
    """What autograd keeps for one saved tensor while the meter is on; its death is the release."""

    __slots__ = ("tensor", "version", "keys", "meter")

    def __init__(self, tensor: Tensor, keys: list[tuple[StorageKey, int]], meter: ActivationMeter) -> None:
        # detach(): a saved output holding its own grad_fn would form a reference cycle through
        # autograd's C++ graph that Python's collector cannot see, leaking it when a graph is dropped
        # unrun. The detached alias shares the storage and the version counter.
        self.tensor = tensor.detach()
        self.version = version(tensor)
        self.keys = keys
        self.meter = meter

    def __del__(self) -> None:
        if self.keys:
            self.meter._release(self.keys)


class ActivationMeter:
    """Bytes of the tensors autograd has saved for backward and not yet released: `live_bytes` now,
    `peak_bytes` the most at any moment since the start or the last `reset_peak()`.

    Inside `with meter:`, every tensor an op saves for backward (built-in ops, custom Functions'
    `ctx.save_for_backward`, reentrant checkpointing's inputs) passes through a pack hook, which
    counts its storage once however many ops save it (a Linear's output saved by the next op and by
    itself, say), and autograd keeps a small holder in its place; when autograd frees the holder,
    after that node's backward or when an unrun graph is dropped, the count falls. So several
    micro-batches in flight (pipeline schedules) add up, and a backward run after the block still
    releases. Storages of `params` (and of their views, such as a Linear's transposed weight) are
    left out: they are state, counted by `state_bytes`.

    Checkpointing (`torch.utils.checkpoint`): inside a non-reentrant region checkpoint's own hook
    takes over, so the region's saved tensors are (rightly) absent; the region's inputs, kept for the
    recompute, are counted where torch keeps them as saved tensors (2.13 does; older versions may
    hold them in a closure instead, unseen). The tensors recomputed during backward are held by
    checkpoint, not seen; so are the outputs a selective policy (`create_selective_checkpoint_contexts`)
    keeps, which live in that policy's own cache, not in autograd's saved tensors. Reentrant
    checkpointing saves its inputs with save_for_backward, counted, and its recompute saves through the
    meter if backward runs inside the block. Not counted either: anything else held for backward other
    than through autograd's saved tensors. A tensor's bytes are those of its storage when saved.

    Saved-tensor hooks switch off autograd's check that a saved tensor was not modified in place
    before backward; the meter makes that check itself (same condition: the version counter moved).
    """

    def __init__(self, params: Iterable[Tensor] = ()) -> None:
        self._params = list(params)
        self._excluded: set[StorageKey] = set()
        self._refs: dict[StorageKey, int] = {}  # storage -> holders alive that point at it
        # A CUDA backward runs on autograd's device threads, releasing while the main thread may pack.
        self._lock = threading.Lock()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.live_bytes = 0
        self.peak_bytes = 0

    def __enter__(self) -> ActivationMeter:
        if self._hooks is not None:
            raise RuntimeError("ActivationMeter entered twice; nest two meters instead")
        # Parameter addresses are read on entry, not at construction: materialising or loading
        # weights may have moved them in between.
        self._excluded = {key for p in self._params for key, _ in _storages(p)}
        # ... and by identity: a parameter sharded between uses (ZeRO-3) is gathered at another address
        self._param_ids = {id(p) for p in self._params}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is None:
            raise RuntimeError("ActivationMeter exited without being entered")
        self._hooks.__exit__(*exc)
        self._hooks = None

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (e.g. at the start of a step)."""
        with self._lock:
            self.peak_bytes = self.live_bytes

    def _pack(self, tensor: Tensor) -> _Saved:
        base = view_base(tensor)
        base = tensor if base is None else base
        is_param = id(tensor) in self._param_ids or id(base) in self._param_ids
        keys = [] if is_param else [(key, n) for key, n in _storages(tensor) if n > 0 and key not in self._excluded]
        if keys:
            with self._lock:
                for key, nbytes in keys:
                    held = self._refs.get(key, 0)
                    self._refs[key] = held + 1
                    if held == 0:  # the first holder of this storage brings its bytes
                        self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        # Parameters get a holder too (with no keys), so that their in-place check happens as well.
        return _Saved(tensor, keys, self)

    @staticmethod
    def _unpack(saved: _Saved) -> Tensor:
        if version(saved.tensor) != saved.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: {tuple(saved.tensor.shape)} {saved.tensor.dtype} is at version "
                f"{version(saved.tensor)}; expected version {saved.version} instead")
        return saved.tensor

    def _release(self, keys: list[tuple[StorageKey, int]]) -> None:
        with self._lock:
            for key, nbytes in keys:
                held = self._refs[key] - 1
                if held:
                    self._refs[key] = held
                else:  # the last holder of this storage is gone
                    del self._refs[key]
                    self.live_bytes -= nbytes


def memory_figures(model: ParallelModel, optimizer_tensors: list[Tensor], meter: ActivationMeter) -> dict[str, float]:
    """MiB a training rank holds: parameters, gradients (bucket buffers, ZeRO slices), optimizer state
    (fp32 masters unless they are the parameters, the optimizer's state), buffers, and the peak of the
    activations saved for the backward pass during the step `meter` watched."""
    buckets = [b for chunk in model.dp_chunks for b in getattr(chunk, "buckets", [])]
    # ZeRO: a rank's slice of the parameters is a parameter (under ZeRO-3 the only copy between uses)
    slices = [getattr(b, "params_slice", None) for b in buckets]
    state = state_bytes(params=[*model.params, *(s for s in slices if s is not None)],
                        grads=[p.grad for p in model.params] + [b.buffer for b in buckets]
                        + [b.shard_grad for b in buckets],
                        optimizer_tensors=optimizer_tensors,
                        buffers=[b for chunk in model.chunks for b in chunk.buffers()])
    figures = {f"mem_{kind}_mb": n / 2**20 for kind, n in state.as_dict().items()}
    figures["mem_activations_mb"] = meter.peak_bytes / 2**20
    return figures
