"""OLMo 3 (models/olmo3.py) and Gemma 3's text model (models/gemma3.py) against transformers' classes on the same
weights (fp32 logits and gradients within 1e-5), each with what makes it itself on: windows shorter than the
sequence, Gemma's local and global RoPE bases and the global layers' linear scaling; their transformers-saved
folders loaded (step-1 loss equal to transformers' own); generation's KV cache keeping the windows; and every
layout of issue 35's list equal to the single process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tetron.checkpoint.load import load_model
from tetron.config import from_dict
from tetron.models import config_from_hf, family
from tetron.models.llama import Llama
from tetron.observe.generate import kv_cache

from conftest import check_layout, first_batch_loss, run_training, tiny_config, train_through_cli

ATOL = RTOL = 1e-5
B, T = 2, 24
TINY = dict(vocab_size=257, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64, sliding_window=5, bos_token_id=2, eos_token_id=1)
LOCAL, GLOBAL = "sliding_attention", "full_attention"
CASES = {  # windows of 5 < T; the full layers scaled (OLMo 3's released YaRN, Gemma's linear), Gemma's local ones
    # on a base of their own
    "olmo3": dict(num_hidden_layers=4, rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "original_max_position_embeddings": 16}),
    "gemma3_text": dict(num_hidden_layers=4, layer_types=[LOCAL, GLOBAL, LOCAL, LOCAL], rope_theta=1000.0,
                        rope_local_base_freq=30.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                        query_pre_attn_scalar=12),
}
HF_CLASSES = {"olmo3": transformers.Olmo3ForCausalLM, "gemma3_text": transformers.Gemma3ForCausalLM}
FOLDER_CLASSES = {**HF_CLASSES, "gemma3": transformers.Gemma3ForConditionalGeneration}  # folders tetron starts from


def config(model_type: str):
    return family(model_type).config_class(**TINY, **CASES[model_type])


def hf_model(cfg) -> transformers.PreTrainedModel:
    """transformers' class from our config's to_hf, random weights of O(1) effect (norm gains in [0.5, 1.5]: a
    (1 + weight) norm's weight in [-0.5, 0.5]), eval mode."""
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = HF_CLASSES[cfg.model_type](hf_cfg).eval()
    offset = 1.0 if cfg.norm_unit_offset else 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5 - offset, 1.5 - offset) if "norm" in name else p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_logits_and_gradients_match_transformers(model_type):
    cfg = config(model_type)
    hf = hf_model(cfg)
    assert config_from_hf(cfg.to_hf()) == cfg  # config.json out and back in
    assert config_from_hf(hf.config.to_dict()) == cfg  # transformers' own config.json in
    ours = Llama(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)  # the same tensor names
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    # ids past the pad ids: transformers' embedding gives its padding_idx row no gradient, tetron's trains it
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))
    expected = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    got = ours(ids)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    (expected.square().mean()).backward()
    (got.square().mean()).backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, atol=ATOL, rtol=1e-4, msg=name)
    with torch.no_grad():  # the windows and the second RoPE matter: the comparison above could fail
        for layer in ours.model.layers.values():
            layer.self_attn.sliding_window = None
        assert (ours(ids) - expected).abs().max() > 1e-2
        if model_type == "gemma3_text":
            for index, layer in ours.model.layers.items():
                layer.self_attn.sliding_window = cfg.layer_window(int(index))
            ours.model.config = dataclasses.replace(cfg, rope_local_base_freq=None)  # the tables' config
            assert (ours(ids) - expected).abs().max() > 1e-2
        else:  # OLMo 3's YaRN on the full layers matters too
            for index, layer in ours.model.layers.items():
                layer.self_attn.sliding_window = cfg.layer_window(int(index))
            ours.model.config = dataclasses.replace(cfg, rope_scaling=None)
            assert (ours(ids) - expected).abs().max() > 1e-2


