"""The memory model: the bytes one rank holds at the peak of a training step, term by term.

Every formula here describes what tetron itself allocates (parallel/*.py, zero.py, model.py), checked
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
state) + the activations of the micro-batches in flight + what that moment adds: the loss and its
gradient over the logits, a decoder layer's backward (and its recomputed forward), or the optimizer
step. The pipeline schedule (parallel/pipeline_schedules.py) says which micro-batches are in flight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from tetron.config import Config
from tetron.parallel.pipeline_parallel import split_layers
from tetron.parallel.pipeline_schedules import (
    Action,
    receives,
    replay,
    schedule,
    sends,
    splits_backward,
    stage_of,
    style_of,
)
from tetron.parallel.tensor_parallel import padded_vocab_size
from tetron.parallel.ulysses import kv_repeats

F32, I64 = 4, 8  # bytes of an fp32 and an int64 element

# Fitted constants for short-lived tensors (bytes are these times the named size; see each use).
LAYER_BWD_I = 2.0  # a layer's backward: MLP-width activation gradients alive at once (grad of the product,
# of silu's output and of up; the layer's own saved tensors are being released meanwhile)
LAYER_BWD_H = 1.0  # ... and residual-width ones (the incoming gradient)


@dataclass(frozen=True)
class Sizes:
    """The sizes one rank's formulas use: the model's widths split by tp, the tokens it sees."""

    d: int  # bytes per element of parameters and activations (4 fp32, 2 bf16)
    h: int  # hidden size (the residual stream is never split in width)
    hq: int  # query width on this rank: heads/tp * head_dim
    hkv: int  # key/value width on this rank (before GQA repetition)
    heads: int  # query heads on this rank
    inter: int  # MLP width on this rank: intermediate/tp
    vocab: int  # vocabulary rows on this rank (padded under tp)
    hd: int  # head dim
    n: int  # tokens of one micro-batch on this rank: micro_batch * seq_len/cp
    n_res: int  # tokens of the residual stream between blocks: n, or n/tp under sequence parallelism
    seq: int  # positions of one sequence on this rank: seq_len/cp
    tp: int
    cp: int
    sp: bool  # sequence parallelism (with tp > 1)
    ulysses_kv: int = 0  # Ulysses attention (parallel.cp_impl): key/value width on this rank after the heads are
    # repeated for cp (hkv, or more); 0 under ring attention or without cp
    ulysses_views: bool = False  # Ulysses, contiguous layout: q, k, v stay views of the all-to-all's buffer
    doc_mask: int = 0  # bytes of the document mask (data.mask_documents) one micro-batch's forward keeps on a
    # chunk: [B, 1, T, T] in the compute dtype, shared by its layers; 0 under ring attention (it remakes
    # each block's mask in the backward) or without the option
    rope_rows: int = 1  # rows of the RoPE tables: 1, or micro_batch when positions restart per document

    @classmethod
    def of(cls, cfg: Config) -> Sizes:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        return _sizes(m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.intermediate_size,
                      m.vocab_size, p.tp, p.cp, p.sp, p.vocab_pad_multiple, cfg.data.seq_len, t.micro_batch,
                      t.dtype == "bfloat16", p.cp_impl, p.cp_layout, cfg.data.mask_documents,
                      cfg.data.reset_positions)


@functools.lru_cache(maxsize=4096)
def _sizes(h: int, heads: int, kv_heads: int, hd: int, inter: int, vocab: int, tp: int, cp: int, sp: bool,
           pad: int, seq_len: int, micro_batch: int, bf16: bool, cp_impl: str = "ring",
           cp_layout: str = "zigzag", mask_documents: bool = False, reset_positions: bool = False) -> Sizes:
    seq = seq_len // cp
    n = micro_batch * seq
    ulysses = cp_impl == "ulysses" and cp > 1 and (heads // tp) % cp == 0
    whole_mask = mask_documents and (cp == 1 or ulysses)  # the kernel sees the whole sequence
    kv = kv_heads // tp * (kv_repeats(heads // tp, kv_heads // tp, cp) if ulysses else 1) * hd
    return Sizes(d=2 if bf16 else 4, h=h, hq=heads // tp * hd, hkv=kv_heads // tp * hd, heads=heads // tp,
                 inter=inter // tp, vocab=padded_vocab_size(vocab, tp, pad) // tp if tp > 1 else vocab, hd=hd,
                 n=n, n_res=n // tp if sp else n, seq=seq, tp=tp, cp=cp, sp=sp and tp > 1,
                 ulysses_kv=kv if ulysses else 0, ulysses_views=ulysses and cp_layout == "contiguous",
                 doc_mask=micro_batch * seq_len * seq_len * (2 if bf16 else 4) if whole_mask else 0,
                 rope_rows=micro_batch if reset_positions else 1)


# ------------------------------------------------------------------------------------ parameters


@dataclass(frozen=True)
class Chunk:
    """One model chunk on a rank: its decoder layers, whether it embeds (first) or holds the head (last)."""

    layers: int
    first: bool
    last: bool


def rank_chunks(cfg: Config, pp_rank: int) -> list[Chunk]:
    """The chunks pipeline rank `pp_rank` holds, in virtual-stage order (pipeline_parallel.rank_stages)."""
    p = cfg.parallel
    stages = p.pp * p.pp_virtual
    ranges = split_layers(cfg.model.num_hidden_layers, stages, p.pp_split)
    held = [stage_of(c, pp_rank, pp=p.pp, style=style_of(p.pp_schedule)) for c in range(p.pp_virtual)]
    return [Chunk(len(ranges[s]), s == 0, s == stages - 1) for s in held]


def layer_numels(cfg: Config) -> list[int]:
    """Elements of one decoder layer's parameters on a rank, in `parameters()` order: q, k, v, o,
    gate, up, down (each 1/tp), then the two RMSNorm weights (whole)."""
    s = Sizes.of(cfg)
    h = s.h
    return [s.hq * h, s.hkv * h, s.hkv * h, h * s.hq, s.inter * h, s.inter * h, h * s.inter, h, h]


def chunk_units(cfg: Config, chunk: Chunk) -> list[list[int]]:
    """A chunk's parameters as ZeRO-3's units (zero.units_of): first the rest of the chunk (embedding,
    final norm, head; the head is the embedding's own Parameter when tied on one chunk), then each layer."""
    s, tied = Sizes.of(cfg), cfg.model.tie_word_embeddings
    root = [s.vocab * s.h] if chunk.first else []
    if chunk.last:
        root.append(s.h)
        if not (tied and chunk.first):
            root.append(s.vocab * s.h)
    return [root] + [layer_numels(cfg) for _ in range(chunk.layers)]


@dataclass(frozen=True)
class Bucket:
    """One fp32 gradient bucket (parallel/data_parallel._Bucket): its parameters' sizes in buffer
    order, padded to a multiple of the shards."""

    numels: tuple[int, ...]
    shards: int

    @functools.cached_property
    def padded(self) -> int:
        return -(-sum(self.numels) // self.shards) * self.shards

    @functools.cached_property
    def slice_size(self) -> int:
        return self.padded // self.shards

    def owned(self, rank: int) -> tuple[int, int]:
        """(elements, pieces) of slice `rank`: the real elements it holds and how many parameters they touch."""
        lo, hi = rank * self.slice_size, (rank + 1) * self.slice_size
        elements = pieces = start = 0
        for numel in self.numels:
            overlap = min(start + numel, hi) - max(start, lo)
            if overlap > 0:
                elements, pieces = elements + overlap, pieces + 1
            start += numel
        return elements, pieces


def chunk_buckets(cfg: Config, chunk: Chunk) -> list[Bucket]:
    """The chunk's buckets in backward order: one per ZeRO-3 unit, else filled to parallel.bucket_mb
    from the last parameter backwards (DataParallelBucket._size_buckets)."""
    p = cfg.parallel
    shards = p.dp * p.cp if p.zero >= 1 else 1
    units = tuple(tuple(u) for u in chunk_units(cfg, chunk))
    return list(_buckets(units, chunk.first, shards, p.zero == 3, p.bucket_mb))


@functools.lru_cache(maxsize=4096)
def _buckets(units: tuple, first: bool, shards: int, per_unit: bool, bucket_mb: float) -> tuple[Bucket, ...]:
    if per_unit:
        return tuple(Bucket(u, shards) for u in reversed(units) if u)
    root, *layers = units
    embed = root[:1] if first else ()
    numels = [*embed, *(n for layer in layers for n in layer), *root[len(embed):]]  # parameters() order
    limit = max(1, int(bucket_mb * 2**20 / 4))
    buckets, group = [], []
    for numel in reversed(numels):
        group.append(numel)
        if sum(group) >= limit:
            buckets.append(Bucket(tuple(group), shards))
            group = []
    if group:
        buckets.append(Bucket(tuple(group), shards))
    return tuple(buckets)


# ------------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class State:
    """What one rank holds from step to step (ZeRO-3: between uses), and what ZeRO adds during a step."""

    params: int  # parameters in the compute dtype: per-parameter tensors, ZeRO's flat buffers, or ZeRO-3's slices
    grads: int  # fp32 bucket buffers (ZeRO-2/3: only this rank's slices between steps)
    optimizer: int  # fp32 master weights where they are not the parameters, AdamW's moments, its step counters
    largest: int  # elements of the largest piece AdamW updates (its step makes temporaries of that size)
    root: int = 0  # ZeRO-3: elements of a first/last chunk's non-layer unit (embedding, final norm, head), padded
    layer: int = 0  # ZeRO-3: elements of one decoder layer's unit, padded
    chunk_units: tuple[int, ...] = ()  # ZeRO-2/3: elements of each chunk's gradient buffers together, padded
    lazy_buckets: tuple[tuple[int, ...], ...] = ()  # ZeRO-2: each chunk's buffers' elements, in backward order
    head: tuple[int, ...] = ()  # ZeRO-2: each chunk's elements before its first layer's, in backward order
    layer_elements: int = 0  # ZeRO-2: one decoder layer's elements


def _optimizer_bytes(cfg: Config, buckets: list[Bucket], dp_rank: int) -> tuple[int, int]:
    """(bytes, largest piece) of the optimizer state: zero.ShardedAdamW's pieces of this rank's slices."""
    p, shards = cfg.parallel, cfg.parallel.dp * cfg.parallel.cp if cfg.parallel.zero >= 1 else 1
    bf16 = cfg.train.dtype == "bfloat16"
    if shards == 1:
        numels = [n for b in buckets for n in b.numels]
        # Plain fp32: AdamW over the parameters themselves (exp_avg + exp_avg_sq, and a 4-byte step each);
        # bf16: plus an fp32 master copy of every parameter (Megatron: 12 + 2 bytes per parameter).
        return (8 + 4 * bf16) * sum(numels) + 4 * len(numels), max(numels)
    owned = [b.owned(dp_rank) for b in buckets]
    elements, pieces = sum(e for e, _ in owned), sum(k for _, k in owned)
    # ZeRO: moments of this rank's pieces only; fp32 masters are views of its parameter slice (no copy),
    # bf16 ones are fp32 copies of its pieces. Largest piece: at most a slice, at most a parameter.
    largest = max(min(b.slice_size, max(b.numels)) for b in buckets)
    return (8 + 4 * bf16) * elements + 4 * pieces, largest if p.dp_impl == "bucket" else 0


def state(cfg: Config, pp_rank: int, *, dp_rank: int = 0) -> State:
    """The persistent bytes of pipeline rank `pp_rank` (and dp*cp rank `dp_rank`, whose ZeRO slices
    differ from the others' by padding only). ZeRO's 1/N of optimizer state (stage 1), gradients (2) and
    parameters (3) as in Rajbhandari et al. 2020 and the Ultra-Scale Playbook, on tetron's buckets: each
    padded to a multiple of N = dp*cp, every gradient in fp32 whatever the compute dtype (Megatron's
    main_grad), one bucket per decoder layer under ZeRO-3 (FSDP2's unit)."""
    p, d = cfg.parallel, Sizes.of(cfg).d
    chunks = rank_chunks(cfg, pp_rank)
    buckets = [b for c in chunks for b in chunk_buckets(cfg, c)]
    shards = buckets[0].shards
    padded = sum(b.padded for b in buckets)
    slices = sum(b.slice_size for b in buckets)
    optimizer, largest = _optimizer_bytes(cfg, buckets, dp_rank)
    if p.zero == 3 and shards > 1:
        units = [chunk_buckets(cfg, c) for c in chunks]
        root = max((u[-1].padded for u, c in zip(units, chunks) if c.first or c.last), default=0)
        layer = max((u[0].padded for u, c in zip(units, chunks) if c.layers), default=0)
        # ZeRO-3: a clone of this rank's slice of every unit; the full flat buffers exist only while gathered
        return State(params=d * slices, grads=F32 * slices, optimizer=optimizer, largest=largest, root=root,
                     layer=layer, chunk_units=tuple(sum(b.padded for b in u) for u in units))
    if p.dp_impl == "naive":  # fp32 only: a .grad per parameter, AdamW over the parameters
        return State(params=F32 * padded, grads=F32 * padded, optimizer=optimizer, largest=largest)
    if p.zero >= 2 and shards > 1:  # the slices persist; a full buffer lives from its first gradient to its reduction
        per_chunk = [chunk_buckets(cfg, c) for c in chunks]
        units = [chunk_units(cfg, c) for c in chunks]
        return State(params=d * padded, grads=F32 * slices, optimizer=optimizer, largest=largest,
                     chunk_units=tuple(sum(b.padded for b in bs) for bs in per_chunk),
                     lazy_buckets=tuple(tuple(b.padded for b in bs) for bs in per_chunk),
                     head=tuple(sum(u[0][1:] if c.first else u[0]) for u, c in zip(units, chunks)),
                     layer_elements=sum(layer_numels(cfg)))
    # ZeRO-0/1 (or nothing to shard): every bucket buffer is allocated once and kept; with shards > 1 the
    # parameters live in one flat buffer per bucket, padded like it.
    return State(params=d * padded, grads=F32 * padded, optimizer=optimizer, largest=largest)


# ------------------------------------------------------------------------------------ activations


def _norm(s: Sizes, tokens: int) -> int:
    """What an RMSNorm saves (model.RMSNorm, computed in fp32): its input in fp32 (the input itself in
    fp32, a copy in bf16), 1/rms per token, and the normalized input in the compute dtype."""
    return tokens * (F32 * s.h + F32 + s.d * s.h)


def _attention(s: Sizes) -> int:
    """What attention saves: q, k and v as the kernel sees them and its output, in the compute dtype, and
    the fp32 log-sum-exp per head. The fused kernel keeps no [s, s] scores (Korthikanti's 5as/h term is
    gone). Without cp, GQA's k and v are repeated to every query head before the kernel (hq each), and
    the output is already laid out for o_proj. Ring attention keeps its own contiguous k and v (hkv
    each) and its output in [B, H, T, D], which o_proj's input reshape copies (one more hq). Ulysses
    attention keeps what the kernel keeps (q, its k and v: repeated to every query head where the rank's
    heads are grouped, its output) and o_proj's copy; under the contiguous layout the kernel's q is a view
    of the all-to-all's buffer, which then stays whole (its k and v parts too)."""
    if s.cp == 1:
        return s.n * (4 * s.d * s.hq + F32 * s.heads)
    if s.ulysses_kv:
        grouped = s.ulysses_kv < s.hq
        kernel_kv = s.hq if grouped else s.ulysses_kv
        buffer = 2 * s.ulysses_kv if s.ulysses_views and grouped else 0  # k, v parts that the q view keeps
        return s.n * (s.d * (3 * s.hq + 2 * kernel_kv + buffer) + F32 * s.heads)
    return s.n * (s.d * (3 * s.hq + 2 * s.hkv) + F32 * s.heads)


def layer_none(s: Sizes) -> int:
    """One decoder layer's saved tensors without recomputation, for one micro-batch. Korthikanti's
    sbh(34 + 5as/h) for GPT becomes, for this Llama (no dropout, SwiGLU, RMSNorm in fp32): two norms
    (on the residual stream, 1/tp of it under sp), the two norm outputs as the column-parallel matmuls
    see them (the whole sequence, all-gathered under sp), attention, and the MLP's gate, silu(gate),
    up and their product (4 x intermediate/tp). fp32, tp 1, no GQA: 24h + 16hq + 16i + 4 heads + 8
    bytes a token (tests/test_recompute.py measures 1,185,792 for its model: this formula exactly)."""
    # Under sp the norm outputs are all-gathered into a strided view, which F.linear copies for each of
    # q, k, v, gate and up: five copies of [n, h] where tp without sp saves the one norm output twice.
    inputs = 5 if s.sp else 2
    return 2 * _norm(s, s.n_res) + inputs * s.n * s.d * s.h + _attention(s) + s.n * 4 * s.d * s.inter


def layer_kept(s: Sizes, mode: str) -> int:
    """What a layer keeps between its forward and backward under recomputation (recompute.py): its input
    always (on the residual stream); `selective` also every matmul output and attention's outputs: q, k,
    v, attention output (+ log-sum-exp), o and down (whole width: row-parallel partial sums), gate, up."""
    kept = s.n_res * s.d * s.h
    if mode == "selective":
        attention = s.d * (2 * s.hq + 2 * s.hkv) + F32 * s.heads
        kept += s.n * (attention + 2 * s.d * s.h + 2 * s.d * s.inter)
    return kept


def layer_activations(s: Sizes, mode: str) -> int:
    return layer_none(s) if mode == "none" else layer_kept(s, mode)


@dataclass(frozen=True)
class Held:
    """Bytes one micro-batch leaves on a chunk until its backward: activations, and the loss's saved softmax."""

    activations: int
    loss: int


def chunk_held(cfg: Config, s: Sizes, chunk: Chunk) -> Held:
    """One micro-batch's saved tensors on one chunk: its layers, the RoPE tables the layers share (cos and
    sin for this rank's positions, per row when they restart per document), the document mask, the
    embedding's indices under tp (ids local to the shard and the mask of ids outside it), the final norm
    and the head's input, and the loss's softmax (fp32)."""
    mode = cfg.train.recompute
    acts = chunk.layers * layer_activations(s, mode) + 2 * s.rope_rows * s.seq * s.hd * s.d + s.doc_mask
    if chunk.first and s.tp > 1:
        acts += s.n * (I64 + 1)
    if not chunk.first and cfg.train.dtype == "bfloat16" and mode == "none":
        acts += s.n_res * s.d * s.h  # the received bf16 input, besides the first norm's fp32 copy of it
    loss = 0
    if chunk.last:
        acts += _norm(s, s.n_res) + s.n * s.d * s.h
        # tp 1: log_softmax's output; tp > 1: the vocab-parallel softmax, the target index and its mask
        loss = s.n * s.vocab * F32 + (s.n * (I64 + 1) if s.tp > 1 else 0)
    return Held(acts, loss)


# ------------------------------------------------------------------------------------ the peak

TERMS = ("params", "grads", "optimizer", "activations", "logits", "comm", "temporaries")


@dataclass
class MemoryEstimate:
    """Predicted bytes one rank holds at the peak of a step, by kind, and where the peak falls."""

    params: int = 0  # parameters in the compute dtype (ZeRO-3: slices, plus the units gathered at the peak)
    grads: int = 0  # fp32 gradient buckets (ZeRO-2/3: slices, plus the full buffers alive at the peak)
    optimizer: int = 0  # fp32 master weights that are not the parameters, AdamW's moments and step counters
    activations: int = 0  # saved for backward, every micro-batch in flight: layers, norms, RoPE, token ids
    logits: int = 0  # the logits and the loss's fp32 copies of them (softmax, its gradient)
    comm: int = 0  # P2P buffers of what crosses a stage boundary: in use, posted ahead, or not yet sent
    temporaries: int = 0  # short-lived tensors at the peak: a layer's recomputed forward, activation gradients
    moment: str = ""  # where in the step the peak falls
    pp_rank: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, t) for t in TERMS)

    def terms(self) -> dict[str, int]:
        return {t: getattr(self, t) for t in TERMS}

    def largest(self, k: int = 3) -> list[tuple[str, int]]:
        """The k largest terms, largest first."""
        return sorted(self.terms().items(), key=lambda kv: -kv[1])[:k]


