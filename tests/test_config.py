"""Config loading: YAML sections, command-line overrides, model sources, and one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from tetron.config import (
    CONFIGS_DIR,
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ParallelConfig,
    TrainConfig,
    from_dict,
    load_config,
)
from tetron.models.llama import LlamaConfig
from tetron.overrides import SHORT_FLAGS
from tetron.validate import validate

from conftest import STEPS, tiny_config

SHIPPED = sorted(CONFIGS_DIR.glob("*.yaml"))


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def tiny_yaml(tmp_path, corpus, cache_dir) -> Path:
    """A valid tiny config (4 heads, 2 kv heads, vocab 256, max positions 64) as a YAML file."""
    return write_yaml(tmp_path / "tiny.yaml", tiny_config(corpus, cache_dir, tmp_path / "out"))


def flat(cfg: Config) -> dict:
    """{"train.steps": 100, ..., "out": "runs/default"}."""
    return {f"{s}.{k}" if isinstance(v, dict) else s: (v[k] if isinstance(v, dict) else v)
            for s, v in cfg.to_dict().items() for k in (v if isinstance(v, dict) else [None])}


def config_error(path, overrides=(), *, world_size=None) -> str:
    """The message of the ConfigError that loading (and validating) raises; it must be one line."""
    with pytest.raises(ConfigError) as info:
        validate(load_config(path, list(overrides)), world_size=world_size)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


# --- loading -------------------------------------------------------------------------------------


def test_yaml_sections_become_typed_dataclasses(tmp_path):
    path = write_yaml(tmp_path / "run.yaml", {
        "model": {"vocab_size": 300, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 3,
                  "num_attention_heads": 6, "num_key_value_heads": 2, "tie_word_embeddings": True},
        "parallel": {"dp": 2, "dp_impl": "bucket", "bucket_mb": 4, "zero": 1, "reduce_dtype": "bfloat16"},
        "data": {"path": "stdlib", "tokenizer": "bpe:300", "seq_len": 16, "max_bytes": 5000},
        "train": {"steps": 7, "lr": 0.002, "grad_clip": 0, "dtype": "bfloat16", "recompute": "selective"},
        "logging": {"progress": False, "peak_tflops": None, "sample_prompt": "class "},
        "out": str(tmp_path / "o"),
    })
    cfg = load_config(path)
    expected = Config(
        model=LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                          num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
        parallel=ParallelConfig(dp=2, dp_impl="bucket", bucket_mb=4.0, zero=1, reduce_dtype="bfloat16"),
        data=DataConfig(path="stdlib", tokenizer="bpe:300", seq_len=16, max_bytes=5000),
        train=TrainConfig(steps=7, lr=0.002, grad_clip=0.0, dtype="bfloat16", recompute="selective"),
        logging=LoggingConfig(progress=False, peak_tflops=None, sample_prompt="class "),
        out=str(tmp_path / "o"),
    )
    assert cfg == expected
    assert cfg.model.head_dim == 8  # derived: 48 // 6
    assert type(cfg.parallel.bucket_mb) is float and type(cfg.train.grad_clip) is float  # ints widened
    assert cfg.world_size == 2 and cfg.global_batch == 2 * 8 * 1
    validate(cfg)
    assert from_dict(cfg.to_dict()) == cfg  # what the launcher hands each rank rebuilds the same config


def test_no_file_gives_the_defaults():
    assert load_config(None) == Config()


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    # YAML 1.1 reads `3e-4` as the string "3e-4"; a float field takes it as the number.
    cfg = load_config(write_yaml(tmp_path / "run.yaml", {"train": {"lr": "3e-4"}}))
    assert type(cfg.train.lr) is float and cfg.train.lr == 0.0003
    (tmp_path / "raw.yaml").write_text("train:\n  lr: 3e-4\n  min_lr_ratio: 1e-1\n")
    cfg = load_config(tmp_path / "raw.yaml")
    assert (cfg.train.lr, cfg.train.min_lr_ratio) == (0.0003, 0.1)


def test_dotted_overrides_are_typed():
    cfg = load_config(None, ["--train.lr=3e-4", "--train.steps", "5", "--logging.progress=false",
                             "--logging.peak_tflops", "12.5", "--data.max_bytes=1000", "--train.warmup_steps=0",
                             "--model.tie_word_embeddings", "true", "--parallel.timeout_s=30"])
    assert type(cfg.train.lr) is float and cfg.train.lr == 0.0003
    assert type(cfg.train.steps) is int and cfg.train.steps == 5
    assert cfg.logging.progress is False and cfg.model.tie_word_embeddings is True
    assert cfg.logging.peak_tflops == 12.5 and cfg.data.max_bytes == 1000 and cfg.train.warmup_steps == 0
    assert type(cfg.parallel.timeout_s) is float and cfg.parallel.timeout_s == 30.0
    assert load_config(None, ["--logging.peak_tflops=null"]).logging.peak_tflops is None


def test_string_fields_keep_the_text_as_typed():
    cfg = load_config(None, ["--out", "007", "--data.path=1e3", "--logging.sample_prompt", "1.50",
                             "--data.cache_dir", "0.10", "--data.tokenizer=bpe:512"])
    assert (cfg.out, cfg.data.path, cfg.logging.sample_prompt) == ("007", "1e3", "1.50")
    assert (cfg.data.cache_dir, cfg.data.tokenizer) == ("0.10", "bpe:512")
    assert load_config(None, ["--data.cache_dir=null"]).data.cache_dir is None


# Each short flag, a value, and where it must land (written out, not read from SHORT_FLAGS).
SHORT_FLAG_CASES = {
    "model": ("demo", lambda c: c.model and c.model.hidden_size, 256),
    "data": ("/some/corpus.txt", lambda c: c.data.path, "/some/corpus.txt"),
    "tokenizer": ("bpe:1000", lambda c: c.data.tokenizer, "bpe:1000"),
    "out": ("runs/x1", lambda c: c.out, "runs/x1"),
    "dp": ("3", lambda c: c.parallel.dp, 3),
    "tp": ("5", lambda c: c.parallel.tp, 5),
    "pp": ("6", lambda c: c.parallel.pp, 6),
    "cp": ("7", lambda c: c.parallel.cp, 7),
    "ep": ("2", lambda c: c.parallel.ep, 2),
    "steps": ("11", lambda c: c.train.steps, 11),
    "seed": ("12", lambda c: c.train.seed, 12),
    "seq-len": ("13", lambda c: c.data.seq_len, 13),
    "micro-batch": ("14", lambda c: c.train.micro_batch, 14),
    "grad-acc": ("15", lambda c: c.train.grad_acc, 15),
    "lr": ("2e-5", lambda c: c.train.lr, 2e-5),
    "dp-impl": ("naive", lambda c: c.parallel.dp_impl, "naive"),
    "sp": ("true", lambda c: c.parallel.sp, True),
    "cp-layout": ("contiguous", lambda c: c.parallel.cp_layout, "contiguous"),
    "cp-impl": ("ulysses", lambda c: c.parallel.cp_impl, "ulysses"),
    "pp-schedule": ("interleaved", lambda c: c.parallel.pp_schedule, "interleaved"),
    "pp-virtual": ("3", lambda c: c.parallel.pp_virtual, 3),
    "save-every": ("5", lambda c: c.checkpoint.save_every, 5),
    "resume": ("auto", lambda c: c.checkpoint.resume, "auto"),
    "overwrite": ("true", lambda c: c.checkpoint.overwrite, True),
    "async-save": ("true", lambda c: c.checkpoint.async_save, True),
    "init-from": ("org/name", lambda c: c.checkpoint.init_from, "org/name"),
    "max-restarts": ("2", lambda c: c.parallel.max_restarts, 2),
    "zero": ("2", lambda c: c.parallel.zero, 2),
    "recompute": ("full", lambda c: c.train.recompute, "full"),
    "force": ("true", lambda c: c.parallel.ignore_memory_limit, True),
    "profile": ("5:7", lambda c: c.logging.profile, "5:7"),
}


def test_sp_flag_stands_alone():
    assert load_config(None, ["--sp", "--tp", "2"]).parallel.sp is True
    assert load_config(None, ["--tp", "2", "--sp"]).parallel.sp is True
    assert load_config(None, ["--sp", "false"]).parallel.sp is False
    assert load_config(None, []).parallel.sp is False


def test_pipeline_fields():
    cfg = load_config(None, ["--pp", "2", "--pp-schedule", "afab", "--parallel.pp_split=[3, 1]"])
    assert (cfg.parallel.pp_schedule, cfg.parallel.pp_split, cfg.parallel.pp_virtual) == ("afab", [3, 1], 1)
    assert load_config(None, ["--parallel.pp_split=null"]).parallel.pp_split is None
    assert ParallelConfig().pp_schedule == "1f1b" and ParallelConfig().pp_split is None


def test_every_short_flag_is_covered():
    assert set(SHORT_FLAG_CASES) == set(SHORT_FLAGS)


@pytest.mark.parametrize("flag", sorted(SHORT_FLAG_CASES))
def test_short_flag_lands_in_its_field(flag):
    value, get, expected = SHORT_FLAG_CASES[flag]
    default = get(Config())
    assert default != expected  # the flag must change something
    for args in ([f"--{flag}", value], [f"--{flag}={value}"]):
        cfg = load_config(None, args)
        assert get(cfg) == expected and type(get(cfg)) is type(expected)
        # nothing else moved (the model flag replaces the whole model section)
        if flag != "model":
            changed = [key for key, v in flat(cfg).items() if v != flat(Config())[key]]
            assert changed == [SHORT_FLAGS[flag]]


def test_overrides_apply_in_order_later_wins(tiny_yaml):
    assert load_config(tiny_yaml).train.steps == STEPS  # from the file
    assert load_config(tiny_yaml, ["--steps", "3"]).train.steps == 3
    assert load_config(tiny_yaml, ["--steps", "3", "--train.steps=7"]).train.steps == 7
    assert load_config(tiny_yaml, ["--train.steps=7", "--steps", "3"]).train.steps == 3
    assert load_config(tiny_yaml, ["--lr=1", "--train.lr", "0.5", "--lr", "2e-3"]).train.lr == 0.002


def test_model_name_then_field_override():
    demo = load_config("demo").model
    cfg = load_config(None, ["--model", "demo", "--model.num_hidden_layers=2"])
    assert cfg.model == dataclasses.replace(demo, num_hidden_layers=2)
    assert demo.num_hidden_layers == 4
    # the name given after the field replaces the whole model section
    assert load_config(None, ["--model.num_hidden_layers=2", "--model", "demo"]).model == demo


def test_model_name_in_yaml_with_fields(tmp_path):
    demo = load_config("demo").model
    by_name = load_config(write_yaml(tmp_path / "a.yaml", {"model": "demo"}), ["--model.vocab_size=512"])
    in_section = load_config(write_yaml(tmp_path / "b.yaml", {"model": {"name": "demo", "vocab_size": 512}}))
    assert by_name.model == in_section.model == dataclasses.replace(demo, vocab_size=512)


def test_model_from_transformers_config_folder_and_file(tmp_path):
    import transformers

    hf = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=96,
                                  rms_norm_eps=1e-5, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "hf")
    for spec in (tmp_path / "hf", tmp_path / "hf" / "config.json"):
        m = load_config(None, ["--model", str(spec), "--model.num_hidden_layers=1"]).model
        assert (m.vocab_size, m.hidden_size, m.intermediate_size, m.num_hidden_layers) == (320, 64, 160, 1)
        assert (m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (8, 2, 8)
        assert (m.max_position_embeddings, m.rms_norm_eps, m.tie_word_embeddings) == (96, 1e-5, True)
        assert m.rope_theta == 10000.0 and m.rope_scaling is None


def test_model_from_to_hf_json(tmp_path):
    ours = LlamaConfig(vocab_size=500, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=128,
                       rope_theta=50000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    (tmp_path / "tiny.json").write_text(json.dumps(ours.to_hf()))
    assert load_config(None, ["--model", str(tmp_path / "tiny.json")]).model == ours
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text(json.dumps(ours.to_hf()))
    assert load_config(write_yaml(tmp_path / "r.yaml", {"model": str(tmp_path / "folder")})).model == ours


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_config_loads_and_validates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative `out` is checked for writability under the working folder
    cfg = load_config(path)
    validate(cfg)
    assert load_config(path.stem) == cfg  # a name from configs/ is the same file
    raw = yaml.safe_load(path.read_text())
    if isinstance(raw.get("model"), dict):  # the model section is usable by name as well
        assert load_config(None, ["--model", path.stem]).model == cfg.model


def test_demo_is_shipped():
    assert CONFIGS_DIR / "demo.yaml" in SHIPPED


def test_tiny_config_is_valid(tiny_yaml):
    # the base of the error cases below passes, so each error comes from the one change it makes
    validate(load_config(tiny_yaml), world_size=1)
    validate(load_config(tiny_yaml, ["--dp", "2"]), world_size=2)
    validate(load_config(tiny_yaml, ["--pp", "2", "--pp-schedule", "interleaved", "--grad-acc", "4"]), world_size=2)
    validate(load_config(tiny_yaml, ["--pp", "2", "--grad-acc", "1", "--parallel.pp_split=[1, 1]"]), world_size=2)


# --- errors: one line naming the field ------------------------------------------------------------


BAD_VALUES = [
    (["--trian.lr=1"], ["trian", "unknown section"]),
    (["--train.lrr=1"], ["train.lrr", "unknown key"]),
    (["--model.hiden_size=8"], ["model.hiden_size", "unknown key"]),
    (["--train.steps=abc"], ["train.steps", "'abc'", "integer"]),
    (["--train.steps=1.5"], ["train.steps", "1.5", "integer"]),
    (["--train.lr=fast"], ["train.lr", "'fast'", "number"]),
    (["--logging.progress=1"], ["logging.progress", "true or false"]),
    (["--model", "no-such-model"], ["model=no-such-model", "unknown model", "demo"]),
    (["--model.num_attention_heads=4", "--model.num_key_value_heads=3"],
     ["num_key_value_heads=3", "num_attention_heads=4"]),
    (["--model.num_attention_heads=0"], ["model.num_attention_heads=0"]),
    (["--train.loss_chunk_tokens=-1"], ["train.loss_chunk_tokens=-1 must be >= 0", "all tokens at once"]),
    (["--model.num_key_value_heads=-2"], ["model.num_key_value_heads=-2"]),
    (["--tp", "3"], ["tp=3", "num_attention_heads=4"]),
    (["--tp", "4"], ["tp=4", "num_key_value_heads=2"]),
    (["--cp", "2", "--seq-len", "30"], ["data.seq_len=30", "2*cp=4", "cp_layout=zigzag"]),
    (["--cp", "2", "--cp-layout", "contiguous", "--seq-len", "31"], ["data.seq_len=31", "cp=2"]),
    (["--cp-layout", "diagonal"], ["parallel.cp_layout='diagonal'", "zigzag", "contiguous"]),
    (["--cp", "2", "--cp-layout", "contiguous", "--tp", "2", "--sp", "--seq-len", "30"],
     ["parallel.sp", "seq_len=30", "cp=2", "tp=2"]),
    (["--pp", "3"], ["parallel.pp=3", "model.num_hidden_layers=2", "pp <= 2"]),
    (["--pp-schedule", "gpipe"], ["parallel.pp_schedule='gpipe'", "afab, 1f1b, interleaved, zbh1, zbv or dualpipev"]),
    (["--pp-virtual", "2"], ["parallel.pp_virtual=2", "pp_schedule=interleaved"]),
    (["--pp-virtual", "0", "--pp-schedule", "interleaved"], ["parallel.pp_virtual=0"]),
    (["--pp-schedule", "interleaved"], ["pp_schedule=interleaved", "pp >= 2", "pp=1"]),
    (["--pp", "2", "--pp-schedule", "interleaved", "--grad-acc", "3"],
     ["train.grad_acc=3", "multiple of pp=2", "grad_acc=4"]),
    (["--pp", "2", "--pp-schedule", "interleaved", "--grad-acc", "2", "--pp-virtual", "2"],
     ["pp_virtual=2", "4 virtual stages", "num_hidden_layers=2", "pp_virtual <= 1"]),
    (["--pp", "2", "--parallel.pp_split=[2]"], ["parallel.pp_split=[2]", "1 entries", "pp*pp_virtual = 2"]),
    (["--pp", "2", "--parallel.pp_split=[2, 1]"], ["parallel.pp_split=[2, 1]", "sums to 3", "num_hidden_layers=2"]),
    (["--pp", "2", "--parallel.pp_split=[0, 2]"], ["parallel.pp_split=[0, 2]", "at least 1 layer"]),
    (["--parallel.pp_split=[1, x]"], ["parallel.pp_split[1]", "'x'", "integer"]),
    (["--parallel.pp_split=3"], ["parallel.pp_split=3", "list"]),
    (["--tp", "2", "--sp", "--seq-len", "31"], ["parallel.sp", "seq_len=31", "tp=2"]),
    (["--model.intermediate_size=66", "--tp", "4", "--model.num_key_value_heads=4"],
     ["tp=4", "intermediate_size=66"]),
    (["--data", "/no/such/corpus.txt"], ["data.path=/no/such/corpus.txt", "does not exist"]),
    (["--dp-impl", "ring"], ["parallel.dp_impl='ring'", "naive", "bucket"]),
    (["--zero", "5"], ["parallel.zero=5", "use 0"]),
    (["--zero", "1", "--dp-impl", "naive"], ["parallel.zero=1", "needs parallel.dp_impl=bucket"]),
    (["--train.dtype=bfloat16", "--dp-impl", "naive"], ["train.dtype=bfloat16", "needs parallel.dp_impl=bucket"]),
    (["--parallel.reduce_dtype=bfloat16", "--dp-impl", "naive"],
     ["parallel.reduce_dtype=bfloat16", "needs parallel.dp_impl=bucket"]),
    (["--recompute", "most"], ["train.recompute='most'", "none, selective or full"]),
    (["--train.dtype=float16"], ["train.dtype='float16'", "float32 or bfloat16"]),
    (["--tokenizer", "bpe:1024"], ["data.tokenizer=bpe:1024", "model.vocab_size=256"]),
    (["--tokenizer", "bpe:100"], ["data.tokenizer=bpe:100", "257"]),
    (["--seq-len", "65"], ["data.seq_len=65", "max_position_embeddings=64"]),
    (["--steps", "0"], ["train.steps=0"]),
    (["--foo", "1"], ["--foo", "--dp"]),
    (["--steps"], ["--steps needs a value"]),
    (["stray"], ["'stray'"]),
]


@pytest.mark.parametrize("overrides, needles", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_value_is_one_line_naming_the_field(tiny_yaml, overrides, needles):
    message = config_error(tiny_yaml, overrides)
    for needle in needles:
        assert needle in message, (needle, message)


def test_world_size_must_be_the_product(tiny_yaml):
    message = config_error(tiny_yaml, ["--dp", "2"], world_size=3)
    assert "world size 3" in message and "2*1*1*1 = 2" in message


def test_unwritable_out(tiny_yaml, tmp_path):
    (tmp_path / "a_file").write_text("x")
    message = config_error(tiny_yaml, ["--out", str(tmp_path / "a_file" / "run")])
    assert f"out={tmp_path / 'a_file' / 'run'}" in message
    validate(load_config(tiny_yaml, ["--out", str(tmp_path / "new" / "deeper")]))  # a missing folder is fine


def test_bad_yaml(tmp_path):
    (tmp_path / "bad.yaml").write_text("train:\n  steps: [1, 2\n")
    message = config_error(tmp_path / "bad.yaml")
    assert "bad.yaml" in message and "not valid YAML" in message
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert "mapping" in config_error(tmp_path / "list.yaml")


def test_missing_config_file(tmp_path):
    message = config_error(tmp_path / "nope.yaml")
    assert "nope.yaml" in message and "no such file" in message


def test_bad_hf_config(tmp_path):
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    message = config_error(None, ["--model", str(tmp_path / "gpt2.json")])
    assert "gpt2.json" in message and "model_type='gpt2'" in message
    (tmp_path / "empty").mkdir()
    assert "no config.json" in config_error(None, ["--model", str(tmp_path / "empty")])


# --- help, the resolved config, the version ---------------------------------------------------------


@pytest.mark.parametrize("args", [["train", "--help"], ["train", "configs/demo.yaml", "--dp", "2", "-h"]])
def test_train_help_lists_every_field_and_flag(capsys, args):
    from tetron.cli import main
    from tetron.config import SECTIONS
    from tetron.overrides import field_docs

    assert main(args) == 0
    text = capsys.readouterr().out
    for section, cls in SECTIONS.items():
        for name, kind, default, doc in field_docs(cls):
            # no default model: a model field's default is the named model's, not LlamaConfig's Llama-7B numbers
            shown = "from the model" if section == "model" else default
            assert f"--{section}.{name} {kind} [{shown}]" in text, (section, name)
            assert doc, f"{section}.{name} has no doc line"  # every field says what it is
    assert "[11008]" not in text and "[4096]" not in text  # Llama-7B's intermediate_size and hidden_size
    for flag in SHORT_FLAGS:
        assert f"(--{flag})" in text, flag


def test_print_config_is_the_resolved_config(capsys, tiny_yaml):
    from tetron.cli import main

    assert main(["train", str(tiny_yaml), "--print-config", "--dp", "2", "--zero", "1"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert from_dict(printed) == load_config(tiny_yaml, ["--dp", "2", "--zero", "1"])
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("tetron 0.")


@pytest.mark.parametrize("tokenizer, rows", [("bytes", 256), ("bpe:1024", 1024)])
def test_model_vocabulary_fits_a_bytes_or_bpe_tokenizer(capsys, tokenizer, rows):
    """`--model demo --tokenizer bytes` trains 256 embedding rows, not the demo's 4096 that no token would
    reach; a note says so. Weights to start from keep their own."""
    from tetron.cli import _fit_tokenizer, main

    args = ["--model", "demo", "--tokenizer", tokenizer]
    assert main(["train", *args, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["vocab_size"] == rows
    cfg, notes = _fit_tokenizer(load_config(None, args), args)
    assert cfg.model.vocab_size == rows
    assert notes == [f"model.vocab_size=4096 -> {rows}: data.tokenizer={tokenizer} has {rows} token ids"]
    kept, notes = _fit_tokenizer(load_config(None, [*args, "--init-from", "some/model"]), args)
    assert kept.model.vocab_size == 4096 and notes == []


@pytest.mark.parametrize("text, lines", [
    ("train:\n  steps: 5000\n  lr: 0.001\n  steps: 2\n", "lines 2 and 4"),  # the last would win silently
    ("train: {steps: 5000, steps: 2}\n", "lines 1 and 1"),
    ("train:\n  steps: 2\ntrain:\n  lr: 0.1\n", "lines 1 and 3"),
])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, text, lines):
    (tmp_path / "twice.yaml").write_text(text)
    with pytest.raises(ConfigError, match=rf"twice\.yaml: key (steps|train) is given twice in one mapping \({lines}\)"):
        load_config(str(tmp_path / "twice.yaml"))


def test_a_merge_key_may_be_overridden(tmp_path):
    """`<<: *base` then a key of base: YAML's way to override, not a key given twice."""
    (tmp_path / "merge.yaml").write_text("base: &b {steps: 3, lr: 0.1}\ntrain:\n  <<: *b\n  steps: 2\n")
    from tetron.config import read_yaml

    assert read_yaml((tmp_path / "merge.yaml").read_text())["train"] == {"steps": 2, "lr": 0.1}


def test_a_key_given_twice_in_a_command_line_value_is_refused():
    with pytest.raises(ConfigError, match=r"^data.sources: key path is given twice in one mapping \(lines 1 and 1\)"):
        load_config(None, ["--model", "demo", "--data.sources=[{path: a.txt, path: b.txt}]"])


def test_file_checks_reuse_each_outcome(corpus, cache_dir, tmp_path):
    """Through one FileChecks (tetron plan's search) the run folder is looked at once: its refusal comes back
    word for word, even after the problem went; without it, it is looked at again."""
    from tetron.errors import ConfigError
    from tetron.validate.paths import FileChecks

    out = tmp_path / "run"
    out.write_text("not a folder")
    cfg = from_dict(tiny_config(corpus, cache_dir, out))
    seen = FileChecks()
    with pytest.raises(ConfigError, match="exists and is not a folder") as first:
        validate(cfg, seen=seen)
    out.unlink()  # fixed meanwhile: the search keeps the outcome it found
    with pytest.raises(ConfigError) as again:
        validate(cfg, seen=seen)
    assert str(again.value) == str(first.value)
    validate(cfg)  # without it: looked at again, and now it passes
