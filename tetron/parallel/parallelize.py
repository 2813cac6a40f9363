"""The recipe: what is done to the plain model, in order, so that this rank trains its part of it.

    build on meta -> pipeline split -> tensor parallel -> expert parallel -> materialize + init -> context
    parallel -> (QK-clip's logit records) -> recompute -> compile -> data parallel

`parallelize` is the only caller of the axes' `apply_*` functions; each axis lives in its own file.
The order matters: the pipeline split decides which modules exist on this rank, tensor parallelism
then swaps those for sharded ones (still on meta, so nothing is allocated twice), expert parallelism keeps
this rank's experts (on meta too), storage and initial
values come only then, each rank filling its own slices; context parallelism swaps the attention
function; recompute then wraps each decoder layer's forward, once the layer holds its final
(sharded, ring-attention) code, since that is what must run again in the backward pass; compile
(train.compile) then compiles each finished layer, recomputation included; and data parallelism
wraps the finished chunk to average its gradients, its hooks outside the compiled code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.config import Config
from tetron.mesh import Mesh
from tetron.models.experts import Experts
from tetron.models.moe import Router, moe_blocks
from tetron.models.spec import spec_of
from tetron.optim import Role, optimizer_class
from tetron.parallel.compile import apply_compile
from tetron.parallel.context_parallel import apply_context_parallel, shard_indices
from tetron.parallel.data_parallel import DataParallel, apply_data_parallel
from tetron.parallel.expert_parallel import apply_expert_parallel
from tetron.parallel.init import Hollow, init_weights_, materialize_
from tetron.parallel.layout import layout_of
from tetron.parallel.moe_balance import scale_moe_losses, sequence_pieces
from tetron.parallel.pipeline_parallel import apply_pipeline_stage, rank_stages, tied_embeddings
from tetron.parallel.pipeline_schedules import splits_backward
from tetron.parallel.qk_clip import build_qk_clip, record_attention_logits
from tetron.parallel.recompute import apply_recompute
from tetron.parallel.tensor_parallel import (
    apply_tensor_parallel,
    sync_sequence_parallel_grads,
)
from tetron.parallel.timers import timer
from tetron.parallel.zero import ShardedOptimizer
from tetron.parallel.zero3 import units_of


@dataclass
class ParallelModel:
    """This rank's part of the model. Without pipeline parallelism there is one chunk, the whole model;
    with it, one per virtual stage the rank holds, in virtual-stage order."""

    chunks: list[nn.Module]  # the bare chunks: parameters, state dicts, checkpoints
    dp_chunks: list[DataParallel]  # the same chunks wrapped for gradient averaging: run forward/backward here
    moe_layers: int = 0  # MoE layers of the whole model (every stage's), 0 for a dense model
    hollow: list[Hollow] = field(default_factory=list)  # ZeRO over several ranks: the chunks' parameters, made
    # without storage, get it and their values bucket by bucket as build_optimizer shards them (fill)
    params: list[nn.Parameter] = field(init=False)  # every trainable parameter, once each, chunk by chunk

    def __post_init__(self) -> None:
        self.params = [p for chunk in self.chunks for p in chunk.parameters() if p.requires_grad]

    def zero_grad(self) -> None:
        for chunk in self.dp_chunks:
            chunk.zero_grad(set_to_none=True)

    def fill(self, params: list[nn.Parameter]) -> None:
        """Storage and seeded values for those of `params` still hollow."""
        for hollow in self.hollow:
            hollow.fill(params)


def parallelize(cfg: Config, mesh: Mesh, device: torch.device) -> ParallelModel:
    """Build this rank's chunks of `cfg.model` for its place in `mesh`, initialised from the run seed
    (each rank its own slices, so every layout starts from the same weights). Under ZeRO over several ranks the
    parameters come hollow (`ParallelModel.hollow`): build_optimizer gives each bucket its storage and values as it
    shards it, so that no more than one bucket is ever whole in fp32 (under ZeRO-3 no more than one unit at all)."""
    p = cfg.parallel
    hollow = p.zero >= 1 and dist.get_world_size(mesh.group("dp_shard")) > 1
    chunks, hollows, moe_layers = [], [], 0
    for layers, first, last in rank_stages(cfg, mesh.local_rank("pp")):
        chunk, moe_layers, unfilled = build_chunk(cfg, mesh, device, layers, first=first, last=last, hollow=hollow)
        chunks.append(chunk)
        hollows += [unfilled] if unfilled is not None else []
    reduce_dtype = torch.bfloat16 if p.reduce_dtype == "bfloat16" else torch.float32
    # ZeRO shards over dp_shard's group (all of dp*cp unless HSDP) and averages across its replicas; expert
    # shards are averaged over edp and sharded over its ranks in the shard group. An optimizer that needs whole
    # matrices gets each of those (its `whole_roles`) whole on one rank.
    kind = optimizer_class(cfg.optim.name)
    roles = param_roles(chunks)
    whole = (lambda param: roles[id(param)] in kind.whole_roles) if kind.needs_whole_matrices else None
    dp_chunks = [apply_data_parallel(chunk, mesh.group("dp_cp"), impl=p.dp_impl, bucket_mb=p.bucket_mb, zero=p.zero,
                                     reduce_dtype=reduce_dtype, units=units_of(chunk) if p.zero == 3 else None,
                                     accumulate=p.zero_accumulate,
                                     shard_group=mesh.group("dp_shard"), replicate_group=mesh.group("dp_replicate"),
                                     expert_group=mesh.group("edp"), expert_shard_group=mesh.group("edp_shard"),
                                     whole=whole)
                 for chunk in chunks]
    return ParallelModel(chunks, dp_chunks, moe_layers=moe_layers, hollow=hollows)


def build_chunk(cfg: Config, mesh: Mesh, device: torch.device, layers: range, *, first: bool,
                last: bool, hollow: bool = False) -> tuple[nn.Module, int, Hollow | None]:
    """One chunk of this rank (the decoder layers `layers`, with the embedding if `first`, the final norm and head
    if `last`), everything but data parallelism done to it, and the MoE layers of the whole model. The recipe the
    run follows, and the planner's measurement of a layer too (plan/probe.py). `hollow`: its parameters without
    storage, and what fills them later (init.Hollow); otherwise None there."""
    p = cfg.parallel
    spec = spec_of(cfg.model)  # the family: its module class, and the plan every axis reads
    with torch.device("meta"):
        chunk = spec.model_class(cfg.model)
    moe_layers = len(moe_blocks(chunk))  # of the whole model, before the pipeline keeps its stage's
    apply_pipeline_stage(chunk, layers, first=first, last=last, plan=spec.plan)
    apply_tensor_parallel(chunk, mesh.group("tp"), sequence_parallel=p.sp,
                          vocab_pad_multiple=p.vocab_pad_multiple, plan=spec.plan, regather=p.sp_regather)
    apply_expert_parallel(chunk, mesh)
    materialize_(chunk, device, hollow=hollow)
    # Names stay Hugging Face names, so every layout starts from the same weights.
    unfilled = Hollow(chunk, seed=cfg.train.seed) if hollow else None  # named before any wrapper renames them
    if not hollow:
        init_weights_(chunk, seed=cfg.train.seed)  # as the family initialises (ModelSpec.init)
    scale_moe_losses(chunk, moe_layers=moe_layers, sequences=cfg.train.micro_batch * cfg.train.grad_acc,
                     cp=mesh.size("cp"), pieces=sequence_pieces(mesh, sequence_parallel=p.sp))
    apply_context_parallel(chunk, mesh, layout=p.cp_layout, impl=p.cp_impl)
    if cfg.optim.qk_clip_tau is not None:  # each attention function, as context parallelism left it, recorded
        record_attention_logits(chunk, mesh, layout=p.cp_layout)
    # zbh1/zbv split each backward into B and W: a recomputed layer must then split too
    apply_recompute(chunk, cfg.train.recompute, split=p.pp > 1 and splits_backward(p.pp_schedule))
    apply_compile(chunk, cfg.train.compile)
    chunk.loss_chunk_tokens = cfg.train.loss_chunk_tokens  # the head and the loss, chunked (models/loss.py)
    if hasattr(chunk, "mtp_loss_weight"):  # multi-token prediction's weight in the objective (models/mtp.py)
        chunk.mtp_loss_weight = cfg.train.mtp_loss_weight
    return chunk, moe_layers, unfilled


def param_roles(chunks: list[nn.Module]) -> dict[int, Role]:
    """Each parameter's role for the optimizer (by id), as the family's plan tells: the token embedding, the head
    (a pipeline's tied copy of the embedding on the last stage is the head there), an MoE layer's router, any
    other weight of 2+ dims a matrix, the rest (norms, biases, sinks) vectors. An MoE layer's experts are stacked
    on a leading dimension: their [E, D] biases are vectors (one per expert), not one [E, D] matrix."""
    roles: dict[int, Role] = {}
    for chunk in chunks:
        plan = spec_of(chunk.config).plan
        routers = {id(p) for m in chunk.modules() if isinstance(m, Router) for p in m.parameters()}
        stacked = {id(p) for m in chunk.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
        for name, p in chunk.named_parameters():
            dims = p.ndim - (id(p) in stacked)  # of one expert's tensor
            # a pipeline's MTP copy of the embedding steps as the embedding does (it must stay equal to it)
            embedding = name in (plan.embedding_weight, "mtp_embed_tokens.weight")
            roles[id(p)] = ("embedding" if embedding else "head" if name == plan.head_weight
                            else "router" if id(p) in routers else "matrix" if dims >= 2 else "vector")
    return roles


def build_optimizer(model: ParallelModel, cfg: Config, mesh: Mesh) -> ShardedOptimizer:
    """The optimizer optim.name over fp32 master weights, sharded over dp_shard (dp*cp) under ZeRO (zero.py); it
    also casts the parameters to the compute dtype, so it comes after data parallelism has laid out the buckets."""
    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    optimizer = ShardedOptimizer(model.params, model.dp_chunks, cfg.train, kind=optimizer_class(cfg.optim.name),
                                 roles=param_roles(model.chunks), zero=cfg.parallel.zero, dtype=dtype,
                                 group=mesh.group("dp_shard"), optim=cfg.optim, tp_group=mesh.group("tp"),
                                 fill=model.fill if model.hollow else None)
    for hollow in model.hollow:
        hollow.fill_rest()  # none is left: every parameter lies in a bucket
    model.hollow = []
    if cfg.optim.qk_clip_tau is not None:
        optimizer.qk_clip = build_qk_clip(model.chunks, mesh, tau=cfg.optim.qk_clip_tau,
                                          num_layers=cfg.model.num_hidden_layers,
                                          num_heads=cfg.model.num_attention_heads)
    return optimizer


@torch.no_grad()
def finish_gradients(model: ParallelModel, mesh: Mesh, optimizer: ShardedOptimizer) -> None:
    """What each axis adds to the averaged gradients (data parallelism averaged them during the
    backward pass), wherever they are (whole, or this rank's ZeRO pieces): tied embedding copies
    summed over the pipeline's ends, sequence-parallel and per-head norm weights summed over tp."""
    copies = tied_embeddings(model.chunks, mesh)
    if copies:
        grad = optimizer.full_grad(copies[0])
        for copy in copies[1:]:  # the last stage's head and MTP embedding; zbv, dualpipev: both ends here
            grad = grad + optimizer.full_grad(copy)
        ends = sum(not layout_of(c).tied_copy for c in copies) + any(layout_of(c).tied_copy for c in copies)
        if ends == 1:  # the other copies are on the pipeline's other end
            with timer("pp"):
                dist.all_reduce(grad, group=mesh.group("embed"))
        for copy in copies:
            optimizer.set_full_grad(copy, grad)
    sync_sequence_parallel_grads([g for g, p in optimizer.grads() if layout_of(p).summed_over_tp],
                                 mesh.group("tp"))


def sequence_positions(cfg: Config, mesh: Mesh) -> Tensor:
    """The positions of each training sequence this rank holds ([T/cp], increasing): all of them, or
    under context parallelism its share (zigzag or contiguous). Token ids, targets and RoPE positions
    are all taken at these indices."""
    cp = mesh.size("cp")
    if cp == 1:
        return torch.arange(cfg.data.seq_len)
    return shard_indices(cfg.data.seq_len, cp, mesh.local_rank("cp"), layout=cfg.parallel.cp_layout)