def _loss_moments(s: Sizes, *, pipelined: bool, bf16: bool) -> list[tuple[str, int, int]]:
    """(moment, logits bytes, temporaries) of the loss on the last chunk, beyond its saved softmax (the
    Ultra-Scale Playbook's point that the [tokens, vocab] logits, in fp32 for the loss, can outweigh a layer;
    the vocabulary-parallel loss holds 1/tp of them, Megatron's cross entropy).
    Forward: the logits and the copies the loss makes of them (bf16: an fp32 copy; tp: the masked and
    shifted logits of the vocab-parallel softmax). Backward: the softmax's gradient and the logits'
    (tp: the softmax's clone and the scaled result). Without pp the training loop still holds the
    logits during the backward; a pipeline stage drops them once the loss is computed."""
    v = s.n * s.vocab
    logits = s.d * v
    alive = 0 if pipelined else logits
    copies = F32 * v if bf16 else 0
    forward = logits + copies + (2 * F32 * v if s.tp > 1 else 0)
    backward = alive + 2 * F32 * v
    return [("loss forward", forward, 0), ("loss backward", backward, 0)]


def _layer_backward(cfg: Config, s: Sizes) -> int:
    """Temporaries of a decoder layer's backward at its worst: its recomputed forward (all it would have
    saved minus what it kept), the activation gradients alive at once (fitted: LAYER_BWD_*), and under
    cp the ring's gradient blocks."""
    mode = cfg.train.recompute
    extra = 0 if mode == "none" else layer_none(s) - layer_kept(s, mode)
    grads = int(LAYER_BWD_I * s.n * s.inter * s.d + LAYER_BWD_H * s.n * s.h * s.d)
    if s.cp > 1:
        grads += s.n * (F32 * s.hq + 2 * F32 * s.hkv + 2 * s.d * s.hkv)  # dq, dk, dv in fp32; the next k, v
    return extra + grads


