"""The sizes the memory and time models count in: one rank's share of a layer's widths and of a
micro-batch's tokens, under its tensor, context and sequence parallelism (plan/memory.py, plan/steptime.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from tetron.config import Config
from tetron.models.moe_models import MoeConfig
from tetron.parallel.tensor_parallel import padded_vocab_size
from tetron.parallel.ulysses import kv_repeats

F32, I64 = 4, 8  # bytes of an fp32 and an int64 element


@dataclass(frozen=True)
class Sizes:
    """The sizes one rank's formulas use: the model's widths split by tp, the tokens it sees."""

    d: int  # bytes per element of parameters and activations (4 fp32, 2 bf16)
    h: int  # hidden size (the residual stream is never split in width)
    hq: int  # query width on this rank: heads/tp * head_dim
    hkv: int  # key/value width on this rank (before GQA repetition)
    heads: int  # query heads on this rank
    inter: int  # MLP width on this rank: intermediate/tp
    vocab: int  # vocabulary rows on this rank (padded under tp)
    hd: int  # head dim
    n: int  # tokens of one micro-batch on this rank: micro_batch * seq_len/cp
    n_res: int  # tokens of the residual stream between blocks: n, or n/tp under sequence parallelism
    seq: int  # positions of one sequence on this rank: seq_len/cp
    tp: int
    cp: int
    sp: bool  # sequence parallelism (with tp > 1)
    ulysses_kv: int = 0  # Ulysses attention (parallel.cp_impl): key/value width on this rank after the heads are
    # repeated for cp (hkv, or more); 0 under ring attention or without cp
    ulysses_views: bool = False  # Ulysses, contiguous layout: q, k, v stay views of the all-to-all's buffer
    doc_mask: int = 0  # bytes of the document mask (data.mask_documents) one micro-batch's forward keeps on a
    # chunk: [B, 1, T, T] in the compute dtype, shared by its layers; 0 under ring attention (it remakes
    # each block's mask in the backward) or without the option
    rope_rows: int = 1  # rows of the RoPE tables: 1, or micro_batch when positions restart per document
    qk_norm: bool = False  # an RMSNorm over each query and key head (Qwen3's q_norm, k_norm)
    # Mixture of experts (models/moe.py; 0 for a dense model): the routed experts of an MoE layer, the k each
    # token goes to, one expert's width, the shared experts' width, the ranks the experts are split over
    # (parallel.ep) and the sequences of a micro-batch (the auxiliary loss's [B, E] counts)
    experts: int = 0
    top_k: int = 0
    expert_inter: int = 0
    shared_inter: int = 0
    ep: int = 1
    batch: int = 1

    @classmethod
    def of(cls, cfg: Config) -> Sizes:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        dense = _sizes(m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.intermediate_size,
                      m.vocab_size, p.tp, p.cp, p.sp, p.vocab_pad_multiple, cfg.data.seq_len, t.micro_batch,
                      t.dtype == "bfloat16", p.cp_impl, p.cp_layout, cfg.data.mask_documents,
                      cfg.data.reset_positions, m.qk_norm)
        if not is_moe(m):
            return dense
        return _moe(dense, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size,
                    m.n_shared_experts * m.moe_intermediate_size, p.ep, t.micro_batch)


def is_moe(model: object) -> bool:
    """Whether a model config is a mixture of experts (MoeConfig's families)."""
    return isinstance(model, MoeConfig)


def moe_layers(model: object) -> int:
    """How many decoder layers are MoE layers (0 for a dense model)."""
    return sum(map(model.is_moe_layer, range(model.num_hidden_layers))) if is_moe(model) else 0


def expert_elements(model: object) -> int:
    """Elements of every routed expert's weights in the whole model (gate, up, down of each): what expert
    parallelism splits over ep ranks; the rest of an MoE model (attention, router, shared experts,
    embeddings) is held as in a dense one."""
    return moe_layers(model) * model.num_experts * 3 * model.hidden_size * model.moe_intermediate_size if \
        is_moe(model) else 0


@functools.lru_cache(maxsize=4096)
def _moe(dense: Sizes, experts: int, top_k: int, inter: int, shared: int, ep: int, batch: int) -> Sizes:
    return replace(dense, experts=experts, top_k=top_k, expert_inter=inter, shared_inter=shared, ep=ep,
                   batch=batch)


@functools.lru_cache(maxsize=4096)
def _sizes(h: int, heads: int, kv_heads: int, hd: int, inter: int, vocab: int, tp: int, cp: int, sp: bool,
           pad: int, seq_len: int, micro_batch: int, bf16: bool, cp_impl: str = "ring",
           cp_layout: str = "zigzag", mask_documents: bool = False, reset_positions: bool = False,
           qk_norm: bool = False) -> Sizes:
    seq = seq_len // cp
    n = micro_batch * seq
    ulysses = cp_impl == "ulysses" and cp > 1 and (heads // tp) % cp == 0
    whole_mask = mask_documents and (cp == 1 or ulysses)  # the kernel sees the whole sequence
    kv = kv_heads // tp * (kv_repeats(heads // tp, kv_heads // tp, cp) if ulysses else 1) * hd
    return Sizes(d=2 if bf16 else 4, h=h, hq=heads // tp * hd, hkv=kv_heads // tp * hd, heads=heads // tp,
                 inter=inter // tp, vocab=padded_vocab_size(vocab, tp, pad) // tp if tp > 1 else vocab, hd=hd,
                 n=n, n_res=n // tp if sp else n, seq=seq, tp=tp, cp=cp, sp=sp and tp > 1,
                 ulysses_kv=kv if ulysses else 0, ulysses_views=ulysses and cp_layout == "contiguous",
                 doc_mask=micro_batch * seq_len * seq_len * (2 if bf16 else 4) if whole_mask else 0,
                 rope_rows=micro_batch if reset_positions else 1, qk_norm=qk_norm)