def test_gemma3_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0: .*use null"):
        config_from_hf({**config("gemma3_text").to_hf(), "final_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        config_from_hf({**config("gemma3_text").to_hf(), "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported; use None, 'linear', "):
        config_from_hf({**config("olmo3").to_hf(), "rope_parameters": None,
                        "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}})
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({**config("olmo3").to_hf(), "layer_types": [LOCAL, "chunked", LOCAL, GLOBAL]})


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_kv_cache_keeps_windows_and_ropes(model_type):
    """Generation's KV cache (observe/generate.py), token by token: each new token's logits equal the whole
    sequence's forward pass (windows of 3, Gemma's two RoPEs and soft-capped scores)."""
    fields = {"attn_logit_softcapping": 2.0} if model_type == "gemma3_text" else {}
    cfg = dataclasses.replace(config(model_type), sliding_window=3, **fields)
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
        full = model(ids)[0]  # [12, vocab]
        with kv_cache(model):
            steps = [model(ids[:, :3])[0, -1]]  # the prompt, then one token at a time
            steps += [model(ids[:, t:t + 1], torch.tensor([t]))[0, -1] for t in range(3, 12)]
    torch.testing.assert_close(torch.stack(steps), full[2:], atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- transformers' folders in


def _hf_folder(path, model_type: str):
    """A tiny model as transformers' save_pretrained writes it (its defaults for what is not given)."""
    torch.manual_seed(3)
    shape = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=5, eos_token_id=1,
                 bos_token_id=2, pad_token_id=0)
    if model_type == "olmo3":
        hf_cfg = transformers.Olmo3Config(**shape, layer_types=[LOCAL, GLOBAL])
    else:
        hf_cfg = transformers.Gemma3TextConfig(**shape, layer_types=[LOCAL, GLOBAL], query_pre_attn_scalar=12,
                                               rope_local_base_freq=30.0,
                                               rope_scaling={"rope_type": "linear", "factor": 4.0})
    if model_type == "gemma3":  # the hub's 4B and up: the text model beside a vision tower, under language_model.
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        hf_cfg = transformers.Gemma3Config(text_config=hf_cfg.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    model = FOLDER_CLASSES[model_type](hf_cfg)
    with torch.no_grad():  # norms away from their start, so that their kind ((1 +) weight) counts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", sorted(FOLDER_CLASSES))
def test_init_from_hf_folder(corpus, cache_dir, tmp_path, model_type):
    """Step 1's loss from a transformers-saved folder (`tetron train` with init_from, on two pipeline stages) is
    transformers' own loss on the same batch; from Gemma 3's multimodal folder, its text model's (the vision
    tower left unread), trained and saved as the text model."""
    hf = _hf_folder(tmp_path / "hf", model_type)
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 1, "micro_batch": 1, "grad_acc": 2},
                      parallel={"pp": 2}, checkpoint={"init_from": str(hf)})
    del raw["model"]  # the model comes from the folder
    assert from_dict(raw).model.model_type == {"gemma3": "gemma3_text"}.get(model_type, model_type)
    (loss,) = train_through_cli(raw, tmp_path, run_training)
    model = FOLDER_CLASSES[model_type].from_pretrained(hf).eval()
    expected = first_batch_loss(raw, model)
    assert abs(loss - float(expected)) <= 1e-5 * abs(float(expected))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the plain model from the folder (generate, convert): the same logits
        torch.testing.assert_close(load_model(hf)(ids), model(ids).logits, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- every layout of issue 35


_OLMO3 = {"model_type": "olmo3", "num_hidden_layers": 4, "sliding_window": 5, "eos_token_id": 1}
# local, local | global, local: two stages meet between a local and a global layer (zbv: every layer a chunk)
_GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 4, "head_dim": 8, "sliding_window": 5,
           "layer_types": [LOCAL, LOCAL, GLOBAL, LOCAL], "rope_theta": 1000.0, "rope_local_base_freq": 30.0,
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "query_pre_attn_scalar": 12,
           "attn_logit_softcapping": 3.0}
LAYOUTS = {
    "dp2": {"dp": 2},
    "tp2-sp": {"tp": 2, "sp": True},
    "pp2-zbv": {"pp": 2, "pp_schedule": "zbv", "pp_virtual": 2},
    "cp2-ring": {"cp": 2},
    "cp2-ulysses": {"cp": 2, "cp_impl": "ulysses"},
}
CASES_IN_LAYOUTS = {
    **{f"olmo3-{name}": (_OLMO3, parallel) for name, parallel in LAYOUTS.items()},
    "olmo3-tp4": ({**_OLMO3, "num_key_value_heads": 4}, {"tp": 4}),
    **{f"gemma3-{name}": (_GEMMA3, parallel) for name, parallel in LAYOUTS.items()},
    "gemma3-pp2-local-global": (_GEMMA3, {"pp": 2}),
}


@pytest.mark.parametrize("name", sorted(CASES_IN_LAYOUTS))
def test_layout_matches_single_process(corpus, cache_dir, tmp_path, name):
    model, parallel = CASES_IN_LAYOUTS[name]
    _, written = check_layout(corpus, cache_dir, tmp_path, model=model, parallel={**parallel, "bucket_mb": 0.01})
    start = 0.0 if model["model_type"] == "gemma3_text" else 1.0  # (1 + weight) norms start at 0
    norms = [key for key in written["model"] if key.endswith("norm.weight")]
    assert any("q_norm" in key for key in norms)
    for key in norms:  # every norm trained, the q/k norms too
        assert (written["model"][key] - start).abs().max() > 1e-4, key


# ----------------------------------------------------------------------------- the shared blocks' new options


def test_rope_per_layer_matches_gemma3_rotary_embedding():
    """rope_inv_freq of each layer (LlamaConfig.layer_rope): the local layers' on their own base, the global
    layers' linearly scaled, each equal to Gemma3RotaryEmbedding's table for its layer type; a Llama's the same
    in every layer."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from tetron.models.llama import LlamaConfig, rope_inv_freq

    cfg = config("gemma3_text")
    theirs = Gemma3RotaryEmbedding(transformers.AutoConfig.for_model(**cfg.to_hf()))
    for index, kind in enumerate(cfg.layer_types):
        torch.testing.assert_close(rope_inv_freq(cfg, layer=index), getattr(theirs, f"{kind}_inv_freq"),
                                   atol=0, rtol=1e-7)
    assert not torch.equal(rope_inv_freq(cfg, layer=0), rope_inv_freq(cfg, layer=1))
    llama = LlamaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=3)
    assert all(torch.equal(rope_inv_freq(llama, layer=i), rope_inv_freq(llama)) for i in range(3))


def test_head_qk_norms_are_of_the_familys_kind():
    """Per-head q/k norms take the family's RMSNorm: (1 + weight), starting at 0, for Gemma 3; a plain weight
    for Qwen3."""
    gemma = Llama(config("gemma3_text")).model.layers["0"].self_attn
    qwen3 = Llama(family("qwen3").config_class(**{k: v for k, v in TINY.items()}, num_hidden_layers=1))
    assert gemma.q_norm.unit_offset and gemma.k_norm.unit_offset
    assert not qwen3.model.layers["0"].self_attn.q_norm.unit_offset


def test_resuming_checks_the_local_rope_base_and_the_scale(tmp_path):
    """A checkpoint's local layers' RoPE base and its scores' scale give its weights their meaning, as rope_theta
    does: another value in the run is one line naming the field (checkpoint.new_model_settings allows it)."""
    from tetron.checkpoint.check import compare_models
    from tetron.errors import CheckpointError

    saved = config("gemma3_text")
    for field, value in (("rope_local_base_freq", 10000.0), ("query_pre_attn_scalar", 16)):
        other = dataclasses.replace(saved, **{field: value})
        with pytest.raises(CheckpointError, match=f"model.{field}=.* there, but this run has model.{field}="):
            compare_models(saved, other, tmp_path)
        compare_models(saved, other, tmp_path, settings=False)


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_tetron_folder_loads_in_transformers(tmp_path, model_type):
    """A transformers folder converted to a tetron checkpoint (tetron's writer and its config.json, per-layer-type
    rope_parameters) loads in transformers' from_pretrained as the same class, with the same logits."""
    from tetron.checkpoint.convert import convert
    from tetron.checkpoint.load import load_model

    hf = _hf_folder(tmp_path / "hf", model_type)
    convert(hf, tmp_path / "ck")
    ids = torch.randint(3, 256, (B, T), generator=torch.Generator().manual_seed(5))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    assert type(theirs) is HF_CLASSES[model_type] and theirs.config.rope_parameters == original.config.rope_parameters
    with torch.no_grad():
        expected = original(ids).logits
        torch.testing.assert_close(theirs(ids).logits, expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(load_model(tmp_path / "ck")(ids), expected, atol=ATOL, rtol=RTOL)
