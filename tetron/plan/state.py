"""What a rank holds from step to step, for the memory model (plan/memory.py): its chunks' parameters as
tetron lays them out (ZeRO-3's units, the gradient buckets), and the bytes of parameters, gradients and
optimizer state under each ZeRO stage."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch

from tetron.config import Config
from tetron.models import family
from tetron.models.moe import Router, moe_blocks
from tetron.optim import ROLES, optimizer_class
from tetron.parallel.data_parallel import owners
from tetron.parallel.pipeline_parallel import split_layers
from tetron.parallel.pipeline_schedules import stage_of, style_of
from tetron.plan.keys import model_repr, values
from tetron.plan.sizes import F32, Sizes, is_moe, moe_layers

# ------------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class Chunk:
    """One model chunk on a rank: its decoder layers (of them `moe` MoE layers), whether it embeds (first)
    or holds the head (last)."""

    layers: int
    first: bool
    last: bool
    moe: int = 0
    mtp: int = 0  # multi-token prediction's modules (the last chunk's): each a decoder layer, counted in `layers`
    # (and `moe`), with its norms, its projection and its cross entropy over the head besides


def rank_chunks(cfg: Config, pp_rank: int) -> list[Chunk]:
    """The chunks pipeline rank `pp_rank` holds, in virtual-stage order (pipeline_parallel.rank_stages)."""
    p, m = cfg.parallel, cfg.model
    kinds = tuple(map(m.is_moe_layer, range(m.num_hidden_layers))) if is_moe(m) else m.num_hidden_layers
    split = tuple(p.pp_split) if p.pp_split is not None else None
    chunks = list(_rank_chunks(kinds, p.pp, p.pp_virtual, split, style_of(p.pp_schedule), pp_rank))
    depth = getattr(m, "num_nextn_predict_layers", 0)
    if depth:  # models/mtp.py: module k holds the decoder layer num_hidden_layers + k - 1 would be
        moe = sum(m.is_moe_layer(m.num_hidden_layers + k) for k in range(depth)) if is_moe(m) else 0
        chunks = [dataclasses.replace(c, layers=c.layers + depth, moe=c.moe + moe, mtp=depth) if c.last else c
                  for c in chunks]
    return chunks


@functools.lru_cache(maxsize=4096)
def _rank_chunks(kinds: tuple[bool, ...] | int, pp: int, virtual: int, split: tuple | None, style: str,
                 pp_rank: int) -> tuple[Chunk, ...]:
    """rank_chunks of a model whose layers are `kinds` (MoE or not; a dense model: their number)."""
    layers = kinds if isinstance(kinds, int) else len(kinds)
    stages = pp * virtual
    ranges = split_layers(layers, stages, list(split) if split is not None else None)
    held = [stage_of(c, pp_rank, pp=pp, style=style) for c in range(virtual)]
    return tuple(Chunk(len(ranges[s]), s == 0, s == stages - 1,
                       0 if isinstance(kinds, int) else sum(kinds[i] for i in ranges[s])) for s in held)


def layer_numels(cfg: Config, *, moe: bool = False, experts: bool = True) -> list[int]:
    """Elements of one decoder layer's parameters on a rank, in `parameters()` order (for Llama: q, k, v, o,
    gate, up, down, each 1/tp, then the two RMSNorm weights, whole); `moe`: of an MoE layer, whose routed
    experts' tensors hold 1/ep of the experts (without them: `experts=False`)."""
    return [n for n, kind, _, _, _ in _layer_params(cfg, moe) if experts or kind != "expert"]


def expert_numels(cfg: Config) -> list[int]:
    """Elements of one MoE layer's routed-expert tensors on a rank (gate_up, down: 1/ep of the experts)."""
    return [n for n, kind, _, _, _ in _layer_params(cfg, True) if kind == "expert"]


