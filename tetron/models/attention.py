"""Attention as the models call it: causal scaled-dot-product attention over grouped-query heads, and, for
packed windows (data.mask_documents), the mask that keeps each document to itself.

A sliding window (Mistral's, Mixtral's, Qwen's `sliding_window`) is one more condition on the same mask: a
query at position i attends to keys at i-window+1 .. i (transformers' `kv_idx > q_idx - sliding_window`). Every
attention function takes it as `window` (None: the whole causal past); a window as long as the sequence masks
nothing, so the plain causal kernel runs.

A window's documents are numbered (data/documents.py) over the whole window, so the mask is "same number
and not later"; a cp rank, which holds a share of the window's positions, still sees the numbers of the
whole window (ring and Ulysses attention build the mask of any pair of shards from them).

A family's attention may differ from Llama's in more than the window; `AttentionOptions` holds, per layer, what
the shared attention (models/llama/model.py's `Attention`) and every attention function here and under parallel/
take: separate q/k and v head widths (DeepSeek-V3's MLA), a scale other than 1/sqrt(head_dim) (Gemma's
query_pre_attn_scalar), logit soft-capping (Gemma 2: scores = cap * tanh(scores / cap)), learned sinks
(gpt-oss: one logit per head added to the softmax's denominator, a key with no value) and QK-norm per head
(Qwen3) or over the whole projection (OLMo 3). An attention function takes the scale, cap and sinks as
keywords (`scale=`, `softcap=`, `sinks=`), given only where a layer sets them. The fused kernels run whatever
they can: SDPA takes a v of another width than q and k; the CPU flash kernel does not, so the narrower side is padded
with zeros there (equal_widths) and the output cut back; sinks on the CPU enter that kernel's log-sum-exp; soft-
capping (and sinks off the CPU) materialise the scores (scored_attention, the math path).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tetron.device import tensor_cache
from tetron.models.core_recompute import active as recompute_active
from tetron.models.core_recompute import recomputed
from tetron.torch_private import cpu_flash_attention, cpu_flash_attention_backward

LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")  # transformers 5's layer_types


@dataclass(frozen=True)
class AttentionOptions:
    """What one layer's attention computes beyond Llama's causal softmax(q k^T / sqrt(head_dim)) v."""

    head_dim: int  # width of a query and key head
    v_head_dim: int  # width of a value head, and of each head's share of o_proj's input
    window: int | None = None  # sliding window: a query attends to this many latest positions (None: all)
    scale: float | None = None  # the scores' scale; None: head_dim**-0.5
    softcap: float | None = None  # scores = softcap * tanh(scores / softcap) before the softmax (Gemma 2)
    sinks: bool = False  # a learned logit per head in the softmax's denominator (gpt-oss's `self_attn.sinks`)
    qk_norm: str | None = None  # "head": RMSNorm over each q/k head (Qwen3); "projection": over the whole q and k
    # projection outputs (OLMo 3); None: no QK-norm

    def __post_init__(self) -> None:
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm={self.qk_norm!r}: use 'head', 'projection' or None")
        for name in ("head_dim", "v_head_dim", "window"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be at least 1")
        for name in ("scale", "softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value} must be positive (or null: off)")

    def extras(self) -> dict:
        """The keywords an attention function takes for these options: only those set, so that functions which
        know none of them (Llama's layers never pass any) keep working."""
        return {k: v for k, v in (("scale", self.scale), ("softcap", self.softcap)) if v is not None}


def layer_windows(layer_types: list[str] | None, sliding_window: int | None, num_layers: int) -> list[int | None]:
    """Each layer's window from transformers 5's `layer_types` ("full_attention" or "sliding_attention" per layer)
    and `sliding_window`; None per layer without layer_types. A ValueError names a bad list in one line; chunked
    attention (Llama 4's) has its name reserved and is refused until implemented."""
    if layer_types is None:
        return [None] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers or any(
            t not in LAYER_KINDS for t in layer_types):
        raise ValueError(f"layer_types={layer_types!r}: give one of {LAYER_KINDS[:2]} per layer ({num_layers})")
    if "chunked_attention" in layer_types:
        raise ValueError("layer_types: 'chunked_attention' is not implemented; use 'full_attention' or "
                         "'sliding_attention'")
    if "sliding_attention" in layer_types and sliding_window is None:
        raise ValueError("layer_types names sliding_attention layers but sliding_window is null; give its width")
    return [sliding_window if t == "sliding_attention" else None for t in layer_types]


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None,
                   window: int | None = None, *, scale: float | None = None, softcap: float | None = None,
                   sinks: Tensor | None = None) -> Tensor:
    """Causal attention: q [B, n_heads, T, head_dim], k [B, n_kv_heads, T, head_dim], v [B, n_kv_heads, T,
    v_head_dim] -> [B, n_heads, T, v_head_dim]; with `docs` (documents.py) each position attends only within its
    document, with `window` only to the `window` latest positions (itself included); `scale`, `softcap` and
    `sinks` [n_heads] as AttentionOptions says."""
    if sinks is None and recompute_active() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # recompute: selective keeps q, k, v only and runs the kernel again in the backward (core_recompute.py)
        core = functools.partial(sdpa_attention, docs=docs, window=window, scale=scale, softcap=softcap)
        return recomputed(core, q, k, v)
    if window is not None and window >= q.shape[2]:
        window = None  # no query is further than T-1 from a key: the window masks nothing
    grouped = k.shape[1] != q.shape[1]
    if softcap is not None or (sinks is not None and q.device.type != "cpu"):
        k, v = repeat_kv(q, k, v)  # the math path: its [B, H, T, T] scores outweigh the repeated heads
        return scored_attention(q, k, v, docs, window, scale=scale, softcap=softcap, sinks=sinks)
    # GQA: the fused kernels that take grouped heads get them as they are, so that the k and v saved for the
    # backward are the kv heads, never one copy per query head. The CPU's flash kernel takes them in every
    # dtype, with or without a mask; on CUDA only FlashAttention (no mask, fp16/bf16): elsewhere torch would fall
    # back to its math path, and the heads are repeated instead.
    if grouped and q.device.type != "cpu" and not (docs is None and window is None and _flash_takes_groups(q, k, v)):
        k, v = repeat_kv(q, k, v)
        grouped = False
    if sinks is not None:  # the CPU's fused kernel, the sinks added to its log-sum-exp
        bias = None if docs is None and window is None else (
            docs.bias(q.dtype, window) if docs is not None else _window_bias(q.shape[2], window, q.dtype, q.device))
        *qkv, scale = equal_widths(q, k, v, scale)
        return _SinksCPU.apply(*qkv, bias, sinks, scale)[..., :v.shape[-1]]
    if docs is None and window is None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # takes v of another width
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)
    bias = docs.bias(q.dtype, window) if docs is not None else _window_bias(q.shape[2], window, q.dtype, q.device)
    return masked_attention(q, k, v, bias, scale=scale)


