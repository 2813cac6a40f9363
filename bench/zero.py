"""ZeRO, side by side: tetron's ZeRO-1 and ZeRO-2 against PyTorch's DistributedDataParallel with
torch.optim.AdamW, and tetron's ZeRO-3 against PyTorch's FSDP2 (`fully_shard` on each decoder layer,
then on the root, AdamW over its DTensor parameters), training the same model from the same initial
weights on the same batches; first their speed, then their memory.

    python bench/zero.py [--ranks 2] [--steps 20] [--hidden 256] [--layers 4] [--batch 8] [--mem-steps 3]

Speed: one set of forked gloo ranks builds all five, checks that they agree (the loss of the first
two steps: the initial weights, then one AdamW update), and times them in interleaved rounds (so
machine noise hits all alike); rank 0 prints the median step time of each and the ratios tetron/peer.
Memory: each implementation in a fresh set of forked ranks (in one process the others' memory would
count): built, then `tetron.device.reset_peak_memory`, `--mem-steps` steps, and rank 0's peak resident
set (`tetron.device.peak_memory_mb`) and its training state in bytes (`tetron.observe.memory.state_bytes`:
parameters, gradients, optimizer state, each storage counted once; FSDP2's DTensors count their local
shards), taken after the last optimizer step, before the gradients are zeroed. These ranks map every
allocation of 64 KiB and more on its own (glibc's mallopt, as bench/memory.py does), so that the
resident set follows the live tensors rather than what glibc's heap keeps of freed ones.

Tetron is built the way `tetron train` builds it: a Config (tetron.config.from_dict, the model section
from this benchmark's LlamaConfig), `parallelize`, `build_optimizer`, then train_step's order:
forward/backward, `finish_gradients`, `clip_grads_`, the optimizer step, `zero_grad`. Gradient
clipping is on for every implementation (`--clip 1.0`, torch's `clip_grad_norm_` for the peers) or,
with `--clip 0`, off for the peers, while tetron still computes the norm it logs (train_step always
does). Weight decay applies to matrices only on both sides; the learning rate is constant. DDP runs
with `gradient_as_bucket_view=True` (no second copy of the gradients) and the same bucket size as
tetron's buckets (`--bucket-mb`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    add_model_args,
    add_timing_args,
    launch,
    map_every_allocation,
    median_step_times,
    model_config,
    rss_mb,
)
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from tetron import device as dev
from tetron.config import from_dict
from tetron.mesh import Mesh
from tetron.models.llama import Llama, LlamaConfig
from tetron.observe.memory import StateBytes, optimizer_tensors, state_bytes
from tetron.parallel.grads import clip_grads_
from tetron.parallel.init import init_weights_
from tetron.parallel.parallelize import build_optimizer, finish_gradients, parallelize

IMPLS = ("zero1", "zero2", "ddp", "zero3", "fsdp2")
LABELS = {"zero1": "tetron ZeRO-1", "zero2": "tetron ZeRO-2", "ddp": "torch DDP + AdamW",
          "zero3": "tetron ZeRO-3", "fsdp2": "torch FSDP2 + AdamW"}
PAIRS = (("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "fsdp2"))  # (tetron, its peer)
SEED, LR, BETAS, EPS, WEIGHT_DECAY = 0, 1e-3, (0.9, 0.95), 1e-8, 0.1
CPU = torch.device("cpu")
# torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor (used by tetron and FSDP2), once per call site
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)

# step(inputs, targets, measure) -> (this rank's loss, its state bytes when `measure`)
Step = Callable[[Tensor, Tensor, bool], tuple[Tensor, StateBytes | None]]


def tetron_step(args: argparse.Namespace, config: LlamaConfig, zero: int, mesh: Mesh) -> Step:
    """Tetron as `tetron train` builds and steps it (train.build_run and train.train_step)."""
    cfg = from_dict({
        "model": dataclasses.asdict(config),
        "parallel": {"dp": args.ranks, "zero": zero, "bucket_mb": args.bucket_mb},
        "data": {"seq_len": args.seq},
        "train": {"micro_batch": args.batch, "lr": LR, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS,
                  "weight_decay": WEIGHT_DECAY, "grad_clip": args.clip, "seed": SEED},
    })
    model = parallelize(cfg, mesh, CPU)
    optimizer = build_optimizer(model, cfg, mesh)
    positions = torch.arange(args.seq)

    def step(inputs: Tensor, targets: Tensor, measure: bool) -> tuple[Tensor, StateBytes | None]:
        loss = model.dp_chunks[0](inputs, positions, targets=targets) / inputs.numel()  # head and loss, chunked
        loss.backward()
        finish_gradients(model, mesh, optimizer)
        clip_grads_(optimizer.grads(), cfg.train.grad_clip, mesh, sharded_over_dp=zero >= 1)
        optimizer.step()
        state = None
        if measure:  # as observe.memory.memory_figures counts it: a rank's parameter slices are parameters
            buckets = [b for chunk in model.dp_chunks for b in chunk.buckets]
            slices = [b.params_slice for b in buckets if getattr(b, "params_slice", None) is not None]
            state = state_bytes(params=[*model.params, *slices],
                                grads=[p.grad for p in model.params] + [b.buffer for b in buckets]
                                + [b.shard_grad for b in buckets],
                                optimizer_tensors=optimizer.tensors())
        model.zero_grad()
        return loss.detach(), state

    return step


def seeded_llama(config: LlamaConfig) -> Llama:
    """The whole model, with the weights tetron's parallelize gives it (init from SEED, by name)."""
    model = Llama(config)
    init_weights_(model, seed=SEED, std=config.initializer_range)
    return model


