"""tetron.models.llama against transformers' LlamaForCausalLM: names, config mapping, logits, gradients."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from tetron.models.llama import Llama, LlamaConfig

ATOL = RTOL = 1e-5
B, T = 2, 24

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # head_dim 8, theta 5e5: wavelengths ~6, ~167, ~4.4e3, ~1.2e5, so with 256 the
    # high (kept), medium (blended) and low (divided by factor) bands are all exercised.
    "original_max_position_embeddings": 256,
}

TINY = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {
    "mha": LlamaConfig(**TINY),
    "gqa2_tied_vocab1003": LlamaConfig(**{**TINY, "vocab_size": 1003}, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4": LlamaConfig(**{**TINY, "hidden_size": 64, "num_attention_heads": 8}, num_key_value_heads=2),
    "mqa_tied": LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=True),
    "head_dim16": LlamaConfig(**TINY, num_key_value_heads=2, head_dim=16),
    "theta5e5": LlamaConfig(**TINY, rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama3_rope": LlamaConfig(
        **TINY, num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3, max_position_embeddings=4096
    ),
}


def hf_model(cfg: LlamaConfig, *, attn: str = "eager", seed: int = 0) -> transformers.LlamaForCausalLM:
    """A transformers model with random weights of O(1) effect (norm weights too), in eval mode."""
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf())
    hf_cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    return model


def ours_from(hf: transformers.LlamaForCausalLM, cfg: LlamaConfig) -> Llama:
    model = Llama(cfg).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def positions(kind: str) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(1)
    if kind == "default":
        return None
    if kind == "offset":
        return torch.arange(T) + 1000  # [T], e.g. a later chunk of a long sequence
    # Non-contiguous, increasing, different per row: [B, T].
    return torch.stack([torch.randperm(3000, generator=g)[:T].sort().values for _ in range(B)])


def hf_logits(hf: transformers.LlamaForCausalLM, ids: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    if pos is not None and pos.dim() == 1:
        pos = pos.unsqueeze(0).expand(ids.shape[0], -1)
    # An explicit all-ones mask: without it transformers 5 reads position-id jumps as packed
    # sequences and masks across them, whereas tetron's attention is causal over the sequence.
    mask = torch.ones_like(ids)
    return hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("pos_kind", ["default", "offset", "noncontiguous"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str, pos_kind: str) -> None:
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    ours = ours_from(hf, cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    pos = positions(pos_kind)
    with torch.no_grad():
        expected = hf_logits(hf, ids, pos)
        got = ours(ids, pos)
    assert got.shape == (B, T, cfg.vocab_size)
    assert expected.abs().max() > 0.5  # weights large enough for the comparison to mean something
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["gqa2_tied_vocab1003", "llama3_rope"])
def test_logits_match_transformers_sdpa(name: str) -> None:
    cfg = CONFIGS[name]
    hf = hf_model(cfg, attn="sdpa")
    ours = ours_from(hf, cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    pos = positions("offset")
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, pos), hf_logits(hf, ids, pos), atol=ATOL, rtol=RTOL)


def test_comparison_is_sensitive() -> None:
    """Changing one weight or the relative positions moves the logits far beyond the tolerance."""
    cfg = CONFIGS["gqa2_tied_vocab1003"]
    ours = ours_from(hf_model(cfg), cfg)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = ours(ids)
        # RoPE sees only relative positions: a constant offset changes nothing but rounding.
        assert (ours(ids, positions("offset")) - base).abs().max() < 1e-3
        assert (ours(ids, positions("noncontiguous")) - base).abs().max() > 1e-2
        ours.model.layers["1"].self_attn.k_proj.weight[0, 0] += 0.5
        assert (ours(ids) - base).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["gqa4", "mqa_tied"])
def test_gradients_match_transformers(name: str) -> None:
    cfg = CONFIGS[name]
    hf = hf_model(cfg)
    ours = ours_from(hf, cfg)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    for logits in (hf_logits(hf, ids, None), ours(ids)):
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    hf_params, our_params = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert hf_params.keys() == our_params.keys()
    for k, p in our_params.items():
        assert p.grad is not None and p.grad.abs().max() > 0, k
        torch.testing.assert_close(p.grad, hf_params[k].grad, atol=ATOL, rtol=RTOL, msg=k)


@pytest.mark.parametrize("tied", [False, True])
def test_state_dict_keys_and_loading_both_ways(tied: bool) -> None:
    cfg = dataclasses.replace(CONFIGS["gqa4"], tie_word_embeddings=tied)
    hf, ours = hf_model(cfg), Llama(cfg)
    assert list(ours.state_dict().keys()) == list(hf.state_dict().keys())
    assert list(ours.buffers()) == []  # nothing non-persistent to lose on the meta device
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    src = Llama(cfg)
    hf.load_state_dict(src.state_dict(), strict=True)
    for k, v in src.state_dict().items():
        assert torch.equal(hf.state_dict()[k], v), k


def test_num_params_and_flops() -> None:
    for cfg in CONFIGS.values():
        hf = hf_model(cfg)
        assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
        emb = {"model.embed_tokens.weight", "lm_head.weight"}
        body = sum(p.numel() for n, p in hf.named_parameters() if n not in emb)
        assert cfg.num_params(include_embedding=False) == body
        h = cfg.num_attention_heads * cfg.head_dim
        expected = 6 * (body + cfg.vocab_size * cfg.hidden_size) + 12 * cfg.num_hidden_layers * h * 128
        assert cfg.flops_per_token(128) == expected


def test_from_hf_dict_file_and_folder(tmp_path) -> None:
    hf_cfg = transformers.LlamaConfig(
        vocab_size=1003, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(LLAMA3), tie_word_embeddings=True, bos_token_id=7, eos_token_id=[8, 9],
    )  # fmt: skip
    hf_cfg.save_pretrained(tmp_path)
    expected = LlamaConfig(
        vocab_size=1003, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=LLAMA3, tie_word_embeddings=True, bos_token_id=7, eos_token_id=[8, 9],
    )  # fmt: skip
    assert LlamaConfig.from_hf(hf_cfg.to_dict()) == expected
    assert LlamaConfig.from_hf(tmp_path / "config.json") == expected
    assert LlamaConfig.from_hf(str(tmp_path)) == expected
    assert LlamaConfig.from_hf(expected.to_hf()) == expected


def test_from_hf_legacy_keys() -> None:
    """transformers 4.x config.json (as Llama-3.2 ships): rope_theta + rope_scaling with "type"."""
    legacy = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 1, "vocab_size": 257,
        "rope_theta": 500000.0, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "use_cache": True,
        "rope_scaling": {"type": "llama3", "factor": 32, "low_freq_factor": 1, "high_freq_factor": 4},
    }  # fmt: skip
    cfg = LlamaConfig.from_hf(legacy)
    assert cfg.head_dim == 8 and cfg.num_key_value_heads == 1 and cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 4096,
    }  # fmt: skip
    assert LlamaConfig.from_hf({k: v for k, v in legacy.items() if k != "model_type"}) == cfg


@pytest.mark.parametrize("name, ids", [("bos_token_id", 10**30), ("eos_token_id", [1, 257]), ("eos_token_id", -1)])
def test_from_hf_refuses_token_ids_outside_the_vocabulary(name, ids) -> None:
    """A config.json (a checkpoint's, resealed after an edit) whose token ids the vocabulary lacks is refused
    where it is read, as the run's own config is by validate."""
    hf = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "vocab_size": 257, name: ids}
    with pytest.raises(ValueError, match=f"^{name}=.*: expected ids below vocab_size=257$"):
        LlamaConfig.from_hf(hf)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_to_hf_round_trip(name: str) -> None:
    cfg = CONFIGS[name]
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf())
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    assert LlamaConfig.from_hf(hf_cfg.to_dict()) == cfg
    assert hf_cfg.head_dim == cfg.head_dim and hf_cfg.num_key_value_heads == cfg.num_key_value_heads
    assert hf_cfg.tie_word_embeddings == cfg.tie_word_embeddings


