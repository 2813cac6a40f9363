"""The sizes the memory and time models count in: one rank's share of a layer's widths and of a
micro-batch's tokens, under its tensor, context and sequence parallelism (plan/memory.py, plan/steptime.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from tetron.config import Config
from tetron.models.moe import grouped_mm_supported
from tetron.models.qwen3_moe import MoeConfig
from tetron.parallel.tensor_parallel import padded_vocab_size
from tetron.parallel.ulysses import kv_repeats
from tetron.plan.keys import Memo, micro_batch_key
from tetron.plan.probe import Probe, probe_of

F32, I64 = 4, 8  # bytes of an fp32 and an int64 element


@dataclass(frozen=True)
class Sizes:
    """The sizes one rank's formulas use: the model's widths split by tp, the tokens it sees."""

    d: int  # bytes per element of parameters and activations (4 fp32, 2 bf16)
    h: int  # hidden size (the residual stream is never split in width)
    hq: int  # query width on this rank: heads/tp * head_dim
    hkv: int  # key/value width on this rank (before GQA repetition)
    heads: int  # query heads on this rank
    inter: int  # MLP width on this rank: intermediate/tp (an MoE model's dense MLP stays whole: intermediate)
    vocab: int  # vocabulary rows on this rank (padded under tp)
    hd: int  # head dim
    n: int  # tokens of one micro-batch on this rank: micro_batch * seq_len/cp
    n_res: int  # tokens of the residual stream between blocks: n, or n/tp under sequence parallelism
    seq: int  # positions of one sequence on this rank: seq_len/cp
    tp: int
    cp: int
    sp: bool  # sequence parallelism (with tp > 1)
    regather: bool = False  # sp's blocks keep their input's shard and gather it again in the backward (sp_regather)
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
    n_mlp: int = 0  # tokens the MLP sees: n, or n_res where it stays whole on every tp rank (an MoE model's mlp:
    # under sp each tp rank runs it on its own n/tp tokens); set by Sizes.of
    mlp_whole: bool = False  # the mlp is outside tp's blocks (an MoE model's: router, experts, dense MLP)
    grouped: bool = False  # the experts run as torch._grouped_mm (models/moe.py Experts.grouped), not one matmul
    # per expert
    align: int = 1  # grouped_mm's rows per group start at a multiple of this (CUDA: 8 bf16 rows; the CPU: 1)
    probes: tuple = ()  # what measures a decoder layer of each kind on this rank (plan/probe.py): dense, MoE

    @classmethod
    def of(cls, cfg: Config) -> Sizes:
        """The sizes of `cfg`'s ranks: made once for the layouts that differ only in ZeRO (keys.py)."""
        return _SIZES.get(micro_batch_key(cfg), lambda: cls._of(cfg))

    @classmethod
    def _of(cls, cfg: Config) -> Sizes:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        # a head's width as attention sees it: q/k's (MLA's nope + rope, 192, not its RoPE tables' head_dim of 64;
        # its v heads, 128, counted as wide: an overestimate of a third of v's share)
        head = m.attention_options(0).head_dim
        dense = _sizes(m.hidden_size, m.num_attention_heads, m.num_key_value_heads, head, m.intermediate_size,
                      m.vocab_size, p.tp, p.cp, p.sp, p.vocab_pad_multiple, cfg.data.seq_len, t.micro_batch,
                      t.dtype == "bfloat16", p.cp_impl, p.cp_layout, cfg.data.mask_documents,
                      cfg.data.reset_positions, m.qk_norm, p.sp_regather)
        if not is_moe(m):
            return replace(dense, probes=(probe_of(cfg, False),))
        cuda = p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available())
        return replace(_moe(dense, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size,
                            m.n_shared_experts * m.moe_intermediate_size, p.ep, t.micro_batch, m.intermediate_size,
                            _grouped(m.hidden_size, m.moe_intermediate_size, dense.d, cuda), 8 if cuda else 1),
                       probes=(probe_of(cfg, False), probe_of(cfg, True)))

    def probe(self, moe: bool = False) -> Probe:
        """What measures this rank's decoder layer of the kind asked for (plan/probe.py)."""
        return self.probes[1 if moe else 0]

    def rows(self, m: int) -> int:
        """Rows of grouped_mm's buffers for m assignments to the rank's experts: m, or under CUDA's alignment
        the padded buffer (models/moe.py: m + (align-1)*experts, rounded up to a multiple of align)."""
        local = self.experts // self.ep
        return m if self.align == 1 else -(-(m + (self.align - 1) * local) // self.align) * self.align


_SIZES = Memo()


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
def _moe(dense: Sizes, experts: int, top_k: int, inter: int, shared: int, ep: int, batch: int, whole: int,
         grouped: bool, align: int) -> Sizes:
    # The mlp (router, experts, a dense layer's MLP) stays whole under tp (models/qwen3_moe.py's plan):
    # its full width, on the tokens of the residual stream (n/tp under sp)
    return replace(dense, experts=experts, top_k=top_k, expert_inter=inter, shared_inter=shared, ep=ep,
                   batch=batch, inter=whole, n_mlp=dense.n_res, mlp_whole=True, grouped=grouped,
                   align=align if grouped else 1)


@functools.lru_cache(maxsize=64)
def _grouped(hidden: int, inter: int, d: int, cuda: bool) -> bool:
    """Whether the experts take torch._grouped_mm (models/moe.py grouped_mm_supported): rows of 16-byte
    multiples; on CUDA in bf16 only, on the CPU where this torch's kernel runs forward and backward. Asked
    with zero-stride stand-ins of the expert tensors' shapes (nothing allocated)."""
    dtype = torch.bfloat16 if d == 2 else torch.float32
    if any(n * d % 16 for n in (hidden, inter, 2 * inter)) or not hasattr(torch, "_grouped_mm"):
        return False
    if cuda:
        return dtype == torch.bfloat16
    stand_in = torch.empty((), dtype=dtype)
    return grouped_mm_supported(stand_in.expand(0, hidden), stand_in.expand(1, 2 * inter, hidden),
                                stand_in.expand(1, hidden, inter))


@functools.lru_cache(maxsize=4096)
def _sizes(h: int, heads: int, kv_heads: int, hd: int, inter: int, vocab: int, tp: int, cp: int, sp: bool,
           pad: int, seq_len: int, micro_batch: int, bf16: bool, cp_impl: str = "ring",
           cp_layout: str = "zigzag", mask_documents: bool = False, reset_positions: bool = False,
           qk_norm: bool = False, regather: bool = True) -> Sizes:
    seq = seq_len // cp
    n = micro_batch * seq
    ulysses = cp_impl == "ulysses" and cp > 1 and (heads // tp) % cp == 0
    whole_mask = mask_documents and (cp == 1 or ulysses)  # the kernel sees the whole sequence
    kv = kv_heads // tp * (kv_repeats(heads // tp, kv_heads // tp, cp) if ulysses else 1) * hd
    return Sizes(d=2 if bf16 else 4, h=h, hq=heads // tp * hd, hkv=kv_heads // tp * hd, heads=heads // tp,
                 inter=inter // tp, vocab=padded_vocab_size(vocab, tp, pad) // tp if tp > 1 else vocab, hd=hd,
                 n=n, n_res=n // tp if sp else n, seq=seq, tp=tp, cp=cp, sp=sp and tp > 1,
                 regather=sp and tp > 1 and regather,
                 ulysses_kv=kv if ulysses else 0, ulysses_views=ulysses and cp_layout == "contiguous",
                 doc_mask=micro_batch * seq_len * seq_len * (2 if bf16 else 4) if whole_mask else 0,
                 rope_rows=micro_batch if reset_positions else 1, qk_norm=qk_norm, n_mlp=n)
