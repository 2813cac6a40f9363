"""ZeRO-1/2/3, HSDP and fp32 master weights: every layout against the single process (gradient
accumulation 1, 2 and 4, sharded and full), the sharding itself, gradient syncs per step, the gradient
bytes held through accumulation, and checkpoints that any layout resumes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tetron.config import from_dict
from tetron.data.loader import prepare_data
from tetron.mesh import Mesh
from tetron.parallel.parallelize import build_optimizer, parallelize
from tetron.train import build_run, train_step

from conftest import (
    LAYOUT_LR,
    LOSS_RTOL,
    WEIGHT_ATOL,
    check_layout,
    layout_configs,
    run_parallel,
    run_training,
    tiny_config,
)
from harness import run_ranks

# Small buckets (0.01 MB = 2621 fp32) cut this model into many buckets, so parameters straddle the
# ranks' slices and the last bucket is padded: the cases a single bucket would not exercise.
SMALL = 0.01

# Gradient accumulation is 2 unless the train section says (1, 4); ZeRO-2/3 accumulate sharded unless "full".
# HSDP: dp_shard 2 of dp 4, two replicas of each slice.
LAYOUTS = {
    "dp2-zero1": ({"dp": 2, "zero": 1}, {}, {}),
    "dp2-zero2-acc4": ({"dp": 2, "zero": 2}, {}, {"grad_acc": 4}),
    "dp2-zero2-acc4-full": ({"dp": 2, "zero": 2, "zero_accumulate": "full"}, {}, {"grad_acc": 4}),
    "dp2-zero3-acc4": ({"dp": 2, "zero": 3}, {}, {"grad_acc": 4}),
    "dp4-zero1-hsdp2": ({"dp": 4, "zero": 1, "dp_shard": 2}, {}, {}),
    "dp4-zero2-hsdp2-one-bucket-acc1": ({"dp": 4, "zero": 2, "dp_shard": 2, "bucket_mb": 25.0}, {}, {"grad_acc": 1}),
    "dp4-zero3-hsdp2": ({"dp": 4, "zero": 3, "dp_shard": 2}, {}, {}),
    "dp4-zero3-tied": ({"dp": 4, "zero": 3}, {"tie_word_embeddings": True}, {}),
    "dp2-tp2-sp-zero2": ({"dp": 2, "tp": 2, "sp": True, "zero": 2}, {"vocab_size": 257}, {}),
    "dp2-tp2-sp-zero3": ({"dp": 2, "tp": 2, "sp": True, "zero": 3}, {"vocab_size": 257}, {}),
    "dp2-pp2-zero1-tied": ({"dp": 2, "pp": 2, "zero": 1}, {"tie_word_embeddings": True}, {}),
    "dp2-pp2-zero2-interleaved": ({"dp": 2, "pp": 2, "zero": 2, "pp_schedule": "interleaved", "pp_virtual": 2},
                                  {}, {}),
    "dp2-pp2-zero3-interleaved-tied": ({"dp": 2, "pp": 2, "zero": 3, "pp_schedule": "interleaved",
                                        "pp_virtual": 2}, {"tie_word_embeddings": True}, {}),
    "cp2-zero2": ({"cp": 2, "zero": 2}, {}, {}),  # ZeRO shards over dp*cp: 2 ranks even at dp=1
    "tp2-zero3-nothing-to-shard": ({"tp": 2, "zero": 3}, {}, {}),  # dp*cp = 1: plain AdamW, whole parameters
    "cp2-zero3": ({"cp": 2, "zero": 3}, {}, {}),
    "dp2-zero3-recompute-full-acc-full": ({"dp": 2, "zero": 3, "zero_accumulate": "full"}, {}, {"recompute": "full"}),
    "dp2-tp2-zero3-recompute-selective": ({"dp": 2, "tp": 2, "zero": 3}, {}, {"recompute": "selective"}),
    "dp2-tp2-pp2-zero1": ({"dp": 2, "tp": 2, "pp": 2, "sp": True, "zero": 1}, {"tie_word_embeddings": True}, {}),
    "dp2-tp2-pp2-zero3": ({"dp": 2, "tp": 2, "pp": 2, "sp": True, "zero": 3}, {"tie_word_embeddings": True}, {}),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_zero_matches_single_process(corpus, cache_dir, tmp_path, name):
    parallel, model, train = LAYOUTS[name]
    results, _ = check_layout(corpus, cache_dir, tmp_path, parallel={"bucket_mb": SMALL, **parallel}, model=model,
                              train=train)
    if parallel["zero"] >= 2 and "tp" not in parallel and "pp" not in parallel:
        # The gradient bytes held between micro-batches: ZeRO-2/3's slices, 1/dp_shard of the model's fp32
        # gradients (within 1%: each bucket's padding), or under full accumulation the whole buffers besides
        raw, _ = layout_configs(corpus, cache_dir, tmp_path, parallel=parallel, model=model)
        whole = 4 * from_dict(raw).model.num_params()
        shards = parallel.get("dp_shard", parallel.get("dp", 1) * parallel.get("cp", 1))
        full = parallel.get("zero_accumulate") == "full" and train.get("grad_acc", 2) > 1
        expected = whole / shards + (whole if full else 0)
        for r in results:
            assert expected <= r["grad_bytes_held"] <= 1.01 * expected, (r["grad_bytes_held"], whole, shards)


def _pieces_rank(raw: dict) -> dict:
    """What each rank's optimizer holds, before and after one step."""
    cfg = from_dict(raw)
    p = cfg.parallel
    mesh = Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, dp_shard=p.dp_shard)
    model = parallelize(cfg, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg, mesh)
    buckets = [(b.padded, b.slice_size, sum(q.numel() for q in b.params)) for b in optimizer.buckets]
    per_bucket = [sum(pc.master.numel() for pc in optimizer.pieces if pc.bucket is b) for b in optimizer.buckets]
    for piece in optimizer.pieces:
        piece.grad.fill_(1.0)  # any gradient: the step creates the moments
    optimizer.step()
    moments = sum(optimizer.inner.state_tensor(pc.master, kind).numel() for pc in optimizer.pieces
                  for kind in optimizer.state_names)
    return {"buckets": buckets, "per_bucket": per_bucket, "masters": sum(per_bucket), "moments": moments,
            "params": sum(q.numel() for q in model.params),
            "dtypes": {str(q.dtype) for q in model.params}, "master_dtypes": {str(m.dtype) for m in optimizer.masters}}


