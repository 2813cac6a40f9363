"""Exports as the next tool reads them: an MoE model folder (OUT/model, a checkpoint's, `tetron convert`'s) holds
its experts one by one as the hub's Qwen3-MoE and Mixtral checkpoints do (the names transformers 4.x's modules
have, and transformers 5's save_pretrained writes), and loads in transformers 5 to tetron's logits; every
export's tokenizer loads in transformers' AutoTokenizer to tetron's ids, for every family, the bytes tokenizer
and a trained BPE; and the trained BPE splits text as GPT-2 does (what docs/checkpoints.md's GGUF recipe tells
llama.cpp's converter)."""

from __future__ import annotations

import json
import re

import pytest
import regex
import torch
import transformers
from safetensors.torch import save_file

from tetron.checkpoint.check import inspect_checkpoint, verify_tensors
from tetron.checkpoint.convert import convert
from tetron.checkpoint.load import TensorReader, load_model
from tetron.checkpoint.save import save_model, write_configs
from tetron.data.tokenizer import Tokenizer, byte_characters, load_tokenizer
from tetron.models import family
from tetron.parallel.init import seeded_model

from conftest import LAYOUT_LR, LOSS_RTOL, WEIGHT_ATOL, run_parallel, tiny_config

MOE = {"qwen3_moe": {"model_type": "qwen3_moe", "moe_intermediate_size": 32},
       "mixtral": {"model_type": "mixtral", "intermediate_size": 32}}
MOE_SHAPE = {"vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}


def transformers4_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """The state_dict of transformers 4.57's Qwen3MoeForCausalLM / MixtralForCausalLM for `cfg`, written out
    from its modeling files: each expert an MLP of nn.Linear modules in an nn.ModuleList (Qwen3-MoE's
    `mlp.experts.E.gate_proj/up_proj/down_proj`, Mixtral's `block_sparse_moe.experts.E.w1/w3/w2`), the router an
    nn.Linear `gate`; Qwen3-MoE's q_norm/k_norm; no biases; lm_head unless tied; rotary inv_freq not persistent."""
    h, d, i, e = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size, cfg.num_experts
    mixtral = cfg.model_type == "mixtral"
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        layer = f"model.layers.{n}."
        out.update({layer + "input_layernorm.weight": (h,), layer + "post_attention_layernorm.weight": (h,),
                    layer + "self_attn.q_proj.weight": (cfg.num_attention_heads * d, h),
                    layer + "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
                    layer + "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
                    layer + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d)})
        if not mixtral:
            out.update({layer + "self_attn.q_norm.weight": (d,), layer + "self_attn.k_norm.weight": (d,)})
        block = layer + ("block_sparse_moe." if mixtral else "mlp.")
        out[block + "gate.weight"] = (e, h)
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for expert in range(e):
            mlp = f"{block}experts.{expert}."
            out.update({f"{mlp}{gate}.weight": (i, h), f"{mlp}{up}.weight": (i, h), f"{mlp}{down}.weight": (h, i)})
    return out


def stored_tensors(folder) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape in a folder's model files, as written (no layout applied)."""
    with TensorReader(folder, "model") as reader:
        return {name: reader.info(name)[1] for name in reader.names()}


def transformers5_tensors(folder, tmp_path) -> dict[str, tuple[int, ...]]:
    """What transformers 5's save_pretrained writes for the model of `folder`'s config.json (the hub's layout)."""
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "transformers")
    return stored_tensors(tmp_path / "transformers")


@pytest.mark.parametrize("kind", sorted(MOE))
def test_moe_exports_keep_the_experts_as_the_hub_does(kind, corpus, cache_dir, tmp_path):
    """A one-process run's OUT/model, its checkpoint and `tetron convert`'s folder of that checkpoint hold exactly
    the tensors (names, shapes) of transformers 4.57's modules and of transformers 5.24's save_pretrained; the
    checkpoint passes the pre-start check and `tetron check`; OUT/model loads in transformers 5 to tetron's
    logits within 1e-5, the converted folder to the same model."""
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model={**MOE_SHAPE, **MOE[kind]},
                      train={"steps": 2}, checkpoint={"save_every": 2})
    run_parallel(raw)
    model_dir, ckpt = tmp_path / "run" / "model", tmp_path / "run" / "checkpoints" / "step_2"
    convert(ckpt, tmp_path / "converted")
    cfg = load_model(model_dir).config
    expected = transformers4_tensors(cfg)
    assert transformers5_tensors(model_dir, tmp_path) == expected
    for folder in (model_dir, ckpt, tmp_path / "converted"):
        assert stored_tensors(folder) == expected, folder
    inspect_checkpoint(ckpt)
    assert verify_tensors(ckpt) == []  # each piece's crc32, as trainer_state.json lists them
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ours = load_model(model_dir)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=1e-5)
        torch.testing.assert_close(load_model(tmp_path / "converted")(ids), ours(ids), rtol=0, atol=0)


