"""Multi-token prediction (DeepSeek-V3, section 2.2): D modules after the last decoder layer, module k predicting
the token k+1 positions ahead from the previous depth's hidden state and the embedding of the token k ahead.

    h_0 = the main model's last hidden state, after its final norm (as Megatron's decoder hands it to its MTP block)
    h_k = Layer_k(eh_proj(cat[enorm(Emb(token at p+k)), hnorm(h_{k-1} at p)]))     (the embedding part first)
    CE_k = cross entropy of Head(shared_head.norm(h_k)) at p against the token at p+k+1 (the main target at p+k)

Emb and Head are the main model's (shared); Layer_k is one decoder layer of the family, the layer
num_hidden_layers + k - 1 would be. A position p counts at depth k only where p+k lies in the window and, with
packed documents, in p's document; only those rows go through the chunked head, so the logits stay bounded.
The objective adds (w / D) * sum_k sum_p CE_k, divided by the main loss's tokens as the main loss is (its
gradient injected, the value any loss code sees stays the main loss's); the modules add up the step's sum of
(1/D) sum_k CE_k for the logs (`mtp_loss`).

The per-depth shifted ids, targets and validity come with the micro-batch (data/batch.py, `mtp_shifted`),
computed on the whole window before context parallelism cuts it, so they are right across chunk boundaries.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tetron.models.attention import Documents
from tetron.models.blocks import RMSNorm
from tetron.models.llama.rope import rope_cos_sin
from tetron.models.loss import head_cross_entropy_rows
from tetron.torch_private import in_backward


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: the module's own norm before the main model's head (`head` is not held here)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


def add_mtp_parts(layer: nn.Module, hidden: int, eps: float) -> nn.Module:
    """Give a decoder layer the parts of an MTP module, under DeepSeek's names: enorm, hnorm, eh_proj,
    shared_head.norm. The layer keeps its own names beside them, as DeepSeek's checkpoints hold them."""
    layer.enorm = RMSNorm(hidden, eps)
    layer.hnorm = RMSNorm(hidden, eps)
    layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    layer.shared_head = SharedHead(hidden, eps)
    return layer


class _AddScaledGradient(torch.autograd.Function):
    """forward: identity on `out`; backward: `extra` gets `scale` times the incoming gradient, so that `scale *
    extra` is part of the objective (scaled as `out` is downstream) while every value seen stays `out`'s."""

    @staticmethod
    def forward(ctx, out: Tensor, extra: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, grad * ctx.scale, None


def mtp_loss(model: nn.Module, h: Tensor, main: Tensor, position_ids: Tensor, docs: Tensor | None,
             shifted: Tensor) -> Tensor:
    """`main` (the summed main loss) with the MTP objective's gradient added; `h` [B, T', H] the main model's
    last hidden state after its final norm, `shifted` [B, D, 3, T'] (ids at p+k, targets at p+k, valid)."""
    modules = list(model.mtp.values())
    cfg, embed, head = model.config, model.model.embed_tokens, model.lm_head
    if embed is None:
        embed = model.mtp_embed_tokens  # a pipeline's last stage: its own copy of the embedding
    documents = Documents(docs) if docs is not None else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for k, module in enumerate(modules, start=1):
        ids, targets, valid = shifted[:, k - 1].unbind(1)  # each [B, T']
        e = module.enorm(embed(ids))  # [B, T', H]
        x = module.eh_proj(torch.cat([e, module.hnorm(h)], dim=-1))  # [B, T', H]
        cos, sin = rope_cos_sin(cfg, position_ids, dtype=x.dtype, layer=cfg.num_hidden_layers + k - 1)
        h = module(x, cos, sin, documents)
        # only the positions whose target is in the window (and document): [n, H] through the head
        total = total + head_cross_entropy_rows(head, module.shared_head.norm(h), valid.bool(), targets,
                                                chunk_tokens=model.loss_chunk_tokens)
    per_depth = total / len(modules)
    if torch.is_grad_enabled() and not in_backward():
        model.mtp_sum = per_depth.detach() if model.mtp_sum is None else model.mtp_sum + per_depth.detach()
    if not per_depth.requires_grad:
        return main
    return _AddScaledGradient.apply(main, per_depth, model.mtp_loss_weight)


def take_mtp_sum(chunks: list[nn.Module], device: torch.device) -> Tensor | None:
    """The summed (1/D) sum_k CE_k of this rank's forwards since the last call (zero where no MTP module ran
    here), and reset; None for a model without MTP."""
    if not any(getattr(c, "mtp", None) is not None for c in chunks) and \
            not getattr(chunks[0].config, "num_nextn_predict_layers", 0):
        return None
    total = torch.zeros((), dtype=torch.float32, device=device)
    for chunk in chunks:
        if getattr(chunk, "mtp_sum", None) is not None:
            total = total + chunk.mtp_sum
            chunk.mtp_sum = None
    return total
