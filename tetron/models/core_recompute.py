"""Korthikanti's selective recomputation: the attention core (the fused kernel) runs again in the backward.

Under `recompute: selective` (parallel/recompute.py) a layer runs as under `none`, keeping what `none` keeps
(fused.py's norms and gated MLP already keep only their inputs, act(gate) and the product recomputed), except the
attention kernel's own saved tensors: `_Core` keeps q, k and v, which `none` keeps too, and no output or
log-sum-exp; its backward runs the kernel's forward again (deterministic: the same bits) and differentiates that.
The output itself survives when o_proj keeps it as its weight gradient's input (the same storage), so what this
saves is the kernel's log-sum-exp, and whatever else a kernel saves besides its output. An MoE layer's experts
(experts.py, not fused.gated_linear's dense MLP) run their gated activation the same way: gate and up kept,
act(gate) recomputed (the product stays, the down projection's input). Never while compiling
(AOTAutograd's partitioner chooses what to save itself, and Dynamo does not trace the backward's autograd.grad).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

_state = threading.local()  # depth of recomputing_core() on this thread (a pipeline runs stages on threads)


@contextlib.contextmanager
def recomputing_core() -> Iterator[None]:
    """Attention cores called inside run as `_Core` (selective recomputation's forward of a layer)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def active() -> bool:
    return getattr(_state, "depth", 0) > 0 and not torch.compiler.is_compiling() and torch.is_grad_enabled()


def within(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`forward(*args, **kwargs)` with its attention cores recomputed in the backward (a layer's forward)."""
    with recomputing_core():
        return forward(*args, **kwargs)


def recomputed(core: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
    """core(*inputs), keeping only the inputs for the backward, which runs core again: attention's q, k and v,
    an MoE expert's gate and up (its act(gate) then not kept). `core` takes no other tensor that needs a
    gradient (a mask, yes; attention sinks, a parameter, no)."""
    return _Core.apply(core, *inputs)


class _Core(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, core: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        ctx.core = core
        ctx.save_for_backward(*inputs)
        return core(*inputs)  # grad mode is off inside a Function's forward: the kernel saves nothing

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple:
        want = ctx.needs_input_grad[1:]
        leaves = [t.detach().requires_grad_(w) for t, w in zip(ctx.saved_tensors, want)]
        with torch.enable_grad():
            out = ctx.core(*leaves)
        inputs = [t for t, w in zip(leaves, want) if w]
        grads = iter(torch.autograd.grad(out, inputs, dout) if inputs else ())
        return (None, *(next(grads) if w else None for w in want))

