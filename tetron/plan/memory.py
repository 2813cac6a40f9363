"""The memory model: the bytes one rank holds at the peak of a training step, term by term. Its terms
come from plan/state.py (what persists: parameters, gradients, optimizer state under each ZeRO stage)
and plan/activations.py (what each micro-batch leaves saved), in the widths of plan/sizes.py; this
module finds the peak over the moments of a step.

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
import functools
from dataclasses import dataclass, field

from tetron.config import Config
from tetron.optim import optimizer_class
from tetron.parallel.pipeline_schedules import Action, schedule_spec, splits_backward
from tetron.plan.activations import (
    Held,
    chunk_held,
    chunk_layers,
    layer_kept,
    layer_none,
    layer_weight_inputs,
    moe_backward,
    moe_forward,
    moe_retained,
    norm_bytes,
)
from tetron.plan.keys import Memo, micro_batch_key
from tetron.plan.pipeline import actions, pipeline_buffers, walked_micro_batches
from tetron.plan.sizes import F32, I64, Sizes, expert_elements
from tetron.plan.state import (
    Chunk,
    State,
    accumulates_sharded,
    chunk_units,
    expert_shards,
    rank_chunks,
    state,
    zero_shards,
)

# Fitted constants for short-lived tensors (bytes are these times the named size; see each use).
LAYER_BWD_I = 4.0  # a layer's backward: MLP-width tensors alive at once (fused.gated_linear's: silu(gate)
# recomputed, the gradients of the product, of silu's output and of up; the layer's own saved tensors are being
# released meanwhile)
LAYER_BWD_H = 1.0  # ... and residual-width ones (the incoming gradient)


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


def loss_chunk(cfg: Config, s: Sizes) -> int:
    """Tokens per chunk of the head and the loss (train.loss_chunk_tokens; 0 or more than a micro-batch: all)."""
    chunk = cfg.train.loss_chunk_tokens
    return s.n if chunk <= 0 else min(chunk, s.n)


def _loss_moments(cfg: Config, s: Sizes) -> list[tuple[str, dict[str, int]]]:
    """The head and the loss on the last chunk (models/loss.py), beyond the two gradients they keep for the
    backward (Held.loss). The Ultra-Scale Playbook's point is that the [tokens, vocab] logits, in fp32 for
    the loss, can outweigh a layer; tetron computes them `loss_chunk` tokens at a time (the vocabulary-
    parallel loss: 1/tp of each chunk's columns), so a chunk's fp32 logits and their log-probabilities
    (tp: their masked, shifted copy) are the most alive at once. The backward scales the two kept
    gradients into new ones (bf16: the head's cast from its fp32 accumulator besides)."""
    chunk, bf16 = loss_chunk(cfg, s), cfg.train.dtype == "bfloat16"
    forward = 2 * F32 * chunk * s.vocab
    cast = s.vocab * s.h * s.d if bf16 and chunk < s.n else 0
    backward = s.n * s.h * s.d + F32 * s.vocab * s.h + cast
    return [("loss forward", {"logits": forward}), ("head backward", {"temporaries": backward})]


def _layer_backward(cfg: Config, s: Sizes, chunk: Chunk) -> tuple[int, int | None]:
    split = cfg.parallel.pp > 1 and splits_backward(cfg.parallel.pp_schedule) and not chunk.first
    return _layer_backward_of(s, chunk, cfg.train.recompute, split)


@functools.lru_cache(maxsize=65536)  # a search's every (sizes, chunk, mode): ~9k for Llama-3-8B on 64 ranks
def _layer_backward_of(s: Sizes, chunk: Chunk, mode: str, split: bool) -> tuple[int, int | None]:
    """Temporaries of a decoder layer's backward at its worst (of the chunk's kinds of layer: dense, MoE),
    before and after an MoE layer's expert gradients begin (ZeRO-2's expert buckets start between; None:
    not in this backward, B of a split one): its
    recomputed forward (all it would have saved minus what it kept), the activation gradients alive at once
    (fitted: LAYER_BWD_*; an MoE block's, stage by stage: activations.moe_backward) and under cp the ring's
    gradient blocks (in an MoE layer attention's backward comes after the block's, whose saved tensors are
    gone by then: not at its peak). Recomputing an MoE layer under expert parallelism replays its forward's
    all-to-alls, whose buffers (activations.moe_forward) may outweigh the backward's. `split`: B of a backward
    split into B and W (zbh1, zbv; not the first stage's, whose W is the whole backward)."""
    kinds = ([False] if chunk.layers > chunk.moe else []) + ([True] if chunk.moe else [])
    early = late = 0
    for moe in kinds:
        extra = 0 if mode == "none" else layer_none(s, moe) - layer_kept(s, mode, moe)
        if moe and s.grouped:
            incoming = extra + s.n_res * s.h * s.d
            replay = moe_forward(s) - 2 * s.n_mlp * s.top_k * s.h * s.d if mode == "full" else 0
            before, after = moe_backward(s, split=split)
            early = max(early, incoming + max(before, replay))
            late = None if split else max(late, incoming + after)  # split: the expert gradients come in W
            continue
        width = s.top_k * s.expert_inter + s.shared_inter if moe else s.inter
        grads = int(LAYER_BWD_I * s.n_mlp * width * s.d + LAYER_BWD_H * s.n * s.h * s.d)
        grads += s.n * s.h * s.d if s.regather else 0  # sp_regather: the block's input all-gathered again
        if moe:
            grads += moe_backward(s)[0]
        ring = s.n * (F32 * s.hq + 2 * F32 * s.hkv + 2 * s.d * s.hkv) if s.cp > 1 else 0  # dq, dk, dv in fp32;
        early = max(early, extra + grads + ring)  # the next k, v
    return early, late


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


@dataclass(frozen=True, slots=True)
class _Moment:
    """One moment of a forward or backward of a chunk, as the micro-batches make it: what it adds to (or, once the
    backward has released them, takes from) the bytes held for the backward pass; ZeRO's terms come apart
    (`_zero_extras`). A layer backward's stands for every layer of the chunk: the one `index` layers from its end
    has released `index * per_layer` more activations."""

    name: str
    experts: bool  # whether the layer's expert gradients have begun arriving
    extra: dict  # bytes by term (a layer backward's: of the chunk's last layer)
    added: int  # their sum
    per_layer: int = 0  # a layer backward's: one layer's saved activations

    def extra_at(self, index: int) -> dict:
        """`extra` at the layer `index` layers from the chunk's end (`added` less index * per_layer)."""
        if not index:
            return self.extra
        return {**self.extra, "activations": self.extra["activations"] - index * self.per_layer}


def _moments(cfg: Config, s: Sizes, chunk: Chunk, held: Held, action: Action) -> tuple[tuple[_Moment, ...], ...]:
    """The moments of one forward or backward of `chunk`, whatever ZeRO holds, in order, in groups: a layer
    backward's group is taken once per layer of the chunk, from its end (predict_rank: the last layer alone where
    ZeRO's buffers do not grow layer by layer)."""
    backward = action.backward
    head = norm_bytes(s, s.n_res) if chunk.last else 0  # what the final norm saved, freed first
    groups = []
    if chunk.last:
        name, extra = _loss_moments(cfg, s)[backward]
        groups.append((_Moment(name, True, extra, sum(extra.values())),))
    # A layer's backward, the last layer first; later layers only matter where ZeRO-3's buffers grow (a
    # chunk of dense and MoE layers: released at their mean). A forward has none: not worked out for it.
    if backward and chunk.layers:
        per_layer = chunk_layers(s, chunk, cfg.train.recompute) // max(1, chunk.layers)
        early, late = _layer_backward(cfg, s, chunk)
        if action.weight and chunk.moe and s.grouped and not chunk.first:
            # W of a split backward (zbh1, zbv) past the first stage computes every weight gradient of the chunk
            # before accumulating them in one pass (weight_grad.py): those, not B's activation gradients
            early, late = s.d * sum(sum(u) for u in chunk_units(cfg, chunk)), None
        layer = []
        for temporaries, experts in ((early, late is not None),) if not late else ((early, False), (late, True)):
            extra = {"logits": -held.loss, "temporaries": temporaries, "activations": -head}
            layer.append(_Moment("layer backward", experts, extra, sum(extra.values()), per_layer))
        groups.append(tuple(layer))
    if not backward:
        groups.append((_Moment("forward", True, {}, 0),))
    if not backward and chunk.moe and moe_forward(s):
        # an MoE layer's combining all-to-all (its last MoE layer taken as the chunk's last layer): before the
        # final norm, the loss and (without recomputation) the combine's two saved [M, H] outputs
        combine = 2 * s.n_mlp * s.top_k * s.h * s.d if cfg.train.recompute == "none" else 0
        extra = {"logits": -held.loss, "activations": -head - combine, "temporaries": moe_forward(s)}
        groups.append((_Moment("forward", True, extra, sum(extra.values())),))
    return tuple(groups)


def _rebuilt_for_w(cfg: Config, s: Sizes, chunks: list[Chunk], split: bool) -> list[int]:
    """Per chunk, what a split backward (zbh1, zbv) holds from B to W beyond the forward's saved tensors."""
    # with full recompute: a layer's input and what W reads of the graph B rebuilt, in place of what recompute
    # kept (recompute.py; the first stage, without a B, rebuilds it within W); selective splits as none does
    mode = cfg.train.recompute
    rebuilt = [sum(n * (s.n_res * s.d * s.h + layer_weight_inputs(s, moe) - layer_kept(s, mode, moe))
                   for n, moe in ((c.layers - c.moe, False), (c.moe, True)) if n)
               if split and mode == "full" and not c.first else 0 for c in chunks]
    # ... and an MoE layer's B keeps the gradients its W multiplies by (the first stage's W runs B's work too)
    return [r + (c.moe * moe_retained(s) if split and not c.first else 0) for r, c in zip(rebuilt, chunks)]


@dataclass(frozen=True, slots=True)
class _Reached:
    """The most bytes of micro-batches in flight (activations and the loss's gradients) one kind of moment of a
    rank's walk sees, at the first action that reaches them: the walk's part of a peak, which ZeRO's terms then
    complete (`predict_rank`)."""

    step: int  # the action's index in the rank's walk
    action: Action
    buffers: int  # stage-boundary buffers P2P holds meanwhile
    done: frozenset  # the chunks whose backward has run in this step (under full accumulation their buffers stay)
    last: bool  # the step's last micro-batch (it reduces its gradients)
    acts: int
    loss: int


@dataclass(frozen=True)
class _Walk:
    """What a rank's micro-batches hold, whatever ZeRO holds besides: per kind of moment its most (`_Reached`, in
    walk order), each chunk's `Held`, and the step's token ids."""

    reached: tuple[_Reached, ...]
    held: tuple[Held, ...]
    ids: int
    sizes: Sizes
    chunks: tuple[Chunk, ...]
    moments: dict = field(default_factory=dict)  # _moments by (chunk, backward, weight), as asked for

    def moments_of(self, cfg: Config, action: Action) -> tuple[tuple[_Moment, ...], ...]:
        key = (action.chunk, action.backward, action.weight)
        if key not in self.moments:
            self.moments[key] = _moments(cfg, self.sizes, self.chunks[action.chunk], self.held[action.chunk], action)
        return self.moments[key]


_WALKS = Memo()


def _walk(cfg: Config, pp_rank: int) -> _Walk:
    """The rank's forwards and backwards in order (pipeline.actions), with the micro-batches in flight at each: the
    same for the layouts that differ only in ZeRO (keys.py), so a search walks each once."""
    return _WALKS.get((micro_batch_key(cfg), pp_rank), lambda: _walked(cfg, pp_rank))


def _walked(cfg: Config, pp_rank: int) -> _Walk:
    s = Sizes.of(cfg)
    chunks = rank_chunks(cfg, pp_rank)
    held = tuple(chunk_held(cfg, s, c) for c in chunks)
    # Every micro-batch's token ids and targets (int64), cut to this rank's positions, for the whole step; with
    # multi-token prediction each depth's ids, targets and validity besides (data/batch.py mtp_shifted)
    depth = getattr(cfg.model, "num_nextn_predict_layers", 0)
    ids = (2 + 3 * depth) * I64 * cfg.train.grad_acc * s.n
    buffers = pipeline_buffers(cfg, pp_rank)  # what crosses a stage boundary: one [b, s, h] each
    split = cfg.parallel.pp > 1 and splits_backward(cfg.parallel.pp_schedule)
    rebuilt = _rebuilt_for_w(cfg, s, chunks, split)
    last = walked_micro_batches(cfg) - 1
    acts = loss = 0
    done: frozenset[int] = frozenset()
    most: dict[tuple, _Reached] = {}  # per kind of moment, the first action holding its most
    for k, action in enumerate(actions(cfg, pp_rank)):
        h = held[action.chunk]
        if not action.backward:
            acts, loss = acts + h.activations, loss + h.loss
        kind = (action.chunk, action.backward, action.weight, buffers[k], done, action.micro == last)
        if kind not in most or acts + loss > most[kind].acts + most[kind].loss:
            most[kind] = _Reached(k, action, buffers[k], done, kind[5], acts, loss)
        if action.backward and split and not action.weight:
            acts += rebuilt[action.chunk]
        if action.backward and (action.weight or not split):  # zbh1, zbv: what B uses is kept for W
            acts, loss = acts - h.activations - rebuilt[action.chunk], loss - h.loss
            if cfg.train.grad_acc > 1 and action.chunk not in done:
                done = done | {action.chunk}
    return _Walk(tuple(sorted(most.values(), key=lambda r: r.step)), held, ids, s, tuple(chunks))


def predict_rank(cfg: Config, pp_rank: int = 0, *, dp_rank: int = 0) -> MemoryEstimate:
    """The peak of pipeline rank `pp_rank` over one steady-state step: the largest moment."""
    walk = _walk(cfg, pp_rank)
    s, st, ids = walk.sizes, state(cfg, pp_rank, dp_rank=dp_rank), walk.ids

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
    most: dict[tuple, _Reached] = {}  # per kind of moment as ZeRO tells them apart, the first action holding its most
    for r in walk.reached:
        attached = sum(st.chunk_units[c] for c in r.done | {r.action.chunk}) if attaches and r.done else 0
        kind = (r.action.chunk, r.action.backward, r.action.weight, r.buffers, attached, r.last)
        if kind not in most or r.acts + r.loss > most[kind].acts + most[kind].loss:
            most[kind] = r
    held_total, peak = best.total, None  # the best moment so far, as (name, acts, loss, comm, extra)
    zero = bool(st.lazy_starts or st.root or st.layer)  # ZeRO-2/3 buffers and gathers: moment by moment
    for kind, r in sorted(most.items(), key=lambda item: item[1].step):  # the first to reach a peak is named
        comm = r.buffers * s.n_res * s.d * s.h
        chunk, holding = walk.chunks[r.action.chunk], base_total + r.acts + r.loss + comm
        for group in walk.moments_of(cfg, r.action):
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
