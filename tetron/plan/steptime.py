"""The time model: how long one training step of a layout takes, and where the time goes.

    step = pipeline span (every micro-batch's forward and backward, with the tp and cp collectives and
           the stage-to-stage P2P inside them, played through the schedule: pipeline_schedules.simulate,
           so the bubble comes from the schedule itself) + the data-parallel communication that the
           backward pass does not hide + the optimizer step + a checkpoint save's blocking time over
           checkpoint.save_every steps

Compute is FLOPs at a device's efficiency figure (hardware.py): per token and layer 2 FLOPs per weight forward (4
backward), and causal attention's 2*s*hq forward (the usual 4*s*hq halved by the mask; s the keys a query reaches, a
sliding-window layer's window where shorter than the sequence), the head's 2*V*h; full recomputation adds one
forward of the layers, selective recomputation (Korthikanti's) one more attention core forward per layer (under ring
attention the ring's forward, its transfers too). Communication is the ring algorithms' volume per rank (the
Ultra-Scale Playbook's table: all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n of the tensor) at the
bandwidth of the slowest link the group spans (inside a node when all its ranks are: tp innermost, then cp, dp, pp,
as mesh.py lays them out), plus a latency per message. Overlap: the bucketed gradient reduction runs during the
backward pass (only what exceeds the last micro-batch's backward, or at least the last bucket, is exposed), ring
attention's key/value transfer during the block computations, ZeRO-3's prefetched gathers during compute. Ulysses
attention's four all-to-alls per layer (each rank sends (cp-1)/cp of its q, k, v or output, or their gradients)
block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tetron.config import Config
from tetron.optim import optimizer_class
from tetron.parallel.pipeline_schedules import simulate, splits_backward
from tetron.plan.hardware import Hardware
from tetron.plan.keys import Memo, micro_batch_key, model_repr
from tetron.plan.muon import muon_work
from tetron.plan.sizes import Sizes
from tetron.plan.state import (
    accumulates_sharded,
    chunk_buckets,
    expert_shards,
    layer_matmul_numels,
    rank_chunks,
    zero_shards,
)


@dataclass
class TimeEstimate:
    """Predicted seconds of one step, and their parts."""

    step_s: float  # the whole step
    compute_s: float  # the busiest pipeline rank's forward, backward and recompute at the efficiency figure
    bubble: float  # idle fraction of the pipeline span (0 without pp)
    tp_s: float  # tensor-parallel collectives (not overlapped)
    cp_s: float  # ring attention's transfers that the block computations do not hide, or Ulysses' all-to-alls
    pp_s: float  # stage-to-stage P2P
    ep_s: float  # expert parallelism's all-to-alls (dispatch and combine, forward and backward; not overlapped)
    dp_s: float  # gradient reduction (and ZeRO's gathers) not hidden by the backward pass
    optimizer_s: float  # the optimizer step: its state streamed through memory once or twice; Muon's Newton-Schulz
    # matmuls and tp gathers (plan/muon.py)
    save_s: float  # a checkpoint save's blocking time, per step of its checkpoint.save_every
    tokens_per_s: float
    mfu: float  # model FLOPs (6N + 12*L*h*s per token; MoE: N active) per second over the peak of all devices


def _bandwidth(hw: Hardware, span: int, gpus_per_node: int) -> float:
    """Bytes/s of a group whose ranks span `span` consecutive global ranks: inside one node, or not."""
    return (hw.intra_gbs if span <= gpus_per_node else hw.inter_gbs) * 1e9


def _ring(hw: Hardware, nbytes: float, n: int, factor: float, bandwidth: float) -> float:
    """Seconds of one ring collective over n ranks moving factor*(n-1)/n of nbytes per rank."""
    if n <= 1:
        return 0.0
    return hw.latency_s + factor * (n - 1) / n * nbytes / bandwidth


def _chunk_costs(cfg: Config, hw: Hardware, gpus_per_node: int) -> dict[str, list[float]]:
    """Seconds of one forward and one backward of each pipeline rank's chunks for one micro-batch, with
    their tp and cp collectives and the P2P of the stage's output or input gradient (in rank order, each
    rank's chunks in virtual-stage order), and the per-layer tp and cp and the per-message P2P costs."""
    s, p = Sizes.of(cfg), cfg.parallel
    rate = hw.flops(cfg.train.dtype)
    # forward FLOPs of a dense and of an MoE layer: its matmul weights (an MoE layer's: those one token's
    # top_k experts use); an MoE model's mlp, whole on every tp rank, on the n_mlp tokens it sees
    # causal attention's forward, 2*s*hq a token, s the keys a query reaches (a sliding window's, where shorter):
    # the model's count (12*H*s a layer for training, unhalved), its mean over the layers, 1/tp of the heads
    attention_per_token = cfg.model.attention_flops_per_token(cfg.data.seq_len) / (6 * cfg.model.num_hidden_layers
                                                                                   * p.tp)
    per_layer, per_moe = (s.n * (2 * layer_matmul_numels(cfg, moe=moe, whole=False) + attention_per_token)
                          + s.n_mlp * 2 * layer_matmul_numels(cfg, moe=moe, whole=True) for moe in (False, True))
    tp_bw = _bandwidth(hw, p.tp, gpus_per_node)
    act = s.n * s.h * s.d  # one residual-stream tensor
    # tp: two all-reduces (sp: all-gather + reduce-scatter, the same volume) per layer forward, two backward
    tp_layer = 2 * _ring(hw, act, p.tp, 2.0, tp_bw)
    regather = 2 * _ring(hw, act, p.tp, 1.0, tp_bw) if s.regather else 0.0  # sp_regather: each block's input again
    cp_bw = _bandwidth(hw, p.tp * p.cp, gpus_per_node)
    kv = 2 * s.n * s.hkv * s.d
    attention = s.n * attention_per_token / rate
    cp_fwd = max(0.0, (p.cp - 1) * (hw.latency_s + kv / cp_bw) - attention) if p.cp > 1 else 0.0
    # the blocks again, and their fp32 gradients travelling with them; recomputation (either mode: selective
    # recomputes the ring's forward too, context_parallel.ring_attention) sends the forward's blocks once more
    cp_bwd = (4 if cfg.train.recompute != "none" else 3) * cp_fwd
    if s.ulysses_kv:  # Ulysses: all-to-all of q, k, v, then of the output (backward: the inverses), not hidden
        cp_fwd = (_ring(hw, s.n * s.d * (s.hq + 2 * s.ulysses_kv), p.cp, 1.0, cp_bw)
                  + _ring(hw, s.n * s.d * s.hq, p.cp, 1.0, cp_bw))
        cp_bwd = cp_fwd * (2 if cfg.train.recompute == "full" else 1)  # recomputation repeats the forward's
    ep_fwd, ep_bwd = expert_exchange(cfg, hw, gpus_per_node)
    p2p = hw.latency_s + act / _bandwidth(hw, p.dp * p.cp * p.tp * 2, gpus_per_node) if p.pp > 1 else 0.0
    recompute = cfg.train.recompute == "full"
    # selective recomputation runs each layer's attention core again (models/core_recompute.py): the kernel, or
    # the ring's blocks (whose exposed transfers cp_bwd counts)
    core_again = attention
    fwd, bwd = [], []
    for chunk in [c for r in range(p.pp) for c in rank_chunks(cfg, r)]:
        dense = chunk.layers - chunk.moe
        layers_flops = dense * per_layer + chunk.moe * per_moe
        # the head; with multi-token prediction each module's head and its eh_proj [h, 2h] besides (its layer is
        # in layers_flops)
        flops = layers_flops + (2 * s.n * s.vocab * s.h if chunk.last else 0) + chunk.mtp * (
            2 * s.n * s.vocab * s.h + 4 * s.n * s.h * s.h)
        compute = flops / rate + chunk.layers * hw.overhead_s / 3
        f = compute + chunk.layers * (tp_layer + cp_fwd) + chunk.moe * ep_fwd + p2p
        b = (2 * compute + chunk.layers * (tp_layer * (2 if recompute else 1) + regather + cp_bwd)
             + chunk.moe * ep_bwd + p2p)
        if recompute:
            b += layers_flops / rate
        elif cfg.train.recompute == "selective":
            b += chunk.layers * core_again
        fwd.append(f)
        bwd.append(b)
    return {"forward": fwd, "backward": bwd, "tp": [tp_layer], "cp": [cp_fwd + cp_bwd], "p2p": [p2p],
            "ep": [ep_fwd + ep_bwd]}