def test_a_one_process_moe_checkpoint_resumes_under_ep2(corpus, cache_dir, tmp_path):
    """The checkpoint (experts one by one) of a one-process run, resumed by dp2 ep2 (each rank reading only its
    experts' pieces), trains the remaining steps as the uninterrupted run: losses within LOSS_RTOL on every rank,
    final weights within WEIGHT_ATOL."""
    model = {**MOE_SHAPE, **MOE["qwen3_moe"]}
    ref_raw = tiny_config(corpus, cache_dir, tmp_path / "ref", model=model, train={"micro_batch": 2, "lr": LAYOUT_LR},
                          checkpoint={"save_every": 2})
    (ref,), ref_written = run_parallel(ref_raw)
    resume = str(tmp_path / "ref" / "checkpoints" / "step_2")
    raw = tiny_config(corpus, cache_dir, tmp_path / "ep", model=model, train={"micro_batch": 1, "lr": LAYOUT_LR},
                      parallel={"dp": 2, "ep": 2}, checkpoint={"resume": resume})
    results, written = run_parallel(raw)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"][2:]), rtol=LOSS_RTOL,
                                   atol=0)
    assert written["model"].keys() == ref_written["model"].keys()
    for name, value in written["model"].items():
        torch.testing.assert_close(value, ref_written["model"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_folders_with_fused_experts_are_still_read(tmp_path):
    """A folder written with transformers 5's fused expert tensors (as tetron wrote before) loads to the same
    model, and `tetron convert` turns it into a checkpoint and back into a folder of the hub's layout."""
    cfg = family("qwen3_moe").config_class(**MOE_SHAPE, moe_intermediate_size=32)
    model = seeded_model(cfg, seed=0, device=torch.device("cpu"))
    (tmp_path / "fused").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "fused" / "model.safetensors")
    write_configs(tmp_path / "fused", cfg, None)
    assert "model.layers.0.mlp.experts.gate_up_proj" in stored_tensors(tmp_path / "fused")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
        torch.testing.assert_close(load_model(tmp_path / "fused")(ids), expected, rtol=0, atol=0)
        convert(tmp_path / "fused", tmp_path / "ck")
        convert(tmp_path / "ck", tmp_path / "back")
        assert stored_tensors(tmp_path / "back") == transformers4_tensors(cfg)
        torch.testing.assert_close(load_model(tmp_path / "back")(ids), expected, rtol=0, atol=0)
    save_model(model, tmp_path / "saved")  # save_model writes the hub's layout too
    assert stored_tensors(tmp_path / "saved") == transformers4_tensors(cfg)


# ----------------------------------------------------------------------------- tokenizers

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"]
# where byte-level pipelines part: digits (Qwen splits them), contractions in capitals, runs of spaces and
# newlines, a decomposed accent (NFC would compose it), emoji, a byte-level character as text, the special
# tokens' texts
TEXTS = ["Hello world 12345 and 3.14!\n\n  def f(x):\treturn x's   I'M ok, WE'LL see",
         "café cafe\u0301 \U0001F680\u200d Ā ÿ <|endoftext|> <|pad|>\r\n  \n",
         "".join(chr(c) for c in range(1, 600))]


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory) -> Tokenizer:
    return load_tokenizer("bpe:300", data_spec=str(corpus), cache_dir=tmp_path_factory.mktemp("bpe"))


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_every_export_tokenizes_in_transformers_as_in_tetron(model_type, kind, bpe, tmp_path):
    """AutoTokenizer on a model folder's files gives tetron's ids (encode as transformers calls it), its padding
    token is the config's pad_token_id and pads a batch, and its longest input is the model's."""
    tok = Tokenizer(None, None) if kind == "bytes" else bpe
    cfg = family(model_type).config_class(vocab_size=300, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=96)
    write_configs(tmp_path, cfg, tok)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert theirs.encode(text) == tok.encode(text), (type(theirs).__name__, text)
    pad = json.loads((tmp_path / "config.json").read_text())["pad_token_id"]
    assert theirs.pad_token_id == pad == (255 if kind == "bytes" else tok.eos_id)
    assert theirs.eos_token_id == tok.eos_id and theirs.model_max_length == 96
    batch = theirs(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0] == [*tok.encode("ab"), *[pad] * (len(tok.encode("abcd")) - len(tok.encode("ab")))]