@pytest.mark.parametrize("dp, zero, dtype", [(4, 1, "float32"), (2, 2, "bfloat16"), (2, 0, "bfloat16"),
                                             (2, 3, "float32")])
def test_each_element_has_one_owner(corpus, cache_dir, tmp_path, dp, zero, dtype):
    """Under ZeRO every element of every bucket is updated on exactly one rank: the ranks' masters
    add up to the parameters, each rank's to at most a slice per bucket, so optimizer state is 1/N."""
    raw = tiny_config(corpus, cache_dir, tmp_path, parallel={"dp": dp, "zero": zero, "bucket_mb": SMALL},
                      train={"dtype": dtype})
    results = run_ranks(dp, _pieces_rank, raw)
    shards = dp if zero else 1
    for r in results:
        assert r["master_dtypes"] == {"torch.float32"}  # fp32 masters whatever the compute dtype
        assert r["dtypes"] == {f"torch.{dtype}"}
        assert r["moments"] == 2 * r["masters"]
        for (padded, slice_size, numel), mine in zip(r["buckets"], r["per_bucket"]):
            assert padded % shards == 0 and slice_size == padded // shards and padded - numel < shards
            assert mine <= slice_size
    if zero == 3:  # one unit per decoder layer (2 here) and one for the rest
        assert len(results[0]["buckets"]) == 3
    else:
        assert len(results[0]["buckets"]) > 3  # several buckets, so straddling and padding happen
    for b in range(len(results[0]["buckets"])):
        assert sum(r["per_bucket"][b] for r in results) == results[0]["buckets"][b][2] * (1 if zero else dp)
    assert sum(r["masters"] for r in results) == results[0]["params"] * (1 if zero else dp)
    if zero:
        # 1/N of the optimizer state per rank, up to the padding of each bucket
        assert max(r["masters"] for r in results) - results[0]["params"] / dp <= len(results[0]["buckets"])