def all_to_all_bytes(cfg: Config) -> int:
    """Bytes one rank sends to the other ranks of its ep group in one MoE layer's all-to-alls of one
    micro-batch, forward and backward: its n tokens' (under sp n/tp: Sizes.n_mlp) n*top_k rows of [H] go to
    their experts' ranks (dispatch) and come back (combine), and the backward sends their gradients the
    reverse ways: 4 exchanges of n*top_k*H elements, of which (ep-1)/ep leave the rank when the router
    spreads the tokens evenly. Full recomputation replays the forward's two. 0 without
    expert parallelism."""
    s, ep = Sizes.of(cfg), cfg.parallel.ep
    exchanges = 4 + (2 if cfg.train.recompute == "full" else 0)
    return exchanges * s.n_mlp * s.top_k * s.h * s.d * (ep - 1) // ep if ep > 1 else 0


def expert_exchange(cfg: Config, hw: Hardware, gpus_per_node: int) -> tuple[float, float]:
    """Seconds of one MoE layer's all-to-alls for one micro-batch (expert_parallel.ExpertExchange), forward and
    backward: the forward exchanges the counts per expert, then dispatches the rows and combines them (each
    sending (ep-1)/ep of n*top_k rows of [H]); the backward sends both gradients back, and under full recomputation
    replays the forward's three. The ep group is ep ranks of dp*cp, tp apart (mesh.py): it spans tp*ep ranks."""
    s, p = Sizes.of(cfg), cfg.parallel
    if p.ep == 1:
        return 0.0, 0.0
    bw = _bandwidth(hw, p.tp * p.ep, gpus_per_node)
    rows = _ring(hw, s.n_mlp * s.top_k * s.h * s.d, p.ep, 1.0, bw)
    forward = hw.latency_s + 2 * rows
    return forward, 2 * rows + (forward if cfg.train.recompute == "full" else 0.0)


