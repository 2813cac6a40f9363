"""Checkpoints: the streaming writer, exact resume, resharding between layouts, Hugging Face in and out.

Multi-rank runs use the fork harness; each compares with an uninterrupted run (bit-identical with the
same layout, within 1e-5 relative across layouts) or with transformers' model (logits within 1e-5)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tetron.checkpoint.check import inspect_checkpoint
from tetron.checkpoint.convert import convert
from tetron.checkpoint.load import TensorReader, load_model, read_header
from tetron.checkpoint.safetensors_stream import SafetensorsWriter
from tetron.checkpoint.save import optimizer_specs
from tetron.checkpoint.shards import assign_writers, nbytes
from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.fs import find_latest

from conftest import first_batch_loss, run_training, tiny_config, train_through_cli

LOSS_RTOL = 1e-5  # per-step loss after a reshard, relative (as tests/test_layouts.py)
LOGITS_ATOL = 1e-5  # transformers' logits against tetron's, fp32
LR = 1e-3  # see tests/test_layouts.py: keeps layouts within tolerance of each other


run = run_training  # train on forked ranks, rank 0's losses


def weights(folder: Path) -> dict[str, torch.Tensor]:
    with TensorReader(folder, "model") as reader:
        return {k: reader.read(k) for k in reader.names()}


# ----------------------------------------------------------------------------- the streaming writer


def test_safetensors_writer_streams_a_readable_file(tmp_path):
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64),
               "c": torch.randn(2, 2).to(torch.bfloat16), "empty": torch.zeros(0, 3)}
    path = tmp_path / "x.safetensors"
    writer = SafetensorsWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
                               metadata={"format": "pt"})
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k
    # out of order or the wrong shape is refused; closing early names the missing tensor
    writer = SafetensorsWriter(tmp_path / "y.safetensors", [("a", torch.float32, (3, 4)), ("b", torch.float32, (1,))])
    with pytest.raises(ValueError, match="expected a"):
        writer.write("b", torch.zeros(1))
    writer.write("a", torch.zeros(3, 4))
    with pytest.raises(ValueError, match="closed before b"):
        writer.close()


def test_the_writer_sums_each_tensor_as_it_writes_and_hands_the_disk_its_bytes_as_they_come(tmp_path, monkeypatch):
    """The crc32 `write` returns is zlib's over the tensor's bytes though it is summed block by block; and every
    WRITEBACK_BYTES written, the disk is asked to start on them (fs.start_writeback), each byte once and in
    order, so that the fsync at close waits for the last of them only."""
    import zlib

    import tetron.checkpoint.safetensors_stream as stream

    monkeypatch.setattr(stream, "WRITE_BLOCK", 1000)  # a tensor of many blocks, one not whole
    monkeypatch.setattr(stream, "WRITEBACK_BYTES", 20_000)
    handed: list[tuple[int, int]] = []
    monkeypatch.setattr(stream, "start_writeback", lambda fd, offset, length: handed.append((offset, length)))
    tensors = {f"t{i}": torch.randn(1234 + i) for i in range(12)}
    path = tmp_path / "x.safetensors"
    writer = SafetensorsWriter(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
    for k, v in tensors.items():
        assert writer.write(k, v) == zlib.crc32(v.numpy().tobytes()), k
    writer.close()
    assert len(handed) >= 2 and handed[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(handed, handed[1:]))  # contiguous, each byte once
    assert all(n >= 20_000 for _, n in handed) and handed[-1][0] + handed[-1][1] <= path.stat().st_size
    with safe_open(str(path), "pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


# ----------------------------------------------------------------------------- format, atomic, exact resume


def written_by_rank(folder: Path) -> dict[int, int]:
    """The tensor bytes each rank wrote into a checkpoint, from the writers trainer_state.json names."""
    written: dict[int, int] = {}
    for name, meta in json.loads((folder / "trainer_state.json").read_text())["files"].items():
        if "writer" in meta:
            sizes = [math.prod(shape) * 4 for _, shape in read_header(folder / name).values()]
            written[meta["writer"]] = written.get(meta["writer"], 0) + sum(sizes)
    return written


def test_exact_resume_on_2_ranks(corpus, cache_dir, tmp_path):
    """Saved in the background (async_save), resumed from a save in the foreground: bit-identical."""
    train_cfg = {"steps": 10, "micro_batch": 1, "grad_acc": 2}
    full = tiny_config(corpus, cache_dir, tmp_path / "full", parallel={"dp": 2}, train=train_cfg,
                       checkpoint={"save_every": 5, "keep": 2, "async_save": True})
    losses = run(full)
    ckpts = tmp_path / "full" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_10", "step_5"]
    assert (ckpts / "latest").read_text().strip() == "step_10"
    step5 = ckpts / "step_5"
    state = inspect_checkpoint(step5)
    assert state["step"] == 5 and state["loader"]["step"] == 5 and state["optimizer"]["present"]
    assert {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors", "rng.safetensors",
            "optimizer.safetensors.index.json", "trainer_state.json"} <= {p.name for p in step5.iterdir()}
    with safe_open(str(step5 / "rng.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["rank_0", "rank_1"]
    # every rank writes its share: none more than half the tensors' bytes plus the largest tensor
    written = written_by_rank(step5)
    largest = max(math.prod(shape) * 4 for *_, shape in optimizer_specs(from_dict(full).model))
    assert sorted(written) == [0, 1] and max(written.values()) <= sum(written.values()) / 2 + largest, written

    # continue from step 5 (the learning-rate schedule is that of the 10-step run) in another folder
    resumed = tiny_config(corpus, cache_dir, tmp_path / "b", parallel={"dp": 2}, train=train_cfg,
                          checkpoint={"resume": str(step5)})
    assert run(resumed) == losses[5:]  # bit-identical
    ref, got = weights(ckpts / "step_10"), weights(tmp_path / "b" / "checkpoints" / "step_10")
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    with TensorReader(ckpts / "step_10", "optimizer") as a, \
            TensorReader(tmp_path / "b/checkpoints/step_10", "optimizer") as b:
        for k in a.names():
            assert torch.equal(a.read(k), b.read(k)), k
    # resume auto in the same folder, with nothing left to do, finds step_10
    assert find_latest(tmp_path / "full") == ckpts / "step_10"


RESHARD = {
    "dp2-tp2 -> pp2": ({"dp": 2, "tp": 2}, {"pp": 2, "pp_schedule": "1f1b"}, {}),
    "dp2-tp2 -> single": ({"dp": 2, "tp": 2}, {}, {"tie_word_embeddings": True}),
    "pp2-interleaved -> tp2-sp": ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2},
                                  {"tp": 2, "sp": True}, {"tie_word_embeddings": True}),
    "tp2 vocab 257 -> pp2 tp2": ({"tp": 2}, {"pp": 2, "tp": 2}, {"vocab_size": 257}),
}
SAVED_IN_THE_BACKGROUND = {"dp2-tp2 -> pp2", "pp2-interleaved -> tp2-sp"}  # checkpoint.async_save


@pytest.mark.parametrize("name", sorted(RESHARD))
def test_reshard_between_layouts(corpus, cache_dir, tmp_path, name):
    saved, loaded, model = RESHARD[name]
    model = {"num_hidden_layers": 4, **model}
    global_batch = 4

    def cfg(out, parallel, steps, **extra):
        dp = parallel.get("dp", 1)
        train_cfg = {"steps": steps, "micro_batch": 1, "grad_acc": global_batch // dp, "lr": LR}
        return tiny_config(corpus, cache_dir, tmp_path / out, model=model, parallel=parallel, train=train_cfg, **extra)

    reference = run(cfg("ref", {}, 8))
    run(cfg("a", saved, 8, checkpoint={"save_every": 4, "async_save": name in SAVED_IN_THE_BACKGROUND}))
    after = run(cfg("b", loaded, 8, checkpoint={"resume": str(tmp_path / "a" / "checkpoints" / "step_4")}))
    torch.testing.assert_close(torch.tensor(after), torch.tensor(reference[4:]), rtol=LOSS_RTOL, atol=0)


# ----------------------------------------------------------------------------- Hugging Face in and out


def _hf_folder(path: Path, *, tied: bool, vocab: int = 256, family: str = "Llama") -> Path:
    """A tiny model of `family` (transformers' class names: Llama, Qwen2, Qwen3) as its save_pretrained writes it
    (transformers 5 lists Qwen's per-layer `layer_types` in config.json)."""
    import transformers

    torch.manual_seed(3)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(path)
    return path


def test_checkpoint_loads_in_transformers(corpus, cache_dir, tmp_path):
    import transformers

    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel={"tp": 2}, train={"steps": 3},
                      model={"tie_word_embeddings": True, "vocab_size": 257})
    run(raw)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    for folder in (tmp_path / "run" / "checkpoints" / "step_3", tmp_path / "run" / "model"):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            torch.testing.assert_close(theirs(ids).logits, load_model(folder)(ids), rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("family, tied", [("Llama", False), ("Llama", True), ("Qwen2", False), ("Qwen3", False)])
def test_init_from_hf_folder(corpus, cache_dir, tmp_path, family, tied):
    """Step 1's loss from a transformers-saved folder is transformers' own loss on the same batch."""
    import transformers

    hf = _hf_folder(tmp_path / "hf", tied=tied, family=family)
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 1, "micro_batch": 1, "grad_acc": 2},
                      parallel={"pp": 2}, checkpoint={"init_from": str(hf)})
    del raw["model"]  # the model comes from the folder
    assert from_dict(raw).model.tie_word_embeddings is tied
    (loss,) = train_through_cli(raw, tmp_path, run)
    expected = first_batch_loss(raw, transformers.AutoModelForCausalLM.from_pretrained(hf).eval())
    assert abs(loss - float(expected)) <= 1e-5 * abs(float(expected))