def test_the_bytes_tokenizer_json_gives_every_byte_its_id(tmp_path):
    """The bytes export's tokenizer.json, read by the tokenizers library itself: id b for byte b of any text."""
    from tokenizers import Tokenizer as HFTokenizer

    Tokenizer(None, None).save(tmp_path)
    backend = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "".join(chr(c) for c in range(1, 0x800)) + "\U0001F680 <|pad|>"
    assert backend.encode(text).ids == list(text.encode("utf-8"))
    assert backend.get_vocab_size() == 256


# GPT-2's split (its encoder.py), which llama.cpp's "gpt-2" pre-tokenizer also applies
GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def test_the_trained_bpe_splits_text_as_gpt2(bpe):
    """The trained BPE's pre-tokenizer cuts text where GPT-2's regex does (docs/checkpoints.md tells llama.cpp's
    converter to use its gpt-2 pre-tokenizer for it)."""
    to_byte = {char: b for b, char in enumerate(byte_characters())}
    for text in TEXTS:
        pieces = [bytes(to_byte[c] for c in piece).decode("utf-8")
                  for piece, _ in bpe.backend.pre_tokenizer.pre_tokenize_str(text)]
        assert pieces == GPT2_SPLIT.findall(text)


def test_converting_an_older_checkpoint_writes_the_tokenizer_for_transformers(corpus, cache_dir, tmp_path):
    """A bytes checkpoint written before tetron wrote tokenizer.json and tokenizer_config.json (its trainer state
    listing neither) converts to a folder AutoTokenizer reads to the bytes' ids, padding named."""
    from tetron.checkpoint.save import seal
    from tetron.fs import STATE_FILE

    run_parallel(tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 1}))
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    state = json.loads((ckpt / STATE_FILE).read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink()
        del state["files"][name]
    (ckpt / STATE_FILE).write_text(json.dumps(seal(state)))
    convert(ckpt, tmp_path / "hf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [theirs.encode(text) for text in TEXTS] == [list(text.encode()) for text in TEXTS]
    assert theirs.pad_token_id == 255 and theirs.model_max_length == 64


@pytest.mark.parametrize("file, edit, error", [
    ("tokenizer.json", lambda t: {**t, "normalizer": None}, "not the bytes tokenizer tetron_tokenizer.json names"),
    ("tokenizer.json", lambda t: {**t, "model": {**t["model"], "merges": [["a", "b"]]}}, "not the bytes tokenizer"),
    ("tokenizer_config.json", lambda c: {**c, "pad_token": "<pad>"}, "pad_token='<pad>' is no token"),
    ("tokenizer_config.json", lambda c: {**c, "model_max_length": None}, "model_max_length=None: expected a pos"),
    ("tokenizer_config.json", lambda c: {**c, "split_special_tokens": "x"}, "split_special_tokens='x': expected"),
    ("tokenizer_config.json", lambda c: {**c, "eos_token": "x"}, "eos_token='x', but tetron_tokenizer.json's eos_id"),
])
def test_a_folder_whose_files_for_transformers_disagree_with_tetron_is_refused(file, edit, error, tmp_path):
    """What transformers reads beside tetron_tokenizer.json is checked with it: an edited file would give
    transformers other ids than the ones the weights were trained on."""
    from tetron.errors import DataError

    Tokenizer(None, None).save(tmp_path)
    load_tokenizer(str(tmp_path), data_spec=None, cache_dir=tmp_path)  # as written: fine
    (tmp_path / file).write_text(json.dumps(edit(json.loads((tmp_path / file).read_text()))))
    with pytest.raises(DataError, match="^" + re.escape(f"{tmp_path / file}: {error}")):
        load_tokenizer(str(tmp_path), data_spec=None, cache_dir=tmp_path)
