"""The dry run's private torch: fake tensors, the fake process group's store, the memory tracker.

    fake_tensor_mode   torch._subclasses.FakeTensorMode: tensors with shapes, dtypes and devices, no storage
    fake_store         torch.testing._internal.distributed.fake_pg.FakeStore: the `fake` backend's store, so one
                       process initialises a group of any world size whose collectives do nothing
    memory_tracker     torch.distributed._tools.mem_tracker.MemTracker: peak bytes by category, under fake tensors

None has a public equivalent: without them `tetron plan --dry-run` says which is missing, in one line.
"""

from __future__ import annotations

from typing import Any

from tetron.torch_private.version import TORCH_VERSION, torch_at_least

_FROM = (2, 5)  # the torch whose FakeTensorMode, fake backend and MemTracker the dry run was written against


class DryRunUnavailable(RuntimeError):
    """This torch lacks a private API the dry run needs."""


def _need(what: str) -> None:
    if not torch_at_least(*_FROM):
        raise DryRunUnavailable(f"--dry-run needs torch >= {_FROM[0]}.{_FROM[1]} ({what}); this is "
                                f"{TORCH_VERSION[0]}.{TORCH_VERSION[1]}")


def fake_tensor_mode() -> Any:
    """A FakeTensorMode that also takes real tensors as inputs (the CPU's small constants, made before it)."""
    _need("FakeTensorMode")
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as err:
        raise DryRunUnavailable(f"--dry-run needs torch._subclasses.fake_tensor.FakeTensorMode ({err})") from None
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_store() -> Any:
    """The store `init_process_group(backend="fake", ...)` takes (importing it registers the backend)."""
    _need("the fake process group")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as err:
        raise DryRunUnavailable(f"--dry-run needs torch's fake process group "
                                f"(torch.testing._internal.distributed.fake_pg: {err})") from None
    return FakeStore()


class _NoModules:
    """Stands in for MemTracker's ModTracker: no module hooks. Those keep statistics per module, refuse a model
    called again from the top (the next micro-batch), and their backward hooks fail inside `autograd.grad` (the
    zero-bubble schedules' split backward); the whole peak needs none of it."""

    is_bw = False
    parents: set[str] = {"Global"}

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


def memory_tracker() -> Any:
    """A MemTracker of the whole peak: `with tracker: ...`, then `tracker.get_tracker_snapshot("peak")`, bytes
    by device and category (every storage an op made, until it is freed or resized); `restart_peak()` starts
    the peak again from what is held."""
    _need("MemTracker")
    try:
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    except ImportError as err:
        raise DryRunUnavailable(f"--dry-run needs torch.distributed._tools.mem_tracker.MemTracker ({err})") from None

    class PeakTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _NoModules()

        def _update_peak_stats(self, peak_state: Any) -> None:
            # the whole peak only: the per-module walk after every op costs O(modules) each (minutes at full size)
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        def restart_peak(self) -> None:
            """The peak from here on: what is held now is where it starts (a step's peak apart from the build's)."""
            self._peak_mem.clear()
            self._peak_mem_snap.clear()
            self._update_peak_stats(None)

    return PeakTracker()


def real_mode() -> Any:
    """A context in which the active fake tensor mode steps aside (a dispatch mode computes real host tensors)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError as err:
        raise DryRunUnavailable(f"--dry-run needs torch._subclasses.fake_tensor.unset_fake_temporarily ({err})") \
            from None
    return unset_fake_temporarily()


def unbox_group(group: Any) -> Any:
    """The ProcessGroup a dispatched c10d op carries as a TorchScript object (its rank() and size())."""
    import torch.distributed as dist

    if not hasattr(dist.ProcessGroup, "unbox"):
        raise DryRunUnavailable("--dry-run needs torch.distributed.ProcessGroup.unbox")
    return dist.ProcessGroup.unbox(group)


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """(device, dtype) of a `Tensor.to(...)` call's arguments, either None where not given."""
    import torch

    parse = getattr(getattr(torch._C, "_nn", None), "_parse_to", None)
    if parse is None:
        raise DryRunUnavailable("--dry-run needs torch._C._nn._parse_to")
    device, dtype = parse(*args, **kwargs)[:2]
    return device, dtype


def _grouped_mm_flops(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of torch._grouped_mm (which FlopCounterMode does not count), from the shapes: [M, K] @ [G, K, N]
    (the experts' forward, and their input gradient) or [K, M] @ [M, N] in groups of M's rows (the weight
    gradient): 2 * M * K * N either way."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    raise NotImplementedError(f"FLOPs of a grouped matmul of shapes {a} and {b}")


def _cpu_attention_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """The CPU flash attention's FLOPs (which FlopCounterMode does not count): as torch counts the CUDA one's."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(q, k, v)


def _cpu_attention_backward_flops(grad: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None,
                                  **kwargs: Any) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad, q, k, v)


def flop_counter() -> Any:
    """A FlopCounterMode of the whole step: get_total_flops(); with the grouped matmul's and the CPU flash
    attention's FLOPs, which it lacks. Without its module tracker, whose backward hooks fail
    inside `autograd.grad` (the zero-bubble schedules' split backward) and which only splits the count by module."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    counter = FlopCounterMode(display=False, custom_mapping={
        aten._grouped_mm: _grouped_mm_flops,
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops})
    if not hasattr(counter, "mod_tracker"):
        raise DryRunUnavailable("--dry-run expects torch.utils.flop_counter.FlopCounterMode to have a mod_tracker")
    counter.mod_tracker = _NoModules()
    return counter
