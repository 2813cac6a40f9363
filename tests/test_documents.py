"""Packed documents kept apart (data.mask_documents, data.reset_positions): the window's documents, the
mask in every attention path (the model's, ring blocks, Ulysses) against separate sequences or a float64
reference, and the loaders' documents against the EOS tokens that end them."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tetron.config import from_dict
from tetron.data.documents import document_positions, window_documents
from tetron.data.loader import DataLoader, prepare_data
from tetron.data.mixture import MixtureLoader, WeightedTokens
from tetron.data.token_store import TokenStore
from tetron.mesh import Mesh
from tetron.models.attention import Documents, document_mask
from tetron.models.llama import LlamaConfig
from tetron.parallel.block_attention import _math_block, block_attention, block_attention_backward
from tetron.parallel.context_parallel import apply_context_parallel, ring_attention, shard_indices
from tetron.parallel.init import seeded_model
from tetron.parallel.ulysses import ulysses_attention

from conftest import check_layout, layout_configs, reference_run, run_training, tiny_config
from harness import run_ranks


def test_window_documents_and_positions():
    ends = np.array([3, 5, 9])  # documents [0,3) [3,5) [5,9) [9, ...)
    docs = window_documents(ends, np.array([0, 4]), 6)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 2]]
    # a document continued from before the window counts from the window's start
    assert document_positions(torch.from_numpy(docs)).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 0]]
    pos = torch.arange(4)
    mask = document_mask(torch.tensor([[0, 0, 1, 1]]), pos, pos)[0, 0]
    assert mask.tolist() == [[True, False, False, False], [True, True, False, False],
                             [False, False, True, False], [False, False, True, True]]


# ----------------------------------------------------------------------------- the model


def _model() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return seeded_model(config, seed=3, device=torch.device("cpu")).double()


@pytest.mark.parametrize("reset", [True, False])
def test_packed_row_equals_its_documents_run_alone(reset):
    """One row holding three documents gives, at every position, the logits of its document run alone
    (from position 0): with RoPE positions restarting per document, and without (RoPE scores depend only
    on the distance between two positions, which the mask keeps within a document)."""
    model, lengths = _model(), [5, 9, 6]
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]  # [1, T]
    positions = document_positions(docs) if reset else None
    packed = model(ids, positions, docs)
    alone = torch.cat([model(part) for part in ids.split(lengths, dim=1)], dim=1)
    # Restarted positions give the same angles: fp64 equal. Otherwise the angles differ, and RoPE computes
    # them in fp32 (as transformers does), so the rotation between two positions agrees only to fp32
    # rounding (measured 7e-7 relative).
    tol = 1e-10 if reset else 1e-5
    torch.testing.assert_close(packed, alone, rtol=tol, atol=tol)
    unmasked = model(ids, positions)
    assert not torch.allclose(unmasked[:, lengths[0]:], alone[:, lengths[0]:])  # the mask is what did it


def test_one_document_per_row_equals_causal():
    """The masked path with one document per row is causal attention (a different kernel, fp64 equal)."""
    model = _model()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids, None, torch.zeros_like(ids)), model(ids), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- blocks, ring, Ulysses


def _random_docs(batch: int, T: int, seed: int) -> torch.Tensor:
    """[batch, T] documents with boundaries at random positions (some rows several, one row a single one)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, T, generator=g) < 0.15
    starts[:, 0] = False
    starts[-1] = False
    return starts.long().cumsum(dim=1)


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_masked_block_matches_math_with_empty_rows(kernel):
    """A block's mask may leave a query nothing to attend to (its document starts later): out 0, lse -inf,
    and a backward (from a finite final lse) without NaN."""
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(2, 3, 8, 16, generator=g) for _ in range(4))
    docs = _random_docs(2, 16, 4)
    mask = document_mask(docs, torch.arange(8, 16), torch.arange(8))  # late queries on early keys
    mask[:, :, 0] = False  # at least one query with nothing to attend to
    out, lse = block_attention(q, k, v, False, kernel=kernel, mask=mask)
    empty = ~mask.any(-1)
    assert torch.isneginf(lse[empty.expand_as(lse)]).all() and (out[empty.unsqueeze(-1).expand_as(out)] == 0).all()
    ref_out, ref_lse = _math_block(q.double(), k.double(), v.double(), False, mask)  # the math runs in fp32
    full = ~empty.expand_as(lse)
    torch.testing.assert_close(out[full.unsqueeze(-1).expand_as(out)].double(),
                               ref_out[full.unsqueeze(-1).expand_as(out)].double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[full].double(), ref_lse[full].double(), rtol=1e-5, atol=1e-5)
    final_lse = torch.where(empty, torch.zeros_like(lse), lse)  # as if other blocks filled those rows
    grads = block_attention_backward(dout, q, k, v, out, final_lse, False, kernel=kernel, mask=mask)
    assert all(torch.isfinite(g).all() for g in grads)


