"""Activation recomputation: keep less of each decoder layer's forward, redo it in the backward pass.

Between a layer's forward and its backward, autograd holds what the backward needs: for a Llama layer
well over a dozen tensors the size of its input (norms in fp32, q/k/v before and after RoPE, the MLP's
gate, up and their product). Recomputation trades compute for that memory, one decoder layer at a time:
- "full": a layer keeps only its input; its whole forward runs again when its backward begins
  (about one more forward pass per step, the least memory).
- "selective" (Korthikanti et al. 2022): a layer keeps what "none" keeps except the attention kernel's own
  saved tensors (its log-sum-exp, whatever a kernel saves besides its output); the backward runs the kernel
  again from q, k and v (models/core_recompute.py). The activation function needs nothing: models/fused.py's
  gated MLP keeps gate and up only under every mode. Under ring attention the ring's forward runs again (its P2P
  too), dropping its output and log-sum-exp.
"full" uses torch.utils.checkpoint without reentrance, so the backward runs on the original graph: the
parameters, their names and the data-parallel gradient hooks are untouched. Collectives inside a layer
(tensor parallelism's f/g, ring attention's P2P) run again during recomputation, in the same order on
every rank, because every rank recomputes the same layers in the same backward order.

Under the zero-bubble schedules (zbh1, zbv: `split`) a backward is B, then W later (weight_grad.py), and
torch's checkpoint would recompute the layer again for each of W's engine runs. There a layer is one
autograd node instead under "full": its forward keeps only its input, and its backward, which runs in B,
recomputes the layer into a graph of its own, runs B on it and leaves that graph's W on the node. So W
recomputes nothing; from B to W the layer keeps of its rebuilt graph only what W reads (`_Boxes`), and W
frees that.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint

from tetron.config import Recompute
from tetron.models import core_recompute
from tetron.models.spec import spec_of
from tetron.parallel.weight_grad import backward_input, weight_nodes


def _recomputed(forward: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`forward(*args)` under non-reentrant checkpointing: the backward runs on the original graph, so
    gradients reach the parameters through their usual AccumulateGrad nodes and hooks."""
    return checkpoint(forward, *args, use_reentrant=False)


def _nothing_saved(tensor: torch.Tensor) -> None:
    return None


class _SplitRecompute(torch.autograd.Function):
    """One layer as one autograd node for the split backward: forward keeps the input; backward recomputes
    the layer into a graph of its own and runs B there, leaving that graph's W in `ctx.deferred` for weight_grad's W."""

    @staticmethod
    def forward(ctx: Any, forward: Callable[..., torch.Tensor], params: list[nn.Parameter], x: torch.Tensor,
                *args: Any) -> torch.Tensor:
        ctx.forward, ctx.params, ctx.args, ctx.deferred = forward, params, args, []
        ctx.save_for_backward(x)
        # With grad on, as a training forward runs (an MoE block counts its expert load only then); the graph
        # this builds saves nothing and is dropped with it.
        with torch.enable_grad(), saved_tensors_hooks(_nothing_saved, _nothing_saved):
            return forward(x.detach(), *args).detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        leaf = x.detach().requires_grad_()
        saved = _Boxes()
        with torch.enable_grad(), saved_tensors_hooks(saved.pack, saved.unpack):
            out = ctx.forward(leaf, *ctx.args)
        dx, pending = backward_input(out, grad, leaf, ctx.params)
        saved.keep_only(weight_nodes(pending))
        ctx.deferred.append(pending)
        return (None, None, dx) + (None,) * len(ctx.args)


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


def _split_recomputed(forward: Callable[..., torch.Tensor], params: list[nn.Parameter],
                      x: torch.Tensor, *args: Any) -> torch.Tensor:
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward to split (evaluation)
        return forward(x, *args)
    return _SplitRecompute.apply(forward, params, x, *args)


def apply_recompute(model: nn.Module, mode: Recompute, *, split: bool = False) -> nn.Module:
    """Make every decoder layer this chunk holds recompute its activations in the backward pass, in place;
    `split`: for a backward run as B and W (the zero-bubble schedules), see above.

    Each layer's `forward` is replaced on the instance, not wrapped in a new module, so parameter names
    and state-dict keys stay Hugging Face's. Layers a pipeline stage dropped are simply not there."""
    if mode == "none":
        return model
    if mode not in ("selective", "full"):
        raise ValueError(f"recompute={mode!r} must be 'none', 'selective' or 'full'")
    for layer in spec_of(model.config).plan.layers_of(model).values():
        recompute_layer(layer, mode, split=split)
    return model


def recompute_layer(layer: nn.Module, mode: Recompute, *, split: bool = False) -> None:
    """One decoder layer's forward under `mode`, set on the instance (apply_recompute's step for each layer; the
    planner's probe, plan/probe.py, switches one layer between modes): "none" gives it its class's forward back."""
    layer.__dict__.pop("forward", None)
    if mode == "selective":  # the same under a split backward: no layer-wide node to split
        layer.forward = functools.partial(core_recompute.within, layer.forward)
    elif mode == "full" and split:
        params = [p for p in layer.parameters() if p.requires_grad]
        layer.forward = functools.partial(_split_recomputed, layer.forward, params)
    elif mode == "full":
        layer.forward = functools.partial(_recomputed, layer.forward)
