"""QK-clip (Kimi-K2's MuonClip, `optim.qk_clip_tau`): after each optimizer step, the query and key weights of the
heads whose largest pre-softmax logit of the step exceeded tau are scaled down so that it would not have.

The logit. S = scale * q.k (RoPE applied; before soft-capping, which bounds what the softmax sees but not the weights
behind it; a learned sink is no q.k and is left out), over the pairs the mask allows (causal, the sliding window, the
documents). Fused attention never returns it, so each attention module's `attn_fn` is wrapped (`LogitMax`): under
autograd (a training forward, or its recomputation; not validation's no_grad) it computes q k^T a block of queries at a
time without keeping it (a [B, H, rows, T] block of at most BLOCK elements), reduced to the maximum per head. Under
context parallelism a rank holds a share of the positions: its keys are all-gathered over cp first (no gradient).

The maximum over the global batch. Each rank's maxima (its layers: pp; its heads: tp; its micro-batches, sequences
and positions: dp, cp) go into one [layers, heads] tensor, -inf where not its own, and one all-reduce (MAX) over
the world makes every rank hold every layer's per-head maximum: what its clip needs, and `max_attn_logit` (the
largest of them) that the step logs.

The clip. For a group of query heads sharing a key head (grouped-query attention), the group's maximum m (as
Megatron-LM does: a shared key cannot be scaled for one head alone); where m > tau, eta = tau / m, and the group's
query rows and its key rows (weights and biases: both scale q and k) are multiplied by sqrt(eta) each, so every logit
of the group scales by eta (RoPE is linear). With one query head per key head this is Kimi-K2's rule per head. An
attention module of another shape says which rows scale by which power of eta (`qk_clip_rule`, built with
`clip_rows`): MLA's (Kimi-K2's rule) scales a head's q and k "nope" rows by sqrt(eta), its q rotary rows by eta, and
leaves the rotary key shared by all heads and the values alone. The
rows are scaled where the optimizer's fp32 masters are (zero.py's pieces: whole, a ZeRO slice's piece, tp's heads),
before the parameters are refreshed from them, so every layout clips the same weights. A step the optimizer skips
(found_inf) clips nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.mesh import Mesh
from tetron.models.attention import causal_mask, document_mask
from tetron.models.spec import spec_of
from tetron.parallel.comm import all_gather_dim
from tetron.parallel.context_parallel import shard_indices

BLOCK = 1 << 22  # elements of one block of scores (16 MiB in fp32)


class LogitMax:
    """An attention function that also records, per query head, the largest logit it was asked to attend with
    (`max`, [heads], fp32; None until a training forward ran)."""

    def __init__(self, fn, mesh: Mesh, *, layout: str) -> None:
        self.fn, self.layout, self.max = fn, layout, None
        self.cp, self.cp_rank, self.cp_group = mesh.size("cp"), mesh.local_rank("cp"), mesh.group("cp")

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, docs=None, window: int | None = None, **options) -> Tensor:
        if torch.is_grad_enabled():
            self._record(q.detach(), k.detach(), docs, window, options.get("scale"))
        return self.fn(q, k, v, docs, window, **options)

    @torch.compiler.disable  # a side effect on the host's object: eager, between compiled pieces
    @torch.no_grad()
    def _record(self, q: Tensor, k: Tensor, docs, window: int | None, scale: float | None) -> None:
        B, H, Tq, D = q.shape  # [B, H, T/cp, D]
        kv = k.shape[1]
        seq = Tq * self.cp
        if self.cp > 1:
            k = all_gather_dim(k, 2, self.cp_group)  # [B, KV, T, D], in cp rank order
            q_pos = shard_indices(seq, self.cp, self.cp_rank, layout=self.layout, device=q.device)
            k_pos = torch.cat([shard_indices(seq, self.cp, r, layout=self.layout, device=q.device)
                               for r in range(self.cp)])
        else:
            q_pos = k_pos = torch.arange(seq, device=q.device)
        scale = D ** -0.5 if scale is None else scale
        qg = q.float().unflatten(1, (kv, H // kv))  # [B, KV, rep, Tq, D]: head h = g * rep + j, as SDPA repeats k
        kt = k.float().unsqueeze(2).transpose(-1, -2)  # [B, KV, 1, D, Tk]
        rows = max(1, BLOCK // (B * H * k.shape[2]))
        best = torch.full((kv, H // kv), float("-inf"), device=q.device)
        for start in range(0, Tq, rows):
            qs = slice(start, start + rows)
            scores = (qg[:, :, :, qs] @ kt) * scale  # [B, KV, rep, rows, Tk]
            allowed = (document_mask(docs.ids, q_pos[qs], k_pos, window).unsqueeze(1) if docs is not None
                       else causal_mask(q_pos[qs], k_pos, window))  # [B, 1, 1, rows, Tk] or [rows, Tk]
            scores = scores.masked_fill(~allowed, float("-inf"))
            best = torch.maximum(best, scores.amax(dim=(0, 3, 4)))
        best = best.reshape(H)
        self.max = best if self.max is None else torch.maximum(self.max, best)


def record_attention_logits(model: nn.Module, mesh: Mesh, *, layout: str) -> nn.Module:
    """Wrap every attention module's `attn_fn` (after context parallelism chose it) in a LogitMax."""
    for module in model.modules():
        if hasattr(module, "attn_fn") and not isinstance(module.attn_fn, LogitMax):
            module.attn_fn = LogitMax(module.attn_fn, mesh, layout=layout)
    return model


