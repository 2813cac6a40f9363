"""One block of attention with its log-sum-exp: the kernel ring attention merges blocks with.

Ring attention needs, for each (query block, key block) pair, the attention output and the
log-sum-exp (lse) of the scores, so that partial results merge exactly (online softmax); its
backward pass recomputes each block's gradients from the FINAL output and lse. PyTorch's fused
attention kernels have exactly that interface, as private ops (called through tetron.torch_private, which
falls back to the plain math where this torch lacks one):
- "cpu_flash": `_scaled_dot_product_flash_attention_for_cpu` (+ `_backward`), lse [B, H, Tq] fp32;
- "flash" (CUDA, fp16/bf16, sm80+): `_scaled_dot_product_flash_attention` (+ `_backward`), lse
  [B, H, Tq] fp32;
- "efficient" (CUDA, any float dtype): `_scaled_dot_product_efficient_attention` (+ `_backward`),
  whose lse is [B, H, ceil(Tq/32)*32] on CUDA: the padding is cut off here after the forward and
  added back (its values are never read) before the backward, which is given the kernel's own layout.
- "math": plain matmuls in fp32, materialising [B, H, Tq, Tk] scores: the reference in the tests, and
  the path for devices without a fused kernel.
Which one a block gets is decided in one place, `tetron.device.attention_kernel`, from its device,
dtype and head width. Every kernel here uses no dropout and the scale head_dim**-0.5 unless given `scale`. A
block with a document mask (models/attention.py: packed documents kept apart) runs on the CPU kernel, which takes
a mask, or else on the math path; so does a block with soft-capped scores (`softcap`), which only the math path
applies. A v of another width than q and k (models/attention.py's v_head_dim) runs on the math path as it is
and on a fused kernel with the narrower side padded with zeros (the CPU's and FlashAttention require equal
widths: models/attention.py's equal_widths), the output and gradients cut back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tetron.device import AttentionKernel, attention_kernel
from tetron.models.attention import equal_widths
from tetron.torch_private import (
    cpu_flash_attention,
    cpu_flash_attention_backward,
    cuda_efficient_attention,
    cuda_efficient_attention_backward,
    cuda_flash_attention,
    cuda_flash_attention_backward,
    math_attention,
    math_attention_backward,
)

# ----------------------------------------------------------------------------- the kernels (tetron.torch_private)

# the reference: plain math (torch_private.math_attention), as the tests and ring attention's math path call it
_math_block = math_attention
_math_block_backward = math_attention_backward


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The CPU kernel takes a mask as scores to add, in the query's dtype: 0 to attend, -inf not to."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None = None, *,
               scale: float | None = None) -> tuple[Tensor, Tensor]:
    return cpu_flash_attention(q, k, v, causal, bias=_additive(mask, q.dtype), scale=scale)


def _cpu_flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        causal: bool, mask: Tensor | None = None, *,
                        scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return cpu_flash_attention_backward(dout, q, k, v, out, lse, causal, bias=_additive(mask, q.dtype), scale=scale)


_FORWARD = {"cpu_flash": _cpu_flash, "flash": cuda_flash_attention, "efficient": cuda_efficient_attention,
            "math": _math_block}
_BACKWARD = {"cpu_flash": _cpu_flash_backward, "flash": cuda_flash_attention_backward,
             "efficient": cuda_efficient_attention_backward, "math": _math_block_backward}


def _kernel(q: Tensor, kernel: AttentionKernel | None, mask: Tensor | None,
            softcap: float | None = None) -> AttentionKernel:
    kernel = kernel or attention_kernel(q.device, q.dtype, q.shape[-1])
    if softcap is not None:
        return "math"  # the fused kernels never show the scores to cap
    # A mask (models/attention.py) goes to a kernel that takes one: the CPU's, else the plain math; the CUDA
    # kernels' mask layouts are not used here.
    return kernel if mask is None or kernel == "cpu_flash" else "math"


def _options(mask: Tensor | None, scale: float | None) -> tuple[tuple, dict]:
    """The fused kernels' extra arguments: the mask where there is one, the scale where given."""
    return (() if mask is None else (mask,)), ({} if scale is None else {"scale": scale})


def block_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, *, kernel: AttentionKernel | None = None,
                    mask: Tensor | None = None, scale: float | None = None,
                    softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(out [B, H, Tq, Dv] in q's dtype, lse [B, H, Tq] fp32) of q [B, H, Tq, D] on k [B, H, Tk, D], v [B, H, Tk,
    Dv]; `kernel` None: the one `device.attention_kernel` picks for q. `mask` [B, 1, Tq, Tk] bool (True: attend)
    adds to `causal`; a query it leaves nothing to attend to gets out 0 and lse -inf (what merging blocks
    expects). `scale` and `softcap` as models/attention.py's AttentionOptions."""
    kernel = _kernel(q, kernel, mask, softcap)
    if kernel == "math":
        out, lse = _math_block(q, k, v, causal, mask, scale=scale, softcap=softcap)
    else:
        width = v.shape[-1]
        q, k, v, scale = equal_widths(q, k, v, scale)
        extra, options = _options(mask, scale)
        out, lse = _FORWARD[kernel](q.contiguous(), k.contiguous(), v.contiguous(), causal, *extra, **options)
        out, lse = out[..., :width], lse.float()
    if mask is not None:
        empty = ~mask.any(dim=-1)  # [B, 1, Tq]: queries with no key in this block
        out, lse = out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))
    return out, lse


def block_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                             *, kernel: AttentionKernel | None = None, mask: Tensor | None = None,
                             scale: float | None = None, softcap: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block, from the FINAL output and lse of the attention the block is part of."""
    kernel = _kernel(q, kernel, mask, softcap)
    if kernel == "math":
        return _math_block_backward(dout, q, k, v, out, lse, causal, mask, scale=scale, softcap=softcap)
    qk_width, v_width = q.shape[-1], v.shape[-1]
    # the forward's padding (equal_widths), and the output and its gradient padded as v: the pads' gradients cut off
    q, k, v, scale = equal_widths(q, k, v, scale)
    if v.shape[-1] > v_width:
        dout, out = (torch.nn.functional.pad(t, (0, v.shape[-1] - v_width)) for t in (dout, out))
    extra, options = _options(mask, scale)
    dq, dk, dv = _BACKWARD[kernel](*(t.contiguous() for t in (dout, q, k, v, out, lse)), causal, *extra, **options)
    return dq[..., :qk_width], dk[..., :qk_width], dv[..., :v_width]