def _gather_memory_rank(raw: dict) -> dict:
    """ZeRO-3's gathers over 3 steps: the pool's allocations after each, and the addresses each step gathered into."""
    cfg = from_dict(raw)
    run = build_run(cfg, Mesh(dp=cfg.parallel.dp), torch.device("cpu"))
    pool = run.optimizer.sharding.pool
    fill, addresses = pool.fill, []

    def recording_fill(storage, nbytes):
        fill(storage, nbytes)
        addresses[-1].add(storage.data_ptr())

    pool.fill = recording_fill
    allocations = []
    for step in range(3):
        addresses.append(set())
        train_step(run, step)
        allocations.append(pool.allocations)
    return {"allocations": allocations, "addresses": addresses, "units": len(run.optimizer.sharding.order[0])}


def test_zero3_gathers_reuse_their_memory(corpus, cache_dir, tmp_path):
    """Each unit's gather takes the memory an earlier one gave back (storage_pool.py): what the pool
    allocates in the first step (fewer buffers than units: the 4 layers share the running one and the
    prefetched one) it never allocates again, and later steps gather into the same addresses."""
    raw = tiny_config(corpus, cache_dir, tmp_path, model={"num_hidden_layers": 4}, parallel={"dp": 2, "zero": 3},
                      train={"steps": 3})
    prepare_data(from_dict(raw))
    for r in run_ranks(2, _gather_memory_rank, raw):
        first = r["allocations"][0]
        assert r["allocations"] == [first] * 3 and 0 < first < r["units"], r
        assert r["addresses"][1] == r["addresses"][2] and r["addresses"][1] <= r["addresses"][0], r


@pytest.mark.parametrize("zero, accumulate", [(1, "sharded"), (2, "full"), (2, "sharded")])
def test_gradient_accumulation_reduces_once_per_step(corpus, cache_dir, tmp_path, zero, accumulate):
    """One reduce-scatter per bucket per step; under ZeRO-2/3's sharded accumulation one per micro-batch
    (ZeRO-1 keeps whole buffers whatever zero_accumulate says)."""
    counts = {}
    for grad_acc in (1, 4):
        raw = tiny_config(corpus, cache_dir, tmp_path / f"acc{grad_acc}",
                          parallel={"dp": 2, "zero": zero, "bucket_mb": SMALL, "zero_accumulate": accumulate},
                          train={"micro_batch": 1, "grad_acc": grad_acc, "steps": 2})
        counts[grad_acc] = [r["collectives"] for r in run_parallel(raw, trace=True)[0]]
    per_micro_batch = zero >= 2 and accumulate == "sharded"
    assert counts[4] == [4 * c if per_micro_batch else c for c in counts[1]] and counts[1][0] > 3


