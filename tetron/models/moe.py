"""The mixture-of-experts layer: a token-choice top-k router, experts stored as transformers 5 stores them
(two fused 3D tensors), and the dispatch between them.

    router      scores (softmax, or sigmoid plus a load-driven routing bias), top-k (optionally within the
                best groups of experts), the weights each chosen expert's output gets
    experts     models/experts.py: the experts' weights as transformers stores them, their loop and grouped paths
    dispatch    permute: each (token, choice) assignment sorted by expert, those over an expert's capacity
                dropped; `experts_fn` runs the experts on their contiguous slices (expert parallelism
                replaces it with all-to-all -> local experts -> all-to-all); un-permute: each token's
                outputs weighted and summed back into its row
    balancing   the auxiliary loss and router z-loss, added to the training objective by injecting their
                gradient in the backward pass (so no loss code and no pipeline stage needs to carry them);
                per-step statistics (expert load, dropped assignments) that parallel/moe_balance.py
                reduces over the ranks to report and to update the routing bias

The auxiliary loss is defined per sequence, E * sum_e f_e * P_e with f_e the fraction of the sequence's
top-k assignments times k (transformers' tokens_per_expert: assignments / tokens) and P_e the sequence's mean
router probability, and averaged over MoE layers: a sum over sequences divided by the sequences of a step, as
the main loss is a sum over tokens, so every data-parallel layout computes the same value. Where a sequence
is split over ranks (context parallelism, tp's sequence parallelism), each rank computes its piece's share
from the sequence's whole assignment counts (summed over the pieces through the `sum_pieces` seam) and its
own tokens' probabilities; the shares add up to the sequence's loss. `moe_aux_loss:
batch` computes transformers' formula instead (over each forward's whole batch, aggregated over layers), for
comparing with transformers in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tetron.models.blocks import MLP
from tetron.models.experts import Experts, grouped_mm_supported  # noqa: F401  (grouped_mm_supported: the planner's)
from tetron.torch_private import in_backward


@dataclass
class Routing:
    """Where a forward's N tokens go: k experts each, with the weights of their outputs."""

    experts: Tensor  # [N, k] long: the chosen experts
    weights: Tensor  # [N, k] fp32: each chosen expert's share of the token's output
    probs: Tensor  # [N, E] fp32: the scores the auxiliary loss balances (softmax, or normalized sigmoid)
    logits: Tensor  # [N, E] fp32: the router logits (the z-loss)


class Router(nn.Module):
    """Token-choice top-k routing. `weight` [E, H] is transformers' `mlp.gate.weight`; with a routing bias
    (DeepSeek-V3's `e_score_correction_bias`, a buffer moved by expert load, never by gradient) the bias
    changes which experts are chosen but not the weights of their outputs."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 norm_topk_prob: bool = True, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, bias_update_rate: float = 0.0, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        # a learned bias on the logits (gpt-oss's `mlp.router.bias`), trained as the weight is
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.top_k, self.scoring, self.norm_topk_prob = top_k, scoring, norm_topk_prob
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.bias_update_rate = bias_update_rate
        has_bias = scoring == "sigmoid" or bool(bias_update_rate)  # a None buffer is not in the state dict
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts) if has_bias else None)

    def forward(self, x: Tensor) -> Routing:  # x [N, H]
        if self.scoring == "sigmoid":  # DeepSeek-V3 scores in fp32 from the start
            logits = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
            scores = logits.sigmoid()  # [N, E]
        else:  # Qwen3-MoE, Mixtral and gpt-oss: logits in the activations' dtype, softmax in fp32 (over all E,
            # then the top k renormalized: the softmax over the top k's logits that gpt-oss computes)
            logits = F.linear(x, self.weight, self.bias).float()
            scores = logits.softmax(-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1:
            choice = self._best_groups(choice)
        experts = choice.topk(self.top_k, dim=-1)[1]  # [N, k]
        weights = scores.gather(1, experts)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        weights = weights * self.routed_scaling_factor
        probs = scores if self.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(experts=experts, weights=weights, probs=probs, logits=logits)

    def _best_groups(self, choice: Tensor) -> Tensor:
        """Scores outside each token's topk_group best groups (a group scored by its two best experts) set to
        -inf, as DeepSeek-V3 limits the nodes a token's experts sit on."""
        n, e = choice.shape
        grouped = choice.view(n, self.n_group, e // self.n_group)  # [N, groups, E/groups]
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [N, groups]
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [N, groups]
        return choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(n, e), float("-inf"))


