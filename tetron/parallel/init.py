"""Layout-independent initialisation: each full tensor comes from a seed derived from the run seed
and the parameter's name, and every rank copies in only its own slice of it.

So a parameter starts bit-identical whether it is whole on one rank or split over eight, which is
what lets every parallel layout be compared with a single-process run. How each tensor starts (normal, ones,
zeros) is the family's own choice (ModelSpec.init, by the module of the plain model that holds it), asked of
the plain model built on the meta device, since the model here may already hold tensor-parallel modules.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from tetron.models.blocks import init_by_type, standard_init
from tetron.models.spec import FAMILIES, Init, spec_of
from tetron.parallel.layout import full_shape, layout_of, local_slice


def name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from the run seed and a parameter name (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def full_tensor(name: str, shape: tuple[int, ...], *, seed: int, std: float = 0.0,
                init: Init | None = None) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`, as `init` says (None: N(0, std))."""
    init = init or Init("normal", std)
    if init.kind == "ones":
        return torch.ones(shape)
    if init.kind == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, init.std, generator=generator)


def init_rules(model: nn.Module, *, std: float | None = None) -> dict[str, Init]:
    """How each parameter of `model`'s plain form starts, by name. A model of a family (its `.config` names
    one) asks the family's init of each module of a plain copy built on meta; any other module its own
    modules by type (models/blocks.py's init_by_type with `std`)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in FAMILIES:
        spec = spec_of(config)
        init = spec.init or standard_init
        with torch.device("meta"):
            plain = spec.model_class(config)
        return {f"{prefix}.{name}" if prefix else name: init(module, name, config)
                for prefix, module in plain.named_modules()
                for name, _ in module.named_parameters(recurse=False)}
    if std is None:
        raise ValueError("a module of no model family needs the std of its normal init")
    return {f"{prefix}.{name}" if prefix else name: init_by_type(module, name, std=std)
            for prefix, module in model.named_modules()
            for name, _ in module.named_parameters(recurse=False)}


def materialize_(model: nn.Module, device: torch.device, *, hollow: bool = False) -> None:
    """Give a model built on the meta device real, uninitialised storage on `device`.

    Unlike `Module.to_empty`, this keeps each Parameter's attributes (its layout) and keeps
    tied parameters tied: one new Parameter per old one, wherever it is registered. Buffers start at zero.
    `hollow`: each parameter's storage is released as soon as it is made (see Hollow)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        # each registration of a parameter (a tied one is registered twice), replaced where it is registered
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) not in new:
                fresh = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                if hollow:
                    fresh.untyped_storage().resize_(0)
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
def init_weights_(model: nn.Module, *, seed: int, std: float | None = None) -> None:
    """Fill every parameter of `model` (named as in the plain, unwrapped model) from its full tensor, started
    as init_rules says (`std`: the normal init's of a module of no family; a family's init reads its config).

    A parameter whose layout names a `source` starts from that tensor: a pipeline's last stage holds its
    own copy of a tied embedding as `lm_head.weight`, initialised as `model.embed_tokens.weight`."""
    rules = init_rules(model, std=std)
    for name, param in model.named_parameters():
        _seeded_(param, name, rules, seed)


def _seeded_(param: nn.Parameter, name: str, rules: dict[str, Init], seed: int) -> None:
    """`param` (named `name`) filled with its slice of its full tensor, or of its layout's `source`'s."""
    source = layout_of(param).source or name
    param.copy_(local_slice(param, full_tensor(source, full_shape(param), seed=seed, init=rules[source])))


class Hollow:
    """A chunk's parameters, materialized hollow (`materialize_(hollow=True)`: real tensors on the device whose
    storage holds nothing), given their storage and their seeded values a few at a time (`fill`), as ZeRO
    shards them (zero.py: one bucket after another; under ZeRO-3 a bucket is a unit). Made whole at once, in fp32,
    before any sharding, they were the most a ZeRO-3 rank ever held: 27 GiB for llama-7b on dp32, a step's 19.5."""

    def __init__(self, chunk: nn.Module, *, seed: int) -> None:
        self.rules, self.seed = init_rules(chunk), seed
        self.names = {id(p): name for name, p in chunk.named_parameters()}  # the first of a tied one's names
        self.pending = {id(p): p for p in chunk.parameters()}

    @torch.no_grad()
    def fill(self, params: list[nn.Parameter]) -> None:
        """Storage and values for those of `params` still hollow (others, and another chunk's, are left)."""
        for param in params:
            if self.pending.pop(id(param), None) is None:
                continue
            param.untyped_storage().resize_(param.numel() * param.element_size())
            _seeded_(param, self.names[id(param)], self.rules, self.seed)  # as init_weights_

    def fill_rest(self) -> None:
        self.fill(list(self.pending.values()))


def seeded_model(config: Any, *, seed: int, device: torch.device) -> nn.Module:
    """The whole model of `config`'s family as a single-process run starts it: built on meta, given storage,
    filled from `seed`."""
    with torch.device("meta"):
        model = spec_of(config).model_class(config)
    materialize_(model, device)
    init_weights_(model, seed=seed)
    return model
