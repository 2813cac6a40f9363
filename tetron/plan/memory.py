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
those (RMSNorm in fp32, no dropout, fused attention that keeps no [s, s] scores, GQA keys/values
repeated before attention, fp32 gradient buckets even at dp 1), the term follows tetron, and the
constants that describe short-lived tensors were fitted to tetron's measurements (noted where used).

The peak is the largest of a few moments, each = what persists (parameters, gradients, optimizer
state) + the activations of the micro-batches in flight + what that moment adds: the head and the loss
over one chunk of logits, the head's backward, a decoder layer's backward (and its recomputed forward),
or the optimizer step. The pipeline schedule (parallel/pipeline_schedules.py) says which micro-batches
are in flight.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, replace

from tetron.config import Config
from tetron.parallel.pipeline_schedules import (
    Action,
    receives,
    replay,
    schedule,
    sends,
    splits_backward,
    style_of,
)
from tetron.plan.activations import (
    Held,
    chunk_held,
    chunk_layers,
    layer_kept,
    layer_none,
    layer_weight_inputs,
    moe_backward,
    norm_bytes,
)
from tetron.plan.sizes import F32, I64, Sizes, expert_elements
from tetron.plan.state import Chunk, State, accumulates_sharded, expert_shards, rank_chunks, state, zero_shards

# Fitted constants for short-lived tensors (bytes are these times the named size; see each use).
LAYER_BWD_I = 2.0  # a layer's backward: MLP-width activation gradients alive at once (grad of the product,
# of silu's output and of up; the layer's own saved tensors are being released meanwhile)
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


def _layer_backward(cfg: Config, s: Sizes, chunk: Chunk) -> int:
    """Temporaries of a decoder layer's backward at its worst (of the chunk's kinds of layer: dense, MoE):
    its recomputed forward (all it would have saved minus what it kept), the activation gradients alive at
    once (fitted: LAYER_BWD_*; an MoE layer's are its assignments' [M, moe_intermediate] and [M, H] ones),
    and under cp the ring's gradient blocks."""
    mode = cfg.train.recompute
    kinds = ([False] if chunk.layers > chunk.moe else []) + ([True] if chunk.moe else [])
    worst = 0
    for moe in kinds:
        extra = 0 if mode == "none" else layer_none(s, moe) - layer_kept(s, mode, moe)
        width = s.top_k * s.expert_inter + s.shared_inter if moe else s.inter
        grads = int(LAYER_BWD_I * s.n * width * s.d + LAYER_BWD_H * s.n * s.h * s.d)
        if moe:
            grads += moe_backward(s)
        worst = max(worst, extra + grads)
    if s.cp > 1:
        worst += s.n * (F32 * s.hq + 2 * F32 * s.hkv + 2 * s.d * s.hkv)  # dq, dk, dv in fp32; the next k, v
    return worst


def _zero_extras(s: Sizes, st: State, chunk: Chunk, moment: str, *, attached: int, index: int,
                 syncing: bool, which: int) -> tuple[int, int]:
    """(params, grads) that ZeRO adds at a moment, at the backward of chunk `which`'s `index`-th layer from
    the end. A full gradient buffer (ZeRO-2/3) is allocated when its first gradient of the step arrives
    (ZeRO-3: when its unit's backward begins) and released once reduced; when `syncing` (the step's last
    micro-batch, or every one under sharded accumulation) a reduced buffer goes when the next one is
    reduced, so at most two are alive; before that (full accumulation) all stay, and `attached` counts
    those an earlier backward of this step left. ZeRO-3 also gathers units: the root while the chunk's
    forward or head backward runs, and on a first chunk until the embedding's gradient at the very end;
    the current layer and the one before."""
    if st.lazy_starts:
        return 0, F32 * (attached or _zero2_buffers(st, chunk, moment, index=index, syncing=syncing, which=which))
    if not st.root and not st.layer:
        return 0, 0
    backward = moment == "layer backward"
    root = st.root if moment in ("forward", "head backward") or (backward and chunk.first) else 0
    gathered = min(2, chunk.layers - index) if backward else int(moment == "forward")
    layers = min(index + 1, 2) if syncing else index + 1
    grads = (st.root if chunk.first or chunk.last else 0) + layers * st.layer if backward else root
    grads = 0 if moment == "forward" else grads
    return s.d * (root + gathered * st.layer), F32 * (attached or grads)


