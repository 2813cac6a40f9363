"""Shared fixtures: a small text corpus on disk and a tiny config that trains in well under a second a step."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))  # tests/harness.py

from tetron import cli  # noqa: E402
from tetron.checkpoint.save import gather_full_state  # noqa: E402
from tetron.config import from_dict  # noqa: E402
from tetron.data.loader import prepare_data  # noqa: E402
from tetron.data.sources import iter_texts  # noqa: E402
from tetron.mesh import Mesh  # noqa: E402
from tetron.parallel.pipeline_parallel import PipelineTrace  # noqa: E402
from tetron.plan import workers  # noqa: E402
from tetron.train import build_run, train, train_steps  # noqa: E402
from tetron.validate import validate  # noqa: E402

from harness import run_ranks  # noqa: E402

# One intra-op thread in the test process, as in each forked rank (harness.py): the models here are so small
# that a second thread only adds synchronisation, and while forked ranks or a launch run beside this process
# its spinning threads take their cores (test_pipeline_parallel.py: 40 s with two threads, 26 s with one, on a
# loaded 2-core machine).
torch.set_num_threads(1)

# Batch scheduling for this process and all it starts (forked ranks, launches, their threads): a gloo collective
# hands its work from the rank's thread to gloo's worker and socket threads and back, and under the default policy
# each wake-up preempts whatever runs on the core, most often another rank mid-computation. Without wake-up
# preemption the running thread keeps its slice (an all-reduce of 64 floats on 8 ranks on 2 cores: 21 ms -> 4.5 ms;
# tests/test_layouts.py and test_zero_bubble.py alone: 44 s -> 33 s; four rank-heavy files on 2 workers, twice each:
# 71-92 s against 83-108 s). Fair shares are as before: only who waits changes.
with contextlib.suppress(AttributeError, OSError):  # Linux only; a policy it may not set is left as it is
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))

# A planner search in this process stays in it: the suite's workers already take every core, and a search of
# 4,096 layouts or more forking one process per core beside them took test_search_ranks_valid_layouts_that_fit
# from 14 s to 49 s. The split itself is tested where a test asks for it (`search(..., workers=3)`).
workers.MIN_LAYOUTS = sys.maxsize

# The files that take longest, longest first (seconds of one worker on a loaded 2-core machine, measured with
# --durations): `make test` hands each file to a worker in collection order (--dist loadfile
# --no-loadscope-reorder), so the long ones start first and the workers end together, instead of a 40 s file
# starting last beside an idle worker (xdist's own reorder, by number of tests, put the two-node Slurm job
# near the end).
LONGEST_FIRST = ("test_plan.py", "test_plan_moe.py", "test_zero.py", "test_operations.py", "test_slurm.py",
                 "test_cli.py", "test_dry_run.py", "test_zero_bubble.py", "test_moe.py", "test_deepseek_v3.py",
                 "test_layouts.py", "test_mtp.py", "test_checkpoint.py", "test_multinode.py",
                 "test_pipeline_parallel.py", "test_gpt_oss.py", "test_recompute.py", "test_plan_muon.py",
                 "test_mixed_precision.py", "test_faults.py", "test_compile.py", "test_token_store.py")


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~200 KB of Python source from the standard library, as one .txt file."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(iter_texts("stdlib", max_bytes=200_000)))
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


# Steps of a tiny run: the few that show a layout equals the single process (2 of warmup, then one of the decay, on
# the moments the first two left). A fourth step ran the third's code again, for 8-15% of a parity run's rank time.
STEPS = 3


def tiny_config(corpus: Path, cache_dir: Path, out: Path, **sections) -> dict:
    """A raw config dict of a 2-layer, hidden-32 Llama on the bytes of `corpus`; `sections` override keys."""
    raw = {
        "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64},
        "data": {"path": str(corpus), "tokenizer": "bytes", "seq_len": 32, "cache_dir": str(cache_dir)},
        # loss_chunk_tokens below the tokens of a micro-batch (but cp4's at micro-batch 1), not dividing them: the
        # parity runs go through the chunked head and loss, last chunk ragged (tp, pp, cp, tied, bf16, ZeRO-3, zb)
        "train": {"steps": STEPS, "micro_batch": 2, "grad_acc": 1, "lr": 1e-2, "warmup_steps": 2, "seed": 1,
                  "loss_chunk_tokens": 12},
        "parallel": {"dp": 1},
        "logging": {"progress": False, "sample_tokens": 0},
        "out": str(out),
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw[section] = {**raw.get(section, {}), **values}
        else:
            raw[section] = values
    from_dict(raw)  # fail here, in the parent, on a bad test config
    return raw


LOSS_RTOL = 1e-5  # per-step loss, relative, on every rank and in metrics.jsonl
WEIGHT_ATOL = 1e-5  # final weights, absolute, fp32
# AdamW turns rounding differences in near-zero gradients into weight steps of up to ~lr/2; at 1e-3
# every layout stays well inside WEIGHT_ATOL after 10 steps (see test_pipeline_parallel.py), and STEPS are fewer.
LAYOUT_LR = 1e-3
GQA = {"num_attention_heads": 4, "num_key_value_heads": 2}


# A check_layout's single-process reference depends only on its config (the model, the data, the global
# batch's settings), and many layouts share one: each is trained once per test session, keyed by that config
# without its output folder. Training is deterministic, so a cached run is the run a new one would give.
_REFERENCES: dict[str, tuple[dict, dict]] = {}


def reference_run(raw: dict) -> tuple[dict, dict]:
    """The single-process run of `raw`: its rank result and what it wrote (see run_parallel), trained once."""
    key = json.dumps({k: v for k, v in raw.items() if k != "out"}, sort_keys=True)
    if key not in _REFERENCES:
        (ref,), written = run_parallel(raw, timeout=600)
        _REFERENCES[key] = (ref, written)
    return _REFERENCES[key]


def layout_configs(corpus, cache_dir, tmp_path, *, parallel: dict, model: dict | None = None, micro_batch: int = 1,
                   grad_acc: int = 2, train: dict | None = None, data: dict | None = None,
                   checkpoint: dict | None = None, logging: dict | None = None,
                   optim: dict | None = None) -> tuple[dict, dict]:
    """check_layout's two raw configs: the layout's, and its single-process reference's (for reference_run);
    `checkpoint` and `logging` go to the layout's only (saving and timing change no loss)."""
    # Four layers where a pipeline splits them (a stage of two, or interleaved chunks); otherwise two, the fewest
    # that show layers composed (one layer's backward feeding the next), at half the per-layer collectives.
    layers = 4 if parallel.get("pp", 1) > 1 else 2
    model = {**GQA, "num_hidden_layers": layers, **(model or {})}
    train_cfg = {"micro_batch": micro_batch, "grad_acc": grad_acc, "lr": LAYOUT_LR, **(train or {})}
    extra = {"optim": optim} if optim else {}  # both runs' optimizer
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", model=model, parallel=parallel, train=train_cfg,
                      data=data or {}, checkpoint=checkpoint or {}, logging=logging or {}, **extra)
    ref_raw = tiny_config(corpus, cache_dir, tmp_path / "ref", model=model, data=data or {}, **extra,
                          train={**train_cfg, "micro_batch": from_dict(raw).global_batch, "grad_acc": 1})
    return raw, ref_raw


