"""The autograd engine's own entry points, storage swaps, batched kernels and torch's private helper modules.

- run_backward: `Variable._execution_engine.run_backward`, the engine without torch.autograd's checks: a
  backward from an output whose data was released (the gradient's shape is checked against the graph, not the
  emptied tensor: Megatron's custom_backward), from gradient edges in the middle of a graph, to given inputs
  without accumulating. Public path: torch.autograd.backward / grad over gradient edges, which take the
  shapes from the graph too.
- queue_after_backward: `Variable._execution_engine.queue_callback`, a call once the running backward ends
  (DDP's way to wait for its last bucket). No public equivalent: without it, an error that says so.
- in_backward: `torch._C._current_graph_task_id`, whether the engine is running a backward (where activation
  recomputation replays a forward). No public equivalent: without it, False (outside every backward).
- engine_runs: `torch._C._will_engine_execute_node`, whether the running backward executes a node (a custom
  Function then computes only the gradients this run wants: B or W of a split backward). Public path: True
  (every gradient computed, as a plain backward wants).
- swap_storages: `UntypedStorage._swap_data_ptr_`, moving memory from one storage to another while tensors
  keep referring to theirs. Public path: the caller resizes its storage instead (storage_swap_available).
- foreach_norm, foreach_scale_: `torch._foreach_norm`, `torch._foreach_mul_`, one kernel for many tensors.
  Public path: one kernel per tensor.
- is_view, view_base, version: `Tensor._base`, `Tensor._version`. Public paths: True for is_view (then no
  data is released), None and 0 for the others (see each).
- wrapped_tensors, TorchDispatchMode: torch.utils._python_dispatch's wrapper subclasses (DTensor's inner
  tensors) and dispatch modes (the planner's op-by-op measurement). No public dispatch mode: re-exported.
- is_fake, tree_leaves, op_name: `torch._subclasses.fake_tensor.is_fake`, `torch.utils._pytree.tree_leaves`,
  `OpOverload._opname`. Public paths: False (no fake tensors without the module), a walk over lists, tuples
  and dicts, the op's name() cut to its base name.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported: no public equivalent)


def _engine() -> Any:
    return getattr(torch.autograd.Variable, "_execution_engine", None)


def run_backward(roots: Sequence[Tensor | GradientEdge], grads: Sequence[Tensor], *, keep_graph: bool = False,
                 inputs: Sequence[GradientEdge] = (), accumulate: bool = True,
                 fallback: bool = False) -> tuple[Tensor | None, ...]:
    """Backward from `roots` (tensors, possibly with their data released, or gradient edges) with incoming
    `grads`. `accumulate`: into the leaves' .grad (only into `inputs` where given); else the gradients of
    `inputs` are returned (None for one the roots do not reach). `keep_graph`: the graph stays for another run."""
    engine = _engine()
    if not fallback and engine is not None:
        return engine.run_backward(tuple(roots), tuple(grads), keep_graph, False, tuple(inputs),
                                   allow_unreachable=True, accumulate_grad=accumulate)
    edges = [get_gradient_edge(r) if isinstance(r, Tensor) else r for r in roots]
    if accumulate:
        torch.autograd.backward(edges, list(grads), retain_graph=keep_graph, inputs=list(inputs) or None)
        return ()
    return torch.autograd.grad(edges, list(inputs), list(grads), retain_graph=keep_graph, allow_unused=True)


def queue_after_backward(fn: Callable[[], None]) -> None:
    """Call `fn` once the backward pass now running has finished (from inside a hook of that pass)."""
    engine = _engine()
    if engine is None or not hasattr(engine, "queue_callback"):
        raise RuntimeError(f"torch {torch.__version__} has no autograd-engine callbacks "
                           "(Variable._execution_engine.queue_callback); use dp_impl=naive")
    engine.queue_callback(fn)


def in_backward(*, fallback: bool = False) -> bool:
    """True while autograd runs a backward pass on this thread."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    if fallback or current is None:
        return False
    return current() != -1


def engine_runs(node: Any, *, fallback: bool = False) -> bool:
    """Inside a backward: whether the engine executes `node` in this run. A leaf's (AccumulateGrad) cannot be
    asked while the engine runs for chosen inputs (torch raises): True for it, as on the public path."""
    ask = getattr(torch._C, "_will_engine_execute_node", None)
    if fallback or ask is None or type(node).__name__ == "AccumulateGrad":
        return True
    return ask(node)


