"""The dry run (tetron/plan/dry_run.py): one real step of a rank on fake tensors, held to the same step on real ones.

The reference for memory and collectives is the same step (train.dispatch_step, built by train.assemble_run) on
real tensors, under the same fake process group (its collectives move nothing: every rank computes on its own
shapes) and watched by the same MemTracker: fake tensors make the same storages of the same sizes, so the peaks
must be equal to the byte (tolerance 0). FLOPs: the single-rank layout against FlopCounterMode over a plain
forward and backward of the same model in one process, exactly.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from tetron.config import from_dict
from tetron.parallel.init import seeded_model
from tetron.plan.commands import plan_command
from tetron.plan.dry_run import distinct_ranks, simulate_rank

MODEL = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
MTP = {"model_type": "deepseek_v3", "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
       "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 1, "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1,
       "num_nextn_predict_layers": 1}


def config(parallel: dict, model: dict | None = None, **train):
    return from_dict({"model": {**MODEL, **(model or {})},
                      "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": 32},
                      "train": {"steps": 2, "micro_batch": 2, "grad_acc": 2, "seed": 1, **train},
                      "parallel": parallel, "out": "unused"})


LAYOUTS = {
    "single": config({"dp": 1}),
    "dp2-tp2-pp2": config({"dp": 2, "tp": 2, "pp": 2, "zero": 1}),
    "dp2-pp2-zbv-zero3-bf16-selective": config({"dp": 2, "pp": 2, "zero": 3, "pp_schedule": "zbv", "pp_virtual": 2},
                                               {"num_hidden_layers": 4}, dtype="bfloat16", recompute="selective",
                                               grad_acc=4),
    "moe-single": config({"dp": 1}, MOE),
    # multi-token prediction: its depth's valid rows picked by a mask of known values, on the last stage
    "mtp-pp2": config({"pp": 2}, MTP),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fake_step_equals_real_step(name, monkeypatch):
    cfg = LAYOUTS[name]
    # ZeRO-3's pool swaps storages on the CPU, unseen by MemTracker; under fake tensors it resizes them, as a GPU
    # run does: the real reference takes the same path
    monkeypatch.setattr("tetron.parallel.storage_pool.storage_swap_available", lambda device: False)
    for rank in distinct_ranks(cfg):
        fake, real = simulate_rank(cfg, rank), simulate_rank(cfg, rank, fake=False)
        assert fake.peak_bytes == real.peak_bytes > 0
        assert fake.build_bytes == real.build_bytes > 0
        assert fake.flops == real.flops > 0
        assert fake.collective_bytes == real.collective_bytes


def test_the_build_is_weighed_apart_from_the_step():
    """A ZeRO-3 rank builds its chunk hollow and gives each unit its storage and values as it shards it
    (parallelize.py, init.Hollow): the build's peak holds the rank's slices and one unit whole, below the step's.
    Built whole in fp32 before sharding, as it was, the build held every parameter (here 4.07 MB, 4.2x what it
    holds now, 1.4x the step; issue 33's llama-7b dry run: 27.05 GiB against a step of 19.52)."""
    cfg = config({"dp": 16, "zero": 3}, {"num_hidden_layers": 16, "hidden_size": 64, "intermediate_size": 256},
                 recompute="full", grad_acc=1)
    f = simulate_rank(cfg, 0)
    assert f.build_bytes < f.peak_bytes < 4 * cfg.model.num_params()
    assert f.build_bytes < cfg.model.num_params()  # a quarter of the whole chunk in fp32


@pytest.mark.parametrize("model", [{}, MOE])
def test_single_rank_flops_equal_a_plain_step(model):
    cfg = config({"dp": 1}, model)
    plain = seeded_model(cfg.model, seed=1, device=torch.device("cpu"))
    plain.loss_chunk_tokens = cfg.train.loss_chunk_tokens
    tokens = torch.randint(0, 256, (cfg.train.micro_batch, cfg.data.seq_len))
    positions = torch.arange(cfg.data.seq_len)
    with FlopCounterMode(display=False) as counter:
        for _ in range(cfg.train.grad_acc):
            plain(tokens, positions, None, targets=tokens).backward()
    # FlopCounterMode counts no CPU flash attention: 4*B*H*T*T*D forward (scores, then values) and 10 backward
    # (the scores again and four gradients), as torch counts the CUDA kernel's
    h = MODEL["num_attention_heads"]
    b, t, d = cfg.train.micro_batch, cfg.data.seq_len, MODEL["hidden_size"] // h
    reference = counter.get_total_flops() + cfg.model.num_hidden_layers * cfg.train.grad_acc * 14 * b * h * t * t * d
    if model:  # FlopCounterMode counts no grouped matmul (the experts'): gate_up [M, H] x [H, 2I] and down
        # [M, I] x [I, H] are 6*M*H*I FLOPs forward, twice that backward, for M = tokens * top_k
        m = cfg.train.micro_batch * cfg.data.seq_len * MOE["num_experts_per_tok"]
        reference += cfg.model.num_hidden_layers * cfg.train.grad_acc * 18 * m * 32 * MOE["moe_intermediate_size"]
    assert simulate_rank(cfg, 0).flops == reference


def test_expert_parallel_exchange_is_balanced():
    """ep2: each MoE layer and micro-batch exchanges the counts per expert, then N*top_k rows of [H] four times
    (dispatch and combine, forward and backward), as the planner's all_to_all_bytes assumes."""
    cfg = config({"dp": 2, "ep": 2, "zero": 1}, MOE)
    n = cfg.train.micro_batch * cfg.data.seq_len * MOE["num_experts_per_tok"]
    per_layer = MOE["num_experts"] * 8 + 4 * n * MODEL["hidden_size"] * 4
    figures = simulate_rank(cfg, 0)
    assert figures.collective_bytes["all_to_all"] == MODEL["num_hidden_layers"] * cfg.train.grad_acc * per_layer


def write_yaml(tmp_path, **parallel):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": 32},
                                    "train": {"steps": 2, "micro_batch": 2, "grad_acc": 2},
                                    "parallel": parallel, "out": str(tmp_path / "out")}))
    return str(path)


