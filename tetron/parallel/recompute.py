"""Activation recomputation: keep less of each decoder layer's forward, redo it in the backward pass.

Between a layer's forward and its backward, autograd holds what the backward needs: for a Llama layer
well over a dozen tensors the size of its input (norms in fp32, q/k/v before and after RoPE, the MLP's
gate, up and their product). Recomputation trades compute for that memory, one decoder layer at a time:
- "full": a layer keeps only its input; its whole forward runs again when its backward begins
  (about one more forward pass per step, the least memory).
- "selective": a layer keeps the outputs of its matmuls and attention kernels, the expensive part,
  and redoes only the element-wise work between them (RMSNorm, SiLU * up, RoPE, casts): the memory of
  the element-wise tensors for a few percent more compute (torchtitan's op-level policy). Inside ring
  attention's autograd Function it keeps the fused block kernels' outputs, never [Tq, Tk] scores.
Both use torch.utils.checkpoint without reentrance, so the backward runs on the original graph: the
parameters, their names and the data-parallel gradient hooks are untouched. Collectives inside a layer
(tensor parallelism's f/g, ring attention's P2P) run again during recomputation, in the same order on
every rank, because every rank recomputes the same layers in the same backward order (selective skips
an all-reduce whose result it already keeps).

Under the zero-bubble schedules (zbh1, zbv: `split`) a backward is B, then W later (weight_grad.py), and
torch's checkpoint would recompute the layer again for each of W's engine runs (selective cannot even
run twice). There a layer is one autograd node instead: its forward keeps only its input (and, selective,
the same matmul outputs), and its backward, which runs in B, recomputes the layer into a graph of its
own, runs B on it and leaves that graph's W on the node. So W recomputes nothing; from B to W the layer
keeps of its rebuilt graph only what W reads (`_Boxes`), and W frees that.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

from tetron.config import Recompute
from tetron.models.spec import spec_of
from tetron.parallel.weight_grad import backward_input, weight_nodes
from tetron.torch_private import is_fake, op_name, tree_leaves

aten = torch.ops.aten


def _ops(names: list[str]) -> frozenset:
    """The `.default` overloads of these aten ops; those a build lacks (CUDA, cuDNN or XPU kernels on a
    CPU build, say) are simply left out."""
    return frozenset(getattr(aten, name).default for name in names
                     if hasattr(aten, name) and hasattr(getattr(aten, name), "default"))


# Matmuls as they reach the dispatcher: F.linear arrives as mm (addmm with a bias), attention's math
# path as bmm; linear itself only where a backend keeps it whole; an MoE layer's experts as _grouped_mm.
MATMUL_OPS = _ops(["mm", "addmm", "bmm", "baddbmm", "linear", "_grouped_mm"])
# Fused attention kernels: their outputs (attention output, log-sum-exp) are O(T), not O(T^2).
ATTENTION_OPS = _ops([
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward", "_efficient_attention_forward",
])


def _storages(tree: Any) -> set[int]:
    """The storages (by address) of the tensors in an op's arguments or outputs. None while torch.compile
    traces (fake tensors have no memory): there collectives are functional, never in place, so the
    policy is by op alone."""
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree)
            if isinstance(t, torch.Tensor) and not is_fake(t) and t.untyped_storage().nbytes()}


class _KeepMatmuls:
    """The selective policy of one call of one layer: keep what matmuls and attention kernels return,
    recompute the rest. One instance per call, as it tracks that call's kept storages."""

    def __init__(self) -> None:
        self.kept: set[int] = set()  # storages of the outputs kept so far
        self.read: set[int] = set()  # kept storages that a recomputed op has read into new memory

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        overwritten = self._overwritten(op, args)
        if overwritten & self.read:
            raise RuntimeError(f"recompute='selective': {op} overwrites a kept matmul output that an earlier "
                               "op read; recomputing that op would read the overwritten value")
        # A matmul costs O(hidden) FLOPs per output element, about a forward pass to redo; the rest is
        # O(1) per element, cheaper to redo than to keep. Not kept: matmuls inside a custom autograd
        # Function's forward (grad mode is off there), which saves what its backward needs itself; ring
        # attention's math blocks would otherwise keep [Tq, Tk] scores that no other mode holds. An
        # in-place collective on a kept output is kept too: the kept tensor already holds its result,
        # so running it again would apply it twice.
        if op in ATTENTION_OPS or (op in MATMUL_OPS and torch.is_grad_enabled()) or overwritten:
            self.kept |= _storages(ctx.op_output)
            return CheckpointPolicy.MUST_SAVE
        self.read |= (_storages(args) & self.kept) - _storages(ctx.op_output)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _overwritten(self, op: Any, args: tuple) -> set[int]:
        """Kept storages that `op` writes in place. c10d's in-place collectives (allreduce_, recv_, ...)
        write their first argument without declaring it in their schema, so torch's own check that kept
        tensors stay unmodified misses them; tensor parallelism all-reduces row-parallel matmul outputs
        in place."""
        if op.namespace != "c10d" or not op_name(op).endswith("_") or not args:
            return set()
        return _storages(args[0]) & self.kept


def _selective_contexts() -> tuple[Any, Any]:
    # A fresh pair per layer call: it holds that call's kept outputs until its backward.
    return create_selective_checkpoint_contexts(_KeepMatmuls())