def test_convert_round_trip(corpus, cache_dir, tmp_path):
    hf = _hf_folder(tmp_path / "hf", tied=False)
    convert(hf, tmp_path / "ck")
    state = inspect_checkpoint(tmp_path / "ck")
    assert state["step"] == 0 and not state["optimizer"]["present"]
    convert(tmp_path / "ck", tmp_path / "back")
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        original = {k: f.get_tensor(k) for k in f.keys()}
    back = weights(tmp_path / "back")
    assert original.keys() == back.keys()
    for k, v in original.items():
        assert torch.equal(v, back[k]), k
    # the converted checkpoint resumes (optimizer fresh): a run from it trains from the HF weights
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", train={"steps": 2},
                      checkpoint={"resume": str(tmp_path / "ck")})
    assert len(run(raw)) == 2
    with pytest.raises(ValueError, match="already exists"):
        convert(hf, tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "trainer_state.json").read_text())["step"] == 0


def test_checkpoints_are_ordered_by_write_time_and_stale_saves_recovered(tmp_path):
    """A run resumed from an earlier step writes lower step numbers after higher ones: `keep` and
    `find_latest`'s fallback must go by write order. A save killed after moving the old step_N aside
    must give that copy back, not delete it."""
    import os

    from tetron.checkpoint.save import clean_stale
    from tetron.fs import STATE_FILE, checkpoints_dir, complete_checkpoints, find_latest

    root = checkpoints_dir(tmp_path)
    for i, step in enumerate((8, 10, 6)):  # written in this order
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / STATE_FILE).write_text("{}")
        os.utime(root / f"step_{step}" / STATE_FILE, ns=(10**18 + i, 10**18 + i))
    (root / "step_4").mkdir()  # incomplete: no state file
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_8", "step_10", "step_6"]
    assert find_latest(tmp_path).name == "step_6"  # no `latest` file: the last written
    moved = root / "step_12.tmp-old-abcd"
    moved.mkdir()
    (moved / STATE_FILE).write_text("{}")
    (root / "step_14.tmp-0123").mkdir()
    clean_stale(tmp_path)
    assert (root / "step_12" / STATE_FILE).is_file() and not moved.exists()
    assert not (root / "step_14.tmp-0123").exists()


