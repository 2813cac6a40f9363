"""What tetron costs around its kernels: a whole tetron training step against the loop a user would
write instead with transformers' LlamaForCausalLM, on the same shape, in one invocation.

    python bench/step_overhead.py [--rounds 3] [--steps 6] [--hidden 256] [--layers 4] [--seq 256]

Two settings, each in its own forked ranks: a single process (micro-batch 8 x grad-acc 2) and data
parallelism over 2 ranks (micro-batch 4 x grad-acc 2 per rank; transformers under torch's
DistributedDataParallel with `no_sync` on the accumulation micro-batches). Both sides train the same GQA
8/4 Llama from the same weights on windows of the same token file, in ranks set up as `tetron train` sets
up its ranks (tetron.launch.setup_rank: the cores shared among the ranks, glibc's allocator as the ZeRO
stage wants it, the signal handlers), so that what is timed is what users run.

tetron's step is everything `tetron train` does per step: `train.train_step` (the loader's batch,
forward/backward, gradient sync, the loss all-reduce, clipping, AdamW, zero_grad) and rank 0's
`Reporter.step` (metrics.jsonl, the progress line). The transformers loop is the usual one: forward
with labels, backward, `clip_grad_norm_`, `torch.optim.AdamW` (torch's CPU default: the for-loop
implementation), `zero_grad`, and `loss.item()` for the log line every step.

Timing: the two alternate in rounds of `--steps` steps (machine drift hits both alike); each step
starts after a barrier; tokens/s is the median over all timed steps, and the spread of the rounds'
own ratios shows the noise. Then one tetron step is profiled
(torch.profiler, single process) and split into forward, backward, gradient sync wait, the loss
all-reduce and its read-back, clipping, optimizer and bookkeeping (the rest of the step's wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import model_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tetron import train as tetron_train  # noqa: E402
from tetron.config import from_dict  # noqa: E402
from tetron.data.loader import prepare_data  # noqa: E402
from tetron.launch import setup_rank  # noqa: E402
from tetron.mesh import Mesh  # noqa: E402

SETTINGS = {  # name: (ranks, micro_batch, grad_acc)
    "single process": (1, 8, 2),
    "dp 2": (2, 4, 2),
}


def tetron_config(args: argparse.Namespace, out: str, *, dp: int, micro_batch: int, grad_acc: int) -> dict:
    config = model_config(args)
    model = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads",
                                              "max_position_embeddings")}
    return {
        "model": model,
        "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": args.seq, "max_bytes": 4_000_000,
                 "cache_dir": os.path.join(out, "cache")},
        "train": {"steps": 10_000, "micro_batch": micro_batch, "grad_acc": grad_acc, "lr": 1e-4, "warmup_steps": 0,
                  "schedule": "constant", "grad_clip": 1.0},
        "parallel": {"dp": dp},
        "logging": {"progress": True, "log_every": 10, "sample_tokens": 0},
        "out": os.path.join(out, "run"),
    }


def hf_model(run, args: argparse.Namespace):
    """transformers' Llama with the tetron run's initial weights (the same names)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM(HFConfig(**run.cfg.model.to_hf(), attn_implementation="sdpa"))
    hf.load_state_dict(run.model.chunks[0].state_dict(), strict=False)
    hf.tie_weights()
    return hf


def hf_step_fn(model, optimizer, batches, *, ranks: int):
    """The step of the loop a user writes: accumulation with no_sync, clip, AdamW, a logged loss."""
    def step(k: int) -> float:
        micro = batches[k % len(batches)]
        total = 0.0
        for i, (inputs, targets, *_) in enumerate(micro):
            last = i == len(micro) - 1
            sync = contextlib.nullcontext() if last or ranks == 1 else model.no_sync()
            with sync:
                logits = model(input_ids=inputs).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) / len(micro)
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total
    return step


def rank_main(rank: int, ranks: int, raw: dict, args: argparse.Namespace, init: str, queue) -> None:
    from datetime import timedelta

    from torch.nn.parallel import DistributedDataParallel

    cfg = from_dict(raw)
    # as `tetron train` sets up a rank (threads, glibc's allocator, signals): transformers' loop runs in it too
    _, restore = setup_rank(cfg, ranks_per_node=ranks)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=600))
    run = tetron_train.build_run(cfg, Mesh(dp=ranks), torch.device("cpu"))
    reporter = tetron_train.Reporter(cfg, device=run.device, world_size=ranks, first_step=0) if rank == 0 else None
    hf = hf_model(run, args)
    wrapped = DistributedDataParallel(hf) if ranks > 1 else hf
    decay = [p for p in hf.parameters() if p.ndim >= 2]
    keep = [p for p in hf.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": keep, "weight_decay": 0.0}],
                                  lr=1e-4, betas=(0.9, 0.95))
    batches = [run.loader.batch_for_step(s) for s in range(8)]
    hf_step = hf_step_fn(wrapped, optimizer, batches, ranks=ranks)
    step_no = [0]

    def tetron_step(k: int) -> None:
        figures = tetron_train.train_step(run, step_no[0])
        if reporter:
            reporter.step(step_no[0], figures)
        step_no[0] += 1

    impls = {"tetron": tetron_step, "transformers": hf_step}
    for fn in impls.values():  # warm-up
        for k in range(2):
            fn(k)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(args.rounds):
        for name, fn in impls.items():
            for k in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                fn(k)
                times[name].append(time.perf_counter() - start)
    breakdown = profile_step(run, step_no[0]) if rank == 0 and ranks == 1 and args.profile else None
    if rank == 0:
        queue.put({"times": times, "breakdown": breakdown, "threads": torch.get_num_threads()})
    dist.destroy_process_group()
    restore()


