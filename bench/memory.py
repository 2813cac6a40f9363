"""Memory per rank under ZeRO 0/1/2/3 x activation recomputation none/selective/full: the README's table.

    python bench/memory.py [--model smollm-135m] [--ranks 2] [--seq-len 256] [--micro-batch 1] [--dtype float32]
    python bench/memory.py --per-step 20 --seq-len 32 [--malloc tetron|default]   # ZeRO-0 and 3 step by step
    python bench/memory.py --grad-acc 4 [--steps 2] [--seq-len 64]   # ZeRO-3 accumulation against FSDP2

Not part of `make bench` (about 4 minutes on 2 CPU cores, 12 launches of a 135M-parameter model, up
to ~3.5 GB of memory per rank). Each of the 12 configurations runs in its own fresh set of forked gloo
ranks (in one process the previous configurations' memory would count), through tetron's own code:
`train.build_run` (data: the standard library's sources, byte tokens; `parallelize`, `build_optimizer`)
and two `train.train_step`s, the first measuring memory as `tetron train` does for metrics.jsonl's first
record. Rank 0's figures, in MiB:

- params, grads, optimizer: its training state after the first optimizer step (`mem_params_mb`,
  `mem_grads_mb`, `mem_optimizer_mb`: each storage once; a rank's ZeRO slice of the parameters is a
  parameter, fp32 masters that are not the parameters and the AdamW moments are optimizer state);
- activations: the peak of the bytes autograd saved for the backward pass during that step
  (`mem_activations_mb`, tetron.observe.memory.ActivationMeter);
- RSS at start, peak RSS: the resident set of the whole process when step 2 starts, and its peak
  during step 2 (`peak_mem_mb`, reset at each step's start): the interpreter and torch (about 0.3 GB),
  the state, and during the step activations, temporaries, gathered parameters and full gradient
  buffers (ZeRO-2/3), communication buffers (gloo's reduce-scatter copies its whole input).
  Step 2, as step 1 allocates the AdamW moments only at its end.

Allocator: with `--malloc tetron` (the default) the ranks are set up as `tetron train` sets up its CPU
ranks (`tetron.launch.setup_rank`): glibc's mmap threshold fixed at 1 MiB under ZeRO-3
(`tetron.device.map_large_allocations`), glibc's own otherwise. With `--malloc mmap` each rank sets the
threshold to 64 KiB (`mallopt`), so that every tensor's memory is mapped when allocated and returned when
freed, and the resident set follows the live tensors: the accounting of the stages' table in
docs/memory.md. With `--malloc default` (glibc untouched) freed tensors of up to 32 MB stay in the heap,
and the resident set grows over the first steps by up to 1 GB of free memory, which hides most of what
ZeRO saves.

`--per-step N`: ZeRO-0 and ZeRO-3 (recompute none) for N steps each, rank 0's peak RSS in every step
(reset at its start): whether the resident set stays where the state says, step after step.

What ActivationMeter (the activations column) does not see, or sees wrongly: under `selective` the
matmul outputs that the policy keeps (held by checkpoint's cache, not autograd's saved tensors), so
`selective` reads like `full`; under ZeRO-3 it counts the gathered parameters that autograd saves for
the backward pass (a Linear saves its weight) at their gathered size, though tetron frees them after
each unit's forward (the storage is resized to nothing): the tied embedding alone is 108 MiB here;
and as storages are told apart by address, a unit gathered where a freed one was counts once, so that
figure also changes with the allocator (534 MiB with `mmap`, 844-896 with `default`, for `none`).

`--grad-acc N` (N > 1): ZeRO-3 with N micro-batches a step, three implementations each in fresh ranks,
`--steps` steps: tetron with `parallel.zero_accumulate: full` (whole gradient buffers kept through the
micro-batches: before) and `sharded` (each micro-batch reduce-scattered into the rank's slice: after),
and FSDP2 (`fully_shard` on each decoder layer, then the root, of transformers' LlamaForCausalLM built
from the same config, random init; AdamW and clipping as bench/zero.py's; FSDP2 reduce-scatters every
micro-batch by default). Rank 0's gradient bytes held between micro-batches (the most alive at any
forward's start: tetron's `DataParallelBucket.max_held_grad_bytes`, which the tests read after training
(tests/conftest.py's `train_rank`); FSDP2's the local shards of its param.grad DTensors) and its peak RSS
(the highest step's, reset at each step's start), and tetron/FSDP2 of each. fp32 only. The data differ
(tetron's loader against random ids of the same shape); the tensors' sizes do not.

The printed step times are for orientation only (one thread per rank, whatever else runs).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F
from common import launch, map_every_allocation, rank_config, rss_mb
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from zero import adamw, local

from tetron import device as dev
from tetron.config import Config, from_dict
from tetron.mesh import Mesh
from tetron.train import build_run, train_step

ZEROS = (0, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")
CPU = torch.device("cpu")
# torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor (tetron's collectives) once per call site
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)


def config(args: argparse.Namespace, zero: int, recompute: str, out: str, accumulate: str = "sharded"):
    return from_dict({
        "model": args.model,
        "parallel": {"dp": args.ranks, "zero": zero, "device": "cpu", "zero_accumulate": accumulate},
        # a fixed 4 MB prefix of the standard library's sources: tokenized once, then cached
        "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": args.seq_len, "max_bytes": 4 * 2**20},
        "train": {"steps": max(2, args.per_step + 1, args.steps), "micro_batch": args.micro_batch,
                  "grad_acc": args.grad_acc, "recompute": recompute, "dtype": args.dtype},
        "logging": {"progress": False, "sample_tokens": 0},
        "out": out,
    })


def rank_setup(args: argparse.Namespace, zero: int) -> Config:
    """What the ranks of ZeRO stage `zero` are set up for (tetron.launch.setup_rank, through common.launch):
    as `tetron train` sets them up under `--malloc tetron`; else as for ZeRO-0, which leaves glibc as it is,
    for set_malloc to change."""
    return rank_config(args.ranks, zero=zero if args.malloc == "tetron" else 0, model=args.model)


def set_malloc(choice: str) -> bool:
    """The allocator setting `--malloc` names, on top of the rank's setup; whether glibc took it (tetron: the
    setup made it already)."""
    if choice == "mmap":
        return map_every_allocation()
    return choice == "tetron"


def malloc_label(choice: str, mapped: bool) -> str:
    if choice == "tetron":
        return "as tetron train (mmap threshold 1 MiB under ZeRO-3, glibc's own otherwise)"
    return "mmap threshold 64 KiB" if choice == "mmap" and mapped else "glibc default"


def rank_main(rank: int, args: argparse.Namespace) -> None:
    """One configuration: build as `tetron train` does, two steps; rank 0 writes its figures."""
    mapped = set_malloc(args.malloc)
    cfg = config(args, args.zero, args.recompute, args.out)
    mesh = Mesh(dp=args.ranks)
    run = build_run(cfg, mesh, CPU)
    n_params = sum(p.numel() for p in run.model.params)
    first = train_step(run, 0, measure_memory=True)
    start = rss_mb()
    second = train_step(run, 1)
    peak = dev.peak_memory_mb(CPU)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"memory": first.memory, "start": start, "peak": peak, "time": second.time_s,
                       "losses": [first.loss, second.loss], "params": n_params, "mapped": mapped}, f)


def per_step_rank(rank: int, args: argparse.Namespace) -> None:
    """`--per-step`: args.per_step steps; rank 0 writes each step's peak RSS."""
    set_malloc(args.malloc)
    cfg = config(args, args.zero, "none", args.out)
    run = build_run(cfg, Mesh(dp=args.ranks), CPU)
    peaks = []
    for step in range(args.per_step):
        train_step(run, step)  # resets the peak at its start
        peaks.append(dev.peak_memory_mb(CPU))
    state = train_step(run, args.per_step, measure_memory=True).memory  # one more step, on every rank
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"peaks": peaks, "state": state}, f)


