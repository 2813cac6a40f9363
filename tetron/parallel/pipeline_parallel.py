"""Pipeline parallelism: the model cut into stages, activations and gradients sent by P2P, a schedule run.

Stages. The decoder layers are cut into p*v contiguous blocks (virtual stages), as evenly as possible
or as `parallel.pp_split` says; virtual stage s lives on pipeline rank s % p as its chunk s // p.
The first stage also embeds the tokens, the last also applies the final norm, the head and the loss.
Each chunk is a plain model of its family whose other parts (models/spec.py's plan says where they are)
are deleted or None, so its parameters keep their Hugging Face names and init, checkpoints and tests see
the same tensors as in the whole model.
Under zbv the stages go down the ranks and back up (a V: rank r holds stages r and 2p-1-r), so rank 0
holds the first and the last stage, and rank p-1 hands its chunk 0's output to its own chunk 1.

Communication. What crosses a stage boundary is the residual stream, [micro_batch, seq_len, hidden]
(seq_len divided by cp, and by tp under sequence parallelism): known from the config, so receivers
allocate it without a handshake. After each action a rank posts one batch of P2P operations: the
output it just produced, and the receives whose turn has come in the order of p2p_order.py, in which
every rank posts its messages by one global key (so that no schedule can deadlock on NCCL, where a
receive posted too early holds up its rank's later sends); receives go out as early as that order
allows, so the data arrives while the rank computes. On every link the messages are received in the
order they were sent, which NCCL requires (and gloo, without tags).

Memory. Once a stage output is sent, its data is released and only its autograd graph is kept
(Megatron's deallocate_output_tensor): the next stage holds the only copy of that tensor. The
backward is then started through the autograd engine directly, which does not compare the gradient's
shape with the (now empty) output's. Under the zero-bubble schedules (zbh1, zbv) a backward is B then
W (weight_grad.py): B sends the input's gradient back at once, the graph is kept until W. Under ZeRO-3
the chunk's parameters are gathered for B by its hooks and freed after it: W reads none of them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.config import Config
from tetron.data.batch import MicroBatch, mtp_kwargs
from tetron.mesh import Mesh
from tetron.models.spec import ParallelPlan, spec_of
from tetron.parallel.layout import set_layout
from tetron.parallel.p2p_order import Op, orders_posting_plan, posting_plan
from tetron.parallel.pipeline_schedules import (
    Action,
    Message,
    forward_only,
    rank_of,
    receives,
    schedule,
    sends,
    splits_backward,
    stage_of,
    style_of,
)
from tetron.parallel.timers import timer
from tetron.parallel.weight_grad import backward_input, backward_weight
from tetron.torch_private import is_view, run_backward

# --------------------------------------------------------------------------------------- stages


def split_layers(num_layers: int, stages: int, split: list[int] | None = None) -> list[range]:
    """The layers of each (virtual) stage: `split[s]` consecutive layers each, or as even as possible
    (the first num_layers % stages stages take one more)."""
    if split is None:
        base, extra = divmod(num_layers, stages)
        split = [base + (s < extra) for s in range(stages)]
    if len(split) != stages or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"pp_split={split} must give {stages} stages of at least 1 layer, {num_layers} in all")
    bounds = [sum(split[:s]) for s in range(stages + 1)]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def layer_ranks(cfg: Config) -> list[int]:
    """The pipeline rank that holds each decoder layer."""
    p = cfg.parallel
    ranges = split_layers(cfg.model.num_hidden_layers, p.pp * p.pp_virtual, p.pp_split)
    style = style_of(p.pp_schedule)
    return [rank_of(s, pp=p.pp, style=style) for s, layers in enumerate(ranges) for _ in layers]


def apply_pipeline_stage(model: nn.Module, layers: range, *, first: bool, last: bool,
                         plan: ParallelPlan | None = None) -> nn.Module:
    """Delete, in place, every part of `model` outside one stage: the other layers, the embedding
    unless `first`, the final norm and head unless `last` (where its family's plan says they are)."""
    plan = plan or spec_of(model.config).plan
    held = plan.layers_of(model)
    for name in list(held):
        if int(name) not in layers:
            del held[name]
    if not first:
        plan.set_part(model, plan.embedding, None)
    if not last:
        plan.set_part(model, plan.final_norm, None)
        plan.set_part(model, plan.head, None)
        if getattr(model, "mtp", None) is not None:  # multi-token prediction runs after the head, on the last stage
            model.mtp = None
    elif not first and model.config.tie_word_embeddings:
        # The head's weight is the embedding's Parameter (tied). This stage keeps it as its own copy:
        # started from the embedding's tensor (init by that name), kept equal to the first stage's by
        # summing the two gradients before each step, and counted once in the gradient norm.
        set_layout(plan.part(model, plan.head).weight, tied_copy=True, source=plan.embedding_weight)
    if last and not first and getattr(model, "mtp", None) is not None:
        # MTP embeds the tokens ahead with the shared embedding: the last stage holds its own copy, kept equal to
        # the first stage's as a tied head is (its gradient summed with the embedding's; counted once in the norm)
        embedding = nn.Embedding(model.config.vocab_size, model.config.hidden_size,
                                 device=next(model.parameters()).device)  # meta, as the rest, where built so
        set_layout(embedding.weight, tied_copy=True, source=plan.embedding_weight)
        model.mtp_embed_tokens = embedding
    return model


def rank_stages(cfg: Config, pp_rank: int) -> list[tuple[range, bool, bool]]:
    """The (virtual) stages pipeline rank `pp_rank` holds, in virtual-stage order: for each, its layers
    and whether it is the first stage (embeds) and the last (norm, head, loss)."""
    p = cfg.parallel
    stages = p.pp * p.pp_virtual
    ranges = split_layers(cfg.model.num_hidden_layers, stages, p.pp_split)
    style = style_of(p.pp_schedule)
    held = [stage_of(c, pp_rank, pp=p.pp, style=style) for c in range(p.pp_virtual)]
    return [(ranges[s], s == 0, s == stages - 1) for s in held]


def activation_shape(cfg: Config) -> tuple[int, int, int]:
    """What crosses a stage boundary: [micro_batch, seq_len / cp (/ tp under sp), hidden]."""
    p = cfg.parallel
    seq = cfg.data.seq_len // p.cp // (p.tp if p.sp else 1)
    return (cfg.train.micro_batch, seq, cfg.model.hidden_size)


def tied_embeddings(chunks: list[nn.Module], mesh: Mesh) -> list[nn.Parameter]:
    """With tied embeddings or multi-token prediction under pp, this rank's copies of the embedding's tensor: the
    first stage's embedding, the last stage's head (tied) and its MTP embedding, or all where one rank holds both
    ends (zbv's and dualpipev's V). Their gradients are summed (over the "embed" group when the copies are on two
    ranks) before each step, so all take the same step. Empty elsewhere."""
    config = chunks[0].config
    mtp = getattr(config, "num_nextn_predict_layers", 0) > 0
    if mesh.size("pp") == 1 or not (config.tie_word_embeddings or mtp):
        return []
    plan = spec_of(config).plan
    heads = [h.weight for c in chunks if (h := plan.part(c, plan.head)) is not None] \
        if config.tie_word_embeddings else []
    return ([e.weight for c in chunks if (e := plan.part(c, plan.embedding)) is not None] + heads
            + [c.mtp_embed_tokens.weight for c in chunks if getattr(c, "mtp_embed_tokens", None) is not None])


# ---------------------------------------------------------------------------------- the schedule


@dataclass
class PipelineTrace:
    """What one rank did in its last training step: the compute interval of each action and the activations
    held. Whoever studies a schedule (tests, benchmarks) sets one as a Pipeline's `watcher`."""

    rank: int
    events: list[tuple[str, int, int, float, float]] = field(default_factory=list)  # (F|B|W, chunk, micro, start, end)
    peak_in_flight: int = 0  # most (chunk, micro-batch) pairs whose activations were held at once
    peak_output_elements: int = 0  # most elements of sent stage outputs still held (0: all released)

    def begin(self) -> None:
        """A new step: forget the last."""
        self.events, self.peak_in_flight, self.peak_output_elements = [], 0, 0

    def record(self, action: Action, start: float, end: float, stored: dict[tuple[int, int], tuple]) -> None:
        """Action done in [start, end] (its output sent and released), `stored`: what the pipeline holds now."""
        self.events.append((action.kind, action.chunk, action.micro, start, end))
        self.peak_in_flight = max(self.peak_in_flight, len(stored))
        held = sum(kept[1].numel() for kept in stored.values() if kept[1] is not None and kept[1].dim() > 0)
        self.peak_output_elements = max(self.peak_output_elements, held)


def measure_bubble(traces: list[PipelineTrace]) -> list[float]:
    """Per rank, the idle fraction of the step: 1 - compute time / (last end - first start over all ranks)."""
    start = min(e[3] for t in traces for e in t.events)
    span = max(e[4] for t in traces for e in t.events) - start
    return [1 - sum(e[4] - e[3] for e in t.events) / span for t in traces]


def _run_backward(output: Tensor, grad: Tensor | None) -> None:
    """Backward from `output` (whose data may have been released) with incoming gradient `grad`.
    `torch.autograd.backward` would reject a gradient shaped unlike the emptied output; the
    engine itself checks against the shape recorded in the graph (Megatron's custom_backward)."""
    if grad is None:
        grad = torch.ones_like(output)  # the loss: a scalar
    run_backward((output,), (grad,))


class Pipeline:
    """Runs one schedule over this rank's chunks: forwards, backwards and the P2P between them.

    `chunks` are this rank's chunks in virtual-stage order, each possibly wrapped for data
    parallelism (then its gradients are synchronised during its last backward, or W, of the step)."""

    def __init__(self, chunks: list[nn.Module], mesh: Mesh, *, schedule_name: str, micro_batches: int,
                 shape: tuple[int, ...], loss_fn: Callable[[Tensor], Tensor],
                 positions: Tensor, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> None:
        self.chunks, self.mesh = chunks, mesh
        self.p, self.rank, self.v = mesh.size("pp"), mesh.local_rank("pp"), len(chunks)
        self.stages = self.p * self.v
        self.m = micro_batches
        self.style, self.split = style_of(schedule_name), splits_backward(schedule_name)
        orders = [schedule(schedule_name, pp=self.p, virtual=self.v, micro_batches=micro_batches, rank=r)
                  for r in range(self.p)]
        self.actions = orders[self.rank]
        # the P2P batch to post before the first action (0) and after each action k (k+1)
        self.plan = posting_plan(schedule_name, pp=self.p, virtual=self.v, micro_batches=micro_batches,
                                 rank=self.rank)
        # each chunk's gradients are reduced over dp during the last action that accumulates them
        accumulates = [k for k, a in enumerate(self.actions) if a.weight or (a.backward and not self.split)]
        self.sync_at = {self.actions[k].chunk: k for k in accumulates}
        self.params = [[q for q in chunk.parameters() if q.requires_grad] for chunk in chunks]
        self.shape, self.dtype = tuple(shape), dtype
        self.device = device or torch.device("cpu")
        self.loss_fn = loss_fn
        # [T/cp] this rank's RoPE positions (all of them without cp), for a micro-batch that brings none
        self.positions = positions.to(self.device)
        self.group = mesh.group("pp")
        # With NCCL the first operation on a group must involve all its ranks, which P2P does not.
        dist.barrier(group=self.group)
        # (chunk, micro) -> (input, output) after F; (None, None, what W needs) after a split B
        self.stored: dict[tuple[int, int], tuple] = {}
        self.sends: list[dist.Work] = []  # posted sends not yet known to be complete
        self.posted: dict[Message, tuple[Tensor, dist.Work]] = {}  # receives in flight
        self.arrived: dict[Message, Tensor] = {}  # handed over on this rank (zbv's turn), not yet used
        self.watcher: PipelineTrace | None = None  # set to record each training step's actions (tests, benchmarks)
        self.forward_orders: dict[int, tuple[list[Action], list[list[Op]]]] = {}  # forward_only's, by micro-batches

    def _stage(self, chunk: int) -> int:
        return stage_of(chunk, self.rank, pp=self.p, style=self.style)

    # --- P2P: one batch after each action ---

    def _post(self, plan: list[list[Op]], point: int, outbound: tuple[Tensor, Message, int] | None) -> None:
        """Post the batch `plan` has at `point` (0 before the first action, k+1 right after action k): the
        send of `outbound` (action k's output: a tensor, its name, a pipeline rank) and the receives whose
        turn has come."""
        payload = None
        if outbound is not None:
            tensor, message, dst = outbound
            if tensor.shape != self.shape or tensor.dtype != self.dtype:
                raise RuntimeError(f"pipeline stage output is {tuple(tensor.shape)} {tensor.dtype}, but the next "
                                   f"stage expects {self.shape} {self.dtype}")
            if dst == self.rank:  # zbv's turn at rank p-1: chunk 0 to chunk 1 (and back), no P2P
                self.arrived[message] = tensor.detach()
            else:
                # contiguous: P2P sends flat memory (sequence parallelism leaves a strided residual stream)
                payload = tensor.detach().contiguous()
            if tensor.requires_grad and not is_view(tensor):
                # Release the data: the P2P op (or the hand-over) holds its own reference; autograd
                # needs only the graph.
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        batch = plan[point]
        ops = []
        for op in batch:
            if op.kind == "send":
                if payload is None or op.message != outbound[1]:
                    raise RuntimeError(f"pipeline P2P plan sends {op.message} at point {point}, not {outbound}")
                ops.append(dist.P2POp(dist.isend, payload, self.mesh.stage_rank(op.peer), self.group))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buffer, self.mesh.stage_rank(op.peer), self.group))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        self.sends = [w for w in self.sends if not w.is_completed()]  # drop finished sends (and their tensors)
        for op, p2p, work in zip(batch, ops, works):
            if op.kind == "send":
                self.sends.append(work)
            else:
                self.posted[op.message] = (p2p.tensor, work)

    def _take(self, action: Action) -> Tensor | None:
        """The activation or gradient `action` needs: its receive, posted by the plan by now, waited for."""
        need = receives(action, pp=self.p, virtual=self.v, rank=self.rank, style=self.style)
        if need is None:
            return None
        message = need[0]
        if message in self.arrived:
            return self.arrived.pop(message)
        buffer, work = self.posted.pop(message)
        with timer("pp"):
            work.wait()
        return buffer

    # --- compute ---

    def _forward(self, action: Action, received: Tensor | None, batch: MicroBatch | tuple[Tensor, Tensor], *,
                 loss_fn: Callable[[Tensor], Tensor], keep: bool = True) -> tuple[Tensor, Message, int] | None:
        """F: one micro-batch through one chunk; the last stage adds loss_fn(its summed loss) to self.loss.
        `keep`: the input and output stay for the backward (not in a forward-only pass)."""
        s, mb = self._stage(action.chunk), MicroBatch(*batch)
        if s == 0:
            x = mb.inputs.to(self.device)  # [B, T] token ids
        else:
            x = received.requires_grad_()  # [B, T', hidden], a leaf: its gradient is what goes back
        positions = self.positions if mb.positions is None else mb.positions
        if s == self.stages - 1:  # the head and the loss, chunked: the logits never exist whole
            loss = loss_fn(self.chunks[action.chunk](x, positions, mb.docs, targets=mb.targets.to(self.device),
                                                     **mtp_kwargs(mb)))
            self.loss += loss.detach()
            if keep:
                self.stored[(action.chunk, action.micro)] = (x, loss)
            return None
        out = self.chunks[action.chunk](x, positions, mb.docs)  # [B, T', hidden]
        if keep:
            self.stored[(action.chunk, action.micro)] = (None if s == 0 else x, out)
        message, dst = sends(action, pp=self.p, virtual=self.v, rank=self.rank, style=self.style)
        return out, message, dst

    def _backward(self, index: int, action: Action, received: Tensor | None) -> tuple[Tensor, Message, int] | None:
        key, chunk = (action.chunk, action.micro), self.chunks[action.chunk]
        # Data parallelism reduces this chunk's gradients during its last accumulating action of the step.
        syncing = contextlib.nullcontext() if self.sync_at[action.chunk] == index else \
            getattr(chunk, "no_sync", contextlib.nullcontext)()
        # ZeRO-3 (zero.py): B accumulates nothing, so no hook frees the units it gathered
        sharding = getattr(chunk, "sharding", None)
        if action.weight:
            (_, _, pending) = self.stored.pop(key)
            with syncing:
                backward_weight(pending)
            if sharding:
                sharding.release(chunk)  # a stage without B (the first) gathered them in its whole W
            return None
        x, out = self.stored.pop(key)
        if self.split:  # B: the input's gradient only, nothing accumulated; W runs later
            dx, pending = backward_input(out, received, x, self.params[action.chunk])
            self.stored[key] = (None, None, pending)
            if sharding:
                sharding.release(chunk)
        else:
            with syncing:
                _run_backward(out, received)
            dx = None if x is None else x.grad
        out_msg = sends(action, pp=self.p, virtual=self.v, rank=self.rank, style=self.style)
        return None if out_msg is None else (dx, *out_msg)

    def step(self, batches: list[MicroBatch] | list[tuple[Tensor, Tensor]]) -> Tensor:
        """Forward and backward of every micro-batch (a MicroBatch, or a pair input_ids, targets); gradients
        accumulate in the chunks. Returns the sum of the micro-batch losses on the last stage, zero elsewhere."""
        if len(batches) != self.m:
            raise ValueError(f"the schedule was built for {self.m} micro-batches, got {len(batches)}")
        self.loss = torch.zeros((), device=self.device)
        if self.watcher is not None:
            self.watcher.begin()
        self._run(self.actions, self.plan, batches, loss_fn=self.loss_fn, keep=True)
        return self.loss

    @torch.no_grad()
    def forward_only(self, batches: list[MicroBatch], *,
                     loss_fn: Callable[[Tensor], Tensor] = lambda summed: summed) -> Tensor:
        """Forward of every micro-batch through the stages, nothing kept for a backward (validation), in
        pipeline_schedules.forward_only's order, with its own P2P plan. Returns the fp64 sum of loss_fn(each
        micro-batch's summed loss) on the last stage, zero elsewhere."""
        actions, plan = self._forward_order(len(batches))
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._run(actions, plan, batches, loss_fn=loss_fn, keep=False)
        return self.loss

    def _forward_order(self, micro_batches: int) -> tuple[list[Action], list[list[Op]]]:
        """This rank's forward-only actions for `micro_batches` and their P2P plan (made once per count)."""
        if micro_batches not in self.forward_orders:
            orders = [forward_only(self.v, micro_batches)] * self.p
            plan = orders_posting_plan(orders, pp=self.p, virtual=self.v, rank=self.rank, style=self.style,
                                       split=False)
            self.forward_orders[micro_batches] = (orders[self.rank], plan)
        return self.forward_orders[micro_batches]

    def _run(self, actions: list[Action], plan: list[list[Op]], batches: list, *,
             loss_fn: Callable[[Tensor], Tensor], keep: bool) -> None:
        """Each action in turn: take its input (a receive, waited for), compute, post the next P2P batch."""
        self._post(plan, 0, None)
        for k, action in enumerate(actions):
            received = self._take(action)
            start = time.perf_counter()
            if action.backward:
                outbound = self._backward(k, action, received)
            else:
                outbound = self._forward(action, received, batches[action.micro], loss_fn=loss_fn, keep=keep)
            end = time.perf_counter()
            self._post(plan, k + 1, outbound)
            if self.watcher is not None and keep:
                self.watcher.record(action, start, end, self.stored)  # after the post: a sent output is released
        with timer("pp"):
            for work in self.sends:
                work.wait()
        self.sends.clear()