def _zero2_buffers(st: State, chunk: Chunk, moment: str, *, index: int, syncing: bool, which: int) -> int:
    """ZeRO-2: elements of the chunk's full buffers alive at a moment of its (first) backward: those whose
    gradients have begun arriving (the head's, then a layer's at a time, in backward order)."""
    if moment not in ("head backward", "layer backward"):
        return 0
    reached = st.head[which] + (index + 1) * st.layer_elements * (moment == "layer backward")
    starts = st.lazy_starts[which]
    touched = bisect.bisect_left(starts, max(reached, 1), 0, len(starts) - 1)  # buckets begun: those starting before
    return starts[touched] - (starts[max(touched - 2, 0)] if syncing else 0)


def _actions(cfg: Config, pp_rank: int) -> tuple[Action, ...]:
    """This rank's forwards and backwards in order: the pipeline schedule, or without pp one micro-batch
    after another (train.forward_backward), each forward followed by its backward. Walking it gives the
    micro-batches in flight that Megatron's theoretical memory takes as a formula (the first stage: all m
    under all-forward-all-backward, p under 1F1B, p + (p-1)/v micro-batches' worth interleaved). 1F1B and interleaved
    reach their most micro-batches in flight within 2*pp of them and then repeat: a longer step is
    represented by its first 2*pp (all-forward-all-backward holds every one, so it keeps them all)."""
    p = cfg.parallel
    return _schedule(p.pp_schedule if p.pp > 1 else "", p.pp, p.pp_virtual, _micro_batches(cfg), pp_rank)


def _micro_batches(cfg: Config) -> int:
    p, m = cfg.parallel, cfg.train.grad_acc
    return m if p.pp == 1 or p.pp_schedule == "afab" else min(m, 2 * p.pp)


@functools.lru_cache(maxsize=1024)
def _schedule(name: str, pp: int, virtual: int, micro_batches: int, rank: int) -> tuple[Action, ...]:
    if not name:  # the second micro-batch on are alike but for the last, which reduces: those stand for all
        kept = sorted({0, 1, micro_batches - 1} & set(range(micro_batches)))
        return tuple(Action(backward, 0, k) for k in kept for backward in (False, True))
    return tuple(schedule(name, pp=pp, virtual=virtual, micro_batches=micro_batches, rank=rank))


@functools.lru_cache(maxsize=256)
def _timeline(name: str, pp: int, virtual: int, micro_batches: int, backward_cost: float) -> tuple:
    """(start, end) of every action of every pipeline rank, replayed with free communication: a forward
    takes 1, a backward `backward_cost`, each starts once its rank is free and its input has been sent
    (pipeline_schedules.replay)."""
    # the zero-bubble schedules' B and W take half a backward each
    cost = backward_cost / 2 if splits_backward(name) else backward_cost
    times = replay(name, pp=pp, virtual=virtual, micro_batches=micro_batches,
                   duration=lambda r, k, a: cost if a.backward else 1.0)
    return tuple(tuple(t) for t in times)


def pipeline_buffers(cfg: Config, pp_rank: int) -> list[int]:
    """For each action of `pp_rank`, how many [micro_batch, seq, hidden] buffers P2P holds meanwhile: the
    receive in use or posted ahead (one while any receiving action remains), and the tensors it has sent
    that are still held (pipeline_parallel keeps a send's tensor until the send is complete and its next
    `_post` drops it). A send completes once the receiver has posted the matching receive, which it does
    one at a time, in order, at the end of its previous receiving action (or at the start of the step)."""
    p = cfg.parallel
    if p.pp == 1:
        return [0] * len(_actions(cfg, pp_rank))
    return list(_buffers(p.pp_schedule, p.pp, p.pp_virtual, _micro_batches(cfg),
                         3.0 if cfg.train.recompute == "full" else 2.0)[pp_rank])