def storage_swap_available(device: torch.device) -> bool:
    """Whether swap_storages runs here: on the CPU, where the call exists (a GPU's caching allocator reuses
    freed blocks anyway); not under fake tensors (the dry run: no memory to swap, and it plays a GPU run, whose
    resizes a memory tracker follows where it cannot see a swap)."""
    return device.type == "cpu" and hasattr(torch.UntypedStorage, "_swap_data_ptr_") and not _fake_mode_active()


def _fake_mode_active() -> bool:
    try:
        from torch._guards import active_fake_mode
    except ImportError:
        return False
    return active_fake_mode() is not None


def swap_storages(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory of two storages; every tensor keeps referring to its own storage object."""
    a._swap_data_ptr_(b)


def foreach_norm(tensors: list[Tensor], *, dtype: torch.dtype = torch.float32,
                 fallback: bool = False) -> list[Tensor]:
    """The 2-norm of each tensor, computed in `dtype`."""
    if not fallback and hasattr(torch, "_foreach_norm"):
        return list(torch._foreach_norm(tensors, 2.0, dtype=dtype))
    return [torch.linalg.vector_norm(t, 2.0, dtype=dtype) for t in tensors]


def foreach_scale_(tensors: list[Tensor], scale: Tensor | float, *, fallback: bool = False) -> None:
    """Multiply each tensor in place by `scale`."""
    if not fallback and hasattr(torch, "_foreach_mul_"):
        torch._foreach_mul_(tensors, scale)
        return
    for t in tensors:
        t.mul_(scale)


def is_view(t: Tensor, *, fallback: bool = False) -> bool:
    """Whether `t` views another tensor's memory (`Tensor._base`); the public path answers True, the safe
    answer for its one use: the data of a view is not released."""
    if not fallback and hasattr(t, "_base"):
        return t._base is not None
    return True


def view_base(t: Tensor, *, fallback: bool = False) -> Tensor | None:
    """The tensor whose memory `t` views (`Tensor._base`), None for a tensor that is no view. Public path:
    None (every tensor counted as its own)."""
    return None if fallback or not hasattr(t, "_base") else t._base


def version(t: Tensor, *, fallback: bool = False) -> int:
    """`t`'s version counter (`Tensor._version`), raised by every in-place change. Public path: 0 (an in-place
    change then goes unnoticed by a check that compares versions)."""
    return 0 if fallback or not hasattr(t, "_version") else t._version


def wrapped_tensors(t: Tensor, *, fallback: bool = False) -> list[Tensor] | None:
    """The inner tensors of a wrapper subclass (DTensor: its local shard; `__tensor_flatten__`), None for a
    plain tensor. Public path: None (every tensor taken as plain)."""
    if fallback:
        return None
    try:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    except ImportError:
        return None
    if not is_traceable_wrapper_subclass(t):
        return None
    inner, _ = t.__tensor_flatten__()
    parts = [getattr(t, name) for name in inner]  # DTensor also lists its device mesh: not a tensor
    return [part for part in parts if isinstance(part, Tensor)]


def is_fake(t: Tensor, *, fallback: bool = False) -> bool:
    """Whether `t` is a fake tensor (shapes and dtypes, no memory: FakeTensorMode)."""
    if not fallback:
        try:
            from torch._subclasses.fake_tensor import is_fake as private_is_fake
        except ImportError:
            pass
        else:
            return private_is_fake(t)
    return False


def tree_leaves(tree: Any, *, fallback: bool = False) -> list[Any]:
    """The leaves of nested lists, tuples and dicts (and whatever else torch's pytree flattens)."""
    if not fallback:
        try:
            from torch.utils._pytree import tree_leaves as private_tree_leaves
        except ImportError:
            pass
        else:
            return private_tree_leaves(tree)
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in tree_leaves(item, fallback=True)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in tree_leaves(item, fallback=True)]
    return [tree]


def op_name(op: Any, *, fallback: bool = False) -> str:
    """An operator overload's base name, without namespace or overload: c10d::allreduce_ -> "allreduce_"."""
    if not fallback and hasattr(op, "_opname"):
        return op._opname
    return op.name().split("::")[-1].split(".")[0]
