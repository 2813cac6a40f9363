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


def memory_tracker() -> Any:
    """A MemTracker: `with tracker: ...`, then `tracker.get_tracker_snapshot("peak")` by device and category.
    It keeps statistics per module too and refuses a model called again from the top (the next micro-batch);
    only the whole peak is wanted here, so each new top-level call starts the per-module statistics afresh."""
    _need("MemTracker")
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as err:
        raise DryRunUnavailable(f"--dry-run needs torch.distributed._tools.mem_tracker.MemTracker ({err})") from None

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # "multiple iterative calls": the next micro-batch's forward
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

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