@functools.lru_cache(maxsize=256)
def _buffers(name: str, pp: int, virtual: int, micro_batches: int, backward_cost: float) -> tuple:
    """pipeline_buffers of every rank of one schedule."""
    times = _timeline(name, pp, virtual, micro_batches, backward_cost)
    orders = [_schedule(name, pp, virtual, micro_batches, r) for r in range(pp)]
    style = style_of(name)
    posted = {}  # message -> when its receive was posted
    for r, order in enumerate(orders):
        previous = 0.0
        for k, action in enumerate(order):
            need = receives(action, pp=pp, virtual=virtual, rank=r, style=style)
            if need is not None:
                posted[need[0]] = previous
                previous = times[r][k][1]
    result = []
    for r, order in enumerate(orders):
        ends = [end for _, end in times[r]]
        last = max((k for k, a in enumerate(order) if receives(a, pp=pp, virtual=virtual, rank=r, style=style)),
                   default=-1)
        held = [int(k <= last) for k in range(len(order))]
        for k, action in enumerate(order):
            out = sends(action, pp=pp, virtual=virtual, rank=r, style=style)
            if out is None:
                continue
            done = max(ends[k], posted[out[0]])
            drop = next((j for j in range(k + 1, len(ends)) if ends[j] >= done), len(ends))
            for j in range(k + 1, min(drop + 1, len(ends))):
                held[j] += 1
        result.append(tuple(held))
    return tuple(result)


def _moments(cfg: Config, s: Sizes, st: State, chunk: Chunk, held: Held, action: Action,
             attached: int) -> list[tuple[str, dict[str, int]]]:
    """The moments of one forward or backward of `chunk`, each with what it adds to (or, once the
    backward has released them, takes from) the bytes held for the backward pass."""
    backward = action.backward
    head = norm_bytes(s, s.n_res) if chunk.last else 0  # what the final norm saved, freed first
    found = []
    if chunk.last:
        name, extra = _loss_moments(cfg, s)[backward]
        found.append((name, 0, extra))
    # A layer's backward, the last layer first; later layers only matter where ZeRO-3's buffers grow (a
    # chunk of dense and MoE layers: released at their mean).
    per_layer = chunk_layers(s, chunk, cfg.train.recompute) // max(1, chunk.layers)
    for index in range(chunk.layers if backward and st.chunk_units else min(1, chunk.layers * backward)):
        found.append(("layer backward", index, {"logits": -held.loss, "activations": -head - index * per_layer,
                                                "temporaries": _layer_backward(cfg, s, chunk)}))
    if not backward:
        found.append(("forward", 0, {}))
    for name, index, extra in found:
        extra["params"], extra["grads"] = _zero_extras(s, st, chunk, name, attached=attached, index=index,
                                                       syncing=action.micro == _micro_batches(cfg) - 1
                                                       or accumulates_sharded(cfg),
                                                       which=action.chunk)
    return [(name, extra) for name, _, extra in found]