def _masked_reference(q, k, v, docs, window=None):
    rep = q.shape[1] // k.shape[1]
    pos = torch.arange(q.shape[2])
    mask = document_mask(docs, pos, pos) if docs is not None else (pos[:, None] >= pos[None, :])
    if window is not None:
        mask = mask & (pos[:, None] - pos[None, :] < window)  # transformers' sliding window
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)


def _cp_rank(T: int, heads: int, kv_heads: int, impl: str, layout: str, window: int | None = None,
             packed: bool = True) -> dict:
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(cp=cp)
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(3, heads, T, 16, generator=g, dtype=torch.float64)
    k = torch.randn(3, kv_heads, T, 16, generator=g, dtype=torch.float64)
    v = torch.randn(3, kv_heads, T, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(3, heads, T, 16, generator=g, dtype=torch.float64)
    docs = _random_docs(3, T, 5) if packed else None
    idx = shard_indices(T, cp, rank, layout=layout)
    local = [t[:, :, idx].float().requires_grad_(True) for t in (q, k, v)]  # the shards in fp32
    masks = Documents(docs) if packed else None
    if impl == "ring":
        out = ring_attention(*local, masks, window, mesh=mesh, layout=layout)
    else:
        out = ulysses_attention(*local, masks, window, mesh=mesh,
                                shards=lambda n, c, r: shard_indices(n, c, r, layout=layout))
    out.backward(dout[:, :, idx].float())
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _masked_reference(*full, docs, window)
    ref.backward(dout)
    return {"out": out.detach().double(), "ref": ref.detach()[:, :, idx],
            "grads": [t.grad.double() for t in local], "ref_grads": [t.grad[:, :, idx] for t in full]}


@pytest.mark.parametrize("impl, layout, cp, kv_heads, window, packed", [
    ("ring", "zigzag", 2, 2, None, True), ("ring", "contiguous", 2, 1, None, True),
    ("ring", "zigzag", 4, 1, None, True), ("ulysses", "zigzag", 2, 2, None, True),
    # a sliding window (Mistral's) shorter than a shard, with and without documents: blocks it empties, too
    ("ring", "zigzag", 2, 2, 3, False), ("ulysses", "zigzag", 2, 1, 5, True)])
def test_context_parallel_attention_keeps_documents_apart(impl, layout, cp, kv_heads, window, packed):
    for r in run_ranks(cp, _cp_rank, 32, 4, kv_heads, impl, layout, window, packed):
        # fp32 shards against an fp64 reference: 1e-5 covers fp32 rounding over 32 keys, as for ring attention
        torch.testing.assert_close(r["out"], r["ref"], rtol=1e-5, atol=1e-5)
        for name, got, want in zip("qkv", r["grads"], r["ref_grads"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"d{name}")


# ----------------------------------------------------------------------------- the loaders


def write_documents(path, count: int = 400, seed: int = 0) -> None:
    """A .jsonl of `count` documents of 3 to 60 characters: a 32-token window holds several."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    with open(path, "w") as f:
        for _ in range(count):
            text = " ".join(rng.choice(words, size=rng.integers(1, 10)))
            f.write(json.dumps({"text": text}) + "\n")


def test_loaders_number_documents_at_their_eos(tmp_path):
    """Every micro-batch's documents (DataLoader and a one-source MixtureLoader) start right after an EOS,
    and only there: the store's recorded ends and the tokens agree."""
    write_documents(tmp_path / "docs.jsonl")
    raw = tiny_config(tmp_path / "docs.jsonl", tmp_path / "cache", tmp_path / "out",
                      data={"tokenizer": "bpe:300", "mask_documents": True})
    raw["model"]["vocab_size"] = 300
    tokenizer, path = prepare_data(from_dict(raw))
    store = TokenStore(path)
    shape = dict(micro_batch=2, grad_acc=2, dp_size=1, dp_rank=0, seed=0, documents=True)
    loaders = [DataLoader(store, 32, **shape), MixtureLoader([WeightedTokens(store, 1.0)], 32, **shape)]
    for loader in loaders:
        for _ in range(3):
            for mb in loader.next_batch():
                after_eos = mb.inputs[:, :-1] == tokenizer.eos_id
                assert torch.equal(mb.docs[:, 1:] - mb.docs[:, :-1], after_eos.long())
                assert (mb.docs[:, 0] == 0).all()


# ----------------------------------------------------------------------------- training in every layout


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A .jsonl of short documents (a 32-byte window holds several) and a token cache for it."""
    folder = tmp_path_factory.mktemp("packed")
    write_documents(folder / "docs.jsonl", count=1500)
    return folder / "docs.jsonl", folder / "cache"


DOCUMENTS = {"mask_documents": True, "reset_positions": True}
EVAL = ({"val_fraction": 0.1}, {"eval_every": 2, "eval_batches": 1})  # step 2 and the last
MASKED_LAYOUTS = {  # parallel, data, train
    "cp2-ring-zigzag": ({"cp": 2}, {**DOCUMENTS, **EVAL[0]}, EVAL[1]),
    "dp2-cp2-ulysses-contiguous": ({"dp": 2, "cp": 2, "cp_impl": "ulysses", "cp_layout": "contiguous"},
                                   {**DOCUMENTS, **EVAL[0]}, EVAL[1]),
    "tp2-sp-pp2-1f1b": ({"tp": 2, "sp": True, "pp": 2, "pp_schedule": "1f1b"}, {**DOCUMENTS, **EVAL[0]}, EVAL[1]),
    "pp2-interleaved-cp2": ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2, "cp": 2},
                            {**DOCUMENTS, **EVAL[0]}, EVAL[1]),
    "cp2-positions-only": ({"cp": 2}, {"reset_positions": True}, {}),
    "dp2-zero3-selective-mask-only": ({"dp": 2, "zero": 3}, {"mask_documents": True}, {"recompute": "selective"}),
    "dp2-mixture": ({"dp": 2}, "sources", {}),
    # an MoE model (its per-sequence balancing losses are per row, whatever documents it packs): experts over
    # the 2 ranks of cp2, attention by Ulysses
    "cp2-ep2-ulysses-moe": ({"cp": 2, "ep": 2, "cp_impl": "ulysses"}, DOCUMENTS, {},
                            {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32, "router_aux_loss_coef": 0.01}),
}


@pytest.mark.parametrize("name", sorted(MASKED_LAYOUTS))
def test_masked_training_matches_single_process(packed, tmp_path, name):
    """Losses, final weights and (where evaluated) the validation loss of a layout with documents masked
    and/or positions restarted equal the single process's (the tolerances of every layout test)."""
    corpus, cache = packed
    parallel, data, train, *model = MASKED_LAYOUTS[name]
    if data == "sources":  # a mixture of two stores: each row's documents from its own store
        other = corpus.with_name("other.jsonl")
        write_documents(other, count=800, seed=1)
        data = {**DOCUMENTS, "sources": [{"path": str(corpus), "weight": 2}, {"path": str(other), "weight": 1}]}
    model = model[0] if model else None
    _, written = check_layout(corpus, cache, tmp_path, parallel=parallel, data=data, train=train, model=model)
    _, ref_raw = layout_configs(corpus, cache, tmp_path, parallel=parallel, data=data, train=train, model=model)
    ref_metrics = reference_run(ref_raw)[1]["metrics"]  # the reference check_layout compared with (cached)
    val = [[m["val_loss"] for m in metrics if "val_loss" in m] for metrics in (written["metrics"], ref_metrics)]
    assert len(val[0]) == (2 if train.get("eval_every") else 0)
    torch.testing.assert_close(torch.tensor(val[0]), torch.tensor(val[1]), rtol=1e-5, atol=0)


def test_masking_changes_training_and_one_document_per_window_does_not(packed, tmp_path):
    """Masking packed documents changes the losses (the layout tests above are not comparing two
    unmasked runs); with each window exactly one document it changes nothing."""
    corpus, cache = packed
    plain = run_training(tiny_config(corpus, cache, tmp_path / "plain"))
    masked = run_training(tiny_config(corpus, cache, tmp_path / "masked", data=DOCUMENTS))
    assert max(abs(a - b) for a, b in zip(plain, masked)) > 1e-3
    whole = tmp_path / "whole.jsonl"  # 32 bytes, no EOS (bytes tokenizer): each window's inputs one document
    rng = np.random.default_rng(0)
    whole.write_text("".join(json.dumps({"text": "".join(rng.choice(list("abcdefgh"), 32))}) + "\n"
                             for _ in range(200)))
    plain = run_training(tiny_config(whole, cache, tmp_path / "plain1"))
    masked = run_training(tiny_config(whole, cache, tmp_path / "masked1", data=DOCUMENTS))
    assert plain == masked


# ----------------------------------------------------------------------------- memory


def _saved(model, ids, positions, docs) -> int:
    """Bytes autograd saves in one forward (weights left out), by storage."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, positions, docs)
    logits.sum().backward()
    return sum(found.values())


def _memory_rank(raws: list[dict]) -> list[tuple[int, int]]:
    """Per config: (what a layer saves, what the chunk saves besides its layers), measured on this rank."""
    out = []
    for raw in raws:
        cfg = from_dict(raw)
        cp, T, B = cfg.parallel.cp, cfg.data.seq_len, cfg.train.micro_batch
        mine = shard_indices(T, cp, dist.get_rank(), layout=cfg.parallel.cp_layout) if cp > 1 else torch.arange(T)
        ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
        docs = _random_docs(B, T, 1) if cfg.data.mask_documents else None
        positions = document_positions(_random_docs(B, T, 1))[:, mine] if cfg.data.reset_positions else mine
        saved = []
        for layers in (1, 2):
            model = seeded_model(replace(cfg.model, num_hidden_layers=layers), seed=0, device=torch.device("cpu"))
            if cp > 1:
                apply_context_parallel(model, Mesh(cp=cp), layout=cfg.parallel.cp_layout, impl=cfg.parallel.cp_impl)
            saved.append(_saved(model, ids[:, mine], positions, docs))
        out.append((saved[1] - saved[0], 2 * saved[0] - saved[1]))
    return out


@pytest.mark.parametrize("cp, impl", [(1, "ring"), (2, "ulysses"), (2, "ring")])
def test_memory_model_counts_the_document_mask(tmp_path, cp, impl):
    """The planner's bytes for masked documents and restarted positions, to the byte: a layer saves nothing
    more (its layers share one mask), a chunk saves one [B, 1, T, T] mask (none under ring attention, which
    remakes each block's) and per-row RoPE tables."""
    from tetron.plan.activations import chunk_held, layer_none
    from tetron.plan.sizes import Sizes
    from tetron.plan.state import Chunk

    raws = [tiny_config(tmp_path, tmp_path, tmp_path / "out", data={"seq_len": 32, **data},
                        parallel={"cp": cp, "cp_impl": impl}, model={"max_position_embeddings": 64})
            for data in ({}, DOCUMENTS)]
    measured = run_ranks(cp, _memory_rank, raws)[0]
    plain, masked = (from_dict(raw) for raw in raws)
    chunk = Chunk(layers=1, first=False, last=False)
    assert measured[1][0] == measured[0][0] == layer_none(Sizes.of(masked))
    held = [chunk_held(cfg, Sizes.of(cfg), chunk).activations for cfg in (plain, masked)]
    extra = held[1] - held[0]
    assert measured[1][1] - measured[0][1] == extra > 0


def test_packed_documents_match_transformers():
    """transformers' LlamaForCausalLM given the same packing as a 4D mask and per-document position ids
    computes the same logits (and, fp32, the same gradients) as tetron's model given the documents."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    model = _model().float()
    config = model.config
    hf = LlamaForCausalLM(HFConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                   intermediate_size=config.intermediate_size,
                                   num_hidden_layers=config.num_hidden_layers,
                                   num_attention_heads=config.num_attention_heads,
                                   num_key_value_heads=config.num_key_value_heads,
                                   max_position_embeddings=config.max_position_embeddings,
                                   tie_word_embeddings=False, attn_implementation="sdpa"))
    hf.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(5))
    docs = _random_docs(2, 48, 6)
    positions = document_positions(docs)
    pos = torch.arange(48)
    ours = model(ids, positions, docs)
    theirs = hf(input_ids=ids, position_ids=positions, attention_mask=document_mask(docs, pos, pos)).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    mine, hfs = dict(model.named_parameters()), dict(hf.named_parameters())
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, hfs[name].grad, rtol=1e-4, atol=1e-6, msg=name)
