"""Layout-independent initialisation: each full tensor comes from a seed derived from the run seed
and the parameter's name, and every rank copies in only its own slice of it.

So a parameter starts bit-identical whether it is whole on one rank or split over eight, which is
what lets every parallel layout be compared with a single-process run.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from tetron.models.spec import spec_of
from tetron.parallel.layout import full_shape, layout_of, local_slice


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from the run seed and a parameter name (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def full_tensor(name: str, shape: tuple[int, ...], *, seed: int, std: float) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`: ones for norm weights, zeros for biases (as
    transformers initialises both), N(0, std) otherwise."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def materialize_(model: nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device real, uninitialised storage on `device`.

    Unlike `Module.to_empty`, this keeps each Parameter's attributes (its layout) and keeps
    tied parameters tied: one new Parameter per old one, wherever it is registered. Buffers start at zero."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        # each registration of a parameter (a tied one is registered twice), replaced where it is registered
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) not in new:
                fresh = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                # its layout and other attributes; not what a tensor subclass keeps there of its own (a fake
                # tensor's device: the dry run, plan/dry_run.py)
                fresh.__dict__.update({k: v for k, v in param.__dict__.items() if k not in fresh.__dict__})
                new[id(param)] = fresh
            setattr(module, name, new[id(param)])
        # state that is no parameter (an MoE routing bias): zeros, as transformers initialises it
        for name, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if buffer.is_meta:
                setattr(module, name, torch.zeros_like(buffer, device=device))


@torch.no_grad()
def init_weights_(model: nn.Module, *, seed: int, std: float) -> None:
    """Fill every parameter of `model` (named as in the plain, unwrapped model) from its full tensor.

    A parameter whose layout names a `source` starts from that tensor: a pipeline's last stage holds its
    own copy of a tied embedding as `lm_head.weight`, initialised as `model.embed_tokens.weight`."""
    for name, param in model.named_parameters():
        full = full_tensor(layout_of(param).source or name, full_shape(param), seed=seed, std=std)
        param.copy_(local_slice(param, full))


def seeded_model(config: Any, *, seed: int, device: torch.device) -> nn.Module:
    """The whole model of `config`'s family as a single-process run starts it: built on meta, given storage,
    filled from `seed`."""
    with torch.device("meta"):
        model = spec_of(config).model_class(config)
    materialize_(model, device)
    init_weights_(model, seed=seed, std=config.initializer_range)
    return model