def predict_rank(cfg: Config, pp_rank: int = 0, *, dp_rank: int = 0) -> MemoryEstimate:
    """The peak of pipeline rank `pp_rank` over one steady-state step: the largest moment."""
    s, st = Sizes.of(cfg), state(cfg, pp_rank, dp_rank=dp_rank)
    chunks = rank_chunks(cfg, pp_rank)
    held = [chunk_held(cfg, s, c) for c in chunks]
    # Every micro-batch's token ids and targets (int64), cut to this rank's positions, for the whole step.
    ids = 2 * I64 * cfg.train.grad_acc * s.n
    base = MemoryEstimate(params=st.params, grads=st.grads, optimizer=st.optimizer, activations=ids,
                          pp_rank=pp_rank)
    best = replace(base, moment="between steps")
    acts = loss = 0
    buffers = pipeline_buffers(cfg, pp_rank)  # what crosses a stage boundary: one [b, s, h] each
    split = cfg.parallel.pp > 1 and splits_backward(cfg.parallel.pp_schedule)
    # zbh1, zbv with recompute: from B to W a layer holds its input and what W reads of the graph B rebuilt,
    # in place of what recompute kept (recompute.py; the first stage, without a B, rebuilds it within W)
    mode = cfg.train.recompute
    rebuilt = [sum(n * (s.n_res * s.d * s.h + layer_weight_inputs(s, moe) - layer_kept(s, mode, moe))
                   for n, moe in ((c.layers - c.moe, False), (c.moe, True)))
               if split and mode != "none" and not c.first else 0 for c in chunks]
    done: set[int] = set()  # chunks whose gradient buffers a backward left attached (ZeRO-2/3, full accumulation)
    most: dict[tuple, int] = {}  # per kind of moment, the most bytes held at one so far: fewer cannot be a peak
    best_total = best.total
    for k, action in enumerate(_actions(cfg, pp_rank)):
        chunk, h = chunks[action.chunk], held[action.chunk]
        if not action.backward:
            acts, loss = acts + h.activations, loss + h.loss
        attached = sum(st.chunk_units[c] for c in done | ({action.chunk} if done else set()))
        key = (action.chunk, action.backward, buffers[k], attached, action.micro == _micro_batches(cfg) - 1)
        comm = buffers[k] * s.n_res * s.d * s.h
        if acts + loss > most.get(key, -1):
            most[key] = acts + loss
            for name, extra in _moments(cfg, s, st, chunk, h, action, attached):
                if base.total + acts + loss + comm + sum(extra.values()) <= best_total:
                    continue
                best = replace(base, params=st.params + extra["params"], grads=st.grads + extra["grads"],
                               activations=ids + acts + extra.get("activations", 0),
                               logits=loss + extra.get("logits", 0), comm=comm,
                               temporaries=extra.get("temporaries", 0), moment=name)
                best_total = best.total
        if action.backward and split and not action.weight:
            acts += rebuilt[action.chunk]
        if action.backward and (action.weight or not split):  # zbh1, zbv: what B uses is kept for W
            acts, loss = acts - h.activations - rebuilt[action.chunk], loss - h.loss
            if st.chunk_units and cfg.train.grad_acc > 1 and not accumulates_sharded(cfg):
                done.add(action.chunk)
    # The optimizer step: activations gone; AdamW's temporaries (sqrt of the second moment, the update
    # denominator) and clipping's squares are each one piece in size, fp32.
    step = replace(base, temporaries=3 * F32 * st.largest, moment="optimizer step")
    return max(best, step, key=lambda e: e.total)


def predict(cfg: Config, *, ranks: list[int] | None = None) -> MemoryEstimate:
    """The worst pipeline rank's peak (every rank of one pipeline stage holds the same, up to ZeRO padding),
    over `ranks` (default: all; the first and the last suffice with an even split, where the first holds
    the most micro-batches in flight and the embedding, the last the logits)."""
    ranks = list(range(cfg.parallel.pp)) if ranks is None else ranks
    return max((predict_rank(cfg, r) for r in ranks), key=lambda e: e.total)


def floor(cfg: Config) -> MemoryEstimate:
    """A lower bound of `predict(cfg)` from arithmetic on the config alone: nothing built (not even on the meta
    device), no schedule walked, no loop over layers, so an absurd model (10**4 layers, a vocabulary of 10**9)
    is weighed at once. The busiest pipeline rank holds at least 1/(tp*pp) of the parameters (tp splits the
    matrices, pp the layers; ep the routed experts), each with its fp32 gradient and AdamW's two moments (plus
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
    in_flight = t.grad_acc if p.pp > 1 and p.pp_schedule == "afab" else 1
    residual = tokens // p.tp if p.sp else tokens
    return MemoryEstimate(params=(F32 if p.dp_impl == "naive" else d) * sharded(3), grads=F32 * sharded(2),
                          optimizer=(8 + 4 * bf16) * sharded(1),
                          activations=2 * I64 * t.grad_acc * tokens + in_flight * residual * d * m.hidden_size)
