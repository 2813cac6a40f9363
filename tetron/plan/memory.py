"""The memory model: the bytes one rank holds at the peak of a training step, term by term. Its terms
come from plan/state.py (what persists: parameters, gradients, optimizer state under each ZeRO stage)
and plan/activations.py (what each micro-batch leaves saved), in the widths of plan/sizes.py; plan/walk.py
walks a rank's micro-batches through the schedule, and this module finds the peak over the moments of the
step, ZeRO's terms added.

Every formula describes what tetron itself allocates (parallel/*.py, zero.py, model.py), checked
against what it measures (`tetron plan --measure`, tests/test_plan.py): the tensors a rank has
allocated, at the worst moment of a step, in steady state (AdamW's moments exist). Sources for the
shape of each term: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (activations per layer, sequence parallelism, selective recomputation); Megatron-LM's
`theoretical_memory_usage.py` (weights and optimizer bytes per parameter, pipeline in-flight
micro-batches, the first stage's worst case); the Ultra-Scale Playbook (Hugging Face, 2025: ZeRO
stages, logits and the vocabulary-parallel loss, context parallelism's 1/cp). Where tetron differs from
those (no dropout, fused norms and gated MLPs that keep their inputs only, fused attention that keeps no
[s, s] scores and takes GQA's kv heads as they are, fp32 gradient buckets even at dp 1), the term follows
tetron, and the constants that describe short-lived tensors were fitted to tetron's measurements (noted where used).

The peak is the largest of a few moments, each = what persists (parameters, gradients, optimizer
state) + the activations of the micro-batches in flight + what that moment adds: the head and the loss
over one chunk of logits, the head's backward, a decoder layer's backward (and its recomputed forward),
or the optimizer step. The pipeline schedule (parallel/pipeline_schedules.py) says which micro-batches
are in flight.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tetron.config import Config
from tetron.optim import optimizer_class
from tetron.parallel.pipeline_schedules import schedule_spec
from tetron.plan.sizes import F32, I64, Sizes, expert_elements
from tetron.plan.state import (
    Chunk,
    State,
    accumulates_sharded,
    expert_shards,
    rank_chunks,
    state,
    zero_shards,
)
from tetron.plan.walk import Reached, walk

# ------------------------------------------------------------------------------------ the peak

TERMS = ("params", "grads", "optimizer", "activations", "logits", "comm", "temporaries")


@dataclass
class MemoryEstimate:
    """Predicted bytes one rank holds at the peak of a step, by kind, and where the peak falls."""

    params: int = 0  # parameters in the compute dtype (ZeRO-3: slices, plus the units gathered at the peak)
    grads: int = 0  # fp32 gradient buckets (ZeRO-2/3: slices, plus the full buffers alive at the peak)
    optimizer: int = 0  # fp32 master weights that are not the parameters, AdamW's moments and step counters
    activations: int = 0  # saved for backward, every micro-batch in flight: layers, norms, RoPE, token ids
    logits: int = 0  # the head and the loss: one chunk of fp32 logits, the two gradients the loss keeps for backward
    comm: int = 0  # P2P buffers of what crosses a stage boundary: in use, posted ahead, or not yet sent
    temporaries: int = 0  # short-lived tensors at the peak: a layer's recomputed forward, activation gradients
    moment: str = ""  # where in the step the peak falls ("": a lower bound, not a moment: floor())
    pp_rank: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, t) for t in TERMS)

    def terms(self) -> dict[str, int]:
        return {t: getattr(self, t) for t in TERMS}

    def largest(self, k: int = 3) -> list[tuple[str, int]]:
        """The k largest terms, largest first."""
        return sorted(self.terms().items(), key=lambda kv: -kv[1])[:k]


def _zero_extras(s: Sizes, st: State, chunk: Chunk, moment: str, *, attached: int, index: int,
                 syncing: bool, which: int, experts: bool = True) -> tuple[int, int]:
    """(params, grads) that ZeRO adds at a moment, at the backward of chunk `which`'s `index`-th layer from
    the end. A full gradient buffer (ZeRO-2/3) is allocated when its first gradient of the step arrives
    (ZeRO-3: when its unit's backward begins) and released once reduced; when `syncing` (the step's last
    micro-batch, or every one under sharded accumulation) a reduced buffer goes when the next one is
    reduced, so at most two are alive; before that (full accumulation) all stay, and `attached` counts
    those an earlier backward of this step left. ZeRO-3 also gathers units: the root while the chunk's
    forward or head backward runs, and on a first chunk until the embedding's gradient at the very end;
    the current layer (all its units) and the unit its backward prefetches of the one before. `experts`:
    whether the layer's expert gradients have begun arriving (ZeRO-2's expert buckets under ep)."""
    if st.lazy_starts:
        return 0, F32 * (attached or _zero2_buffers(st, chunk, moment, index=index, syncing=syncing, which=which,
                                                     experts=experts))
    if not st.root and not st.layer:
        return 0, 0
    backward = moment == "layer backward"
    root = st.root if moment in ("forward", "head backward") or (backward and chunk.first) else 0
    gathered = (st.layer + (st.prefetched if index < chunk.layers - 1 else 0) if backward
                else st.layer * (moment == "forward"))
    layers = min(index + 1, 2) if syncing else index + 1
    grads = (st.root if chunk.first or chunk.last else 0) + layers * st.layer_grads if backward else root
    grads = 0 if moment == "forward" else grads
    return s.d * (root + gathered), F32 * (attached or grads)


def _zero2_buffers(st: State, chunk: Chunk, moment: str, *, index: int, syncing: bool, which: int,
                   experts: bool) -> int:
    """ZeRO-2: elements of the chunk's full buffers alive at a moment of its (first) backward: those whose
    gradients have begun arriving (the head's, then a layer's at a time, in backward order); under ep the
    expert shards' buckets apart, reached an MoE layer at a time (the chunk's MoE layers taken as its last),
    each once its `experts` gradients begin."""
    if moment not in ("head backward", "layer backward"):
        return 0
    layer = moment == "layer backward"
    alive = _begun(st.lazy_starts[which], max(1, st.head[which] + (index + 1) * st.layer_elements * layer), syncing)
    moe = min(index + experts, chunk.moe) if layer and st.expert_starts else 0
    return alive + (_begun(st.expert_starts[which], moe * st.expert_layer, syncing) if moe else 0)


def _begun(starts: tuple[int, ...], reached: int, syncing: bool) -> int:
    """Elements of the buckets (starting at `starts`, in backward order) that `reached` elements of gradients
    have begun, less those reduced and released meanwhile when `syncing` (two stay: the one being filled and
    the one in flight)."""
    touched = bisect.bisect_left(starts, reached, 0, len(starts) - 1)  # buckets begun: those starting before
    return starts[touched] - (starts[max(touched - 2, 0)] if syncing else 0)


def predict_rank(cfg: Config, pp_rank: int = 0, *, dp_rank: int = 0) -> MemoryEstimate:
    """The peak of pipeline rank `pp_rank` over one steady-state step: the largest moment."""
    rank_walk = walk(cfg, pp_rank)
    s, st, ids = rank_walk.sizes, state(cfg, pp_rank, dp_rank=dp_rank), rank_walk.ids

    def at(moment: str, **terms: int) -> MemoryEstimate:  # what persists, plus `terms` (not dataclasses.replace:
        # its introspection was a few % of a search, which calls this for every layout)
        return MemoryEstimate(**{"params": st.params, "grads": st.grads, "optimizer": st.optimizer,
                                 "activations": ids, **terms}, moment=moment, pp_rank=pp_rank)

    base = at("")
    best = at("between steps")
    base_total = base.total
    sharded = accumulates_sharded(cfg)
    # ZeRO-2/3 accumulating in full buffers: a chunk's backward leaves them attached for the rest of the step
    attaches = bool(st.chunk_units) and cfg.train.grad_acc > 1 and not sharded
    most: dict[tuple, Reached] = {}  # per kind of moment as ZeRO tells them apart, the first action holding its most
    for r in rank_walk.reached:
        attached = sum(st.chunk_units[c] for c in r.done | {r.action.chunk}) if attaches and r.done else 0
        kind = (r.action.chunk, r.action.backward, r.action.weight, r.buffers, attached, r.last)
        if kind not in most or r.acts + r.loss > most[kind].acts + most[kind].loss:
            most[kind] = r
    held_total, peak = best.total, None  # the best moment so far, as (name, acts, loss, comm, extra)
    zero = bool(st.lazy_starts or st.root or st.layer)  # ZeRO-2/3 buffers and gathers: moment by moment
    for kind, r in sorted(most.items(), key=lambda item: item[1].step):  # the first to reach a peak is named
        comm = r.buffers * s.n_res * s.d * s.h
        chunk, holding = rank_walk.chunks[r.action.chunk], base_total + r.acts + r.loss + comm
        for group in rank_walk.moments_of(cfg, r.action):
            # a layer backward's, once per layer where ZeRO's buffers grow with them; else the last layer's stands
            # for all (the layers before it hold no more)
            layers = range(chunk.layers if st.chunk_units and group[0].name == "layer backward" else 1)
            for index in layers:
                for m in group:
                    params, grads = _zero_extras(s, st, chunk, m.name, attached=kind[4], index=index,
                                                 syncing=kind[5] or sharded, which=r.action.chunk,
                                                 experts=m.experts) if zero else (0, 0)
                    total = holding + m.added - index * m.per_layer + params + grads
                    if total > held_total:
                        held_total = total
                        peak = (m.name, r.acts, r.loss, comm, {**m.extra_at(index), "params": params, "grads": grads})
    if peak is not None:
        name, acts, loss, comm, extra = peak
        best = at(name, params=st.params + extra["params"], grads=st.grads + extra["grads"],
                  activations=ids + acts + extra.get("activations", 0), logits=loss + extra.get("logits", 0),
                  comm=comm, temporaries=extra.get("temporaries", 0))
    # The optimizer step: activations gone; AdamW's temporaries (sqrt of the second moment, the update
    # denominator) and clipping's squares are each one piece in size, fp32.
    step = at("optimizer step", temporaries=3 * F32 * st.largest)
    return max(best, step, key=lambda e: e.total)


def predict(cfg: Config, *, ranks: list[int] | None = None) -> MemoryEstimate:
    """The worst pipeline rank's peak (every rank of one pipeline stage holds the same, up to ZeRO padding),
    over `ranks` (default: all)."""
    ranks = list(range(cfg.parallel.pp)) if ranks is None else ranks
    return max((predict_rank(cfg, r) for r in ranks), key=lambda e: e.total)


def heaviest_ranks(cfg: Config) -> list[int]:
    """The pipeline ranks whose peaks bound every rank's, for a search that cannot weigh them all: the first and
    the last (the embedding and the most micro-batches in flight; the logits), and of the ranks holding the same
    kind of chunks (their layers, dense and MoE) the earliest, which has the most in flight. With dense layers
    first, an MoE model's middle ranks hold more than either end (DeepSeek-V3 on 32 stages: four times the first's)."""
    kinds: dict[tuple, int] = {}
    for r in range(cfg.parallel.pp):
        kinds.setdefault(tuple(rank_chunks(cfg, r)), r)
    return sorted({0, cfg.parallel.pp - 1, *kinds.values()})


def floor(cfg: Config) -> MemoryEstimate:
    """A lower bound of `predict(cfg)` from arithmetic on the config alone: nothing built (not even on the meta
    device), no schedule walked, no loop over layers, so an absurd model (10**4 layers, a vocabulary of 10**9)
    is weighed at once. The busiest pipeline rank holds at least 1/(tp*pp) of the parameters (tp splits the
    matrices, pp the layers; ep the routed experts), each with its fp32 gradient and the optimizer's state (plus
    an fp32 master under bf16), divided by dp*cp (HSDP: dp_shard; expert shards: their edp group) where ZeRO
    shards them; the step's token ids; and under
    all-forward-all-backward the first stage keeps at least every micro-batch's input to one layer."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    # expert parallelism: each rank holds 1/ep of the routed experts, sharded by ZeRO over their edp group
    experts = expert_elements(m)
    dense, expert = (m.num_params() - experts) // (p.tp * p.pp), experts // (p.tp * p.pp * p.ep)
    shards, edp = zero_shards(cfg), expert_shards(cfg)
    elements = dense + expert

    def sharded(stage: int) -> int:  # elements of this rank's slices where ZeRO stage `stage` shards them
        return dense // shards + expert // edp if p.zero >= stage else elements

    bf16 = t.dtype == "bfloat16"
    d = 2 if bf16 else F32
    tokens = t.micro_batch * (cfg.data.seq_len // p.cp)
    in_flight = t.grad_acc if p.pp > 1 and schedule_spec(p.pp_schedule).holds_every_micro_batch else 1
    residual = tokens // p.tp if p.sp else tokens
    return MemoryEstimate(params=(F32 if p.dp_impl == "naive" else d) * sharded(3), grads=F32 * sharded(2),
                          optimizer=(optimizer_class(cfg.optim.name).state_bytes() + 4 * bf16) * sharded(1),
                          activations=2 * I64 * t.grad_acc * tokens + in_flight * residual * d * m.hidden_size)