def test_plan_dry_run_prints_the_table(tmp_path, capsys):
    assert plan_command([write_yaml(tmp_path, dp=2, tp=2, pp=2), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "8 ranks (dp2 tp2 pp2" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["0", "0"], ["4", "1"])]
    assert len(rows) == 2  # one row per pipeline rank


def test_train_dry_run_prints_the_table(tmp_path, capsys):
    from tetron.cli import train_command

    assert train_command([write_yaml(tmp_path, dp=2), "--dry-run"]) == 0
    assert "2 ranks (dp2 tp1 pp1" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # no run folder, no data prepared


def test_bad_layout_refused_in_one_line(tmp_path, capsys):
    assert plan_command([write_yaml(tmp_path, dp=2), "--dry-run", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tp=3" in err
    assert plan_command([write_yaml(tmp_path, dp=2), "--dry-run", "--nodes", "1", "--gpus-per-node", "4"]) == 2
    assert "--gpus-per-node 4" in capsys.readouterr().err


def test_storage_pool_resizes_under_fake_tensors():
    """ZeRO-3's pool swaps storages on the CPU, which MemTracker cannot see (a released unit would count as held);
    the dry run plays a GPU run, whose pool resizes them."""
    from tetron.torch_private import storage_swap_available
    from tetron.torch_private.fake import fake_tensor_mode

    cpu = torch.device("cpu")
    with fake_tensor_mode():
        assert not storage_swap_available(cpu)
    assert storage_swap_available(cpu) == hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def test_the_dry_run_steps_the_mtp_module():
    """The last stage's step with multi-token prediction does the module's work (its layer, its head): more FLOPs
    and more memory than the same model without it; the first stage's is the same."""
    with_mtp = LAYOUTS["mtp-pp2"]
    without = config({"pp": 2}, {**MTP, "num_nextn_predict_layers": 0})
    first, last = distinct_ranks(with_mtp)
    assert simulate_rank(with_mtp, last).flops > simulate_rank(without, last).flops
    assert simulate_rank(with_mtp, last).peak_bytes > simulate_rank(without, last).peak_bytes
    assert simulate_rank(with_mtp, first).flops == simulate_rank(without, first).flops