# ----------------------------------------------------------------------------- extending a run


def test_a_run_extended_past_its_horizon_is_the_longer_run(corpus, cache_dir, tmp_path):
    """6 steps planned with decay_steps=12, then resumed to 12: the learning rates and losses of the
    12-step run, bit for bit. Resuming the same 6 steps without a horizon (decay_steps = steps = 12
    now, 6 then) would change the rates of the steps already taken: the command line says so."""
    from tetron.cli import _schedule_note

    def cfg(out, steps, **train):
        return tiny_config(corpus, cache_dir, tmp_path / out, train={"steps": steps, "warmup_steps": 2, **train},
                           **({"checkpoint": {"resume": str(tmp_path / "a" / "checkpoints" / "step_6")}}
                              if out == "b" else {}))

    whole = run(cfg("whole", 12, decay_steps=12))
    run(cfg("a", 6, decay_steps=12))
    assert run(cfg("b", 12, decay_steps=12)) == whole[6:]
    lrs = {out: [json.loads(line)["lr"] for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
           for out in ("whole", "b")}
    assert lrs["b"] == lrs["whole"][6:]  # steps 7-12, in their own run folder
    step6 = str(tmp_path / "a" / "checkpoints" / "step_6")
    same = from_dict(tiny_config(corpus, cache_dir, tmp_path / "c", train={"steps": 12, "warmup_steps": 2,
                                 "decay_steps": 12}, checkpoint={"resume": step6}))
    assert _schedule_note(same) is None
    changed = from_dict(tiny_config(corpus, cache_dir, tmp_path / "d", train={"steps": 24, "warmup_steps": 2},
                                    checkpoint={"resume": step6}))
    note = _schedule_note(changed)
    assert note is not None and "step 4" in note and "decay_steps=12" in note, note  # step 3 is the peak in both


def test_weights_come_with_their_tokenizer(corpus, cache_dir, tmp_path):
    """--init-from a folder that ships a tokenizer trains with that tokenizer unless told otherwise; an
    explicit different one is refused in one line (its ids would not mean what the weights learned),
    unless checkpoint.new_tokenizer says so."""
    from tetron.cli import _check_data
    from tetron.errors import ConfigError

    model = {"vocab_size": 300}
    run(tiny_config(corpus, cache_dir, tmp_path / "a", model=model, data={"tokenizer": "bpe:300"},
                    train={"steps": 2}))
    src = tmp_path / "a" / "model"

    def cfg(**data):
        raw = tiny_config(corpus, cache_dir, tmp_path / "b", model=model, data=data,
                          checkpoint={"init_from": str(src)})
        raw["data"] = {k: v for k, v in raw["data"].items() if k != "tokenizer" or v is not None}
        return from_dict(raw)

    theirs = prepare_data(from_dict(tiny_config(corpus, cache_dir, tmp_path / "a", model=model,
                                                data={"tokenizer": "bpe:300"})))[0]
    assert prepare_data(cfg(tokenizer=None))[0].fingerprint() == theirs.fingerprint()
    _check_data(cfg(tokenizer=None))
    _check_data(cfg(tokenizer="bpe:300"))  # the same tokenizer, named: fine
    with pytest.raises(ConfigError, match=r"data.tokenizer=bytes is not the tokenizer of .*new_tokenizer=true"):
        _check_data(cfg(tokenizer="bytes"))
    with_override = cfg(tokenizer="bytes")
    with_override.checkpoint.new_tokenizer = True
    _check_data(with_override)
    # a tokenizer the config file names gives way to the weights' own, with a note; on the command line it stands
    from tetron.cli import _fit_tokenizer

    args = ["--tokenizer", "bytes"]
    yielded, notes = _fit_tokenizer(cfg(tokenizer="bytes"), [])
    assert yielded.data.tokenizer is None and notes == [
        f"data.tokenizer=bytes (from the config) gives way to {src}, the tokenizer its weights were trained with"]
    _check_data(yielded)
    explicit, notes = _fit_tokenizer(cfg(tokenizer="bytes"), args)
    assert explicit.data.tokenizer == "bytes" and notes == []
    with pytest.raises(ConfigError, match=r"data.tokenizer=bytes is not the tokenizer of "):
        _check_data(explicit)
    # a resumed run's config is the one it trained with: nothing gives way (a differing tokenizer is refused)
    resumed = from_dict(tiny_config(corpus, cache_dir, tmp_path / "a", model=model, data={"tokenizer": "bpe:300"},
                                    checkpoint={"resume": "auto"}))
    assert _fit_tokenizer(resumed, []) == (resumed, [])


def test_writers_are_where_the_pieces_are():
    """Under ZeRO each tensor is written by the rank holding most of it (nothing to receive for a tensor a rank
    holds whole, the smaller part for one a slice boundary cuts), however unbalanced; without ZeRO (held=None)
    by bytes alone, largest first to the least loaded rank of the tensor's stage."""
    specs = [(f"t{i}", f"t{i}", torch.float32, (n,)) for i, n in enumerate([100, 60, 50, 40, 10])]
    holder = {0: {0: 400, 1: 0}, 1: {0: 0, 1: 240}, 2: {0: 120, 1: 80}, 3: {0: 160, 1: 0}, 4: {0: 0, 1: 40}}
    assert assign_writers(specs, [0] * 5, [[0, 1]], lambda i, r: holder[i][r]) == [0, 1, 0, 0, 1]
    owners = assign_writers(specs, [0] * 5, [[0, 1]])
    assert owners == [0, 1, 1, 0, 1]  # 100 -> 0; 60 -> 1; 50 -> 1 (110 after); 40 -> 0 (140); 10 -> 1
    loads = [sum(nbytes(s) for s, o in zip(specs, owners) if o == r) for r in (0, 1)]
    assert max(loads) - min(loads) <= max(nbytes(s) for s in specs)
    # two stages: each tensor stays on its stage's ranks
    assert assign_writers(specs, [0, 1, 0, 1, 0], [[0, 1], [2, 3]]) == [0, 2, 1, 3, 1]