def _pipeline_span(cfg: Config, costs: dict[str, list[float]]) -> tuple[float, float, float]:
    """(span, busiest rank's busy time, idle fraction) of every micro-batch through the schedule."""
    p, m = cfg.parallel, cfg.train.grad_acc
    if p.pp == 1:
        busy = m * (costs["forward"][0] + costs["backward"][0])
        return busy, busy, 0.0
    # chunk c of rank r is virtual stage c*pp + r, listed rank by rank
    per_rank = [[r * p.pp_virtual + c for c in range(p.pp_virtual)] for r in range(p.pp)]
    unit = costs["forward"][0]
    # The idle fractions do not change when every duration is scaled: simulate each shape once, to 10%.
    relative = tuple(round(10 * c / unit) / 10 for c in costs["forward"] + costs["backward"])
    # A rank idles while the pipeline fills and drains, which 2*pp micro-batches show: that idle time
    # holds for any larger number of them (Narayanan et al. 2021: the bubble is (p-1) stage times).
    shown = min(m, 2 * p.pp)
    idle = _idle(p.pp_schedule, p.pp, p.pp_virtual, shown, relative)
    busy = [sum(costs["forward"][k] + costs["backward"][k] for k in ks) for ks in per_rank]
    span = max(b * shown / (1 - i) - b * shown + b * m for b, i in zip(busy, idle) if i < 1)
    return span, m * max(busy), 1 - m * max(busy) / span


@functools.lru_cache(maxsize=4096)
def _idle(name: str, pp: int, virtual: int, micro_batches: int, relative: tuple[float, ...]) -> list[float]:
    """pipeline_schedules.simulate with these forward and backward durations (rank by rank, chunk by chunk)."""
    half = len(relative) // 2

    split = 2 if splits_backward(name) else 1  # zbh1, zbv: B and W take half a backward each

    def duration(rank: int, index: int, action) -> float:
        k = rank * virtual + action.chunk
        return relative[half + k] / split if action.backward else relative[k]

    return simulate(name, pp=pp, virtual=virtual, micro_batches=micro_batches, duration=duration)