def test_from_hf_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_hf({"model_type": "mistral", "hidden_size": 32})
    with pytest.raises(ValueError, match="config"):
        LlamaConfig.from_hf(tmp_path)  # a folder without config.json
    with pytest.raises(ValueError, match="config"):
        LlamaConfig.from_hf(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})  # no factor
    with pytest.raises(ValueError, match="linear"):
        LlamaConfig(**TINY, rope_scaling={"type": "linear", "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "xielu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf(tmp_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_and_rope_bitwise_in_low_precision(dtype: torch.dtype) -> None:
    """RMSNorm's fp32 math and cast order, and RoPE's cos/sin, equal transformers' exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    from tetron.models.blocks import RMSNorm
    from tetron.models.llama import rope_cos_sin

    cfg = CONFIGS["llama3_rope"]
    x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(6)).to(dtype)
    theirs, ours = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps), RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(theirs.weight)
        theirs.to(dtype), ours.to(dtype)
        assert torch.equal(ours(x), theirs(x))
        rotary = LlamaRotaryEmbedding(transformers.LlamaConfig(**cfg.to_hf()))  # its buffers stay fp32
        pos = positions("noncontiguous")
        for a, b in zip(rope_cos_sin(cfg, pos, dtype=dtype), rotary(x, pos)):
            assert a.dtype == dtype and torch.equal(a, b)


def test_meta_device_build_and_retie() -> None:
    """Built on meta, moved with to_empty (which unties), re-tied, it runs and counts right."""
    cfg = CONFIGS["mqa_tied"]
    with torch.device("meta"):
        model = Llama(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, cfg.vocab_size)
