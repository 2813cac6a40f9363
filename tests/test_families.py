"""The dense families beside Llama (models/qwen.py, models/mistral.py) against transformers' classes on the
same weights (fp32 logits within 1e-5), each with its distinctive feature on: Qwen2's q/k/v biases, Qwen3's
per-head q/k norms (and its optional biases), a sliding window shorter than the sequence (Mistral's, Qwen's
upper layers); their Hugging Face folders in and out; and the layouts where a feature meets an axis."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tetron.checkpoint.convert import convert
from tetron.checkpoint.load import load_model
from tetron.config import from_dict
from tetron.models import config_from_hf, family
from tetron.models.attention import Documents, document_mask, sdpa_attention
from tetron.models.llama import Llama
from tetron.observe.generate import kv_cache
from tetron.plan.state import layer_numels

from conftest import check_layout, tiny_config

ATOL = RTOL = 1e-5
B, T = 2, 24
TINY = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
# family, its fields; window 5 < T = 24 wherever a window is on
CASES = {
    "qwen2": ("qwen2", {}),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "qwen3_bias_tied_window": ("qwen3", dict(attention_bias=True, tie_word_embeddings=True, use_sliding_window=True,
                                             sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                                                            "sliding_attention"])),
    "mistral_window": ("mistral", dict(sliding_window=5)),
}
HF_CLASSES = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
              "mistral": transformers.MistralForCausalLM}


def config(name: str):
    model_type, fields = CASES[name]
    return family(model_type).config_class(**TINY, **fields)


def hf_model(cfg) -> transformers.PreTrainedModel:
    """transformers' class of the family from our config's to_hf, random weights of O(1) effect (biases and
    norm weights too), eval mode."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = HF_CLASSES[cfg.model_type](hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("name", ["qwen2_window", "qwen3_bias_tied_window", "mistral_window"])
def test_logits_match_transformers(name):
    cfg = config(name)
    hf = hf_model(cfg)
    ours = Llama(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)  # the same tensor names, biases and q/k norms included
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = ours(ids)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    layers = [layer.self_attn for layer in ours.model.layers.values()]
    if any(a.sliding_window for a in layers):  # the window changes the logits: the comparison above could fail
        for attention in layers:
            attention.sliding_window = None
        with torch.no_grad():
            assert (ours(ids) - expected).abs().max() > 1e-2


def test_window_within_documents():
    """Attention with a window, with and without documents, equals plain attention under the mask the
    query's document and window leave it; each window's cached mask is its own."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    ids = torch.tensor([[0] * 9 + [1] * 7, [0] * 3 + [1] * 13])
    docs, pos = Documents(ids), torch.arange(16)
    for window in (1, 4, 16):
        near = pos[:, None] - pos[None, :] < window
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids, pos, pos)
                                                                    & near)
        torch.testing.assert_close(sdpa_attention(q, k, v, docs, window), expected, atol=1e-6, rtol=1e-5)
        causal = (pos[:, None] >= pos[None, :]) & near
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        torch.testing.assert_close(sdpa_attention(q, k, v, None, window), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_hf_folders_in_and_out(name, tmp_path):
    """transformers' save_pretrained folder is read (config and weights) to equal logits; tetron's folder (its
    config.json from to_hf) loads in transformers' from_pretrained as the same class, to equal logits."""
    cfg = config(name)
    hf = hf_model(cfg)
    hf.save_pretrained(tmp_path / "hf")
    assert config_from_hf(cfg.to_hf()) == cfg
    read = config_from_hf(tmp_path / "hf")  # transformers' config.json: it writes null windows where off
    windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
    assert type(read) is type(cfg) and [read.layer_window(i) for i in range(cfg.num_hidden_layers)] == windows
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(load_model(tmp_path / "hf")(ids), expected, atol=ATOL, rtol=RTOL)
    convert(tmp_path / "hf", tmp_path / "ck")  # tetron's checkpoint writer and its config.json
    written = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert written["model_type"] == cfg.model_type and written["architectures"] == [type(hf).__name__]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    assert type(theirs) is type(hf)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, expected, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- where a feature meets an axis

FAMILY_LAYOUTS = {
    # q/k/v biases split with their column-parallel rows; windows of 5 in sequences of 32 in the upper two of
    # the four layers, masked in ring attention's blocks (zigzag shards of 8)
    "qwen2-window-tp2-cp2": ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 5,
                              "max_window_layers": 2}, {"tp": 2, "cp": 2}),
    # q/k norms: whole on each tp rank, gradients summed over tp (each rank saw its heads), on ZeRO-2's pieces,
    # beside the residual norms' under sequence parallelism
    "qwen3-dp2-tp2-sp-zero2": ({"model_type": "qwen3"}, {"dp": 2, "tp": 2, "sp": True, "zero": 2}),
}


@pytest.mark.parametrize("name", sorted(FAMILY_LAYOUTS))
def test_family_layout_matches_single_process(corpus, cache_dir, tmp_path, name):
    model, parallel = FAMILY_LAYOUTS[name]
    _, written = check_layout(corpus, cache_dir, tmp_path, model=model, parallel={**parallel, "bucket_mb": 0.01})
    for key, value in written["model"].items():  # the features trained: biases left 0, q/k norms left 1
        start = 1.0 if key.endswith(("q_norm.weight", "k_norm.weight")) else 0.0 if key.endswith(".bias") else None
        assert start is None or (value - start).abs().max() > 1e-4, key


def test_planner_counts_biases_and_head_norms(corpus, cache_dir, tmp_path):
    """Under tp2 the q/k/v biases are halved with their rows; the q/k norms stay whole (as the residual norms)."""
    h, q, kv, inter, hd = 32, 32, 16, 64, 8
    matmuls = (q * h + 2 * kv * h + h * q + 3 * inter * h) // 2
    for model_type, extra in (("qwen2", (q + 2 * kv) // 2), ("qwen3", 2 * hd), ("mistral", 0)):
        cfg = from_dict(tiny_config(corpus, cache_dir, tmp_path, model={"model_type": model_type},
                                    parallel={"tp": 2}))
        assert sum(layer_numels(cfg)) == matmuls + 2 * h + extra


def test_kv_cache_keeps_the_window():
    """Generation's KV cache (observe/generate.py) attends, token by token, to what the window leaves: each
    new token's logits equal the whole sequence's forward pass."""
    cfg = config("mistral_window")
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids)[0]  # [12, vocab]
        with kv_cache(model):
            steps = [model(ids[:, :3])[0, -1]]  # the prompt, then one token at a time
            steps += [model(ids[:, t:t + 1], torch.tensor([t]))[0, -1] for t in range(3, 12)]
    torch.testing.assert_close(torch.stack(steps), full[2:], atol=ATOL, rtol=RTOL)
