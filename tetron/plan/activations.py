"""What a micro-batch leaves saved between its forward and backward pass, for the memory model
(plan/memory.py): per decoder layer under each recompute mode, and per chunk (RoPE tables, the document
mask, the final norm's input and the loss's gradients)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tetron.config import Config
from tetron.plan.probe import saved_bytes
from tetron.plan.sizes import F32, I64, Sizes
from tetron.plan.state import Chunk

# ------------------------------------------------------------------------------------ activations


def norm_bytes(s: Sizes, tokens: int) -> int:
    """What an RMSNorm saves (models/fused.py's rms_norm): its input in the compute dtype and 1/rms per token
    in fp32; its backward recomputes the normalized input from them."""
    return tokens * (s.d * s.h + F32)


def layer_none(s: Sizes, moe: bool = False) -> int:
    """One decoder layer's saved tensors without recomputation, for one micro-batch: measured from the family's
    own layer (plan/probe.py), so whatever a family's layer keeps is counted (MLA's latents, sinks, sandwich norms,
    an MoE block's routing and expert buffers), and a new family needs nothing here. For a Llama layer it is
    Korthikanti's sbh(34 + 5as/h) as tetron keeps it (docs/memory.md gives the terms)."""
    return saved_bytes(s.probe(moe), "none")


def _block_input(s: Sizes) -> int:
    """Tokens of a tp block's input its column-parallel linears keep: all (gathered under sp), or the shard."""
    return s.n_res if s.regather else s.n


def _mlp_input(s: Sizes) -> int:
    """Tokens of the norm output the MLP keeps: a tp block's (_block_input), or an MoE model's whole mlp's own."""
    return s.n_mlp if s.mlp_whole else _block_input(s)


def _head_norms(s: Sizes) -> int:
    """Qwen3's RMSNorm over each query and key head (models/llama.py's q_norm, k_norm), before RoPE: what an
    RMSNorm saves (norm_bytes): its input, the q and k projections' outputs, and 1/rms per head."""
    if not s.qk_norm:
        return 0
    return s.n * (s.d * (s.hq + s.hkv) + F32 * (s.hq + s.hkv) // s.hd)


def layer_kept(s: Sizes, mode: str, moe: bool = False) -> int:
    """What a layer keeps between its forward and backward under recomputation (recompute.py), measured as
    layer_none is: `full` its input (on the residual stream); `selective` (Korthikanti's) what `none` keeps but
    what the attention kernel saves for itself alone, and in an MoE layer the experts' act(gate)."""
    return saved_bytes(s.probe(moe), mode)


def layer_weight_inputs(s: Sizes, moe: bool = False) -> int:
    """What W reads of a layer that B rebuilt (zbh1, zbv with recomputation: recompute.py keeps only
    this from B to W): each RMSNorm's input and 1/rms, each matmul's input (the norm outputs as the
    column-parallel matmuls see them, attention's output, the MLP's gate and up, from which its node
    recomputes the product; an MoE layer's permuted tokens and each assignment's product, the shared
    experts' gate and up; Qwen3's per-head norms')."""
    # under sp each column-parallel linear keeps its own gathered input (with regather: the block's one shard); a
    # whole mlp reads the norm's output
    attention = s.n_res * s.h if s.regather else s.n * s.h * (3 if s.sp else 1)
    reads = 1 if s.mlp_whole or not s.sp or s.regather else 2
    m = s.n_mlp * s.top_k
    mlp_in = _mlp_input(s) * reads * s.h
    mlp = (s.d * (mlp_in + s.n_mlp * 2 * s.shared_inter) + s.rows(m) * s.d * (s.h + s.expert_inter) if moe
           else s.d * (mlp_in + s.n_mlp * 2 * s.inter))
    return 2 * norm_bytes(s, s.n_res) + s.d * (attention + s.n * s.hq) + _head_norms(s) + mlp


def layer_activations(s: Sizes, mode: str, moe: bool = False) -> int:
    return layer_none(s, moe) if mode == "none" else layer_kept(s, mode, moe)


@functools.lru_cache(maxsize=65536)  # per action of every layout's walk (walk._moments): computed once a shape
def chunk_layers(s: Sizes, chunk: Chunk, mode: str) -> int:
    """The saved tensors of a chunk's decoder layers, its dense and its MoE ones, for one micro-batch."""
    return sum(n * layer_activations(s, mode, moe) for n, moe in ((chunk.layers - chunk.moe, False), (chunk.moe, True))
               if n)  # a kind the chunk does not hold is not measured


@dataclass(frozen=True)
class Held:
    """Bytes one micro-batch leaves on a chunk until its backward: activations, and the loss's gradients."""

    activations: int
    loss: int


def chunk_held(cfg: Config, s: Sizes, chunk: Chunk) -> Held:
    """One micro-batch's saved tensors on one chunk: its layers, the RoPE tables the layers share (cos and
    sin for this rank's positions, per row when they restart per document), the document mask, the
    embedding's indices under tp (ids local to the shard and the mask of ids outside it), the final norm
    and the loss's gradients (of the head's input and weight: the head saves nothing else)."""
    mode = cfg.train.recompute
    acts = chunk_layers(s, chunk, mode) + 2 * s.rope_rows * s.seq * s.hd * s.d + s.doc_mask
    if chunk.first and s.tp > 1:
        acts += s.n * (I64 + 1)
    loss = 0
    if chunk.last:
        acts += norm_bytes(s, s.n_res)
        # the loss's gradients, computed chunk by chunk in the forward (models/loss.py): the hidden states'
        # and the head's (its shard under tp), fp32 across chunks, in the head's dtype when there is one chunk
        one_chunk = cfg.train.loss_chunk_tokens <= 0 or cfg.train.loss_chunk_tokens >= s.n
        loss = s.n * s.h * s.d + s.vocab * s.h * (s.d if one_chunk else F32)
        # multi-token prediction (models/mtp.py), each module beside its decoder layer (in chunk.layers): its three
        # norms' inputs, eh_proj's [n, 2h] input; and its cross entropy's gradients as the main loss's (its valid
        # rows: at most n)
        acts += chunk.mtp * (3 * norm_bytes(s, s.n) + 2 * s.n * s.h * s.d)
        loss *= 1 + chunk.mtp
    return Held(acts, loss)


def moe_backward(s: Sizes, *, split: bool = False) -> tuple[int, int]:
    """(before, after its expert gradients begin) the most an MoE block's backward adds to the layer's saved
    tensors, beyond the incoming gradient (walk._layer_backward), for M assignments of [H] (A bytes each in
    the compute dtype) and [I] (B). With torch._grouped_mm (Sizes.grouped; measured op by op here) the
    backward walks the forward back: the shared experts first (a dense MLP's gradients; then its saved
    tensors go and the gradient of its input stays); the combine (the scatter-add's gradient gathered per
    assignment, times each weight, and the weights' gradient: 2A beside the [M, H] the scatter-add kept, 3A
    in fp32 where bf16 upcasts to the fp32 weights); under expert parallelism the reverse all-to-all and the
    un-permute's scatter, A beyond the [M, H] output released by then; then, once the experts' weight
    gradients begin: the down projection (its [E_local, H, I] weight gradient and the product's B, the [M, H]
    output released); silu and the product (2B, the outputs of both released); the gate_up projection (its
    [E_local, 2I, H] weight gradient and the tokens' A, the [M, 2I] output and the product released). The
    peak is the largest of these. One matmul per expert (Experts.loop) instead gathers each expert's weight
    gradient into one of the whole tensor, two alive at once, besides the reverse all-to-all's [M, H].
    `split`: B of a backward split into B and W (zbh1, zbv past the first stage): no weight gradient,
    nothing saved released (W runs on the same graph), and the gradients W multiplies by stay (moe_retained:
    A and 2B): at worst, the combine's 3A, under ep the reverse all-to-all and its scatter (3A), silu and the
    product (A + 4B), and the tokens' gradient scattered back (under ep A and 2A more, else 2 [N, H])."""
    m, local = s.n_mlp * s.top_k, s.experts // s.ep
    a, b = m * s.h * s.d, s.rows(m) * s.expert_inter * s.d
    if not s.grouped:
        exchange = a if s.ep > 1 else 0
        both = exchange + 2 * s.d * local * 3 * s.h * s.expert_inter
        return both, both
    shared = s.n_mlp * s.d * (s.h - 2 * s.shared_inter) if s.shared_inter else 0  # once its backward is done
    combine = m * s.h * (2 * F32 + (F32 if s.d < F32 else 0)) + (m * F32 if s.d == F32 else 0)
    down = local * s.h * s.expert_inter * s.d + b - a
    gate_up = local * 2 * s.expert_inter * s.h * s.d + s.rows(m) * s.h * s.d - 2 * a - 2 * b
    first = 2 * s.n_mlp * s.d * s.shared_inter  # the shared experts' own backward
    if split:
        combine = 3 * m * s.h * F32 + (a if s.d < F32 else m * F32)
        scatter = 4 * a + 2 * b if s.ep > 1 else 2 * a + 2 * b + 2 * s.n_mlp * s.h * s.d
        return max(first, max(combine, 3 * a if s.ep > 1 else 0, a + 4 * b, scatter)), 0
    before = max(first, shared + max(combine, a if s.ep > 1 else 0))
    return before, shared + max(down, 2 * b - 2 * a, gate_up)


def moe_retained(s: Sizes) -> int:
    """What an MoE layer's B keeps for its W beyond its saved tensors (zbh1, zbv: weight_grad.py records the
    gradient flowing into each node that leads to a weight): the gradients of the grouped experts' outputs,
    [M, H] of the down projection's and [M, 2I] of gate_up's."""
    m = s.n_mlp * s.top_k
    return m * s.h * s.d + 2 * s.rows(m) * s.expert_inter * s.d if s.grouped else 0


def moe_forward(s: Sizes) -> int:
    """What an MoE block's forward holds beyond what it saves, at its worst, under expert parallelism: at the
    combining all-to-all the tokens sent, the rows received, the experts' output, its un-permuted copy and
    the combine's output ([M, H] each, M on average), of which only the last is saved (and only without
    recomputation). Without ep, the block's temporaries are its [N, H] output: as little as a dense MLP's."""
    if s.ep == 1:
        return 0
    return 5 * s.n_mlp * s.top_k * s.h * s.d
