"""Memory per rank under ZeRO 0/1/2/3 x activation recomputation none/selective/full: the README's table.

    python bench/memory.py [--model smollm-135m] [--ranks 2] [--seq-len 256] [--micro-batch 1] [--dtype float32]
    python bench/memory.py --per-step 20 --seq-len 32 [--malloc tetron|default]   # ZeRO-0 and 3 step by step

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

Allocator: with `--malloc mmap` (the default) each rank first sets glibc's mmap threshold to 64 KiB
(`mallopt`), so that every tensor's memory is mapped when allocated and returned when freed, and the
resident set follows the live tensors. `--malloc tetron` sets it as `tetron train`'s CPU ranks do (1 MiB,
`tetron.device.map_large_allocations`). With `--malloc default` (glibc untouched) freed tensors of up to
32 MB stay in the heap, and the resident set grows over the first steps by up to 1 GB of free memory,
which hides most of what ZeRO saves.

`--per-step N`: ZeRO-0 and ZeRO-3 (recompute none) for N steps each, rank 0's peak RSS in every step
(reset at its start): whether the resident set stays where the state says, step after step.

What ActivationMeter (the activations column) does not see, or sees wrongly: under `selective` the
matmul outputs that the policy keeps (held by checkpoint's cache, not autograd's saved tensors), so
`selective` reads like `full`; under ZeRO-3 it counts the gathered parameters that autograd saves for
the backward pass (a Linear saves its weight) at their gathered size, though tetron frees them after
each unit's forward (the storage is resized to nothing): the tied embedding alone is 108 MiB here;
and as storages are told apart by address, a unit gathered where a freed one was counts once, so that
figure also changes with the allocator (534 MiB with `mmap`, 844-896 with `default`, for `none`).

The printed step times are for orientation only (one thread per rank, whatever else runs).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import tempfile
import time
import warnings

import torch
from common import launch

from tetron import device as dev
from tetron.config import from_dict
from tetron.mesh import Mesh
from tetron.train import build_run, train_step

ZEROS = (0, 1, 2, 3)
RECOMPUTES = ("none", "selective", "full")
CPU = torch.device("cpu")
# torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor (tetron's collectives) once per call site
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)


def config(args: argparse.Namespace, zero: int, recompute: str, out: str):
    return from_dict({
        "model": args.model,
        "parallel": {"dp": args.ranks, "zero": zero, "device": "cpu"},
        # a fixed 4 MB prefix of the standard library's sources: tokenized once, then cached
        "data": {"path": "stdlib", "tokenizer": "bytes", "seq_len": args.seq_len, "max_bytes": 4 * 2**20},
        "train": {"steps": max(2, args.per_step + 1), "micro_batch": args.micro_batch, "recompute": recompute,
                  "dtype": args.dtype},
        "logging": {"progress": False, "sample_tokens": 0},
        "out": out,
    })


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def map_every_allocation() -> bool:
    """glibc: allocations of 64 KiB and more mapped on their own and unmapped when freed (no dynamic
    threshold), free heap top returned above 1 MiB. False where there is no glibc mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 16)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 20))
    except (OSError, AttributeError, TypeError):
        return False


def rss_mb() -> float:
    """This process's resident set now (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**10
    return float("nan")


def set_malloc(choice: str) -> bool:
    """The allocator setting `--malloc` names; whether glibc took it."""
    if choice == "mmap":
        return map_every_allocation()
    return dev.map_large_allocations() if choice == "tetron" else False


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
                                                     out=os.path.join(tmp, f"run-zero{zero}")))
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
                                         out=os.path.join(tmp, f"run-zero{zero}-{recompute}")))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm-135m", help="a name from configs/ or a Hugging Face config")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (ZeRO shards over them)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--malloc", choices=("mmap", "tetron", "default"), default="mmap",
                        help="mmap: every allocation of 64 KiB+ mapped and unmapped (RSS follows live tensors); "
                             "tetron: as tetron train's CPU ranks (1 MiB+); default: glibc untouched")
    parser.add_argument("--per-step", type=int, default=0, help="steps of ZeRO-0 and ZeRO-3 with each step's peak RSS")
    args = parser.parse_args()
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
    threshold = "64 KiB" if args.malloc == "mmap" else "1 MiB"
    mapped = all(r["mapped"] for r in rows.values())
    malloc = "glibc default" if args.malloc == "default" else (
        f"mmap threshold {threshold}" if mapped else "mallopt unavailable: glibc default")
    print(f"\n{args.model}: {n / 1e6:.1f}M parameters ({cfg.model.num_hidden_layers} layers, hidden "
          f"{cfg.model.hidden_size}, vocab {cfg.model.vocab_size}), dp {args.ranks} (gloo), {args.dtype}, AdamW, "
          f"micro-batch {args.micro_batch} x {args.seq_len} tokens per rank; rank 0, MiB; step 2; malloc: {malloc} "
          f"({time.perf_counter() - start:.0f} s in all)\n")
    print(table(rows))


if __name__ == "__main__":
    main()
