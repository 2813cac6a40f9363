"""What the dry run (dry_run.py) watches and answers while one real step runs on fake tensors.

Fake tensors have shapes, not values, so the few places where the step reads a value on the host must be
answered otherwise:
- arithmetic on real host tensors (the mesh's grid of ranks, indexed for a pipeline peer) stays real;
- the routing of an MoE block is taken as perfectly balanced: `bincount` of N assignments over E experts
  counts N/E for each, and that value follows the counts through views, sums and the expert-parallel
  all-to-all to the `.tolist()` that sizes the exchange (the planner assumes the same even spread).
Any other host read of a fake value fails, naming the op.

The same mode counts the bytes each kind of collective moves (c10d's ops are dispatched like any other).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from tetron.device import clear_tensor_caches
from tetron.torch_private import TorchDispatchMode, is_fake, tree_leaves
from tetron.torch_private.fake import parse_to, real_mode, unbox_group

aten, c10d = torch.ops.aten, torch.ops.c10d

# Each collective kind: (its op, the argument whose bytes it moves). All-gather: the gathered output;
# reduce-scatter: the input it reduces; all-reduce, broadcast, send, recv: their tensors; all-to-all: the rows sent.
COLLECTIVES = {
    c10d.allreduce_.default: ("all_reduce", 0),
    c10d.allreduce_coalesced_.default: ("all_reduce", 0),
    c10d._allgather_base_.default: ("all_gather", 0),
    c10d.allgather_.default: ("all_gather", 0),
    c10d.allgather_into_tensor_coalesced_.default: ("all_gather", 0),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", 1),
    c10d.alltoall_base_.default: ("all_to_all", 1),
    c10d.broadcast_.default: ("broadcast", 0),
    c10d.send.default: ("send", 0),
    c10d.recv_.default: ("recv", 0),
}

# Index tensors made from nothing on the host (positions: arange) get real values beside their fake ones, up to this
# many elements, so host decisions on them (torch.equal) can be answered
HOST_INDICES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
SHADOW_MAX = 1 << 20


def _shadowed_mask(index: Any, shadow: WeakTensorKeyDictionary) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool and index in shadow


def _map(fn: Any, x: Any) -> Any:
    """`fn` over the leaves of an op's arguments (tuples, lists and dicts of them)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _bytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