def layer_matmul_numels(cfg: Config, *, moe: bool = False, whole: bool | None = None) -> int:
    """Matmul weights one token's forward multiplies by in a decoder layer on a rank: its plan's column- and
    row-parallel linears, and in an MoE layer the router, the shared experts and top_k of the routed experts
    (every rank computes its ep group's tokens' assignments to its experts: top_k experts' worth a token).
    `whole`: only those in the parts the plan keeps whole under tp (True: an MoE model's mlp, which under sp
    sees 1/tp of the tokens) or only the others (False); None: all."""
    m = cfg.model
    dense = sum(n for n, kind, part, _, _ in _layer_params(cfg, moe) if kind == "matmul" and whole in (None, part))
    if not (moe and is_moe(m)) or whole is False:
        return dense
    return dense + sum(expert_numels(cfg)) * cfg.parallel.ep * m.num_experts_per_tok // m.num_experts


_LAYER_PARAMS: dict[tuple[str, int, int, bool], tuple[tuple[int, str, bool, str, tuple], ...]] = {}  # -> below


def _layer_params(cfg: Config, moe: bool = False) -> tuple[tuple[int, str, bool, str, tuple], ...]:
    """(elements on a rank, kind, whether in a part the plan keeps whole under tp, the optimizer's role: "matrix",
    "router" or "vector", as parallelize.param_roles tells; its whole shape, unsplit) of each parameter of one
    decoder layer (dense, or `moe`), read off the family's module built on the meta device and split as its
    parallel plan says (ParallelPlan.tp_dim) and, for a routed expert's tensor, over ep. Kinds: "matmul" (a
    tp-split linear's weight, or an MoE layer's router and shared experts, or a weight of a part kept whole),
    "expert" (a routed expert's), "other" (norms, biases). Memoised: the layout search asks for every chunk
    of every layout."""
    p = cfg.parallel
    moe = moe and is_moe(cfg.model)
    key = (model_repr(cfg.model), p.tp, p.ep, moe)
    if key not in _LAYER_PARAMS:
        spec = family(cfg.model.model_type)
        # one layer and a one-token vocabulary: a layer's shapes do not depend on the vocabulary's size
        one = cfg.model.layer_of_kind(moe) if is_moe(cfg.model) else cfg.model.one_layer(0)  # the kind asked for
        one = dataclasses.replace(one, vocab_size=1)
        with torch.device("meta"):
            layer = spec.plan.layers_of(spec.model_class(one))["0"]
        experts = {id(t) for block in moe_blocks(layer) for t in block.experts.parameters()}
        in_block = {id(t) for block in moe_blocks(layer) for t in block.parameters()}  # router, experts, shared
        routers = {id(t) for m in layer.modules() if isinstance(m, Router) for t in m.parameters()}
        found = []
        for name, param in layer.named_parameters():
            dim = spec.plan.tp_dim(name)
            n = param.numel() if dim is None else param.numel() // p.tp
            whole = name.split(".")[0] in spec.plan.replicated
            role = "router" if id(param) in routers else "matrix" if param.dim() >= 2 else "vector"
            if id(param) in experts:
                found.append((n // p.ep, "expert", whole, role, tuple(param.shape)))
            else:
                matmul = name.endswith(".weight") and (dim is not None or (id(param) in in_block and param.dim() == 2)
                                                       or (whole and param.dim() == 2))
                found.append((n, "matmul" if matmul else "other", whole, role, tuple(param.shape)))
        _LAYER_PARAMS[key] = tuple(found)
    return _LAYER_PARAMS[key]


def chunk_units(cfg: Config, chunk: Chunk, *, experts: bool = True) -> list[list[int]]:
    """A chunk's parameters as ZeRO-3's units (zero3.units_of): first the rest of the chunk (embedding,
    final norm, head; the head is the embedding's own Parameter when tied on one chunk), then each layer
    (its MoE layers last: the order matters only to where buckets are cut); `experts=False` leaves out the
    routed experts' tensors."""
    s, tied = Sizes.of(cfg), cfg.model.tie_word_embeddings
    root = [s.vocab * s.h] if chunk.first else []
    if chunk.last:
        root.append(s.h)
        if not (tied and chunk.first):
            root.append(s.vocab * s.h)
    parts = [n for n, _ in _mtp_parts(s, chunk)]
    dense = layer_numels(cfg)
    moe = layer_numels(cfg, moe=True, experts=experts) if chunk.moe else []
    return _with_mtp([root] + [dense] * (chunk.layers - chunk.moe) + [moe] * chunk.moe, parts, [s.vocab * s.h], chunk)


def chunk_unit_roles(cfg: Config, chunk: Chunk, *, experts: bool = True) -> list[list[str]]:
    """The optimizer's role of each parameter of chunk_units, in the same places."""
    root = ["embedding"] if chunk.first else []
    if chunk.last:
        root.append("vector")
        if not (cfg.model.tie_word_embeddings and chunk.first):
            root.append("head")
    parts = [role for _, role in _mtp_parts(Sizes.of(cfg), chunk)]
    dense = [role for _, kind, _, role, _ in _layer_params(cfg)]
    moe = [role for _, kind, _, role, _ in _layer_params(cfg, True) if experts or kind != "expert"] if chunk.moe else []
    return _with_mtp([root] + [dense] * (chunk.layers - chunk.moe) + [moe] * chunk.moe, parts, ["embedding"], chunk)


def _mtp_parts(s: Sizes, chunk: Chunk) -> list[tuple[int, str]]:
    """(elements, the optimizer's role) of what one multi-token prediction module adds to its decoder layer
    (models/mtp.py; whole under tp): enorm, hnorm, eh_proj [h, 2h] and shared_head.norm."""
    return [(s.h, "vector"), (s.h, "vector"), (2 * s.h * s.h, "matrix"), (s.h, "vector")] if chunk.mtp else []


def _with_mtp(units: list[list], parts: list, copy: list, chunk: Chunk) -> list[list]:
    """`units` (root, then each layer, the last chunk's MTP modules' layers last) as zero3.units_of has them: the MTP
    modules, outside the model's layers, in the root unit after the head, each its layer's parameters and then its
    own `parts`; then `copy`, on a pipeline's last stage the modules' copy of the embedding (parameters() order)."""
    if not chunk.mtp:
        return units
    root, *layers = units
    cut = len(layers) - chunk.mtp
    modules = [x for layer in layers[cut:] for x in layer + parts]
    return [root + modules + (copy if not chunk.first else [])] + layers[:cut]


@dataclass(frozen=True)
class Bucket:
    """One fp32 gradient bucket (parallel/data_parallel._Bucket): its parameters' sizes in buffer
    order, padded to a multiple of the shards."""

    numels: tuple[int, ...]
    shards: int
    expert: bool = False  # routed experts' shards under expert parallelism: averaged (ZeRO-1: sharded) over edp
    whole: bool = False  # each parameter whole in one owner rank's slice (an optimizer's whole_roles: Muon's matrices)
    loads: tuple[int, ...] = ()  # whole: the elements each rank owns of the earlier whole buckets of its kind

    @functools.cached_property
    def owners(self) -> list[int]:
        return owners(list(self.numels), self.shards, list(self.loads) or None)

    def loads_after(self) -> tuple[int, ...]:
        """`loads` with this bucket's owned elements added: the next whole bucket's."""
        loads = list(self.loads) or [0] * self.shards
        owners(list(self.numels), self.shards, loads)
        return tuple(loads)

    @functools.cached_property
    def slice_size(self) -> int:
        if self.whole and self.shards > 1:  # the fullest owner's
            return max(sum(n for n, q in zip(self.numels, self.owners) if q == r) for r in range(self.shards))
        return -(-sum(self.numels) // self.shards)

    @functools.cached_property
    def padded(self) -> int:
        return self.slice_size * self.shards

    def owned(self, rank: int) -> tuple[int, int]:
        """(elements, pieces) of slice `rank`: the real elements it holds and how many parameters they touch."""
        if self.whole and self.shards > 1:
            mine = [n for n, q in zip(self.numels, self.owners) if q == rank]
            return sum(mine), len(mine)
        lo, hi = rank * self.slice_size, (rank + 1) * self.slice_size
        elements = pieces = start = 0
        for numel in self.numels:
            overlap = min(start + numel, hi) - max(start, lo)
            if overlap > 0:
                elements, pieces = elements + overlap, pieces + 1
            start += numel
        return elements, pieces


def zero_shards(cfg: Config) -> int:
    """The ranks ZeRO shards over: dp*cp, or HSDP's dp_shard (the rest hold replicas); 1 without ZeRO."""
    p = cfg.parallel
    return (p.dp_shard or p.dp * p.cp) if p.zero >= 1 else 1


def expert_shards(cfg: Config) -> int:
    """The ranks ZeRO shards expert-parallel shards over: their edp group (dp*cp/ep); 1 without ZeRO."""
    return max(1, zero_shards(cfg) // cfg.parallel.ep)


def accumulates_sharded(cfg: Config) -> bool:
    """Whether every micro-batch's gradients are reduce-scattered into the slices (ZeRO-2/3's sharded
    accumulation), the full buffers released in between: data_parallel.DataParallelBucket."""
    return cfg.parallel.zero >= 2 and zero_shards(cfg) > 1 and cfg.parallel.zero_accumulate == "sharded"


def chunk_buckets(cfg: Config, chunk: Chunk) -> list[Bucket]:
    """The chunk's buckets in backward order: one per ZeRO-3 unit, else filled to parallel.bucket_mb
    from the last parameter backwards (DataParallelBucket._size_buckets); under expert parallelism the
    routed experts' shards after the others, in buckets of their own (on their edp group)."""
    p = cfg.parallel
    apart = p.ep > 1 and chunk.moe > 0
    kind = optimizer_class(cfg.optim.name)
    units = tuple(tuple(u) for u in chunk_units(cfg, chunk, experts=not apart))
    # an optimizer that needs some roles whole (data_parallel.py's `whole`): their parameters in buckets of their own
    flags = tuple(tuple(map(kind.whole, u)) for u in chunk_unit_roles(cfg, chunk, experts=not apart))
    buckets = list(_buckets(units, flags, chunk.first, zero_shards(cfg), p.zero == 3, p.bucket_mb))
    if apart:
        experts = ((),) + tuple(tuple(expert_numels(cfg)) for _ in range(chunk.moe))
        whole = tuple(tuple(kind.whole("matrix") for _ in u) for u in experts)
        buckets += _buckets(experts, whole, False, expert_shards(cfg), p.zero == 3, p.bucket_mb, True)
    return buckets


def _kinds(numels, flags) -> list[tuple[list[int], bool]]:
    """`numels` split as data_parallel.py's kinds: those cut anywhere, then those kept whole (`flags`)."""
    flags = list(flags)
    return [([n for n, w in zip(numels, flags) if w == whole], whole) for whole in (False, True)]


def _balanced(buckets: list[Bucket]) -> tuple[Bucket, ...]:
    """`buckets` in order, each whole one knowing what the earlier ones gave each rank (data_parallel.owners)."""
    loads: tuple[int, ...] = ()
    out = []
    for b in buckets:
        if b.whole and b.shards > 1:
            b = dataclasses.replace(b, loads=loads)
            loads = b.loads_after()
        out.append(b)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _buckets(units: tuple, flags: tuple, first: bool, shards: int, per_unit: bool, bucket_mb: float,
             expert: bool = False) -> tuple[Bucket, ...]:
    if per_unit:
        return _balanced([Bucket(tuple(ns), shards, expert, w) for u, f in zip(reversed(units), reversed(flags))
                          for ns, w in _kinds(u, f) if ns])
    (root, *layers), (root_flags, *layer_flags) = units, flags
    embed = root[:1] if first else ()
    numels = [*embed, *(n for layer in layers for n in layer), *root[len(embed):]]  # parameters() order
    wholes = [*root_flags[:len(embed)], *(w for layer in layer_flags for w in layer), *root_flags[len(embed):]]
    limit = max(1, int(bucket_mb * 2**20 / 4))
    buckets = []
    for kind, whole in _kinds(numels, wholes):
        group, filled = [], 0  # (a running total: summing the group anew is quadratic in its length)
        for numel in reversed(kind):
            group.append(numel)
            filled += numel
            if filled >= limit:
                buckets.append(Bucket(tuple(group), shards, expert, whole))
                group, filled = [], 0
        if group:
            buckets.append(Bucket(tuple(group), shards, expert, whole))
    return _balanced(buckets)


# ------------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class State:
    """What one rank holds from step to step (ZeRO-3: between uses), and what ZeRO adds during a step."""

    params: int  # parameters in the compute dtype: per-parameter tensors, ZeRO's flat buffers, or ZeRO-3's slices
    grads: int  # fp32 bucket buffers (ZeRO-2/3: only this rank's slices between steps)
    optimizer: int  # fp32 master weights where they are not the parameters, the optimizer's declared state (AdamW:
    # its moments, and its step counters)
    largest: int  # elements of the largest piece the optimizer updates (its step makes temporaries of that size)
    root: int = 0  # ZeRO-3: elements of a first/last chunk's non-layer unit (embedding, final norm, head), padded
    layer: int = 0  # ZeRO-3: elements of one decoder layer's units together (under ep an MoE layer has two), padded
    layer_grads: int = 0  # ZeRO-3: elements of the gradient buffers a layer's backward attaches (`layer` less its
    # expert shards' where they stay whole, their shard group one rank: those persist), padded
    prefetched: int = 0  # ZeRO-3: elements of the unit a layer's backward gathers ahead of the layer before (its
    # last unit in forward order: under ep an MoE layer's non-expert one, else the whole layer), padded
    chunk_units: tuple[int, ...] = ()  # ZeRO-2/3: elements of each chunk's gradient buffers together, padded
    lazy_starts: tuple[tuple[int, ...], ...] = ()  # ZeRO-2: where each chunk's buffers start in backward order, and
    # their total (prefix sums of their padded elements: a moment's buffers found by bisection)
    head: tuple[int, ...] = ()  # ZeRO-2: each chunk's elements before its first layer's, in backward order
    layer_elements: int = 0  # ZeRO-2: one decoder layer's elements (under ep, those outside its expert shards)
    expert_starts: tuple[tuple[int, ...], ...] = ()  # ZeRO-2 under ep: lazy_starts of the expert shards' buckets
    expert_layer: int = 0  # ZeRO-2 under ep: one MoE layer's expert-shard elements


def _optimizer_bytes(cfg: Config, buckets: list[Bucket], dp_rank: int) -> tuple[int, int]:
    """(bytes, largest piece) of the optimizer state: zero.ShardedOptimizer's pieces of this rank's slices, each with
    the state the optimizer declares (tetron/optim)."""
    p, shards = cfg.parallel, zero_shards(cfg)
    kind = optimizer_class(cfg.optim.name)
    master = 4 * (cfg.train.dtype == "bfloat16")
    # per element and per piece, by bucket kind: Muon keeps one momentum on its (whole) matrices, AdamW's moments and
    # step counters on the rest; an optimizer without whole roles has one kind
    roles = {w: [r for r in ROLES if kind.whole(r) == w] or list(ROLES) for w in (False, True)}
    per_element = {w: master + max(kind.state_bytes(r) for r in rs) for w, rs in roles.items()}
    per_tensor = {w: kind.tensor_bytes * any(r in kind.tensor_roles for r in rs) for w, rs in roles.items()}
    if shards == 1:
        numels = [n for b in buckets for n in b.numels]
        # Plain fp32: the optimizer over the parameters themselves (AdamW: exp_avg + exp_avg_sq, and a 4-byte step
        # each); bf16: plus an fp32 master copy of every parameter (Megatron: 12 + 2 bytes per parameter).
        return sum(per_element[b.whole] * sum(b.numels) + per_tensor[b.whole] * len(b.numels)
                   for b in buckets), max(numels)
    # the slice of its place in the shard group (an expert shard's: in its edp group, mesh.py's dp*cp index // ep)
    owned = [(b.whole, *b.owned((dp_rank // p.ep if b.expert else dp_rank) % b.shards)) for b in buckets]
    total = sum(per_element[w] * e + per_tensor[w] * k for w, e, k in owned)
    # ZeRO: moments of this rank's pieces only; fp32 masters are views of its parameter slice (no copy),
    # bf16 ones are fp32 copies of its pieces. Largest piece: at most a slice, at most a parameter.
    largest = max(min(b.slice_size, max(b.numels)) for b in buckets)
    return total, largest if p.dp_impl == "bucket" else 0


def _mean_layer(cfg: Config, *, experts: bool = True) -> int:
    """Elements of a decoder layer on a rank, averaged over the model's dense and MoE layers (`experts=False`:
    an MoE layer's without its routed experts' shards)."""
    layers, moe = cfg.model.num_hidden_layers, moe_layers(cfg.model)
    return ((layers - moe) * sum(layer_numels(cfg)) + moe * sum(layer_numels(cfg, moe=True, experts=experts))) \
        // layers


def _zero3_units(cfg: Config, chunks: list[Chunk]) -> dict[str, int]:
    """ZeRO-3's root, layer and prefetched sizes (State's fields), padded as their buckets are, from the chunks'
    units: a root unit, then a unit per layer (under ep an MoE layer's expert shards are a unit of their own,
    on the same module: gathered, and given gradient buffers, together with the rest of the layer)."""
    shards, experts = zero_shards(cfg), expert_shards(cfg)
    apart = cfg.parallel.ep > 1
    kind = optimizer_class(cfg.optim.name)
    expert = Bucket(tuple(expert_numels(cfg)), experts, True, kind.whole("matrix")).padded if apart else 0
    whole = expert if apart and experts == 1 else 0  # whole expert buckets: their gradients persist

    def padded(numels: list[int], roles: list[str]) -> int:  # a unit's buckets: one per kind (cut, whole)
        return sum(Bucket(tuple(ns), shards, whole=w).padded for ns, w in _kinds(numels, map(kind.whole, roles)))

    root = layer = prefetched = grads = 0
    for chunk in chunks:
        units = chunk_units(cfg, chunk, experts=not apart)
        roles = chunk_unit_roles(cfg, chunk, experts=not apart)
        if chunk.first or chunk.last:
            root = max(root, padded(units[0], roles[0]))
        kinds = ([1] if chunk.layers > chunk.moe else []) + ([len(units) - 1] if chunk.moe else [])
        for i in kinds:
            unit = units[i]
            rest = padded(unit, roles[i])
            moe = unit is units[-1] and chunk.moe
            layer = max(layer, rest + (expert if moe else 0))
            grads = max(grads, rest + (expert - whole if moe else 0))
            prefetched = max(prefetched, rest if moe and apart else rest + (expert if moe else 0))
    return {"root": root, "layer": layer, "prefetched": prefetched, "layer_grads": grads}


def _starts(per_chunk: list[list[Bucket]]) -> tuple[tuple[int, ...], ...]:
    """Where each chunk's buckets start in backward order, and their total (prefix sums of their padded
    elements)."""
    return tuple(tuple(itertools.accumulate((b.padded for b in bs), initial=0)) for bs in per_chunk)


_STATES: dict[tuple, State] = {}  # state() by what it depends on: the layout search asks again for each
# micro-batch size, recompute mode and pipeline schedule of the same parallel sizes


def state(cfg: Config, pp_rank: int, *, dp_rank: int = 0) -> State:
    """The persistent bytes of pipeline rank `pp_rank` (and dp*cp rank `dp_rank`, whose ZeRO slices
    differ from the others' by padding only). ZeRO's 1/N of optimizer state (stage 1), gradients (2) and
    parameters (3) as in Rajbhandari et al. 2020 and the Ultra-Scale Playbook, on tetron's buckets: each
    padded to a multiple of N = dp*cp (HSDP: dp_shard), every gradient in fp32 whatever the compute dtype
    (Megatron's main_grad), one bucket per decoder layer under ZeRO-3 (FSDP2's unit)."""
    # the model, the parallel section, the dtype and the optimizer are all it reads (the train section's
    # micro-batch, recompute and accumulation do not change what persists)
    key = (model_repr(cfg.model), values(cfg.parallel), cfg.train.dtype, cfg.optim.name, pp_rank, dp_rank)
    if key not in _STATES:
        if len(_STATES) > 65536:
            _STATES.clear()
        _STATES[key] = _state(cfg, pp_rank, dp_rank)
    return _STATES[key]


def _state(cfg: Config, pp_rank: int, dp_rank: int) -> State:
    p, d = cfg.parallel, Sizes.of(cfg).d
    chunks = rank_chunks(cfg, pp_rank)
    buckets = [b for c in chunks for b in chunk_buckets(cfg, c)]
    shards = zero_shards(cfg)
    padded = sum(b.padded for b in buckets)
    slices = sum(b.slice_size for b in buckets)
    optimizer, largest = _optimizer_bytes(cfg, buckets, dp_rank)
    if p.zero == 3 and shards > 1:
        units = [chunk_buckets(cfg, c) for c in chunks]
        # ZeRO-3: a clone of this rank's slice of every unit; the full flat buffers exist only while gathered
        return State(params=d * slices, grads=F32 * slices, optimizer=optimizer, largest=largest,
                     chunk_units=tuple(sum(b.padded for b in u if b.shards > 1) for u in units),
                     **_zero3_units(cfg, chunks))
    if p.dp_impl == "naive":  # fp32 only: a .grad per parameter, AdamW over the parameters
        return State(params=F32 * padded, grads=F32 * padded, optimizer=optimizer, largest=largest)
    if p.zero >= 2 and shards > 1:  # the slices persist; a full buffer lives from its first gradient to its reduction
        per_chunk = [chunk_buckets(cfg, c) for c in chunks]
        units = [chunk_units(cfg, c) for c in chunks]
        # under ep the expert shards' buckets (whole where their shard group is one rank: they persist, as
        # between steps) begin once a layer's expert gradients do, mid-way through its backward
        lazy = [[b for b in bs if not b.expert] for bs in per_chunk]
        experts = [[b for b in bs if b.expert and b.shards > 1] for bs in per_chunk]
        return State(params=d * padded, grads=F32 * slices, optimizer=optimizer, largest=largest,
                     chunk_units=tuple(sum(b.padded for b in bs + es) for bs, es in zip(lazy, experts)),
                     lazy_starts=_starts(lazy), expert_starts=_starts(experts),
                     head=tuple(sum(u[0][1:] if c.first else u[0]) for u, c in zip(units, chunks)),
                     layer_elements=_mean_layer(cfg, experts=p.ep == 1),
                     expert_layer=sum(expert_numels(cfg)) if p.ep > 1 else 0)
    # ZeRO-0/1 (or nothing to shard): every bucket buffer is allocated once and kept; with shards > 1 the
    # parameters live in one flat buffer per bucket, padded like it.
    return State(params=d * padded, grads=F32 * padded, optimizer=optimizer, largest=largest)
