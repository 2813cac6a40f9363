"""What an optimizer declares and does, apart from how its work is spread over ranks (parallel/zero.py).

An optimizer is handed this rank's tensors to update (`Param`s: a parameter, its fp32 master weights, or a
flat ZeRO piece of those), each with the role of the parameter it belongs to, which the family's parallel
plan tells (a matrix, a vector, the token embedding, the head). It declares, as class attributes:

- `state`: the tensors it keeps per parameter (`StateSpec`: a name, a dtype; each shaped like the parameter,
  element by element, so ZeRO can cut it where it cuts the parameter). Checkpoints store them as
  "{parameter}.{name}", so the names are the checkpoint's: AdamW's `exp_avg`, `exp_avg_sq`. A state may
  belong to some roles only (`StateSpec.roles`: Muon's momentum on matrices, AdamW's moments on the rest): a
  parameter's checkpoint holds the names of its role (`state_names(role)`).
- `tensor_bytes`: what it keeps per tensor besides (AdamW's step counter: 4 bytes), for the planner; only for
  tensors of `tensor_roles` (Muon: those AdamW updates).
- `needs_whole_matrices`: whether its step needs each matrix whole on one rank (Muon's Newton-Schulz
  iteration on a 2-D update). ZeRO then keeps every parameter of its `whole_roles` (Muon: matrices) whole in
  the slice of one owner rank, in buckets of their own (the others' are cut anywhere), so each such tensor it
  gets is a whole parameter, flat: `Param.shape` says its shape. Tensor parallelism still splits matrices:
  `Param.split` says how (its group, dim, this rank's part); an optimizer that gathers those parts itself
  declares `gathers_tp_splits`, and validate.py refuses tp > 1 for one that needs whole matrices and does not.

and implements `step` on its local tensors, reading their `.grad`: where the device scalar `found_inf` is 1
nothing may change (no update, no state decay), so that a non-finite step is skipped alike on every rank.
`TorchOptimizer` adapts any `torch.optim.Optimizer` to this (AdamW, and a test's SGD, are a few lines each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.config import OptimConfig, TrainConfig

Role = Literal["matrix", "vector", "embedding", "head", "router"]
ROLES: tuple[Role, ...] = ("matrix", "vector", "embedding", "head", "router")


@dataclass(frozen=True)
class StateSpec:
    """One tensor an optimizer keeps per parameter, shaped like the parameter."""

    name: str  # its name in checkpoints: "{parameter}.{name}"
    dtype: torch.dtype = torch.float32
    roles: tuple[Role, ...] = ROLES  # the roles of the parameters that keep it


@dataclass(frozen=True)
class TensorSplit:
    """Tensor parallelism's cut of a parameter: part `index` of `count` equal parts along `dim`, over `group`."""

    group: dist.ProcessGroup
    dim: int
    index: int
    count: int


@dataclass
class Param:
    """A tensor an optimizer updates (its `.grad` set by the caller before each step) and what it is."""

    tensor: nn.Parameter  # the parameter itself, its fp32 master copy, or this rank's flat piece of that
    role: Role  # of the whole parameter: "matrix" (any other weight of 2+ dims), "vector" (norms, biases),
    # "embedding" (the token embedding), "head" (the output projection), "router" (an MoE layer's router)
    shape: torch.Size  # the (tensor-parallel local) parameter's shape; a ZeRO piece is a flat part of it
    split: TensorSplit | None = None  # how tensor parallelism cuts the parameter; None: whole on this rank


class Optimizer:
    """The interface parallel/zero.py drives; subclasses declare `name`, `state` and implement the methods."""

    name: ClassVar[str]
    state: ClassVar[tuple[StateSpec, ...]]
    tensor_bytes: ClassVar[int] = 0
    tensor_roles: ClassVar[tuple[Role, ...]] = ROLES  # the roles whose tensors keep tensor_bytes
    needs_whole_matrices: ClassVar[bool] = False
    whole_roles: ClassVar[tuple[Role, ...]] = ROLES  # with needs_whole_matrices: the roles it needs whole
    gathers_tp_splits: ClassVar[bool] = False

    def __init__(self, params: list[Param], train: TrainConfig, optim: OptimConfig | None = None) -> None:
        self.params = params

    @classmethod
    def state_names(cls, role: Role | None = None) -> tuple[str, ...]:
        """The declared state's names: all of them, or those a parameter of `role` keeps."""
        return tuple(spec.name for spec in cls.state if role is None or role in spec.roles)

    @classmethod
    def whole(cls, role: Role) -> bool:
        """Whether ZeRO must keep a parameter of `role` whole on one rank for this optimizer."""
        return cls.needs_whole_matrices and role in cls.whole_roles

    @classmethod
    def state_bytes(cls, role: Role | None = None) -> int:
        """Bytes of state per element of a parameter (of `role`; None: the most any role keeps)."""
        roles = ROLES if role is None else (role,)
        return max(sum(spec.dtype.itemsize for spec in cls.state if r in spec.roles) for r in roles)

    def set_lr(self, lr: float) -> None:
        raise NotImplementedError

    def step(self, found_inf: Tensor | None = None) -> None:
        raise NotImplementedError

    def state_tensor(self, tensor: nn.Parameter, name: str) -> Tensor:
        """State `name` of one of the tensors it updates (after its first step, or a load)."""
        raise NotImplementedError

    def load_state(self, tensor: nn.Parameter, values: dict[str, Tensor], *, step: float) -> None:
        """Set the state of `tensor` (one value per name its role keeps, shaped like it) as after `step` steps."""
        raise NotImplementedError

    def tensors(self) -> list[Tensor]:
        """Every tensor it holds (its state, and the tensors it updates), for memory accounting."""
        raise NotImplementedError


class TorchOptimizer(Optimizer):
    """An Optimizer over one `torch.optim.Optimizer` (`inner`) whose per-parameter state is keyed by the
    declared names. `skips_on_device`: the inner optimizer reads `found_inf` itself (the fused kernels);
    otherwise the host reads it and skips the step."""

    def __init__(self, params: list[Param], train: TrainConfig, inner: torch.optim.Optimizer, *,
                 skips_on_device: bool = False) -> None:
        super().__init__(params, train, None)
        self.inner, self.skips_on_device = inner, skips_on_device
        self.param_groups = inner.param_groups

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def step(self, found_inf: Tensor | None = None) -> None:
        if found_inf is not None and not self.skips_on_device:
            if not bool(found_inf):  # the host waits for the device's word
                self.inner.step()
            return
        self.inner.found_inf = found_inf  # read by the fused kernels, which skip when it is 1
        self.inner.step()
        self.inner.found_inf = None

    def state_tensor(self, tensor: nn.Parameter, name: str) -> Tensor:
        return self.inner.state[tensor][name]

    def load_state(self, tensor: nn.Parameter, values: dict[str, Tensor], *, step: float) -> None:
        self.inner.state[tensor] = {name: values[name].clone().view_as(tensor) for name in self.state_names()}

    def tensors(self) -> list[Tensor]:
        found = [t for state in self.inner.state.values() for t in state.values() if isinstance(t, Tensor)]
        return found + [p for group in self.inner.param_groups for p in group["params"]]
