"""Autograd Functions that save only what their backward needs (Korthikanti et al. 2022's accounting).

PyTorch's composite ops save every intermediate their derivative formulas name: an RMSNorm written out keeps
an fp32 copy of its input and the normalised input besides it; act(gate) * up keeps gate, act(gate) and up,
and the down projection keeps their product. These Functions compute the same forward, op for op (so the
outputs are bit-identical to the composite ones), and keep less:
- `rms_norm`: the input as it comes (the compute dtype) and one fp32 1/rms per row; the backward recomputes the
  normalised input from them (one multiply).
- `gated_linear`: down(act(gate) * up) keeps gate and up only; the backward recomputes the product (for the
  down projection's weight gradient and act's derivative), by the same ops autograd would differentiate.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tetron.torch_private import engine_runs


def wanted(ctx: Any, present: tuple[bool, ...]) -> tuple[bool, ...]:
    """Per leading input of a Function (`present`: which of them are tensors, not None), in its backward: whether
    this engine run wants its gradient. A backward split into B and W (parallel/weight_grad.py) runs the node
    twice, for the input's gradient, then for the weight's, and W may run where the weights are released
    (ZeRO-3): a gradient not wanted is neither computed nor read from. A plain backward wants every input that
    needs one. A parameter's gradient counts as wanted (torch_private.engine_runs cannot ask about a leaf), so B
    computes a weight gradient it then drops (a norm's; the down projection's: one matmul); W never computes an
    input's gradient, the one that reads the weights, as data inputs are never leaves (`_not_leaf`). The node's
    edges are its tensor inputs', in order."""
    if torch.compiler.is_compiling():  # traced, the node is not the engine's (and a split backward is refused)
        return tuple(ctx.needs_input_grad[:len(present)])
    edges = iter(ctx.next_functions)
    nodes = [next(edges)[0] if here else None for here in present]
    return tuple(need and node is not None and engine_runs(node) for need, node in zip(ctx.needs_input_grad, nodes))


def _rstd(x: Tensor, eps: float) -> Tensor:
    """1 / rms over the last dim, in fp32 ([..., 1]): transformers' and F.rms_norm's order of operations."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def _scaled(xhat: Tensor, x: Tensor, weight: Tensor, unit_offset: bool) -> Tensor:
    """The norm's output from the normalised fp32 input, with each variant's casts where RMSNorm has them."""
    if unit_offset:  # Gemma: (1 + weight) multiplied in fp32, then cast
        return (xhat * (1.0 + weight.float())).type_as(x)
    if x.dtype == torch.float32:  # F.rms_norm's composite: x * rstd, then the weight
        return xhat * weight
    return weight * xhat.to(x.dtype)  # Llama: cast back before the weight


class _RMSNorm(torch.autograd.Function):
    """y = xhat * w (or (1 + w)), xhat = x / rms(x); saves x and 1/rms ([..., 1] fp32), nothing else."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> Tensor:
        rstd = _rstd(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.unit_offset = unit_offset
        return _scaled(x.float() * rstd, x, weight, unit_offset)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple:
        x, weight, rstd = ctx.saved_tensors
        want_x, want_w = wanted(ctx, (True, True))
        xhat = x.float() * rstd  # [..., h] fp32
        dy = dy.float()
        dx = dw = None
        if want_w:
            dw = (dy * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        if want_x:
            dxhat = dy * (weight.float() + 1.0 if ctx.unit_offset else weight.float())
            # d(x * rstd)/dx: rstd * (dxhat - xhat * mean(dxhat * xhat)) over the normalised dim
            dx = (rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None, None


def _not_leaf(x: Tensor) -> Tensor:
    """x, or where it is a leaf (a pipeline stage's received input), a view of it: a node `wanted` can ask about.
    Whether or not it needs a gradient, so that a recomputed forward runs the ops its first run did. Compiled, x
    (Dynamo does not trace grad_fn; a compiled run never splits its backward: validate.py refuses the pair)."""
    if torch.compiler.is_compiling():
        return x
    return x.view_as(x) if x.grad_fn is None else x


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, unit_offset: bool = False) -> Tensor:
    """RMSNorm over x's last dim (models/blocks.py's variants), saving x and one fp32 statistic per row."""
    return _RMSNorm.apply(_not_leaf(x), weight, eps, unit_offset)


class _GatedLinear(torch.autograd.Function):
    """y = (act(gate) * up) @ W.T + b: keeps gate and up (and W, a parameter), never act(gate) nor the product.
    `act` may clamp first, `bound` (None: none) transforms up (gpt-oss's clamps)."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None,
                act: Callable[[Tensor], Tensor], bound: Callable[[Tensor], Tensor] | None) -> Tensor:
        ctx.save_for_backward(gate, up, weight)
        ctx.act, ctx.bound, ctx.has_bias = act, bound, bias is not None
        gate, up = gate.detach(), up.detach()
        # Under grad mode with nothing that requires grad (no graph is built): recompute.py's selective policy
        # keeps the outputs of matmuls that run with grad on, as this one would outside the Function.
        with torch.enable_grad():
            product = act(gate) * (up if bound is None else bound(up))  # [..., inter]
            return F.linear(product, weight.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple:
        gate, up, weight = ctx.saved_tensors
        want_gate, want_up, want_weight, want_bias = wanted(ctx, (True, True, True, ctx.has_bias))
        # The ops autograd would run on the composite, in its order, each temporary freed once used: the
        # backward holds about as much as autograd's did beside its four saved tensors.
        with torch.enable_grad():
            gate_ = gate.detach().requires_grad_()
            activated = ctx.act(gate_)  # [..., inter], a graph back to the gate
            up_ = up.detach().requires_grad_() if ctx.bound is not None else up
            bounded = ctx.bound(up_) if ctx.bound is not None else up
        flat_dy = dy.reshape(-1, dy.shape[-1])  # [tokens, out]
        dweight = dbias = None
        if want_weight:  # as F.linear's backward: (input^T @ grad)^T
            product = activated.detach() * bounded.detach()
            dweight = product.reshape(-1, product.shape[-1]).t().mm(flat_dy).t()
            del product
        if want_bias:
            dbias = flat_dy.sum(0)
        if not (want_gate or want_up):
            return None, None, dweight, dbias, None, None
        dproduct = dy.matmul(weight)  # [..., inter]
        dbounded = dproduct * activated.detach()
        dactivated = dproduct * bounded.detach()
        del dproduct
        (dgate,) = torch.autograd.grad(activated, gate_, dactivated)
        del activated, dactivated
        dup = dbounded if ctx.bound is None else torch.autograd.grad(bounded, up_, dbounded)[0]
        return dgate, dup, dweight, dbias, None, None


def gated_linear(gate: Tensor, up: Tensor, weight: Tensor, bias: Tensor | None, act: Callable[[Tensor], Tensor],
                 bound: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """F.linear(act(gate) * bound(up), weight, bias), saving gate and up only (bound None: up as it is)."""
    return _GatedLinear.apply(_not_leaf(gate), _not_leaf(up), weight, bias, act, bound)
