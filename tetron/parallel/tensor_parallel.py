"""Tensor parallelism (Megatron-style) with vocab-parallel loss and optional sequence parallelism.

Each attention block and MLP is split over the tp group without communication inside:
- column-parallel: q/k/v and gate/up keep rows `[r*n/t, (r+1)*n/t)` of their weight, so each rank
  computes its own attention heads (and GQA key/value heads) and its share of the MLP width;
- row-parallel: o and down keep the matching columns, and their partial outputs are summed (g).
The replicated activation entering a block goes through f once, at the block's input (a forward
pre-hook), so the gradients of q, k and v (or gate and up) are summed locally first and reduced
in one all-reduce. See comm.py for f and g.

The embedding is split by vocabulary rows, the head by vocabulary columns, and the loss is computed
from vocab-sharded logits, a chunk of tokens at a time (VocabParallelHead): no rank ever holds more
than `[chunk, vocab/tp]` of them. The vocabulary is padded to a
multiple of tp (times `vocab_pad_multiple`); padded rows start at zero, are masked out of the
softmax, so receive no gradient, and are dropped on export.

With sequence parallelism the residual stream between blocks is split along the sequence: f and g
become all-gather and reduce-scatter, and RMSNorm weights, which then see only this rank's tokens,
have their gradients summed over tp after the backward pass. So do, with or without it, the parameters of
what the plan keeps whole inside a block (`kept_whole`: Qwen3's per-head q_norm, k_norm; MLA's latent
projections before the column-parallel ones, and their norms): computed from the block's input, which f makes
whole on every rank, they are whole on every rank, but each rank's gradient holds only its own heads' share
(and f sums the shares of the input's gradient with the column-parallel linears'); summed, they stay equal on
every rank. A part of a layer outside every block (`replicated`: an MoE layer's mlp, its experts split by expert
parallelism instead) runs on every tp rank: on the same tokens without sequence parallelism (the same
gradients, nothing to sync), on each rank's share of them with it (gradients summed over tp, as the norms').
The plan answers which parameters these are (`ParallelPlan.tp_partial`).

Per-head parameters (the plan's `head_params`: gpt-oss's sinks, one logit per query head) split with the
heads. A norm over a whole projection's output (the plan's `projection_norms`: OLMo 3's q_norm over all query
heads) splits its weight with the projection's rows, and its statistic, the sum of squares over the whole width,
is summed over tp (`comm.all_reduce_both_ways`: every rank's heads are normed by the same number, as in one process).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tetron.models.loss import linear_cross_entropy
from tetron.models.spec import ParallelPlan, spec_of
from tetron.parallel.comm import (
    all_reduce_both_ways,
    copy_to_group,
    gather_from_sequence,
    reduce_from_group,
    reduce_scatter_to_sequence,
)
from tetron.parallel.layout import Shard, set_layout
from tetron.parallel.regather import SequenceGather, linear_on_shard
from tetron.parallel.timers import timer


def _shard_param(old: nn.Parameter, shape: tuple[int, ...], *, dim: int, group: dist.ProcessGroup,
                 logical: int | None = None) -> nn.Parameter:
    """An uninitialised parameter holding this rank's part along `dim` of what `old` held whole; it
    keeps what earlier strategies recorded about `old` (parallel/layout.py). Init fills it later."""
    param = nn.Parameter(torch.empty(shape, device=old.device, dtype=old.dtype))
    shard = Shard("tp", dim, dist.get_rank(group), dist.get_world_size(group), logical)
    set_layout(param, inherit=old, tp=shard)
    return param


class ColumnParallelLinear(nn.Module):
    """y[..., rows of this rank] = x @ W[rows].T; `input_mode` says how x arrives:
    "copy" applies f (replicated x), "gather" all-gathers a sequence-split x, "none" takes x as is
    (f already applied by the caller, once for several sibling layers; with `gathered`, the sequence-parallel
    block's gather, which this linear keeps x's shard of for the backward instead of x: regather.py)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, *, input_mode: str = "copy",
                 padded_out: int | None = None, gathered: SequenceGather | None = None) -> None:
        super().__init__()
        world = dist.get_world_size(group)
        out_features, in_features = linear.weight.shape
        padded = padded_out or out_features  # the head's vocabulary, padded to a multiple of tp
        if padded % world:
            raise ValueError(f"{padded} output features are not divisible by tp={world}")
        self.group, self.input_mode, self.gathered = group, input_mode, gathered
        logical = out_features if padded_out else None
        self.weight = _shard_param(linear.weight, (padded // world, in_features), dim=0, group=group, logical=logical)
        # a bias is split like the rows it is added to
        self.bias = (None if linear.bias is None else
                     _shard_param(linear.bias, (padded // world,), dim=0, group=group, logical=logical))

    def forward(self, x: Tensor) -> Tensor:
        if self.input_mode == "copy":
            x = copy_to_group(x, self.group)
        elif self.input_mode == "gather":
            x = gather_from_sequence(x, self.group)  # [B, T/t, in] -> [B, T, in]
        elif self.gathered is not None:
            return linear_on_shard(x, self.weight, self.bias, self.gathered)  # [B, T, out/t]
        return F.linear(x, self.weight, self.bias)  # [B, T, out/t]


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[..., cols of this rank] @ W[:, cols].T (g: all-reduce, or
    reduce-scatter along the sequence with sequence parallelism)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        world = dist.get_world_size(group)
        out_features, in_features = linear.weight.shape
        if in_features % world:
            raise ValueError(f"{in_features} input features are not divisible by tp={world}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard_param(linear.weight, (out_features, in_features // world), dim=1, group=group)
        # A bias is added once, after the sum: replicated. Under sequence parallelism it then sees only this
        # rank's tokens, so its gradient is summed over tp like a norm weight's.
        self.bias = linear.bias
        if self.bias is not None and sequence_parallel:
            set_layout(self.bias, summed_over_tp=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.finish(F.linear(x, self.weight))  # F.linear: [B, T, out], this rank's share of the sum

    def finish(self, partial: Tensor) -> Tensor:
        """The output from this rank's partial product [B, T, out] (the MLP computes that itself: blocks.py)."""
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence(partial, self.group)  # [B, T/t, out]
        else:
            out = reduce_from_group(partial, self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the (padded) embedding table; tokens outside look up zeros, and the sum
    over ranks (g) gives every token its row."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup, *, padded_vocab: int,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        vocab, hidden = embedding.weight.shape
        per_rank = padded_vocab // world
        self.group, self.sequence_parallel = group, sequence_parallel
        self.start, self.end = rank * per_rank, (rank + 1) * per_rank
        self.weight = _shard_param(embedding.weight, (per_rank, hidden), dim=0, group=group, logical=vocab)

    def forward(self, ids: Tensor) -> Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [B, T, hidden]
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial, self.group)  # [B, T/t, hidden]
        return reduce_from_group(partial, self.group)


def _vocab_parallel_chunk(logits: Tensor, targets: Tensor, with_grad: bool, *, start: int, vocab_size: int,
                          group: dist.ProcessGroup) -> tuple[Tensor, Tensor | None]:
    """Summed cross entropy from fp32 logits [n, V/t] holding vocabulary columns [start, start + V/t) of
    every rank's, targets [n] global ids; and its gradient on this rank's columns, softmax minus one-hot.
    The max, then the sum of exponentials and the target's logit (one all-reduce) are reduced over `group`."""
    cols = torch.arange(start, start + logits.shape[1], device=logits.device)
    logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # padding gets no probability
    row_max = logits.max(dim=1).values
    with timer(group):
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits.sub_(row_max.unsqueeze(1))
    local_target = targets - start
    mine = (local_target >= 0) & (local_target < logits.shape[1])
    index = local_target.clamp(0, logits.shape[1] - 1).unsqueeze(1)
    target_logit = shifted.gather(1, index).squeeze(1).masked_fill(~mine, 0.0)
    exp = shifted.exp_()
    sums = torch.stack([exp.sum(dim=1), target_logit])  # [2, n]: one all-reduce for both
    with timer(group):
        dist.all_reduce(sums, group=group)
    sum_exp, target_logit = sums
    loss = (sum_exp.log() - target_logit).sum()
    if not with_grad:
        return loss, None
    grad = exp.div_(sum_exp.unsqueeze(1))  # the softmax, in the logits' buffer
    grad.scatter_add_(1, index, -mine.to(grad.dtype).unsqueeze(1))
    return loss, grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross entropy from whole logits split by vocabulary columns over `group` (Megatron's)."""

    @staticmethod
    def forward(ctx, logits, targets, start, vocab_size, group):
        loss, grad = _vocab_parallel_chunk(logits.float(), targets, True, start=start, vocab_size=vocab_size,
                                           group=group)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, group: dist.ProcessGroup, *,
                                 vocab_start: int, vocab_size: int) -> Tensor:
    """Sum over tokens of -log p(target) from logits [..., V/t] holding columns from `vocab_start` (whole
    logits that exist anyway: tests, benchmarks; training goes through VocabParallelHead's, chunked)."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), vocab_start, vocab_size,
                                            group)


class VocabParallelHead(ColumnParallelLinear):
    """The head: column-parallel over the (padded) vocabulary, and the loss from its vocabulary shard,
    chunk by chunk (models/loss.py): no rank ever holds more than [chunk, V/t] of the logits."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, *, input_mode: str, padded_out: int) -> None:
        super().__init__(linear, group, input_mode=input_mode, padded_out=padded_out)
        self.vocab_size = linear.weight.shape[0]
        self.vocab_start = dist.get_rank(group) * (padded_out // dist.get_world_size(group))

    def cross_entropy(self, x: Tensor, targets: Tensor, *, chunk_tokens: int) -> Tensor:
        """Summed cross entropy of this head's logits for x [B, T(/t), H] against targets [B, T] (whole
        over the vocabulary: every tp rank gets the same sum)."""
        if self.input_mode == "copy":
            x = copy_to_group(x, self.group)  # f: the hidden states' gradient is summed over the shards
        elif self.input_mode == "gather":
            x = gather_from_sequence(x, self.group)
        chunk_loss = functools.partial(_vocab_parallel_chunk, start=self.vocab_start, vocab_size=self.vocab_size,
                                       group=self.group)
        return linear_cross_entropy(x, self.weight, targets, chunk_tokens=chunk_tokens, chunk_loss=chunk_loss)

    def cross_entropy_rows(self, x: Tensor, rows: Tensor, targets: Tensor, *, chunk_tokens: int) -> Tensor:
        """As cross_entropy over only the positions `rows` [B, T] (bool, whole) selects. Under sp the shards are
        gathered first (ranks may select different counts of their own rows), and the selection's gradient
        reaches each rank's shard through the gather's reduce-scatter, which sums the vocabulary shards' parts."""
        x = gather_from_sequence(x, self.group) if self.input_mode == "gather" else copy_to_group(x, self.group)
        chunk_loss = functools.partial(_vocab_parallel_chunk, start=self.vocab_start, vocab_size=self.vocab_size,
                                       group=self.group)
        return linear_cross_entropy(x[rows], self.weight, targets[rows], chunk_tokens=chunk_tokens,
                                    chunk_loss=chunk_loss)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """The vocabulary rounded up to a multiple of tp * multiple."""
    step = tp * multiple
    return -(-vocab_size // step) * step


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup, *, sequence_parallel: bool = False,
                          vocab_pad_multiple: int = 1, plan: ParallelPlan | None = None,
                          regather: bool = True) -> nn.Module:
    """Swap the plain model's layers for tensor-parallel ones over `group`, in place, as its family's plan
    says (models/spec.py; None: the plan of `model.config`'s family). Under sequence parallelism, `regather`:
    each block's column-parallel linears keep their input's sequence shard for the backward and gather it
    again there (regather.py), not the whole gathered input.

    Parameters keep their names (so init and checkpoints see Hugging Face names) and are left
    uninitialised; call init (or load) afterwards. Works on a model still on the meta device."""
    world = dist.get_world_size(group)
    if world == 1:
        return model
    plan = plan or spec_of(model.config).plan
    sp = sequence_parallel
    padded = padded_vocab_size(model.config.vocab_size, world, vocab_pad_multiple)
    # f once at each block's input, shared by its column-parallel linears: one all-reduce, not three.
    enter = _gather_input if sp else _copy_input
    # multi-token prediction's layers (models/mtp.py) split as the decoder layers do
    mtp = getattr(model, "mtp", None)
    for layer in [*plan.layers_of(model).values(), *(mtp.values() if mtp is not None else ())]:
        for block in plan.blocks:
            part = layer.get_submodule(block.path)
            gathered = SequenceGather(group) if sp and regather else None  # the pre-hook and its linears' record
            for name in block.column:
                if getattr(part, name, None) is not None:  # a layer may lack one (MLA: q_proj or q_b_proj)
                    setattr(part, name, ColumnParallelLinear(getattr(part, name), group, input_mode="none",
                                                             gathered=gathered))
            setattr(part, block.row, RowParallelLinear(getattr(part, block.row), group, sequence_parallel=sp))
            part.register_forward_pre_hook(gathered or enter(group))
        _split_heads(layer, plan, group)
        # whole weights whose gradient on each rank is a share (of the heads always, of the tokens under sp)
        for name, param in layer.named_parameters():
            if plan.tp_partial(name, sequence_parallel=sp):
                set_layout(param, summed_over_tp=True)
    for layer in mtp.values() if mtp is not None and sp else ():
        # their own parts see one rank's share of the tokens under sp, as the residual norms do
        for part in (layer.enorm, layer.hnorm, layer.eh_proj, layer.shared_head):
            for param in part.parameters():
                set_layout(param, summed_over_tp=True)
    embedding, final_norm, head = (plan.part(model, path) for path in (plan.embedding, plan.final_norm, plan.head))
    if embedding is not None:
        plan.set_part(model, plan.embedding, VocabParallelEmbedding(embedding, group, padded_vocab=padded,
                                                                    sequence_parallel=sp))
    if getattr(model, "mtp_embed_tokens", None) is not None:  # a pipeline's last stage's copy, for MTP: split alike
        model.mtp_embed_tokens = VocabParallelEmbedding(model.mtp_embed_tokens, group, padded_vocab=padded,
                                                        sequence_parallel=sp)
    if final_norm is not None and sp:
        set_layout(final_norm.weight, summed_over_tp=True)
    if head is not None:
        plan.set_part(model, plan.head, VocabParallelHead(head, group, input_mode="gather" if sp else "copy",
                                                          padded_out=padded))
    model.tie_weights()
    return model


def _split_heads(layer: nn.Module, plan: ParallelPlan, group: dist.ProcessGroup) -> None:
    """Split the layer's per-head parameters and projection norms by rows (dim 0), as the heads are split; a norm
    over the whole projection sums its statistic over tp. Parts this layer does not have are skipped."""
    world = dist.get_world_size(group)
    for path in plan.head_params:
        module_path, _, name = path.rpartition(".")
        module = layer.get_submodule(module_path)
        param = getattr(module, name, None)
        if param is not None:
            setattr(module, name, _shard_param(param, (param.shape[0] // world, *param.shape[1:]), dim=0, group=group))
    for path in plan.projection_norms:
        norm = plan.part(layer, path)
        if norm is not None:
            norm.weight = _shard_param(norm.weight, (norm.weight.shape[0] // world,), dim=0, group=group)
            norm.sum_over_shards = functools.partial(all_reduce_both_ways, group=group)


def _copy_input(group: dist.ProcessGroup):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (copy_to_group(args[0], group), *args[1:])
    return hook


def _gather_input(group: dist.ProcessGroup):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return (gather_from_sequence(args[0], group), *args[1:])  # [B, T/t, h] -> [B, T, h]
    return hook


@torch.no_grad()
def sync_sequence_parallel_grads(grads: list[Tensor], group: dist.ProcessGroup) -> None:
    """Sum over tp the gradients of replicated weights that saw only this rank's tokens or heads (RMSNorm
    under sequence parallelism, per-head norms: the caller picks them by layout), in one flat all-reduce."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.flatten() for g in grads])
    with timer(group):
        dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