PHASES = {  # tetron.train's functions timed in the profile, by the phase they are
    "forward_backward": "backward (and loss)",
    "finish_gradients": "gradient sync wait",
    "global_loss": "loss all-reduce and read-back",
    "clip_grads_": "clipping",
}


def profile_step(run, step: int) -> dict[str, float]:
    """One tetron step under torch.profiler, each phase in a record_function scope (wrapped here, so
    tetron's own code carries no profiling calls): milliseconds per phase, and the rest of the step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    originals = {name: getattr(tetron_train, name) for name in PHASES}

    def scoped(name, fn):
        def inner(*a, **kw):
            with record_function(f"phase:{name}"):
                return fn(*a, **kw)
        return inner

    for name, fn in originals.items():
        setattr(tetron_train, name, scoped(name, fn))
    optimizer_step = run.optimizer.step
    run.optimizer.step = scoped("optimizer", optimizer_step)
    model = run.model.dp_chunks[0]
    model.forward = scoped("forward", model.forward)
    try:
        tetron_train.train_step(run, step)  # once more unprofiled: the wrappers' first call
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            tetron_train.train_step(run, step + 1)
            wall = time.perf_counter() - start
    finally:
        for name, fn in originals.items():
            setattr(tetron_train, name, fn)
        run.optimizer.step = optimizer_step
        del model.forward
    totals = {e.key.removeprefix("phase:"): e.cpu_time_total / 1e3 for e in prof.key_averages()
              if e.key.startswith("phase:")}
    totals["forward_backward"] -= totals["forward"]  # the forward's scope is inside it
    ms = {PHASES.get(k, k): v for k, v in totals.items()}
    ms["bookkeeping"] = wall * 1e3 - sum(ms.values())
    ms["step"] = wall * 1e3
    return ms


def run_setting(name: str, args: argparse.Namespace, tmp: str) -> dict:
    ranks, micro_batch, grad_acc = SETTINGS[name]
    raw = tetron_config(args, tmp, dp=ranks, micro_batch=micro_batch, grad_acc=grad_acc)
    prepare_data(from_dict(raw))  # tokenize once here, the ranks find the cache
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    init = os.path.join(tmp, f"init-{ranks}")
    procs = [ctx.Process(target=rank_main, args=(r, ranks, raw, args, init, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
    tokens = micro_batch * grad_acc * ranks * args.seq
    times, k = result["times"], args.steps
    # the noise: the ratio of each round's medians (the two ran back to back in it)
    rounds = [statistics.median(times["transformers"][i:i + k]) / statistics.median(times["tetron"][i:i + k])
              for i in range(0, len(times["tetron"]), k)]
    return {impl: tokens / statistics.median(t) for impl, t in times.items()} | {
        "breakdown": result["breakdown"], "rounds": rounds, "threads": result["threads"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation per round")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--only", choices=list(SETTINGS), help="run one setting")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run_setting(name, args, tmp) for name in SETTINGS if args.only in (None, name)}
    print(f"step overhead: hidden {args.hidden}, {args.layers} layers, GQA 8/4, seq {args.seq}, vocab {args.vocab}; "
          f"median tokens/s over {args.rounds} interleaved rounds of {args.steps} steps")
    for name, r in results.items():
        print(f"  {name:15s} ({r['threads']} threads a rank) tetron {r['tetron']:9,.0f}  "
              f"transformers {r['transformers']:9,.0f}  "
              f"tetron/transformers = {r['tetron'] / r['transformers']:.3f}  (above 1: tetron is faster; "
              f"rounds {min(r['rounds']):.3f}-{max(r['rounds']):.3f})")
    breakdown = results.get("single process", {}).get("breakdown")
    if breakdown:
        step = breakdown.pop("step")
        print(f"  one tetron step, single process, profiled: {step:.1f} ms")
        for phase, ms in breakdown.items():
            print(f"    {phase:30s} {ms:8.1f} ms  {100 * ms / step:5.1f}%")


if __name__ == "__main__":
    main()