def _recomputed(forward: Callable[..., torch.Tensor], context_fn: Callable[[], tuple[Any, Any]] | None,
                *args: Any) -> torch.Tensor:
    """`forward(*args)` under non-reentrant checkpointing: the backward runs on the original graph, so
    gradients reach the parameters through their usual AccumulateGrad nodes and hooks."""
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False)
    # Selective: recompute the whole layer. Stopping early (once the needed tensors exist) leaves the
    # outputs kept for later ops unconsumed, and with an in-place collective among them (tp's all-reduce)
    # they form a cycle through the autograd graph that is never freed: every step leaked a layer's worth.
    # (Compiled, the checkpoint is traced into the graph instead, and the switch would break the graph.)
    if torch.compiler.is_compiling():
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn)
    with set_checkpoint_early_stop(False):
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn)


def _nothing_saved(tensor: torch.Tensor) -> None:
    return None


class _SplitRecompute(torch.autograd.Function):
    """One layer as one autograd node for the split backward: forward keeps the input (and, with
    `selective`, the matmul outputs the policy keeps); backward recomputes the layer into a graph of its
    own and runs B there, leaving that graph's W in `ctx.deferred` for weight_grad's W."""

    @staticmethod
    def forward(ctx: Any, forward: Callable[..., torch.Tensor], selective: bool, params: list[nn.Parameter],
                x: torch.Tensor, *args: Any) -> torch.Tensor:
        ctx.forward, ctx.params, ctx.args, ctx.deferred = forward, params, args, []
        ctx.save_for_backward(x)
        # With grad on, as a training forward runs (an MoE block counts its expert load only then; the
        # selective policy sees the matmuls it keeps as in a checkpointed layer); the graph this builds
        # saves nothing and is dropped with it.
        caching, cached = _selective_contexts() if selective else (contextlib.nullcontext(), None)
        ctx.recompute_context = (lambda: cached) if selective else contextlib.nullcontext
        with torch.enable_grad(), saved_tensors_hooks(_nothing_saved, _nothing_saved), caching:
            return forward(x.detach(), *args).detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        leaf = x.detach().requires_grad_()
        saved = _Boxes()
        with torch.enable_grad(), ctx.recompute_context(), saved_tensors_hooks(saved.pack, saved.unpack):
            out = ctx.forward(leaf, *ctx.args)
        dx, pending = backward_input(out, grad, leaf, ctx.params)
        saved.keep_only(weight_nodes(pending))
        ctx.deferred.append(pending)
        return (None, None, None, dx) + (None,) * len(ctx.args)


class _Boxes:
    """What a rebuilt layer's graph saves, each tensor in a box of its own, so that once B has run, the
    boxes of every node that W will not run can be emptied: from B to W a layer then holds only what its
    weight gradients read (each matmul's input, each norm's normalized input), not all its activations."""

    def __init__(self) -> None:
        self.boxes: list[list] = []
        self.read: list[list] | None = None  # while finding what W reads: the boxes unpacked

    def pack(self, tensor: torch.Tensor) -> list:
        box = [tensor]
        self.boxes.append(box)
        return box

    def unpack(self, box: list) -> torch.Tensor:
        if self.read is not None:
            self.read.append(box)
        if box[0] is None:
            raise RuntimeError("a recomputed layer's W read a tensor that only its B was to use")
        return box[0]

    def keep_only(self, nodes: set | None) -> None:
        """Empty the boxes that none of `nodes` (None: all nodes) reads. Reading each node's saved tensors
        (`_saved_*` of autograd's nodes, `saved_tensors` of a custom Function's) unpacks their boxes."""
        if nodes is None:
            return
        self.read = []
        for node in nodes:
            for name in dir(node):
                if name.startswith("_saved_") or name == "saved_tensors":
                    getattr(node, name)
        kept = {id(box) for box in self.read}
        for box in self.boxes:
            if id(box) not in kept:
                box[0] = None
        self.boxes, self.read = [], None


def _split_recomputed(forward: Callable[..., torch.Tensor], selective: bool, params: list[nn.Parameter],
                      x: torch.Tensor, *args: Any) -> torch.Tensor:
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward to split (evaluation)
        return forward(x, *args)
    return _SplitRecompute.apply(forward, selective, params, x, *args)


def apply_recompute(model: nn.Module, mode: Recompute, *, split: bool = False) -> nn.Module:
    """Make every decoder layer this chunk holds recompute its activations in the backward pass, in place;
    `split`: for a backward run as B and W (the zero-bubble schedules), see above.

    Each layer's `forward` is replaced on the instance, not wrapped in a new module, so parameter names
    and state-dict keys stay Hugging Face's. Layers a pipeline stage dropped are simply not there."""
    if mode == "none":
        return model
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute={mode!r} must be 'none', 'selective' or 'full'")
    context_fn = _selective_contexts if mode == "selective" else None
    for layer in spec_of(model.config).plan.layers_of(model).values():
        if split:
            params = [p for p in layer.parameters() if p.requires_grad]
            layer.forward = functools.partial(_split_recomputed, layer.forward, mode == "selective", params)
        else:
            layer.forward = functools.partial(_recomputed, layer.forward, context_fn)
    return model