def repeat_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k and v with each kv head repeated for its group of query heads ([B, n_heads, T, D]); as they are without
    GQA."""
    if k.shape[1] == q.shape[1]:
        return k, v
    rep = q.shape[1] // k.shape[1]
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _flash_takes_groups(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether CUDA's FlashAttention runs causal attention on these grouped heads (enable_gqa), by torch's own
    check; False where this torch cannot say."""
    try:
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)
        return torch.backends.cuda.can_use_flash_attention(params, False)
    except (AttributeError, TypeError, RuntimeError):
        return False


def scored_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None, window: int | None = None, *,
                     scale: float | None = None, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """sdpa_attention's math path, the scores [B, H, T, T] materialised in fp32 (what soft-capping and sinks
    need), differentiated by autograd: q, k, v with every query head. The sinks enter as transformers' GptOss
    eager attention writes them: a column of logits beside the scores, softmaxed with them, then dropped."""
    B, H, T = q.shape[:3]
    scores = (q.float() @ k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(T, device=q.device)
    allowed = document_mask(docs.ids, pos, pos, window) if docs is not None else causal_mask(pos, pos, window)
    scores = scores.masked_fill(~allowed, float("-inf"))  # [B, H, T, T]
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # [B, H, T, T]
    return (probs @ v.float()).to(q.dtype)


def causal_mask(q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """[Tq, Tk] bool, True where the key is not after the query (and, with `window`, fewer than `window`
    positions before it); q_pos/k_pos are the window positions of the queries and keys ([Tq], [Tk])."""
    behind = q_pos[:, None] - k_pos[None, :]  # [Tq, Tk]: how far each key lies before each query
    allowed = behind >= 0
    return allowed if window is None else allowed & (behind < window)


def document_mask(docs: Tensor, q_pos: Tensor, k_pos: Tensor, window: int | None = None) -> Tensor:
    """[B, 1, Tq, Tk] bool, True where a query may attend: the key is in the query's document and not
    after it (nor, with `window`, as far back as the window). `docs` [B, T] numbers the whole window;
    q_pos/k_pos are the window positions of the queries and keys ([Tq], [Tk])."""
    same = docs[:, q_pos, None] == docs[:, None, k_pos]  # [B, Tq, Tk]
    return (same & causal_mask(q_pos, k_pos, window)).unsqueeze(1)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as the scores to add that the fused kernels take: 0 where a query may attend, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


@tensor_cache(maxsize=2)
def _window_bias(length: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[1, 1, T, T] additive causal sliding-window mask, made once for every layer of every step (the
    layers save one tensor for their backward, not one each); two kept: training's, and one more."""
    pos = torch.arange(length, device=device)
    return _additive(causal_mask(pos, pos, window), dtype)[None, None]


class Documents:
    """The documents of a forward pass's windows ([B, T] `ids`, the whole window even on a cp rank) and the
    additive mask of the whole sequence made from them once per window length, when an attention first asks
    for it: every layer then uses, and saves for its backward, the same tensor (ring attention never asks; it
    masks each block from the ids)."""

    def __init__(self, ids: Tensor) -> None:
        self.ids = ids
        self._bias: dict[tuple[torch.dtype, int | None], Tensor] = {}

    def bias(self, dtype: torch.dtype, window: int | None = None) -> Tensor:
        """[B, 1, T, T] in `dtype`: 0 where a query may attend, -inf elsewhere (what the fused kernels take)."""
        if (dtype, window) not in self._bias:
            pos = torch.arange(self.ids.shape[1], device=self.ids.device)
            self._bias[dtype, window] = _additive(document_mask(self.ids, pos, pos, window), dtype)
        return self._bias[dtype, window]


class _CausalMaskedCPU(torch.autograd.Function):
    """The CPU's fused attention kernel told both: causal (so it skips the key blocks after each query
    block, as causal attention does) and the document mask. torch's scaled_dot_product_attention takes one
    or the other; with the mask alone the kernel scores every block (1.6x the attention time at 2048)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        out, lse = cpu_flash_attention(q, k, v, True, bias=bias, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias = ctx.saved_tensors
        dq, dk, dv = cpu_flash_attention_backward(dout.contiguous(), q, k, v, out, lse, True, bias=bias,
                                                  scale=ctx.scale)
        return dq, dk, dv, None, None


class _SinksCPU(torch.autograd.Function):
    """Causal attention with learned sinks on the CPU's fused kernel, no [T, T] scores kept: the sink, a key
    with no value, enters the kernel's log-sum-exp afterwards (lse' = logaddexp(lse, sink), out * exp(lse -
    lse')); given lse', the kernel's own backward is the sinks' attention's (its delta, sum(dout * out), holds the
    sink's share), and the sinks' gradient is -sum over queries of exp(sink - lse') * delta (as ring attention's)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, scale):
        out, lse = cpu_flash_attention(q, k, v, True, bias=bias, scale=scale)
        with_sink = torch.logaddexp(lse.float(), sinks.float().view(1, -1, 1))  # [B, H, T]
        out = (out.float() * (lse.float() - with_sink).exp().unsqueeze(-1)).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, with_sink, bias, sinks)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, bias, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = cpu_flash_attention_backward(dout, q, k, v, out, lse, True, bias=bias, scale=ctx.scale)
        delta = (dout.float() * out.float()).sum(-1)  # [B, H, T]
        dsinks = -((sinks.float().view(1, -1, 1) - lse).exp() * delta).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, None, dsinks, None


def document_attention(q: Tensor, k: Tensor, v: Tensor, docs: Documents, window: int | None = None) -> Tensor:
    """Causal attention within documents: q, k, v [B, H, T, D] (k and v with every query head) -> like v."""
    return masked_attention(q, k, v, docs.bias(q.dtype, window))


def masked_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, *, scale: float | None = None) -> Tensor:
    """Causal attention with an additive mask `bias` [B or 1, 1, T, T] on top: q [B, H, T, D], k [B, KVH, T, D],
    v [B, KVH, T, Dv] (KVH dividing H) -> [B, H, T, Dv]."""
    if q.device.type == "cpu":
        if v.shape[-1] == q.shape[-1]:
            return _CausalMaskedCPU.apply(q, k, v, bias, scale)  # strided as they come, as torch passes them
        # the CPU kernel takes q, k and v of one width only: the narrower side padded, the output cut back
        *qkv, scale = equal_widths(q, k, v, scale)
        return _CausalMaskedCPU.apply(*qkv, bias, scale)[..., :v.shape[-1]]
    # CUDA: the memory-efficient kernel, which takes a mask (FlashAttention takes none) but not grouped heads
    k, v = repeat_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def equal_widths(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor, Tensor, float | None]:
    """(q, k, v, scale) for a kernel that needs one head width: the narrower side padded with zeros (zeros in
    q and k add nothing to the scores, zeros in v give output columns of zeros, cut off after); where q and k
    are padded, the scale stays that of their true width."""
    width = max(q.shape[-1], v.shape[-1])
    if width > q.shape[-1]:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q, k = F.pad(q, (0, width - q.shape[-1])), F.pad(k, (0, width - k.shape[-1]))
    return q, k, F.pad(v, (0, width - v.shape[-1])) if width > v.shape[-1] else v, scale


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole projection's output [..., n_heads*head_dim] (OLMo 3's q_norm, k_norm), in fp32 with
    the weight applied before the cast back, as transformers' Olmo3RMSNorm. Under tensor parallelism a rank
    holds its heads' slice of the width: `sum_over_shards` (the identity here; tensor_parallel.py sets an
    all-reduce over tp) completes the sum of squares, and `width` stays the whole projection's."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps, self.width = eps, width
        self.sum_over_shards = _unchanged

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        squares = self.sum_over_shards(x.square().sum(-1, keepdim=True))  # [..., 1]: over the whole width
        x = x * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * x).to(dtype)


def _unchanged(x: Tensor) -> Tensor:
    return x