def per_step(args: argparse.Namespace) -> None:
    """ZeRO-0 and ZeRO-3, rank 0's peak RSS step by step, and ZeRO-3's against ZeRO-0's."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for zero in (0, 3):
            result = os.path.join(tmp, f"zero{zero}.json")
            launch(per_step_rank, argparse.Namespace(**vars(args), zero=zero, result=result,
                                                     out=os.path.join(tmp, f"run-zero{zero}")),
                   cfg=rank_setup(args, zero))
            with open(result) as f:
                rows[zero] = json.load(f)
    print(f"{args.model}, dp {args.ranks}, {args.dtype}, micro-batch {args.micro_batch} x {args.seq_len} tokens, "
          f"malloc {args.malloc}: rank 0's peak RSS per step, MiB")
    print("| step | " + " | ".join(str(i + 1) for i in range(args.per_step)) + " |")
    print("|---" * (args.per_step + 1) + "|")
    for zero, r in rows.items():
        print(f"| ZeRO-{zero} | " + " | ".join(f"{p:,.0f}" for p in r["peaks"]) + " |")
    for zero, r in rows.items():
        peaks = r["peaks"]
        print(f"ZeRO-{zero}: state {r['state']['mem_total_mb']:,.0f} MiB; peak after step 2 within "
              f"{min(peaks[1:]) / peaks[1] - 1:+.1%} / {max(peaks[1:]) / peaks[1] - 1:+.1%} of step 2's")
    print(f"ZeRO-3 / ZeRO-0, highest peak of steps 2+: {max(rows[3]['peaks'][1:]) / max(rows[0]['peaks'][1:]):.2f}")


def measure(args: argparse.Namespace, zero: int, recompute: str, tmp: str) -> dict:
    result = os.path.join(tmp, f"zero{zero}-{recompute}.json")
    launch(rank_main, argparse.Namespace(**vars(args), zero=zero, recompute=recompute, result=result,
                                         out=os.path.join(tmp, f"run-zero{zero}-{recompute}")),
           cfg=rank_setup(args, zero))
    with open(result) as f:
        return json.load(f)


def table(rows: dict[tuple[int, str], dict]) -> str:
    lines = ["| ZeRO | recompute | params | grads | optimizer | state | activations (meter) | RSS at start "
             "| peak RSS | peak - start | step time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (zero, recompute), r in rows.items():
        m = r["memory"]
        lines.append(f"| {zero} | `{recompute}` | {m['mem_params_mb']:,.0f} | {m['mem_grads_mb']:,.0f} | "
                     f"{m['mem_optimizer_mb']:,.0f} | {m['mem_total_mb']:,.0f} | {m['mem_activations_mb']:,.0f} | "
                     f"{r['start']:,.0f} | {r['peak']:,.0f} | {r['peak'] - r['start']:,.0f} | {r['time']:.1f} s |")
    return "\n".join(lines)


# --------------------------------------------------------------- --grad-acc: ZeRO-3 accumulation against FSDP2

ACCUMULATORS = {"full": "tetron ZeRO-3, zero_accumulate full (before)",
                "sharded": "tetron ZeRO-3, zero_accumulate sharded (after)",
                "fsdp2": "torch FSDP2 (fully_shard per layer + root)"}


def write_result(rank: int, args: argparse.Namespace, figures: dict) -> None:
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({**figures, "mapped": args.mapped}, f)


def tetron_accumulating(rank: int, args: argparse.Namespace) -> None:
    """Tetron's ZeRO-3 as `tetron train` builds it, with args.impl as parallel.zero_accumulate."""
    args.mapped = set_malloc(args.malloc)
    run = build_run(config(args, 3, "none", args.out, accumulate=args.impl), Mesh(dp=args.ranks), CPU)
    peaks, losses, times = [], [], []
    for step in range(args.steps):
        figures = train_step(run, step)  # resets the peak at its start
        peaks.append(dev.peak_memory_mb(CPU))
        losses.append(figures.loss)
        times.append(figures.time_s)
    # as tests/conftest.py's train_rank reads it: the most gradient bytes alive at any forward's start
    held = sum(getattr(chunk, "max_held_grad_bytes", 0) for chunk in run.model.dp_chunks)
    write_result(rank, args, {"peaks": peaks, "losses": losses, "times": times, "held": held})