def _cfg(corpus, cache_dir, tmp_path, out, parallel, *, steps=8, **extra):
    """A 4-layer run with a global batch of 4 whatever the layout."""
    dp = parallel.get("dp", 1)
    train = {"steps": steps, "micro_batch": 1, "grad_acc": 4 // dp, "lr": LAYOUT_LR, **extra.pop("train", {})}
    return tiny_config(corpus, cache_dir, tmp_path / out, model={"num_hidden_layers": 4}, train=train,
                       parallel={"bucket_mb": SMALL, **parallel}, **extra)


@pytest.mark.parametrize("saved, loaded", [({"dp": 4, "zero": 3}, {"tp": 2}), ({"tp": 2}, {"dp": 4, "zero": 3}),
                                           ({"dp": 4, "zero": 2, "dp_shard": 2}, {"dp": 2, "zero": 1}),
                                           ({"dp": 2, "pp": 2, "zero": 3}, {"dp": 2, "zero": 2})],
                         ids=["zero3-dp4 -> tp2", "tp2 -> zero3-dp4", "zero2-dp4-hsdp2 -> zero1-dp2",
                              "zero3-dp2-pp2 -> zero2-dp2"])
def test_zero_checkpoints_resume_in_any_layout(corpus, cache_dir, tmp_path, saved, loaded):
    """Checkpoints hold full tensors by name whatever the ZeRO stage, so they reshard like any other."""
    reference = run_training(_cfg(corpus, cache_dir, tmp_path, "ref", {}))
    background = saved.get("pp", 1) > 1  # one case saves with checkpoint.async_save
    run_training(_cfg(corpus, cache_dir, tmp_path, "a", saved, checkpoint={"save_every": 4, "async_save": background}))
    step4 = str(tmp_path / "a" / "checkpoints" / "step_4")
    after = run_training(_cfg(corpus, cache_dir, tmp_path, "b", loaded, checkpoint={"resume": step4}))
    torch.testing.assert_close(torch.tensor(after), torch.tensor(reference[4:]), rtol=LOSS_RTOL, atol=0)
    final, ref_final = (load_file(tmp_path / d / "model" / "model.safetensors") for d in ("b", "ref"))
    for name, value in final.items():
        torch.testing.assert_close(value, ref_final[name], rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("parallel, dtype", [({"dp": 2, "zero": 2}, "float32"), ({"dp": 2, "zero": 1}, "bfloat16"),
                                             ({"dp": 2}, "bfloat16"), ({"dp": 2, "zero": 3}, "bfloat16")])
def test_same_layout_resume_is_exact(corpus, cache_dir, tmp_path, parallel, dtype):
    """Sharded moments and fp32 master weights come back bit for bit: the resumed losses are the same,
    whether saved in the foreground or (ZeRO-2 and 3) in the background from a copy of this rank's slices."""
    background = parallel.get("zero", 0) >= 2
    full = run_training(_cfg(corpus, cache_dir, tmp_path, "full", parallel, train={"dtype": dtype},
                             checkpoint={"save_every": 4, "async_save": background}))
    step4 = str(tmp_path / "full" / "checkpoints" / "step_4")
    resumed = run_training(_cfg(corpus, cache_dir, tmp_path, "b", parallel, train={"dtype": dtype},
                                checkpoint={"resume": step4}))
    assert resumed == full[4:]


def test_state_bytes_shrink_by_stage(corpus, cache_dir, tmp_path):
    """Rank 0's measured state (metrics.jsonl, first step) at dp 2: ZeRO-1 halves the optimizer
    state, ZeRO-2 the gradients too, ZeRO-3 the parameters too, each within 2% of N/dp (the bucket
    padding and AdamW's 4-byte step counter per piece are the rest)."""
    model = {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    measured = {}
    for zero in (0, 1, 2, 3):
        raw = tiny_config(corpus, cache_dir, tmp_path / f"z{zero}", model=model, data={"seq_len": 32},
                          parallel={"dp": 2, "zero": zero}, train={"steps": 1, "micro_batch": 1})
        (first,) = run_parallel(raw)[1]["metrics"]
        measured[zero] = {k: first[f"mem_{k}_mb"] * 2**20 for k in ("params", "grads", "optimizer", "buffers")}
    n = from_dict(raw).model.num_params()  # 1.9M parameters, 4 bytes each in fp32
    full = {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n}
    shards = {0: set(), 1: {"optimizer"}, 2: {"optimizer", "grads"}, 3: {"optimizer", "grads", "params"}}
    for zero, got in measured.items():
        for kind, nbytes in full.items():
            want = nbytes / 2 if kind in shards[zero] else nbytes
            assert abs(got[kind] - want) <= 0.02 * want, (zero, kind, got[kind], want)
        assert got["buffers"] == 0