def check_layout(corpus, cache_dir, tmp_path, **layout) -> tuple[list[dict], dict]:
    """Train the layout of `layout` (layout_configs' keywords: parallel, model, ...) and the single process on
    the same global batches (a GQA model of 2 layers, 4 under pp, unless `model` says otherwise): per-step losses
    on every rank and in metrics.jsonl within LOSS_RTOL, the saved OUT/model within WEIGHT_ATOL. Returns the
    layout's per-rank results and what rank 0 wrote."""
    raw, ref_raw = layout_configs(corpus, cache_dir, tmp_path, **layout)
    cfg = from_dict(raw)
    ref, ref_written = reference_run(ref_raw)
    results, written = run_parallel(raw, timeout=600, state=False)  # its weights: OUT/model, as rank 0 wrote them
    ref_state, state = ref_written["model"], written["model"]
    expected = torch.tensor(ref["losses"])
    assert len(expected) == cfg.train.steps
    for losses in [*(r["losses"] for r in results), [m["loss"] for m in written["metrics"]]]:
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=LOSS_RTOL, atol=0)
    assert state.keys() == ref_state.keys()
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    return results, written


def train_rank(raw: dict, *, trace: bool = False, state: bool = True) -> dict:
    """On one rank of a process group: train the raw config. Returns the losses of the steps run, with `state`
    this rank's final weights as whole tensors (every chunk, gathered over tp, vocabulary padding cut), the
    number of its parameters, the most gradient bytes it held between micro-batches, and with `trace` its
    pipeline trace of the last step (a watcher set on the run's pipeline, as train() builds it) and the
    gradient reductions data parallelism issued."""
    cfg = from_dict(raw)
    p = cfg.parallel
    mesh = Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, dp_shard=p.dp_shard)
    run = build_run(cfg, mesh, torch.device("cpu"))  # train(cfg, mesh), with the pipeline watched between
    if trace and run.pipeline is not None:
        run.pipeline.watcher = PipelineTrace(rank=mesh.local_rank("pp"))
    result = train_steps(run)
    weights = {}
    for chunk in result.chunks if state and p.zero < 3 else []:  # under ZeRO-3 only slices are left: see OUT/model
        weights.update(gather_full_state(chunk, mesh.group("tp"), mesh.group("ep")))
    held = sum(getattr(chunk, "max_held_grad_bytes", 0) for chunk in run.model.dp_chunks)  # bucket buffers, slices
    return {"losses": result.losses, "state": weights, "grad_bytes_held": held,
            "trace": run.pipeline.watcher if trace and run.pipeline is not None else None,
            "collectives": sum(chunk.num_collectives for chunk in run.model.dp_chunks) if trace else None,
            "num_params": sum(1 for c in result.chunks for _ in c.parameters())}