def _data_parallel(cfg: Config, hw: Hardware, gpus_per_node: int, *, backward_s: float,
                   compute_s: float) -> float:
    """Seconds of gradient reduction over dp*cp (and ZeRO's parameter gathers) that compute does not hide.
    Under expert parallelism the routed experts' shards are reduced (and sharded) over their edp group,
    dp*cp/ep ranks spread over the same span, in buckets of their own: each group's time is added."""
    p = cfg.parallel
    buckets = [b for c in rank_chunks(cfg, 0) for b in chunk_buckets(cfg, c)]
    n = p.dp * p.cp
    # (buckets, ranks, shards, ranks the shard group spans): HSDP's shards are consecutive, edp's spread out
    groups = [([b for b in buckets if not b.expert], n, zero_shards(cfg), p.tp * zero_shards(cfg)),
              ([b for b in buckets if b.expert], n // p.ep, expert_shards(cfg), p.tp * n)]
    return sum(_reduction(cfg, hw, gpus_per_node, group, n=size, shard=shard, span=span, backward_s=backward_s,
                          compute_s=compute_s) for group, size, shard, span in groups if group and size > 1)


def _reduction(cfg: Config, hw: Hardware, gpus_per_node: int, buckets: list, *, n: int, shard: int, span: int,
               backward_s: float, compute_s: float) -> float:
    """Seconds of one group's gradient reduction (n ranks) not hidden by compute. ZeRO reduce-scatters and
    gathers within its shard group (dp*cp, or HSDP's dp_shard consecutive ranks), once a step or, under
    sharded accumulation, every micro-batch; HSDP then all-reduces the step's fp32 slices across the
    replicas."""
    p, s = cfg.parallel, Sizes.of(cfg)
    elements = sum(b.padded for b in buckets)
    grads = elements * (2 if p.reduce_dtype == "bfloat16" else 4)
    params = elements * s.d
    bw = _bandwidth(hw, p.tp * p.cp * p.dp, gpus_per_node)
    if shard == 1:
        reduce = _ring(hw, grads, n, 2.0, bw) if p.dp_impl == "bucket" else len(buckets) * _ring(hw, grads, n, 2, bw)
        return max(reduce - backward_s, reduce / len(buckets))
    shard_bw = _bandwidth(hw, span, gpus_per_node)
    scatter = _ring(hw, grads, shard, 1.0, shard_bw)
    gather = _ring(hw, params, shard, 1.0, shard_bw)
    replicate = _ring(hw, 4 * elements / shard, n // shard, 2.0, bw)
    earlier = cfg.train.grad_acc - 1 if accumulates_sharded(cfg) else 0  # micro-batches that reduce before the last
    if p.zero < 3:  # the reductions overlap their backward; the all-gather after the step does not
        last, each = scatter + replicate, max(scatter - backward_s, scatter / len(buckets))
        return max(last - backward_s, last / len(buckets)) + earlier * each + gather
    # ZeRO-3: every unit gathered before its forward and again before its backward, in every micro-batch,
    # each prefetched while the previous unit computes; only the first gather of each pass is exposed.
    gathers = 2 * cfg.train.grad_acc * gather + (1 + earlier) * scatter + replicate
    return max(0.0, gathers - compute_s) + 2 * gather / len(buckets)


def save_blocking(cfg: Config, hw: Hardware, *, gpus_per_node: int) -> float:
    """Seconds a checkpoint save holds training up. In the foreground: the rank's stage's state (fp32
    weights and two moments) gathered whole (all-reduced over dp*cp under ZeRO, all-gathered over tp),
    and its 1/world share written at its node's disk bandwidth. With async_save: this rank's own part of
    that state copied to host memory; the rest happens while training goes on."""
    p, params = cfg.parallel, cfg.model.num_params()
    stage = 12 * params / p.pp  # bytes of this rank's stage's checkpoint
    dp_cp = p.dp * p.cp
    if cfg.checkpoint.async_save:
        return stage / p.tp / (dp_cp if p.zero >= 1 else 1) / (hw.host_gbs * 1e9)
    gather = _ring(hw, stage / p.tp, dp_cp, 2, _bandwidth(hw, dp_cp * p.tp, gpus_per_node)) if p.zero >= 1 else 0.0
    gather += _ring(hw, stage, p.tp, 1, _bandwidth(hw, p.tp, gpus_per_node))
    write = 12 * params / cfg.world_size * min(cfg.world_size, gpus_per_node) / (hw.disk_gbs * 1e9)
    return gather + write


_MICRO_BATCHES = Memo()
_FLOPS = Memo()  # the model's per token at a sequence length (a loop over its layers)


def _micro_batches(cfg: Config, hw: Hardware, gpus_per_node: int) -> tuple[dict[str, list[float]], tuple]:
    """The chunk costs and the pipeline span: the same for layouts that differ only in ZeRO (keys.py)."""
    costs = _chunk_costs(cfg, hw, gpus_per_node)
    return costs, _pipeline_span(cfg, costs)


def estimate(cfg: Config, hw: Hardware, *, gpus_per_node: int) -> TimeEstimate:
    """The predicted step time of `cfg` on devices `hw`, `gpus_per_node` ranks to a node."""
    p, m = cfg.parallel, cfg.train.grad_acc
    costs, (span, busy, bubble) = _MICRO_BATCHES.get((micro_batch_key(cfg), hw, gpus_per_node),
                                                     lambda: _micro_batches(cfg, hw, gpus_per_node))
    layers_rank0 = sum(c.layers for c in rank_chunks(cfg, 0))
    tp_s = m * layers_rank0 * costs["tp"][0] * (3 if cfg.train.recompute == "full" else 2)
    cp_s = m * layers_rank0 * costs["cp"][0]
    pp_s = m * 2 * p.pp_virtual * costs["p2p"][0]
    ep_s = m * sum(c.moe for c in rank_chunks(cfg, 0)) * costs["ep"][0]
    compute = busy - tp_s - cp_s - pp_s - ep_s
    backward_last = sum(costs["backward"][k] for k in range(p.pp_virtual))
    dp_s = _data_parallel(cfg, hw, gpus_per_node, backward_s=backward_last, compute_s=compute)
    buckets = [b for c in rank_chunks(cfg, 0) for b in chunk_buckets(cfg, c)]
    owned = sum(b.slice_size for b in buckets)
    # the optimizer reads and writes the masters and its state and reads the gradient (AdamW: ~7 fp32 values an
    # element)
    optimizer = owned * (4 * 3 + 2 * optimizer_class(cfg.optim.name).state_bytes()) / (hw.hbm_gbs * 1e9)
    # Muon (plan/muon.py): the Newton-Schulz matmuls of the matrices this rank updates, in optim.muon_ns_dtype,
    # and the all-gathers over tp of the matrices tensor parallelism cuts (not overlapped: one after another)
    muon = muon_work(cfg, 0)
    optimizer += muon.ns_flops / hw.flops(cfg.optim.muon_ns_dtype)
    if muon.tp_gather_bytes:
        optimizer += _ring(hw, muon.tp_gather_bytes, p.tp, 1.0, _bandwidth(hw, p.tp, gpus_per_node))
    every = cfg.checkpoint.save_every
    save = save_blocking(cfg, hw, gpus_per_node=gpus_per_node) / every if every else 0.0
    step = span + dp_s + optimizer + save
    tokens = cfg.global_batch * cfg.data.seq_len
    per_token = _FLOPS.get((model_repr(cfg.model), cfg.data.seq_len),
                           lambda: cfg.model.flops_per_token(cfg.data.seq_len))
    flops = per_token * tokens / step
    peak = hw.tflops * 1e12 / (1 if cfg.train.dtype == "bfloat16" or hw.cpu else hw.fp32_slowdown)
    return TimeEstimate(step_s=step, compute_s=compute, bubble=bubble, tp_s=tp_s, cp_s=cp_s, pp_s=pp_s,
                        ep_s=ep_s, dp_s=dp_s, optimizer_s=optimizer, save_s=save, tokens_per_s=tokens / step,
                        mfu=flops / (peak * cfg.world_size))
