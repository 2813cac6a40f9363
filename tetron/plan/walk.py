"""What a pipeline rank's micro-batches hold through a step, for the memory model (plan/memory.py): its forwards and
backwards in the schedule's order (plan/pipeline.py), the activations and loss gradients in flight at each, and the
moments of each action (the head and the loss, a layer's backward, an MoE layer's combining all-to-all) with what they
add. None of it depends on how ZeRO holds the state, so a search walks each rank once for the layouts that differ only
in that (plan/keys.py); memory.predict_rank adds ZeRO's terms moment by moment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tetron.config import Config
from tetron.parallel.pipeline_schedules import Action, splits_backward
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
from tetron.plan.sizes import F32, I64, Sizes
from tetron.plan.state import Chunk, chunk_units, rank_chunks

# Fitted constants for short-lived tensors (bytes are these times the named size; see each use).
LAYER_BWD_I = 4.0  # a layer's backward: MLP-width tensors alive at once (fused.gated_linear's: silu(gate)
# recomputed, the gradients of the product, of silu's output and of up; the layer's own saved tensors are being
# released meanwhile)
LAYER_BWD_H = 1.0  # ... and residual-width ones (the incoming gradient)


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


@dataclass(frozen=True, slots=True)
class Moment:
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


def _moments(cfg: Config, s: Sizes, chunk: Chunk, held: Held, action: Action) -> tuple[tuple[Moment, ...], ...]:
    """The moments of one forward or backward of `chunk`, whatever ZeRO holds, in order, in groups: a layer
    backward's group is taken once per layer of the chunk, from its end (predict_rank: the last layer alone where
    ZeRO's buffers do not grow layer by layer)."""
    backward = action.backward
    head = norm_bytes(s, s.n_res) if chunk.last else 0  # what the final norm saved, freed first
    groups = []
    if chunk.last:
        name, extra = _loss_moments(cfg, s)[backward]
        groups.append((Moment(name, True, extra, sum(extra.values())),))
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
            layer.append(Moment("layer backward", experts, extra, sum(extra.values()), per_layer))
        groups.append(tuple(layer))
    if not backward:
        groups.append((Moment("forward", True, {}, 0),))
    if not backward and chunk.moe and moe_forward(s):
        # an MoE layer's combining all-to-all (its last MoE layer taken as the chunk's last layer): before the
        # final norm, the loss and (without recomputation) the combine's two saved [M, H] outputs
        combine = 2 * s.n_mlp * s.top_k * s.h * s.d if cfg.train.recompute == "none" else 0
        extra = {"logits": -held.loss, "activations": -head - combine, "temporaries": moe_forward(s)}
        groups.append((Moment("forward", True, extra, sum(extra.values())),))
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
class Reached:
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
class Walk:
    """What a rank's micro-batches hold, whatever ZeRO holds besides: per kind of moment its most (`Reached`, in
    walk order), each chunk's `Held`, and the step's token ids."""

    reached: tuple[Reached, ...]
    held: tuple[Held, ...]
    ids: int
    sizes: Sizes
    chunks: tuple[Chunk, ...]
    moments: dict = field(default_factory=dict)  # _moments by (chunk, backward, weight), as asked for

    def moments_of(self, cfg: Config, action: Action) -> tuple[tuple[Moment, ...], ...]:
        key = (action.chunk, action.backward, action.weight)
        if key not in self.moments:
            self.moments[key] = _moments(cfg, self.sizes, self.chunks[action.chunk], self.held[action.chunk], action)
        return self.moments[key]


WALKS = Memo()


def walk(cfg: Config, pp_rank: int) -> Walk:
    """The rank's forwards and backwards in order (pipeline.actions), with the micro-batches in flight at each: the
    same for the layouts that differ only in ZeRO (keys.py), so a search walks each once."""
    return WALKS.get((micro_batch_key(cfg), pp_rank), lambda: _walked(cfg, pp_rank))


def _walked(cfg: Config, pp_rank: int) -> Walk:
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
    most: dict[tuple, Reached] = {}  # per kind of moment, the first action holding its most
    for k, action in enumerate(actions(cfg, pp_rank)):
        h = held[action.chunk]
        if not action.backward:
            acts, loss = acts + h.activations, loss + h.loss
        kind = (action.chunk, action.backward, action.weight, buffers[k], done, action.micro == last)
        if kind not in most or acts + loss > most[kind].acts + most[kind].loss:
            most[kind] = Reached(k, action, buffers[k], done, kind[5], acts, loss)
        if action.backward and split and not action.weight:
            acts += rebuilt[action.chunk]
        if action.backward and (action.weight or not split):  # zbh1, zbv: what B uses is kept for W
            acts, loss = acts - h.activations - rebuilt[action.chunk], loss - h.loss
            if cfg.train.grad_acc > 1 and action.chunk not in done:
                done = done | {action.chunk}
    return Walk(tuple(sorted(most.values(), key=lambda r: r.step)), held, ids, s, tuple(chunks))
