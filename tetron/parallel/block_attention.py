"""One block of attention with its log-sum-exp: the kernel ring attention merges blocks with.

Ring attention needs, for each (query block, key block) pair, the attention output and the
log-sum-exp (lse) of the scores, so that partial results merge exactly (online softmax); its
backward pass recomputes each block's gradients from the FINAL output and lse. PyTorch's fused
attention kernels have exactly that interface, as private ops:
- "cpu_flash": `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), lse [B, H, Tq] fp32;
- "flash" (CUDA, fp16/bf16, sm80+): `_scaled_dot_product_flash_attention` (+ `_backward`), lse
  [B, H, Tq] fp32;
- "efficient" (CUDA, any float dtype): `_scaled_dot_product_efficient_attention` (+ `_backward`),
  whose lse is [B, H, ceil(Tq/32)*32] on CUDA: the padding is cut off here after the forward and
  added back (its values are never read) before the backward, which is given the kernel's own layout.
- "math": plain matmuls in fp32, materialising [B, H, Tq, Tk] scores: the reference in the tests, and
  the path for devices without a fused kernel.
Which one a block gets is decided in one place, `tetron.device.attention_kernel`, from its device,
dtype and head width. Every kernel here uses the scale head_dim**-0.5 and no dropout. A block with a
document mask (models/attention.py: packed documents kept apart) runs on the CPU kernel, which takes a mask, or
else on the math path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tetron.device import AttentionKernel, attention_kernel

aten = torch.ops.aten
LSE_ALIGN = 32  # the efficient kernel pads its lse's last dim to a multiple of this (torch's meta registration)

# ----------------------------------------------------------------------------- the reference: plain math


def _math_scores(q: Tensor, k: Tensor, causal: bool, mask: Tensor | None) -> Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, H, Tq, Tk]
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _math_block(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q [B, H, Tq, D] on k/v [B, H, Tk, D] -> (out like q, lse [B, H, Tq] fp32); `mask`
    [B, 1, Tq, Tk] bool (True: attend) where given."""
    scores = _math_scores(q, k, causal, mask)
    lse = scores.logsumexp(dim=-1)
    out = (scores - lse.unsqueeze(-1)).exp() @ v.float()
    return out.to(q.dtype), lse


def _math_block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         causal: bool, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the FINAL out and lse of the whole attention (flash-style)."""
    scale = q.shape[-1] ** -0.5
    qf, kf, vf, dof = q.float(), k.float(), v.float(), dout.float()
    scores = _math_scores(q, k, causal, mask)
    probs = (scores - lse.unsqueeze(-1)).exp()  # this block's share of the final softmax
    dv = probs.transpose(-1, -2) @ dof
    dprobs = dof @ vf.transpose(-1, -2)
    delta = (dof * out.float()).sum(-1, keepdim=True)  # [B, H, Tq, 1]
    dscores = probs * (dprobs - delta) * scale
    return (dscores @ kf).to(q.dtype), (dscores.transpose(-1, -2) @ qf).to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- fused kernels


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The CPU kernel takes a mask as scores to add, in the query's dtype: 0 to attend, -inf not to."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                attn_mask=_additive(mask, q.dtype))
    return out, lse


def _cpu_flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        causal: bool, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                     attn_mask=_additive(mask, q.dtype))


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    # -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug_mask)
    out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=q.shape[-1] ** -0.5)
    return out, lse


def _no_dropout_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """The philox seed and offset a backward takes: read only under dropout, which tetron never uses."""
    return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = _no_dropout_rng(q.device)
    # cum_seq_q/k None: the dense (not variable-length) kernel, as the forward returned them
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
        scale=q.shape[-1] ** -0.5)
    return dq, dk, dv


def _efficient(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    # -> (out, lse [B, H, padded Tq], philox_seed, philox_offset)
    out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                scale=q.shape[-1] ** -0.5)
    return out, lse[..., :q.shape[2]]


def _efficient_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    tq = q.shape[2]
    padded = -(-tq // LSE_ALIGN) * LSE_ALIGN
    lse = F.pad(lse, (0, padded - tq)).contiguous()  # the forward kernel's layout again
    seed, offset = _no_dropout_rng(q.device)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=q.shape[-1] ** -0.5)
    return dq, dk, dv


_FORWARD = {"cpu_flash": _cpu_flash, "flash": _flash, "efficient": _efficient, "math": _math_block}
_BACKWARD = {"cpu_flash": _cpu_flash_backward, "flash": _flash_backward, "efficient": _efficient_backward,
             "math": _math_block_backward}


def _kernel(q: Tensor, kernel: AttentionKernel | None, mask: Tensor | None) -> AttentionKernel:
    kernel = kernel or attention_kernel(q.device, q.dtype, q.shape[-1])
    # A mask (models/attention.py) goes to a kernel that takes one: the CPU's, else the plain math; the CUDA
    # kernels' mask layouts are not used here.
    return kernel if mask is None or kernel == "cpu_flash" else "math"


def block_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, *, kernel: AttentionKernel | None = None,
                    mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out like q, lse [B, H, Tq] fp32) of q [B, H, Tq, D] on k/v [B, H, Tk, D]; `kernel` None: the one
    `device.attention_kernel` picks for q. `mask` [B, 1, Tq, Tk] bool (True: attend) adds to `causal`; a
    query it leaves nothing to attend to gets out 0 and lse -inf (what merging blocks expects)."""
    kernel = _kernel(q, kernel, mask)
    if kernel == "math":
        out, lse = _math_block(q, k, v, causal, mask)
    else:
        extra = () if mask is None else (mask,)
        out, lse = _FORWARD[kernel](q.contiguous(), k.contiguous(), v.contiguous(), causal, *extra)
        lse = lse.float()
    if mask is not None:
        empty = ~mask.any(dim=-1)  # [B, 1, Tq]: queries with no key in this block
        out, lse = out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


def block_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                             *, kernel: AttentionKernel | None = None,
                             mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, from the FINAL output and lse of the attention the block is part of."""
    kernel = _kernel(q, kernel, mask)
    if kernel == "math":
        return _math_block_backward(dout, q, k, v, out, lse, causal, mask)
    extra = () if mask is None else (mask,)
    return _BACKWARD[kernel](*(t.contiguous() for t in (dout, q, k, v, out, lse)), causal, *extra)
