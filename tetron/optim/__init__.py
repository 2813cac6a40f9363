"""Optimizers, apart from how ZeRO spreads their work (parallel/zero.py shards whatever state they declare).

    base.py    what an optimizer declares (parameter roles, state tensors, whether it needs whole matrices)
               and does (its step on this rank's tensors); TorchOptimizer adapts a torch.optim optimizer
    adamw.py   AdamW, the default
    muon.py    Muon on the hidden matrices (whole, in every layout), AdamW on the rest

`optim.name` picks one from OPTIMIZERS; adding an optimizer is one module here and one entry (a test may add
its own entry to the dict). Imports only config and the layers below it.
"""

from tetron.optim.adamw import AdamW
from tetron.optim.base import ROLES, Optimizer, Param, Role, StateSpec, TensorSplit, TorchOptimizer
from tetron.optim.muon import Muon

OPTIMIZERS: dict[str, type[Optimizer]] = {AdamW.name: AdamW, Muon.name: Muon}  # optim.name -> class


def optimizer_class(name: str) -> type[Optimizer]:
    """The optimizer `optim.name` names, or a ValueError listing the known ones."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not a known optimizer; use one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[name]


__all__ = ["AdamW", "Muon", "OPTIMIZERS", "Optimizer", "Param", "ROLES", "Role", "StateSpec", "TensorSplit",
           "TorchOptimizer", "optimizer_class"]
