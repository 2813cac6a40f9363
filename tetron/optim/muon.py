"""Muon (Keller Jordan; Moonlight's split): momentum orthogonalised by a Newton-Schulz iteration on the hidden
matrices, AdamW on the rest. Equal to `torch.optim.Muon` plus torch's AdamW in one process.

Which parameters. Every weight of the `matrix` role (the decoder layers' projections; an MoE layer's fused
expert tensor [E, rows, cols] is E matrices, each orthogonalised on its own); AdamW (tetron's, train.lr,
weight_decay, beta1/2, eps) for the token embedding, the head, norms, biases, sinks and routers.

The update of a matrix W [A, B] with gradient G, momentum mu (optim.muon_momentum), as torch computes it:
    buf <- lerp(buf, G, 1 - mu)                       (the momentum, fp32, kept per element: `momentum_buffer`)
    U   <- lerp(G, buf, mu) if nesterov else buf
    O   <- NS(U)    (U / max(|U|_F, eps), then ns_steps of X <- aX + (bXX^T + c(XX^T)^2)X on the wide side, in bf16
                     as torch, or in fp32: optim.muon_ns_dtype)
    W   <- W (1 - lr * weight_decay) - lr * ratio * O,   ratio = 0.2 sqrt(max(A, B)) (match_rms_adamw)
                                                                  or sqrt(max(1, A / B)) (original)

In every layout. Everything but NS is element by element, so it runs on whatever part of W a rank holds. NS
needs the whole matrix: ZeRO keeps each matrix whole on one owner rank (`needs_whole_matrices`); tensor
parallelism cuts matrices by rows or columns (`Param.split`), so each tp rank all-gathers the others' parts of
U, orthogonalises the whole matrix (every tp rank the same, exactly) and keeps its own part of O; an expert's
matrices are whole on the rank that holds the expert.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.config import OptimConfig, TrainConfig
from tetron.optim.adamw import AdamW
from tetron.optim.base import Optimizer, Param, StateSpec

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # its 2.13 name
ADAMW_ROLES = ("vector", "embedding", "head", "router")  # what AdamW updates (Moonlight's split)


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The quintic Newton-Schulz iteration toward the orthogonal factor of a 2-D `update`, in `dtype`; op for op
    torch.optim.Muon's (in bf16, its bits are torch's)."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # iterate on the wide side: the Gram matrix is the smaller one
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_ratio(adjust: str, rows: int, cols: int) -> float:
    """Muon's learning rate per matrix, as a multiple of train.lr."""
    return 0.2 * math.sqrt(max(rows, cols)) if adjust == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols))


class Muon(Optimizer):
    name = "muon"
    state = (StateSpec("momentum_buffer", roles=("matrix",)),  # torch.optim.Muon's name
             StateSpec("exp_avg", roles=ADAMW_ROLES), StateSpec("exp_avg_sq", roles=ADAMW_ROLES))
    tensor_bytes = 4  # AdamW's step counter per tensor
    tensor_roles = ADAMW_ROLES
    needs_whole_matrices = True
    whole_roles = ("matrix",)  # AdamW's parameters are cut by ZeRO anywhere, as under optim.name=adamw
    gathers_tp_splits = True

    def __init__(self, params: list[Param], train: TrainConfig, optim: OptimConfig | None = None) -> None:
        super().__init__(params, train, optim)
        o = optim or OptimConfig()
        self.matrices = [p for p in params if p.role == "matrix"]
        self.adamw = AdamW([p for p in params if p.role != "matrix"], train)
        self.lr, self.weight_decay = train.lr, train.weight_decay
        self.momentum, self.nesterov, self.adjust = o.muon_momentum, o.muon_nesterov, o.muon_adjust_lr
        self.ns = (tuple(o.muon_ns_coefficients), o.muon_ns_steps, o.muon_eps, getattr(torch, o.muon_ns_dtype))
        self.buffers: dict[Tensor, Tensor] = {}  # momentum_buffer, by the tensor it belongs to

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        self.adamw.set_lr(lr)

    @torch.no_grad()
    def step(self, found_inf: Tensor | None = None) -> None:
        """One step; where the device scalar `found_inf` is 1, nothing changes. The host never waits for it: the
        new values are computed aside and taken where it is 0 (one matrix at a time), as the fused AdamW skips."""
        self.adamw.step(found_inf)
        skip = found_inf > 0 if found_inf is not None else None
        for p in self.matrices:
            grad = p.tensor.grad
            if grad is None:
                continue
            buf = self.buffers.get(p.tensor)
            if buf is None:  # the first step (or a fresh optimizer state): torch's starts at zero too
                buf = self.buffers[p.tensor] = torch.zeros_like(p.tensor)
            grad = grad.view_as(buf)
            new_buf = buf.lerp_(grad, 1 - self.momentum) if skip is None else buf.lerp(grad, 1 - self.momentum)
            update = grad.lerp(new_buf, self.momentum) if self.nesterov else new_buf
            ortho = self._orthogonalised(update.view(p.shape), p)
            weight = p.tensor.view(p.shape)
            new = weight.mul_(1 - self.lr * self.weight_decay) if skip is None else weight * (
                1 - self.lr * self.weight_decay)
            rows, cols = self._matrix_shape(p)
            new.add_(ortho, alpha=-self.lr * lr_ratio(self.adjust, rows, cols))
            if skip is not None:  # the same arithmetic as in place, kept where the step is not skipped
                weight.copy_(torch.where(skip, weight, new))
                buf.copy_(torch.where(skip, buf, new_buf))

    @staticmethod
    def _matrix_shape(p: Param) -> tuple[int, int]:
        """The whole matrix's [rows, cols] (tensor parallelism's parts put together)."""
        shape = list(p.shape)
        if p.split is not None:
            shape[p.split.dim] *= p.split.count
        return shape[-2], shape[-1]

    def _orthogonalised(self, update: Tensor, p: Param) -> Tensor:
        """NS of each matrix of `update` ([rows, cols], or [E, rows, cols]: one per expert), whole: gathered over
        tensor parallelism where it is cut, this rank's part of the result kept."""
        split = p.split
        if split is not None and split.count > 1:
            parts = torch.empty(split.count * update.numel(), dtype=update.dtype, device=update.device)
            all_gather_flat(parts, update.reshape(-1), group=split.group)
            update = torch.cat(list(parts.view(split.count, *update.shape).unbind(0)), dim=split.dim)
        if update.dim() == 2:
            ortho = newton_schulz(update, *self.ns)
        else:
            ortho = torch.stack([newton_schulz(m, *self.ns) for m in update.reshape(-1, *update.shape[-2:])])
            ortho = ortho.view(update.shape)
        if split is not None and split.count > 1:
            ortho = ortho.chunk(split.count, dim=split.dim)[split.index]
        return ortho

    def state_tensor(self, tensor: nn.Parameter, name: str) -> Tensor:
        if name == "momentum_buffer":
            if tensor not in self.buffers:  # a matrix that has had no gradient yet
                self.buffers[tensor] = torch.zeros_like(tensor)
            return self.buffers[tensor]
        return self.adamw.state_tensor(tensor, name)

    def load_state(self, tensor: nn.Parameter, values: dict[str, Tensor], *, step: float) -> None:
        if "momentum_buffer" in values:
            self.buffers[tensor] = values["momentum_buffer"].clone().view_as(tensor)
        else:
            self.adamw.load_state(tensor, values, step=step)

    def tensors(self) -> list[Tensor]:
        return [*self.buffers.values(), *(p.tensor for p in self.matrices), *self.adamw.tensors()]