class DryRunMode(TorchDispatchMode):
    """Inside a FakeTensorMode: host arithmetic stays real, MoE routing counts are balanced, collectives counted.

    Balanced counts live as real "shadow" tensors beside their fake ones: an op whose tensor inputs all have
    shadows (or are real) runs on the shadows too, so a `.tolist()` of anything computed from the counts
    (their sums per rank, their offsets) reads the value a balanced routing would give."""

    def __init__(self) -> None:
        super().__init__()
        self.shadow: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # fake tensor -> its values, real
        self.collective_bytes: dict[str, int] = defaultdict(int)
        self.collective_calls: dict[str, int] = defaultdict(int)

    def __enter__(self) -> "DryRunMode":
        clear_tensor_caches()  # the run's cached masks are made here, as fake tensors, and counted
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        clear_tensor_caches()  # none of those fake tensors may reach a real run after this one

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in COLLECTIVES:
            kind, index = COLLECTIVES[func]
            self.collective_bytes[kind] += _bytes(args[index])
            self.collective_calls[kind] += 1
        if tensors and not any(is_fake(t) or t.is_meta for t in tensors):
            with real_mode():  # the host's own small tensors (a rank grid): computed, not faked
                return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            if args[0] not in self.shadow:
                raise RuntimeError(f"the dry run cannot read a value on the host here ({func}): fake tensors "
                                   f"hold none")
            with real_mode():
                return self.shadow[args[0]].item()
        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            # its fake (meta) kernel takes bf16 only, where the CPU's real one also runs fp32: the shape in bf16
            dtype = args[0].dtype
            return func(*[a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                          for a in args], **kwargs).to(dtype)
        if func is aten.bincount.default:
            return self._balanced_counts(args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0))
        fakes = [t for t in tensors if is_fake(t)]
        if func is aten.index.Tensor and any(_shadowed_mask(i, self.shadow) for i in args[1]):
            # rows picked by a mask of known values (multi-token prediction's valid positions): their indices
            with real_mode():
                index = [self.shadow[i].nonzero().unbind(1) if _shadowed_mask(i, self.shadow) else [i]
                         for i in args[1]]
            return func(args[0], [j for part in index for j in part])
        if func is aten.equal.default and fakes and all(t in self.shadow for t in fakes):
            with real_mode():  # positions compared on the host (Ulysses' order after its all-to-all)
                return func(*_map(lambda x: self.shadow.get(x, x) if isinstance(x, torch.Tensor) else x, args))
        out = func(*args, **kwargs)
        if func in HOST_INDICES and not tensors and not out.is_floating_point() and out.numel() <= SHADOW_MAX:
            with real_mode():  # positions made on the host (a cp rank's shard of the sequence): their values too
                self.shadow[out] = func(*args, **kwargs)
        if func is c10d.alltoall_base_.default and args[1] in self.shadow and not args[3]:
            self.shadow[args[0]] = self._exchanged_counts(args[1], args[2])
        elif fakes and all(t in self.shadow for t in fakes):
            self._follow(func, args, kwargs, out)
        return out

    def _balanced_counts(self, chosen: torch.Tensor, minlength: int) -> torch.Tensor:
        """bincount of `chosen` over `minlength` experts, as an even routing would count (an [E] fake tensor)."""
        out = torch.empty(minlength, dtype=torch.int64, device=chosen.device)
        with real_mode():
            n = chosen.numel()
            self.shadow[out] = torch.full((minlength,), n // minlength, dtype=torch.int64)
            self.shadow[out][:n % minlength] += 1
        return out

    def _exchanged_counts(self, sent: torch.Tensor, group: Any) -> torch.Tensor:
        """An equal-split all-to-all of counts: every rank routes alike, so from each rank this rank receives
        the piece of its own index."""
        group = unbox_group(group)
        with real_mode():
            pieces = self.shadow[sent].view(group.size(), -1)
            return pieces[group.rank()].repeat(group.size())

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """`func` once more on the shadows of its inputs: the shadows of its outputs (and of what it wrote to);
        none for an output past SHADOW_MAX elements (computed for real, it would cost what faking saves)."""
        if any(isinstance(t, torch.Tensor) and t.numel() > SHADOW_MAX for t in tree_leaves(out)):
            return
        def real(x: Any) -> Any:
            return self.shadow[x] if isinstance(x, torch.Tensor) and x in self.shadow else x

        with real_mode():
            r_args, r_kwargs = _map(real, args), _map(real, kwargs)
            r_out = func(*r_args, **r_kwargs)
        for fake, value in zip(tree_leaves(out), tree_leaves(r_out)):
            if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor):
                self.shadow[fake] = value


class CrossDeviceCopies(TorchFunctionMode):
    """Copies between the CPU and fake `cuda` tensors, answered before torch's device guard refuses them in a CPU
    build: `copy_` writes nothing (fake tensors hold nothing), `.to(cuda)` and `.cuda()` give a fake tensor there.
    The CUDA forward check's (dry_run.cuda_forward): whatever the copies, every other op sees the devices as
    the real run would."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_" and args[0].device != args[1].device:
            return args[0]
        if name in ("to", "cuda") and isinstance(args[0], torch.Tensor):
            device, dtype = (torch.device("cuda"), None) if name == "cuda" else parse_to(*args[1:], **kwargs)
            x = args[0]
            if device is not None and device.type != x.device.type:
                return torch.empty_like(x, device=device, dtype=dtype or x.dtype).requires_grad_(x.requires_grad)
        return func(*args, **kwargs)