def fsdp2_model(args: argparse.Namespace) -> nn.Module:
    """transformers' LlamaForCausalLM of the same config, random init, under fully_shard: each decoder
    layer, then the root (the embedding, tied to the head, and the final norm)."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    model_cfg = config(args, 3, "none", args.out).model
    torch.manual_seed(0)
    model = LlamaForCausalLM(HFConfig(**model_cfg.to_hf(), attn_implementation="sdpa"))
    device_mesh = init_device_mesh("cpu", (args.ranks,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=device_mesh)
    return fully_shard(model, mesh=device_mesh)


def fsdp2_accumulating(rank: int, args: argparse.Namespace) -> None:
    """FSDP2 in the usual loop: args.grad_acc forward/backwards (each reduce-scattered, FSDP2's default),
    clip_grad_norm_ as tetron's train.grad_clip, AdamW as bench/zero.py's, zero_grad."""
    args.mapped = set_malloc(args.malloc)
    model = fsdp2_model(args)
    params = list(model.parameters())
    optimizer, clip = adamw(model), config(args, 3, "none", args.out).train.grad_clip
    g = torch.Generator().manual_seed(1000 + rank)
    peaks, losses, times, held = [], [], [], 0
    for _ in range(args.steps):
        dev.reset_peak_memory(CPU)
        start, loss_sum = time.perf_counter(), 0.0
        for _ in range(args.grad_acc):
            # what accumulation holds: the local shards of the param.grad DTensors at a forward's start
            held = max(held, sum(t.numel() * t.element_size() for t in local(p.grad for p in params) if t is not None))
            ids = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g)
            logits = model(ids[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()) / args.grad_acc
            loss.backward()
            loss_sum += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad()
        peaks.append(dev.peak_memory_mb(CPU))
        losses.append(loss_sum)
        times.append(time.perf_counter() - start)
    write_result(rank, args, {"peaks": peaks, "losses": losses, "times": times, "held": held})


def accumulation(args: argparse.Namespace) -> None:
    """Tetron's ZeRO-3 (full, then sharded) and FSDP2, each in fresh ranks; rank 0's figures and the ratios."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in ACCUMULATORS:
            result = os.path.join(tmp, f"{impl}.json")
            rank_main = fsdp2_accumulating if impl == "fsdp2" else tetron_accumulating
            launch(rank_main, argparse.Namespace(**vars(args), impl=impl, result=result,
                                                 out=os.path.join(tmp, f"run-{impl}")), cfg=rank_setup(args, 3))
            with open(result) as f:
                rows[impl] = json.load(f)
            print(f"{impl:8s} losses " + " ".join(f"{x:.4f}" for x in rows[impl]["losses"]), flush=True)
    cfg = config(args, 3, "none", "unused")
    malloc = malloc_label(args.malloc, all(r["mapped"] for r in rows.values()))
    print(f"\n{args.model} ({cfg.model.num_params() / 1e6:.1f}M parameters), dp {args.ranks} (gloo), ZeRO-3, "
          f"{args.dtype}, AdamW, micro-batch {args.micro_batch} x {args.seq_len} tokens x {args.grad_acc} "
          f"micro-batches per rank, {args.steps} steps; rank 0, MiB; peak: the highest step's; malloc: {malloc}\n")
    print("| implementation | gradients held between micro-batches | peak RSS | step time |")
    print("|---|---|---|---|")
    for impl, label in ACCUMULATORS.items():
        r = rows[impl]
        print(f"| {label} | {r['held'] / 2**20:,.1f} | {max(r['peaks']):,.0f} | {r['times'][-1]:.1f} s |")
    for impl in ("full", "sharded"):
        a, b = rows[impl], rows["fsdp2"]
        print(f"tetron {impl} / FSDP2: peak {max(a['peaks']) / max(b['peaks']):.3f}, gradients held "
              f"{a['held'] / b['held']:.3f}   (goal: peak <= 1.00)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm-135m", help="a name from configs/ or a Hugging Face config")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (ZeRO shards over them)")
    parser.add_argument("--seq-len", type=int, default=None, help="256; 64 with --grad-acc")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--malloc", choices=("tetron", "mmap", "default"), default="tetron",
                        help="tetron: as tetron train's CPU ranks (1 MiB+ mapped under ZeRO-3); mmap: every "
                             "allocation of 64 KiB+ mapped and unmapped (RSS follows live tensors); default: "
                             "glibc untouched")
    parser.add_argument("--per-step", type=int, default=0, help="steps of ZeRO-0 and ZeRO-3 with each step's peak RSS")
    parser.add_argument("--grad-acc", type=int, default=1,
                        help="above 1: ZeRO-3 with that many micro-batches, tetron full/sharded against FSDP2")
    parser.add_argument("--steps", type=int, default=2, help="with --grad-acc: optimizer steps of each")
    args = parser.parse_args()
    args.seq_len = args.seq_len or (64 if args.grad_acc > 1 else 256)
    if args.grad_acc > 1:
        if args.dtype != "float32":
            parser.error("--grad-acc compares against FSDP2 in fp32 only; use --dtype float32")
        accumulation(args)
        return
    if args.per_step:
        per_step(args)
        return
    start = time.perf_counter()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for zero in ZEROS:
            for recompute in RECOMPUTES:
                rows[zero, recompute] = measure(args, zero, recompute, tmp)
                r = rows[zero, recompute]
                print(f"zero {zero} recompute {recompute:9s} losses {r['losses'][0]:.6f} {r['losses'][1]:.6f}  "
                      f"step 2: RSS at start {r['start']:,.0f} MiB, peak {r['peak']:,.0f} MiB", flush=True)
    cfg = config(args, 0, "none", "unused")
    n = rows[0, "none"]["params"]
    malloc = malloc_label(args.malloc, all(r["mapped"] for r in rows.values()))
    print(f"\n{args.model}: {n / 1e6:.1f}M parameters ({cfg.model.num_hidden_layers} layers, hidden "
          f"{cfg.model.hidden_size}, vocab {cfg.model.vocab_size}), dp {args.ranks} (gloo), {args.dtype}, AdamW, "
          f"micro-batch {args.micro_batch} x {args.seq_len} tokens per rank; rank 0, MiB; step 2; malloc: {malloc} "
          f"({time.perf_counter() - start:.0f} s in all)\n")
    print(table(rows))


if __name__ == "__main__":
    main()
