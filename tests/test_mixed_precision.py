"""bf16 parameters with fp32 master weights: the loss tracks fp32 in every layout, the masters stay
fp32 (in memory and in checkpoints), and OUT/model is written in bf16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tetron.checkpoint.load import load_model

from conftest import GQA, run_parallel, tiny_config

# Measured here over 12 steps at lr 3e-3 (4 layers, hidden 32): the bf16 runs' losses stay within
# 5.4e-4 of fp32's, relative, in every layout below (bf16 rounds each parameter by up to 2^-9 = 2e-3
# relative; the fp32 masters keep the updates). 1% is the "within a few percent" with room.
BF16_TRACKS_FP32 = 0.01
MODEL = {**GQA, "num_hidden_layers": 4}
LAYOUTS = {
    "single": {},
    "dp2-zero1": {"dp": 2, "zero": 1},
    "dp2-zero2-reduce-bf16": {"dp": 2, "zero": 2, "reduce_dtype": "bfloat16"},
    "tp2-sp": {"tp": 2, "sp": True},
    "pp2": {"pp": 2},  # the residual stream crosses the stages in bf16
    "cp2": {"cp": 2},
}


def _raw(corpus, cache_dir, out, parallel: dict, dtype: str) -> dict:
    train = {"steps": 12, "micro_batch": 1, "grad_acc": 4 // parallel.get("dp", 1), "lr": 3e-3, "dtype": dtype}
    return tiny_config(corpus, cache_dir, out, model=MODEL, parallel=parallel, train=train)


@pytest.fixture(scope="module")
def fp32_losses(corpus, cache_dir, tmp_path_factory) -> list[float]:
    return run_parallel(_raw(corpus, cache_dir, tmp_path_factory.mktemp("fp32"), {}, "float32"))[0][0]["losses"]


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_bf16_tracks_fp32(corpus, cache_dir, tmp_path, fp32_losses, name):
    results, written = run_parallel(_raw(corpus, cache_dir, tmp_path, LAYOUTS[name], "bfloat16"))
    for result in results:
        losses = torch.tensor(result["losses"])
        torch.testing.assert_close(losses, torch.tensor(fp32_losses), rtol=BF16_TRACKS_FP32, atol=0)
        assert not torch.equal(losses, torch.tensor(fp32_losses))  # bf16 really ran
    assert fp32_losses[-1] < fp32_losses[0] - 0.5  # and there was a curve to track


def test_masters_are_fp32_and_the_model_folder_bf16(corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    run_parallel(_raw(corpus, cache_dir, out, {"dp": 2, "zero": 1}, "bfloat16"))
    step = out / "checkpoints" / "step_12"
    # a checkpoint's shards (every rank writes some: model-*-of-*), and OUT/model's one file
    for folder, pattern, dtype in ((step, "model-*", "F32"), (step, "optimizer-*", "F32"),
                                   (out / "model", "model.safetensors", "BF16")):
        files = sorted(folder.glob(pattern))
        assert files, (folder, pattern)
        for path in files:
            with safe_open(str(path), "pt") as f:
                dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
            assert dtypes == {dtype}, path
    assert json.loads((out / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    # the bf16 folder is the checkpoint's fp32 masters rounded once
    bf16 = load_model(out / "model").state_dict()
    fp32 = load_model(step).state_dict()
    for name, value in bf16.items():
        assert value.dtype == torch.float32  # loaded for the CPU in fp32
        assert torch.equal(value, fp32[name].to(torch.bfloat16).float()), name