def train_rank_losses(raw: dict) -> list[float]:
    """On one rank of a process group: train the raw config, return the losses of the steps run."""
    cfg = from_dict(raw)
    p = cfg.parallel
    return train(cfg, Mesh(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, dp_shard=p.dp_shard)).losses


def run_parallel(raw: dict, *, trace: bool = False, timeout: float = 300, state: bool = True
                 ) -> tuple[list[dict], dict]:
    """Validate, tokenize once here, train on cfg.world_size forked ranks (train_rank on each). Returns
    every rank's result and what rank 0 wrote: the metrics records and the saved model's tensors."""
    cfg = from_dict(raw)
    validate(cfg)
    prepare_data(cfg)  # tokenize once here, so ranks only read the cache
    results = run_ranks(cfg.world_size, train_rank, raw, trace=trace, state=state, timeout=timeout)
    out = Path(cfg.out)
    written = {"metrics": [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
               "model": load_file(out / "model" / "model.safetensors")}
    return results, written


def run_training(raw: dict) -> list[float]:
    """Validate, tokenize once here, train on cfg.world_size forked ranks; rank 0's losses."""
    cfg = from_dict(raw)
    validate(cfg)
    prepare_data(cfg)
    return run_ranks(cfg.world_size, train_rank_losses, raw, timeout=300)[0]


def cli_in_process(args: list[str], workdir: Path) -> subprocess.CompletedProcess:
    """`tetron ARGS` through tetron.cli.main in this process, in `workdir`, launching nothing: (exit code,
    stdout, stderr) as a CompletedProcess, like a real run of the command."""
    def launch(cfg):
        raise AssertionError(f"launched {cfg.out}")

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.chdir(workdir)
        patch.setattr(cli, "launch", launch)
        code = cli.main(args)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def train_through_cli(raw: dict, folder: Path, run) -> list[float]:
    """`tetron train` as typed on `raw` (written to folder/run.yaml): every check before the ranks (the memory
    model's too), then `run(raw dict)` in place of the launch; the losses it returns."""
    import yaml

    (folder / "run.yaml").write_text(yaml.safe_dump(raw))
    losses: list[float] = []

    def launch(cfg):
        losses.extend(run(cfg.to_dict()))
        return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "launch", launch)
        assert cli.main(["train", str(folder / "run.yaml")]) == 0
    return losses


def first_batch_loss(raw: dict, model) -> float:
    """`model`'s (a transformers causal LM) cross entropy on the first global batch the run of `raw` trains on
    (sequences of 32, two of them: the init-from tests' batch)."""
    from tetron.data.loader import DataLoader, load_tokens

    cfg = from_dict(raw)
    _, tokens = prepare_data(cfg)
    loader = DataLoader(load_tokens(tokens), 32, micro_batch=2, grad_acc=1, dp_size=1, dp_rank=0, seed=cfg.train.seed)
    ((inputs, targets, *_),) = loader.next_batch()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()))