class MoEStats:
    """What a block's forwards of one optimizer step add up (on the device, no host reads): the
    assignments each expert was chosen for (before dropping), those dropped, and the per-sequence sums of
    the auxiliary and z losses. parallel/moe_balance.py reads and resets them after each step."""

    def __init__(self) -> None:
        self.counts: Tensor | None = None  # [E] fp32
        self.totals: Tensor | None = None  # [4] fp32: aux sum, z sum, dropped, assignments

    def add(self, counts: Tensor, aux: Tensor, z: Tensor, dropped: Tensor, assigned: int) -> None:
        totals = torch.stack([aux.detach().float(), z.detach().float(), dropped.float(),
                              torch.full((), float(assigned), device=counts.device)])
        self.counts = counts.float() if self.counts is None else self.counts + counts
        self.totals = totals if self.totals is None else self.totals + totals

    def reset(self) -> None:
        self.counts = self.totals = None


class _InjectGrad(torch.autograd.Function):
    """forward: identity on `out`; backward: `loss` gets gradient `scale`, so that `scale * loss` is part of
    the objective without being added to the value any loss code sees (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def add_loss_gradient(out: Tensor, loss: Tensor, scale: float) -> Tensor:
    """`out` unchanged; in the backward pass `scale * loss` adds its gradient."""
    return _InjectGrad.apply(out, loss, scale) if scale and loss.requires_grad else out


def in_recomputation() -> bool:
    """True while autograd runs a backward pass, where activation recomputation replays a forward: its
    statistics are already counted."""
    return in_backward()


def sequence_balance_losses(route: Routing, batch: int, num_experts: int, *, pieces: int = 1,
                            sum_pieces: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(auxiliary loss, z-loss) each summed over the `batch` sequences of the forward: per sequence of T tokens
    E * sum_e (A_e / T) * (S_e / T), A_e its assignments to expert e and S_e the sum of its probabilities of e,
    and the mean of logsumexp(logits)^2. A sequence split into `pieces` over ranks (context or sequence
    parallelism): the forward holds one piece, `sum_pieces` sums [B, E] counts over the ranks holding the others
    (A is then the whole sequence's, a constant), and this is the piece's share, E * sum_e A_e * S_e(piece) / T^2
    and its tokens' sum of logsumexp^2 / T: the shares of a sequence's pieces add up to its losses."""
    n, k = route.experts.shape
    t = n // batch  # this piece's tokens of each sequence
    whole = t * pieces  # T
    ones = torch.ones(batch, t * k, device=route.probs.device)
    assigned = torch.zeros(batch, num_experts, device=route.probs.device).scatter_add_(
        1, route.experts.view(batch, t * k), ones)  # [B, E]
    if sum_pieces is not None:
        assigned = sum_pieces(assigned)  # [B, E]: the whole sequences'
    prob_sums = route.probs.view(batch, t, num_experts).sum(1)  # [B, E]
    aux = num_experts * (assigned * prob_sums).sum() / whole**2
    z = route.logits.logsumexp(-1).square().sum() / whole
    return aux, z


def batch_balance_loss(routes: list[Routing], num_experts: int) -> Tensor:
    """transformers' load_balancing_loss_func: assignment fractions and mean probabilities over every token
    of the batch and every layer together, then E * their dot product."""
    chosen = torch.cat([r.experts.reshape(-1) for r in routes])
    probs = torch.cat([r.probs for r in routes])  # [L*N, E]
    fraction = torch.bincount(chosen, minlength=num_experts).float() / probs.shape[0]
    return num_experts * (fraction * probs.mean(0)).sum()