def adamw(model: nn.Module) -> torch.optim.AdamW:
    """AdamW as tetron's: decoupled weight decay on matrices only."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


@torch.no_grad()
def local(tensors) -> list[Tensor | None]:
    """FSDP2's DTensors as their local shards, for tetron.observe.memory (whose DTensor case reads the names
    of DTensor.__tensor_flatten__, which in torch 2.13 include the non-tensor `device_mesh`)."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def torch_step(args: argparse.Namespace, config: LlamaConfig, impl: str) -> Step:
    """DDP (with AdamW on its replicated parameters) or FSDP2 (AdamW on its DTensor shards)."""
    model = seeded_llama(config)
    if impl == "ddp":
        wrapped: nn.Module = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    else:
        device_mesh = init_device_mesh("cpu", (args.ranks,))
        for layer in model.model.layers.values():
            fully_shard(layer, mesh=device_mesh)
        wrapped = fully_shard(model, mesh=device_mesh)
    optimizer = adamw(model)
    params = list(model.parameters())
    positions = torch.arange(args.seq)

    def step(inputs: Tensor, targets: Tensor, measure: bool) -> tuple[Tensor, StateBytes | None]:
        logits = wrapped(inputs, positions)  # [B, T, vocab]
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        optimizer.step()
        state = None
        if measure:
            state = state_bytes(params=local(params), grads=local(p.grad for p in params),
                                optimizer_tensors=local(optimizer_tensors(optimizer)))
        # DDP's gradients are views into its buckets: zeroed in place, as tetron zeroes its buckets
        optimizer.zero_grad(set_to_none=impl != "ddp")
        return loss.detach(), state

    return step


def build(impl: str, args: argparse.Namespace, config: LlamaConfig, mesh: Mesh) -> Step:
    if impl.startswith("zero"):
        return tetron_step(args, config, int(impl[-1]), mesh)
    return torch_step(args, config, impl)


