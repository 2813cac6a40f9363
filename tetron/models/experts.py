"""The routed experts of an MoE layer (models/moe.py's MoEBlock holds them as `experts`): E gated feed-forwards
as transformers stores them, fused into 3D tensors, run on tokens already grouped by expert, one matmul per
expert (loop) or all of them in one torch._grouped_mm (grouped)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tetron.models.blocks import activation
from tetron.models.core_recompute import active as recompute_active
from tetron.models.core_recompute import recomputed
from tetron.torch_private import grouped_mm, grouped_mm_available


class Experts(nn.Module):
    """E gated experts, down(act(gate(x)) * up(x)) with the activation the config names (`hidden_act`, as
    transformers' experts read it: SwiGLU with silu), as transformers 5 stores them: `gate_up_proj` [E, 2*I, H]
    (gate rows, then up rows) and `down_proj` [E, H, I]. Takes tokens already grouped by expert.

    Options, as transformers' experts implementations name them (gpt-oss sets all four): `transposed`, the weights
    stored [E, in, out] (`gate_up_proj` [E, H, 2*I], `down_proj` [E, I, H]) and applied as x @ w; `interleaved`,
    gate and up alternating along 2*I (gate, up, gate, up, ...) instead of gate's I then up's I; `bias`, a bias per
    expert on each projection (`gate_up_proj_bias` [E, 2*I], `down_proj_bias` [E, H]); `glu`, the gated activation
    (gate, up) -> [.., I] in place of act(gate) * up (gpt-oss's clamped SwiGLU, models/blocks.py)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, act: str = "silu",
                 transposed: bool = False, interleaved: bool = False, bias: bool = False,
                 glu: Callable[[Tensor, Tensor], Tensor] | None = None) -> None:
        super().__init__()
        self.transposed, self.interleaved = transposed, interleaved
        gate_up, down = (hidden, 2 * intermediate), (intermediate, hidden)  # (in, out) of each projection
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, *(gate_up if transposed else gate_up[::-1])))
        self.down_proj = nn.Parameter(torch.empty(num_experts, *(down if transposed else down[::-1])))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.act_fn = activation(act)
        self.glu = glu
        # Whether the CPU can run the grouped path, found out now: inside a forward that activation
        # recomputation records, the probe's own operations would be recorded with it
        grouped_mm_available("cpu")

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x [M, H], the rows of expert 0 first, then expert 1's, ...; counts [E] rows per expert -> [M, H]."""
        if grouped_mm_supported(x, self.gate_up_proj, self.down_proj):
            return self.grouped(x, counts, align=8 if x.is_cuda else 1)
        return self.loop(x, counts)

    def activate(self, gate_up: Tensor) -> Tensor:
        """[.., 2*I] -> [.., I]: gate and up split as stored, then the gated activation."""
        if self.interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        else:
            gate, up = gate_up.chunk(2, dim=-1)
        if recompute_active() and gate.requires_grad:  # recompute: selective keeps gate and up only
            return recomputed(self._glu, gate, up)
        return self._glu(gate, up)

    def _glu(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.glu(gate, up) if self.glu is not None else self.act_fn(gate) * up

    def _project(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """One expert's projection of its rows: x @ w (+ b) as gpt-oss writes it where transposed, else x w^T."""
        if not self.transposed:
            return F.linear(x, weight, bias)
        y = x @ weight
        return y if bias is None else y + bias

    def _weights_in_out(self) -> tuple[Tensor, Tensor]:
        """gate_up_proj and down_proj as [E, in, out] (what the grouped matmul multiplies by)."""
        if self.transposed:
            return self.gate_up_proj, self.down_proj
        return self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)

    def loop(self, x: Tensor, counts: Tensor) -> Tensor:
        """One matmul per expert on its contiguous slice (one host read of the counts per layer)."""
        outs = []
        gate_up_bias, down_bias = self.gate_up_proj_bias, self.down_proj_bias
        for e, (start, n) in enumerate(zip((counts.cumsum(0) - counts).tolist(), counts.tolist())):
            if n:
                h = self._project(x[start:start + n], self.gate_up_proj[e],
                                  None if gate_up_bias is None else gate_up_bias[e])
                outs.append(self._project(self.activate(h), self.down_proj[e],
                                          None if down_bias is None else down_bias[e]))
        return torch.cat(outs) if outs else self._nothing(x)

    def _nothing(self, x: Tensor) -> Tensor:
        """Nothing routed here (often an expert-parallel rank's share): an empty [0, H] output still joined to the
        weights, so they get a (zero) gradient."""
        return x[:0] + 0 * sum(p.sum() for p in self.parameters(recurse=False))

    def _add_bias(self, y: Tensor, bias: Tensor | None, sizes: Tensor) -> Tensor:
        """y [rows, D] in groups of `sizes` [E] rows, each group plus its expert's bias [E, D] (or y as it is)."""
        if bias is None:
            return y
        expert = torch.repeat_interleave(torch.arange(sizes.shape[0], device=y.device), sizes, output_size=y.shape[0])
        return y + bias[expert]

    def grouped(self, x: Tensor, counts: Tensor, *, align: int = 8) -> Tensor:
        """The experts by torch._grouped_mm. CUDA's weight-gradient kernel needs each group to start 16 bytes
        apart (8 bf16 rows): each expert's rows are moved to start at a multiple of `align`, in a buffer sized
        without reading the counts on the host (the last expert's group takes the zero rows at the end). The
        CPU's kernel needs no alignment (align=1): the rows are used where they are."""
        w_gate_up, w_down = self._weights_in_out()  # [E, H, 2I], [E, I, H]
        if align == 1:
            if not x.shape[0]:  # the CPU kernel's backward refuses zero rows
                return self._nothing(x)
            ends = counts.cumsum(0).to(torch.int32)
            h = self._add_bias(grouped_mm(x, w_gate_up, ends), self.gate_up_proj_bias, counts)
            out = _DenseGrad.apply(grouped_mm(self.activate(h), w_down, ends))
            return self._add_bias(out, self.down_proj_bias, counts)
        M, E = x.shape[0], counts.shape[0]
        aligned = (counts + align - 1) // align * align
        rows = (M + (align - 1) * E + align - 1) // align * align  # >= aligned.sum(), a multiple of align
        expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=M)  # [M]
        place = (aligned.cumsum(0) - aligned)[expert] + torch.arange(M, device=x.device) \
            - (counts.cumsum(0) - counts)[expert]  # [M]: each row's place in the buffer
        ends = aligned.cumsum(0)
        ends[-1] = rows
        ends = ends.to(torch.int32)
        padded = x.new_zeros(rows, x.shape[1]).index_copy(0, place, x)  # [rows, H]
        sizes = torch.diff(ends, prepend=ends.new_zeros(1)).long()  # [E]: each expert's rows of the buffer
        h = self._add_bias(grouped_mm(padded, w_gate_up, ends), self.gate_up_proj_bias, sizes)
        # the padding rows' outputs are dropped by [place]: they give the biases no gradient
        return self._add_bias(grouped_mm(self.activate(h), w_down, ends), self.down_proj_bias, sizes)[place]


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: the CPU's grouped-matmul backward refuses an expanded
    one (stride 0, as `out.sum().backward()` gives) in torch 2.13."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def grouped_mm_supported(x: Tensor, *weights: Tensor) -> bool:
    """torch._grouped_mm where it runs forward and backward: rows of 16-byte multiples (its kernels' strides); on
    CUDA in bf16 (fp32 is not among its CUDA kernels), on the CPU in fp32 and bf16 where this torch has it."""
    if any(w.dtype != x.dtype or any(d * x.element_size() % 16 for d in w.shape[1:]) for w in weights):
        return False
    if x.is_cuda:
        return grouped_mm_available("cuda") and x.dtype == torch.bfloat16
    return grouped_mm_available(x.device.type)