class MoEBlock(nn.Module):
    """The MoE feed-forward of a decoder layer, transformers' `mlp` with `gate` (the router), `experts` and,
    with shared experts, `shared_experts`. `experts_fn(tokens, counts)` is the one seam between the
    permuted tokens and the experts that compute them."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 aux_loss: str = "sequence", n_shared_experts: int = 0, act: str = "silu",
                 experts: Experts | None = None, router_name: str = "gate", **router: object) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef, self.aux_loss = aux_loss_coef, z_loss_coef, aux_loss
        # the router under transformers' name for it in the family: `gate` (Qwen3-MoE, Mixtral), `router` (gpt-oss)
        self.router_name = router_name
        setattr(self, router_name, Router(hidden, num_experts, top_k, **router))
        # the routed experts; a family whose experts have options (Experts' docstring) builds its own
        self.experts = experts if experts is not None else Experts(num_experts, hidden, intermediate, act=act)
        # DeepSeek's shared experts: one dense gated MLP as wide as n of them (models/blocks.py's, no biases)
        self.shared_experts = MLP(hidden, intermediate * n_shared_experts, act=act) if n_shared_experts else None
        # (tokens [M, H] grouped by expert, counts [E]) -> [M, H]; None: this rank's `experts`. Expert
        # parallelism sets its exchange here: all-to-all to the experts' ranks, their experts, all-to-all back.
        self.experts_fn: Callable[[Tensor, Tensor], Tensor] | None = None
        # The objective's share of this block's summed per-sequence losses: 1 / (MoE layers * sequences of a
        # rank's step), times cp under context parallelism, set by the model and the training run
        # (parallel/moe_balance.py says why).
        self.loss_scale = 1.0
        # Sequences split over ranks (context parallelism, or tp's sequence parallelism): the pieces of each, and
        # the sum of a forward's [B, E] assignment counts over the ranks holding them (parallel/moe_balance.py)
        self.pieces = 1
        self.sum_pieces: Callable[[Tensor], Tensor] | None = None
        self.stats = MoEStats()
        self.last_route: Routing | None = None  # the last forward's routing, kept under aux_loss="batch"

    def router_module(self) -> Router:
        """The block's router, under the name the family gives it."""
        return getattr(self, self.router_name)

    def capacity(self, tokens: int) -> int | None:
        """Assignments an expert takes per forward: capacity_factor * tokens * k / E, None when dropless."""
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)

    def forward(self, x: Tensor) -> Tensor:  # x [B, T, H]
        B, T, H = x.shape
        flat = x.reshape(-1, H)  # [N, H]
        route = self.router_module()(flat)
        out, counts, dropped = self.dispatch(flat, route)  # [N, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        out = out.view(B, T, H)
        if not torch.is_grad_enabled():
            return out
        # Recomputation (recompute.py) replays this forward in the backward pass: the same operations, so that
        # it saves the same tensors, but its figures are already counted.
        counted = not in_recomputation()
        if self.aux_loss == "batch":  # the model adds transformers' formula over all its layers
            if counted:
                self.last_route = route
                zero = torch.zeros((), device=x.device)
                self.stats.add(counts, zero, zero, dropped, route.experts.numel())
            return out
        aux, z = sequence_balance_losses(route, B, self.num_experts, pieces=self.pieces, sum_pieces=self.sum_pieces)
        if counted:
            self.stats.add(counts, aux, z, dropped, route.experts.numel())
        objective = self.aux_loss_coef * aux + self.z_loss_coef * z
        return add_loss_gradient(out, objective, self.loss_scale)

    # Eager under torch.compile (train.compile compiles each decoder layer): its shapes depend on the routing
    # (each expert's rows, read on the host), so Dynamo would break the graph there and recompile the rest for
    # every new split of the tokens; the router, the balancing losses and the shared experts around it compile.
    @torch.compiler.disable
    def dispatch(self, x: Tensor, route: Routing) -> tuple[Tensor, Tensor, Tensor]:
        """Each token's weighted sum of its experts' outputs [N, H]; also the assignments each expert was
        chosen for [E] and the number dropped for capacity."""
        N, k = route.experts.shape
        chosen = route.experts.reshape(-1)  # [N*k]: assignment i is token i // k's choice i % k
        order = torch.argsort(chosen, stable=True)  # assignments grouped by expert, in token order within
        counts = torch.bincount(chosen, minlength=self.num_experts)  # [E]
        kept, capacity = counts, self.capacity(N)
        dropped = torch.zeros((), device=x.device)
        if capacity is not None:  # an expert keeps its first `capacity` tokens; the others skip it
            starts = counts.cumsum(0) - counts
            place = torch.arange(N * k, device=x.device) - starts[chosen[order]]  # rank within its expert
            order = order[place < capacity]
            kept = counts.clamp(max=capacity)
            dropped = (counts - kept).sum()
        token = order // k  # [M]: the token of each kept assignment, grouped by expert
        y = (self.experts_fn or self.experts)(x[token], kept)  # [M, H]
        y = y * route.weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype)), counts, dropped

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """Aux-loss-free balancing (DeepSeek-V3): each expert's routing bias moves by the rate toward
        balance, up when it took fewer assignments than the mean, down when more. `load` [E] must be the
        same on every rank (counted over all of them)."""
        router = self.router_module()
        bias = router.e_score_correction_bias
        if bias is not None and router.bias_update_rate:
            bias += router.bias_update_rate * torch.sign(load.mean() - load)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The MoE blocks of a model (or pipeline chunk), in layer order."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def add_batch_balance_loss(out: Tensor, blocks: list[MoEBlock]) -> Tensor:
    """Under aux_loss="batch": transformers' formula over the blocks' last routings, its gradient injected
    through `out`, its value (times the batch's sequences, as the per-sequence sums are) in the stats."""
    routes = [b.last_route for b in blocks if b.last_route is not None]
    if not routes or not torch.is_grad_enabled() or in_recomputation():
        return out
    aux = batch_balance_loss(routes, blocks[0].num_experts)
    for b in blocks:
        b.last_route = None
    blocks[0].stats.totals[0] += aux.detach() * out.shape[0] * len(blocks)
    return add_loss_gradient(out, blocks[0].aux_loss_coef * aux, blocks[0].loss_scale * len(blocks) * out.shape[0])