def batch(rank: int, args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """This rank's batch, the same for every implementation and every step."""
    g = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return inputs, targets


def mean_over_ranks(value: Tensor) -> float:
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return float(value)


def speed_main(rank: int, args: argparse.Namespace) -> None:
    """All five in one set of ranks: the losses of the first two steps, then interleaved timing."""
    config, mesh = model_config(args), Mesh(dp=args.ranks)
    inputs, targets = batch(rank, args)
    steps = {impl: build(impl, args, config, mesh) for impl in IMPLS}
    losses = {impl: [mean_over_ranks(steps[impl](inputs, targets, False)[0]) for _ in range(2)] for impl in IMPLS}
    med = median_step_times({impl: lambda impl=impl: steps[impl](inputs, targets, False) for impl in IMPLS},
                            steps=args.steps, per_round=args.per_round)
    if rank != 0:
        return
    n_params = config.num_params()
    print(f"ZeRO, {args.ranks} ranks (gloo, {torch.get_num_threads()} threads each), {n_params / 1e6:.1f}M params "
          f"({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}), batch {args.batch}x{args.seq} per rank, "
          f"fp32, bucket {args.bucket_mb} MB, clip {args.clip or 'off'}, {args.steps} timed steps each")
    ref = losses["ddp"]
    for impl in IMPLS:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses[impl], ref))
        print(f"  {LABELS[impl]:20s} loss step 1 {losses[impl][0]:.6f}  step 2 {losses[impl][1]:.6f}  "
              f"(max rel. diff to DDP {diff:.1e})   median step {med[impl] * 1e3:8.1f} ms")
    for ours, peer in PAIRS:
        print(f"  {LABELS[ours]} / {LABELS[peer]:20s} = {med[ours] / med[peer]:.3f}   (1.00 or below: not slower)")


def memory_main(rank: int, args: argparse.Namespace) -> None:
    """One implementation in fresh ranks: build, reset the peak, a few steps; rank 0 writes its figures."""
    mapped = map_every_allocation()
    config, mesh = model_config(args), Mesh(dp=args.ranks)
    inputs, targets = batch(rank, args)
    start_mb = rss_mb()
    step = build(args.impl, args, config, mesh)
    dist.barrier()
    dev.reset_peak_memory(CPU)
    for i in range(args.mem_steps):
        _, state = step(inputs, targets, i == args.mem_steps - 1)
    peak = dev.peak_memory_mb(CPU)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"start_mb": start_mb, "peak_mb": peak, "mapped": mapped, **state.as_dict()}, f)


def measure_memory(args: argparse.Namespace) -> dict[str, dict]:
    """Each implementation in its own launch; rank 0's figures."""
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in IMPLS:
            result = os.path.join(tmp, f"{impl}.json")
            launch(memory_main, argparse.Namespace(**vars(args), impl=impl, result=result))
            with open(result) as f:
                figures[impl] = json.load(f)
    return figures


def print_memory(args: argparse.Namespace, figures: dict[str, dict]) -> None:
    mb = 2**20
    malloc = "every allocation of 64 KiB+ mapped" if all(m["mapped"] for m in figures.values()) else "glibc default"
    print(f"memory of rank 0, each implementation in fresh ranks, {args.mem_steps} steps after building "
          f"(state: after the last optimizer step; peak: resident set, whole process; malloc: {malloc})")
    print(f"  {'':20s} {'params':>9s} {'grads':>9s} {'optimizer':>10s} {'state':>9s} {'peak RSS':>9s} "
          f"{'peak - RSS before build':>24s}  (MiB)")
    for impl in IMPLS:
        m = figures[impl]
        print(f"  {LABELS[impl]:20s} {m['params'] / mb:9.2f} {m['grads'] / mb:9.2f} {m['optimizer'] / mb:10.2f} "
              f"{m['total'] / mb:9.2f} {m['peak_mb']:9.1f} {m['peak_mb'] - m['start_mb']:24.1f}")
    for ours, peer in PAIRS:
        a, b = figures[ours], figures[peer]
        print(f"  {LABELS[ours]} / {LABELS[peer]:20s} state {a['total'] / b['total']:.3f}   "
              f"peak {a['peak_mb'] / b['peak_mb']:.3f}   peak above start "
              f"{(a['peak_mb'] - a['start_mb']) / (b['peak_mb'] - b['start_mb']):.3f}   (1.00 or below: no more)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(parser)
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip on every side; 0: off")
    parser.add_argument("--mem-steps", type=int, default=3)
    args = parser.parse_args()
    launch(speed_main, args)
    print_memory(args, measure_memory(args))


if __name__ == "__main__":
    main()
