"""How a parameter is laid out over the mesh: one typed record per parameter, set once, read everywhere.

A parallel strategy that changes what a rank holds of a tensor says so here, and everything that
needs the whole tensor (init, checkpoints, gradient-norm clipping, gradient syncs) asks here:

- `tp`: the parameter is one of `count` equal parts of the full tensor along `dim` (tensor
  parallelism), this rank's being part `index`; `logical_size` is the full size along `dim` before
  the padding that makes it divisible (a vocabulary that tp does not divide).
- `summed_over_tp`: replicated over tp, but each tp rank's gradient is only a share of the whole, so
  gradients are summed over tp: RMSNorm weights under sequence parallelism (each rank saw its share of
  the sequence), per-head norms (Qwen3's q_norm, k_norm: each rank saw its heads).
- `tied_copy`: this rank's own copy of a tensor another pipeline stage also holds (the last stage's
  head when embeddings are tied): its gradient is summed with the other copy's, and it is left out
  of the gradient norm, which counts the first stage's.
- `ep`: one of `count` equal parts of an MoE layer's fused expert tensor along dim 0 (its experts), over
  the expert-parallel group (expert parallelism); its gradient is averaged over the `edp` group (the
  ranks holding the same experts), not over dp*cp.
- `source`: the name of the tensor it starts from and is loaded from, where that is not its own
  name (that same tied head: `model.embed_tokens.weight`).

A sharding along another axis (ZeRO over dp) is one more field of the same `Shard` type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

_ATTR = "_tetron_layout"  # the one attribute tetron sets on a Parameter; read only through layout_of


@dataclass(frozen=True)
class Shard:
    """Part `index` of `count` equal parts of the full tensor along `dim`, over mesh axis `axis`."""

    axis: str
    dim: int
    index: int
    count: int
    logical_size: int | None = None  # the full size along `dim` before padding; None: count * local size


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter's values come from and how its gradient is finished; see the module doc."""

    tp: Shard | None = None
    summed_over_tp: bool = False
    tied_copy: bool = False
    source: str | None = None
    ep: Shard | None = None

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the whole (unpadded) tensor of which a local part shaped `local_shape` is one."""
        shape = list(local_shape)
        if self.tp is not None:
            shape[self.tp.dim] = self.tp.logical_size or shape[self.tp.dim] * self.tp.count
        if self.ep is not None:
            shape[self.ep.dim] *= self.ep.count
        return tuple(shape)


_REPLICATED = ParamLayout()


def layout_of(param: Tensor) -> ParamLayout:
    """The layout of `param`: the one set with set_layout, else replicated and named as itself."""
    return getattr(param, _ATTR, _REPLICATED)


def set_layout(param: nn.Parameter, *, inherit: Tensor | None = None, **fields: Any) -> None:
    """Record `param`'s layout: `inherit`'s (the parameter it replaces; default replicated) with `fields`
    changed. Set once: a parameter whose layout changes is a new Parameter."""
    if hasattr(param, _ATTR):
        raise RuntimeError(f"parameter {tuple(param.shape)} already has a layout: {layout_of(param)}")
    base = layout_of(inherit) if inherit is not None else _REPLICATED
    setattr(param, _ATTR, dataclasses.replace(base, **fields))


def full_shape(param: Tensor) -> tuple[int, ...]:
    """The shape of the whole (unpadded) tensor of which `param` holds a part."""
    return layout_of(param).full_shape(tuple(param.shape))


def local_slice(param: Tensor, full: Tensor) -> Tensor:
    """This rank's part of the whole tensor `full`: its tp shard, padded rows (past the logical size)
    as zeros; or its experts."""
    experts = layout_of(param).ep
    if experts is not None:
        return full.chunk(experts.count, dim=experts.dim)[experts.index]
    shard = layout_of(param).tp
    if shard is None:
        return full
    padded = param.shape[shard.dim] * shard.count
    if full.shape[shard.dim] < padded:
        pad = [0, 0] * (full.dim() - 1 - shard.dim) + [0, padded - full.shape[shard.dim]]
        full = torch.nn.functional.pad(full, pad)
    return full.chunk(shard.count, dim=shard.dim)[shard.index]