def scale_rows_(flat: Tensor, start: int, cols: int, factor: Tensor) -> None:
    """Multiply the elements [start, start + flat.numel()) of a flattened [rows, cols] tensor, held in `flat`, by
    `factor` [rows] of their row: a partial first row, whole rows, a partial last row (no index tensor)."""
    n, at = flat.numel(), 0
    lead = min(n, (-start) % cols)
    if lead:
        flat[:lead].mul_(factor[start // cols])
        at = lead
    whole = (n - at) // cols
    row = (start + at) // cols
    if whole:
        flat[at:at + whole * cols].view(whole, cols).mul_(factor[row:row + whole, None])
        at += whole * cols
    if at < n:
        flat[at:].mul_(factor[row + whole])


def clip_rows(groups: int, parts: list[tuple[int, float]]) -> tuple[Tensor, Tensor]:
    """The rows of a projection laid out as `groups` consecutive blocks, each block the `parts` (width, power) in
    order: each row's group and the power of the group's eta it scales by (0.5: one side of q.k, 1: all of it,
    0: untouched). Returns ([rows] group index, [rows] power)."""
    width = sum(w for w, _ in parts)
    power = torch.cat([torch.full((w,), float(p)) for w, p in parts]).repeat(groups)
    return torch.arange(groups).repeat_interleave(width), power


def default_clip_rule(module: nn.Module, q_proj: nn.Linear, k_proj: nn.Linear) -> tuple[int, int, list]:
    """Separate q and k projections of head_dim rows a head (grouped-query attention): every query row of a kv-head
    group and the group's key rows scale by sqrt(eta). Returns (heads, kv heads, [(param, groups, parts)]): each
    parameter's rows as clip_rows(groups, parts) reads them."""
    heads = q_proj.weight.shape[0] // module.head_dim  # this rank's
    kv_heads = k_proj.weight.shape[0] // module.head_dim
    rules = [(p, kv_heads, [(rows, 0.5)])
             for proj, rows in ((q_proj, heads // kv_heads * module.head_dim), (k_proj, module.head_dim))
             for p in (proj.weight, proj.bias) if p is not None]
    return heads, kv_heads, rules


class QKClip:
    """The clip of one rank's attention layers (every chunk's), after each optimizer step (zero.py calls `apply`
    on its pieces). `max_logit`: the last step's largest logit over the model and the global batch, on the device.
    An attention module whose q and k are not two head_dim-wide projections gives its own rule: a method
    `qk_clip_rule()` returning what default_clip_rule does (MLA's: models/deepseek_v3.py)."""

    def __init__(self, chunks: list[nn.Module], mesh: Mesh, *, tau: float, num_layers: int, num_heads: int) -> None:
        self.tau, self.world = tau, mesh.world_size
        self.shape = (num_layers, num_heads)
        self.layers = []  # (layer index, first head's index, heads, kv heads, LogitMax, {id(param): (group, power)})
        tp_rank = mesh.local_rank("tp")
        self.device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
        for chunk in chunks:
            plan = spec_of(chunk.config).plan
            for index, layer in plan.layers_of(chunk).items():
                for block in plan.blocks:
                    module = plan.part(layer, block.path)
                    if not isinstance(getattr(module, "attn_fn", None), LogitMax):
                        continue
                    if hasattr(module, "qk_clip_rule"):
                        heads, kv_heads, rules = module.qk_clip_rule()
                    else:  # the attention block's first two input linears: its query and key projections
                        heads, kv_heads, rules = default_clip_rule(
                            module, *(getattr(module, name) for name in block.column[:2]))
                    params = {id(p): tuple(t.to(self.device) for t in clip_rows(groups, parts))
                              for p, groups, parts in rules}
                    self.layers.append((int(index), tp_rank * heads, heads, kv_heads, module.attn_fn, params))
        self.max_logit = torch.full((), float("nan"))

    @torch.no_grad()
    def apply(self, pieces: list, found_inf: Tensor | None) -> None:
        """Reduce the step's maxima over the world, clip this rank's pieces (zero.Piece: a parameter, the offset of
        its flat elements, its fp32 master) of the query and key projections, and forget the maxima."""
        maxima = torch.full(self.shape, float("-inf"), device=self.device)  # a rank may hold no piece (ZeRO)
        for layer, first, heads, _, record, _ in self.layers:
            if record.max is not None:
                maxima[layer, first:first + heads] = record.max
            record.max = None
        if self.world > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        self.max_logit = maxima.max()
        factors: dict[int, Tensor] = {}  # id(param) -> [rows] factor
        for layer, first, heads, kv_heads, _, params in self.layers:
            group_max = maxima[layer, first:first + heads].view(kv_heads, -1).amax(dim=1)  # [KV]
            eta = torch.where(group_max > self.tau, self.tau / group_max, torch.ones_like(group_max))
            if found_inf is not None:
                eta = torch.where(found_inf > 0, torch.ones_like(eta), eta)
            for pid, (group, power) in params.items():
                factors[pid] = eta[group] ** power
        for piece in pieces:
            factor = factors.get(id(piece.param))
            if factor is not None:
                cols = piece.param.numel() // factor.numel()
                scale_rows_(piece.master.view(-1), piece.start, cols, factor.to(piece.master.dtype))


def build_qk_clip(chunks: list[nn.Module], mesh: Mesh, *, tau: float, num_layers: int,
                  num_heads: int) -> QKClip:
    """QK-clip over the attention modules record_attention_logits wrapped in `chunks`."""
    if not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"optim.qk_clip_tau={tau} must be a positive number (or null: off)")
    return QKClip(chunks, mesh, tau=tau, num_layers=num_layers, num_heads=num_heads)
