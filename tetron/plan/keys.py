"""What the planner's per-layout work is cached by. A search predicts tens of thousands of layouts that differ in one
axis at a time: the layouts that differ only in how ZeRO holds the state (its stage, accumulation, shard group, the
data-parallel buckets) run the same micro-batches through the same schedule, so what a micro-batch keeps and how long
it takes are computed once for all of them (plan/walk.py's walk, steptime's chunk costs and pipeline span).

A key holds every field of every section of the config but those (STATE_FIELDS), so a field added later counts
unless it is named there; the model section as its repr, made once per config object (`model_repr`).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

from tetron.config import Config

# parallel's fields that say how data parallelism holds and reduces the persistent state (plan/state.py), not what a
# micro-batch computes, keeps or sends
STATE_FIELDS = frozenset({"zero", "zero_accumulate", "dp_shard", "dp_impl", "bucket_mb", "reduce_dtype"})


class PerObject:
    """What `make(obj)` returns, made once per object (configs are not hashable: kept by id). The object is held, so
    its id is not reused while its entry lives; one changed in place after it was asked for is not seen."""

    def __init__(self, size: int = 1024) -> None:
        self.size, self.found = size, {}

    def get(self, obj: object, make: Callable[[object], Any]) -> Any:
        found = self.found.get(id(obj))
        if found is None or found[0] is not obj:
            if len(self.found) > self.size:
                self.found.clear()
            found = self.found[id(obj)] = (obj, make(obj))
        return found[1]


_REPRS = PerObject()


def model_repr(model: object) -> str:
    """The model config's repr (a dataclass's names every field), made once per config object: a search shares its
    base's between its layouts, and making it took longer than the walk a key saves."""
    return _REPRS.get(model, repr)


_GETTERS: dict[tuple[type, frozenset], Callable[[object], tuple]] = {}


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def values(section: object, skip: frozenset = frozenset()) -> tuple:
    """The section's fields but `skip`, in order (a search builds a key per layout: one attrgetter call)."""
    key = (type(section), skip)
    if key not in _GETTERS:
        _GETTERS[key] = operator.attrgetter(*[f.name for f in dataclasses.fields(section) if f.name not in skip])
    found = _GETTERS[key](section)
    try:
        hash(found)
    except TypeError:  # a list or a dict among them
        return tuple(_frozen(v) if type(v) in (list, dict) else v for v in found)
    return found


def micro_batch_key(cfg: Config) -> tuple:
    """`cfg` but for how ZeRO holds the state: equal for layouts whose micro-batches run, keep and send alike."""
    return (model_repr(cfg.model), values(cfg.parallel, STATE_FIELDS), values(cfg.train), values(cfg.data),
            values(cfg.optim), values(cfg.checkpoint), values(cfg.logging), cfg.out)


class Memo:
    """A dict of results by key, emptied when it grows past `size` entries (a search's working set stays well
    under; a long-lived process does not grow without bound)."""

    def __init__(self, size: int = 65536) -> None:
        self.size, self.found = size, {}

    def get(self, key: tuple, compute):
        found = self.found.get(key)
        if found is None:
            if len(self.found) >= self.size:
                self.found.clear()
            found = self.found[key] = compute()
        return found