def _zero_extras(s: Sizes, st: State, chunk: Chunk, moment: str, *, attached: int, index: int,
                 syncing: bool, which: int) -> tuple[int, int]:
    """(params, grads) that ZeRO adds at a moment, at the backward of chunk `which`'s `index`-th layer from
    the end. A full gradient buffer (ZeRO-2/3) is allocated when its first gradient of the step arrives
    (ZeRO-3: when its unit's backward begins) and released once reduced; when `syncing` (the step's last
    micro-batch) a reduced buffer goes when the next one is reduced, so at most two are alive; before
    that (gradient accumulation) all stay, and `attached` counts those an earlier backward of this step
    left. ZeRO-3 also gathers units: the root while the chunk's forward or head backward runs, and on a
    first chunk until the embedding's gradient at the very end; the current layer and the one before."""
    if st.lazy_buckets:
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
    touched, start = [], 0
    for size in st.lazy_buckets[which]:
        if start >= max(reached, 1):
            break
        touched.append(size)
        start += size
    return sum(touched[-2:] if syncing else touched)


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
    pipelined, bf16, backward = cfg.parallel.pp > 1, cfg.train.dtype == "bfloat16", action.backward
    alive = s.d * s.n * s.vocab if chunk.last and not pipelined else 0  # the loop's logits (see _loss_moments)
    head = _norm(s, s.n_res) + s.n * s.d * s.h if chunk.last else 0  # final norm and head input, freed first
    found = []
    if chunk.last:
        fwd, bwd = _loss_moments(s, pipelined=pipelined, bf16=bf16)
        name, logits, temps = bwd if backward else fwd
        found.append((name, 0, {"logits": logits, "temporaries": temps}))
    if backward and chunk.last:  # the head's backward: the logits' fp32 gradient, its weight gradient
        found.append(("head backward", 0, {"logits": alive + F32 * s.n * s.vocab - held.loss,
                                           "temporaries": s.n * s.d * s.h + s.vocab * s.h * s.d}))
    # A layer's backward, the last layer first; later layers only matter where ZeRO-3's buffers grow.
    per_layer = layer_activations(s, cfg.train.recompute)
    for index in range(chunk.layers if backward and st.chunk_units else min(1, chunk.layers * backward)):
        found.append(("layer backward", index, {"logits": alive - held.loss, "activations": -head - index * per_layer,
                                                "temporaries": _layer_backward(cfg, s)}))
    if not backward:
        found.append(("forward", 0, {}))
    for name, index, extra in found:
        extra["params"], extra["grads"] = _zero_extras(s, st, chunk, name, attached=attached, index=index,
                                                       syncing=action.micro == _micro_batches(cfg) - 1,
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
    done: set[int] = set()  # chunks whose gradient buffers a backward left attached (ZeRO-3, grad_acc > 1)
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
        if action.backward and (action.weight or not split):  # zbh1, zbv: what B uses is kept for W
            acts, loss = acts - h.activations, loss - h.loss
            if st.chunk_units and cfg.train.grad_acc > 1:
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
