"""Muon against AdamW and against torch.optim.Muon: one optimizer step on the SmolLM-135M shape, in one process and
at dp2 ZeRO-1; and what keeping matrices whole costs ZeRO on the wire at dp8 (the 135M shape's bucket layouts,
computed).

    python bench/optimizer.py [--layers 30] [--steps 3] [--rounds 5] [--peer-layers 2] [--ns-dtype float32|bfloat16]
                              [--config CONFIG] [--tiny]

`--tiny` runs every part on a tiny model of the config's family (hidden 72, 2 layers, vocabulary 512, sequences
of 64): a check that the benchmark runs, not a measurement.

Step time. The model of the config (SmolLM-135M: hidden 576, 30 layers, 9/3 heads, tied embeddings), fp32, with
fixed random gradients; each optimizer (tetron's AdamW, the fused kernel; tetron's Muon; torch.optim.Muon on the
matrices plus torch's fused AdamW on the rest: the peer) steps in turn, round after round, and the medians are
compared. Newton-Schulz runs in `--ns-dtype`. The row against torch.optim.Muon always runs, both sides in bf16
(torch's only dtype, which this CPU has slow matmuls for), on `--peer-layers` layers, the median of `--rounds`.
`--layers` shrinks the model (every layer has the same matrices, so the ratio per layer stays); `--hidden` and
`--intermediate` shrink its matrices, for a quick bf16 comparison with torch's on a CPU. The overhead on a training
step: Muon's optimizer step less AdamW's, over AdamW's step plus one forward and backward of the config's
micro-batches (timed here, on this device: the fraction that device would see).

dp2 ZeRO-1: two forked gloo ranks, each tetron's own ZeRO-1 build of the model (parallelize, build_optimizer) with
AdamW and with Muon, fixed random gradients in the buckets, the optimizer steps (the update of the owned pieces and
the all-gather of the parameters after it) timed in interleaved rounds, medians compared.

Muon's extra FLOPs: per matrix [A, B] (m = min, n = max) and iteration 4 m^2 n + 2 m^3, times ns_steps; printed
beside a training step's 6 * parameters * tokens at the config's batch, the fraction a GPU spends on it.

Bytes on the wire at dp8: ZeRO-1 (buckets of bucket_mb) and ZeRO-3 (one unit per decoder layer): each bucket's
padded size, cut anywhere (AdamW) or each matrix whole on one rank (Muon), from the planner's layout (plan/state.py,
equal to data_parallel.py's: tests/test_plan_muon.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import launch, median_step_times  # noqa: E402

from tetron.config import OptimConfig, load_config  # noqa: E402
from tetron.mesh import Mesh  # noqa: E402
from tetron.models.spec import spec_of  # noqa: E402
from tetron.optim import AdamW, Muon, Param  # noqa: E402
from tetron.parallel.parallelize import build_optimizer, parallelize, param_roles  # noqa: E402
from tetron.plan.state import chunk_buckets, rank_chunks  # noqa: E402


def ns_flops(shape: torch.Size, steps: int) -> int:
    """Newton-Schulz FLOPs of one parameter: each of its [A, B] matrices, `steps` iterations of three matmuls."""
    a, b = shape[-2:]
    m, n = min(a, b), max(a, b)
    return (shape.numel() // (a * b)) * steps * (4 * m * m * n + 2 * m ** 3)


class TorchPeer:
    """torch.optim.Muon on the matrices, torch's fused AdamW (decay on all but vectors) on the rest."""

    def __init__(self, params: list[Param], train, optim: OptimConfig) -> None:
        matrices = [p.tensor for p in params if p.role == "matrix"]
        rest = [p for p in params if p.role != "matrix"]
        self.muon = torch.optim.Muon(matrices, lr=train.lr, weight_decay=train.weight_decay,
                                     momentum=optim.muon_momentum, nesterov=optim.muon_nesterov,
                                     ns_coefficients=tuple(optim.muon_ns_coefficients), eps=optim.muon_eps,
                                     ns_steps=optim.muon_ns_steps, adjust_lr_fn=optim.muon_adjust_lr)
        self.adamw = torch.optim.AdamW(
            [{"params": [p.tensor for p in rest if p.role != "vector"], "weight_decay": train.weight_decay},
             {"params": [p.tensor for p in rest if p.role == "vector"], "weight_decay": 0.0}],
            lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, fused=True)

    def step(self) -> None:
        self.adamw.step()
        self.muon.step()


def step_times(cfg, args) -> None:
    """One process: each optimizer's step over the model's parameters, fixed random gradients; then the step's
    forward and backward, for the overhead on a whole training step."""
    torch.manual_seed(0)
    model = spec_of(cfg.model).model_class(cfg.model)
    roles = param_roles([model])
    optim = OptimConfig(name="muon", muon_ns_dtype=args.ns_dtype)
    runs = {}
    for name, make in (("adamw", lambda ps: AdamW(ps, cfg.train)), ("muon", lambda ps: Muon(ps, cfg.train, optim))):
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        runs[name] = (make([Param(q, roles[id(p)], q.shape) for q, p in zip(params, model.parameters())]), [])
    for _ in range(args.steps + 1):  # the first step of each (state allocated) is not timed
        for opt, times in runs.values():
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    median = {name: statistics.median(times[1:]) for name, (_, times) in runs.items()}
    for name, t in median.items():
        print(f"  {name:18s} step {t * 1e3:9.1f} ms (median of {args.steps})")
    print(f"  muon / adamw: {median['muon'] / median['adamw']:.2f}x the optimizer step")
    train_s = forward_backward_s(cfg, model)
    extra = median["muon"] - median["adamw"]
    print(f"  a training step's forward and backward ({cfg.train.grad_acc} x {cfg.train.micro_batch} x "
          f"{cfg.data.seq_len} tokens): {train_s * 1e3:,.1f} ms -> Muon adds {extra * 1e3:,.1f} ms, "
          f"{extra / (train_s + median['adamw']):+.1%} of the step (goal <= 10%)")


def torch_peer_row(cfg, args) -> None:
    """tetron's Muon against torch.optim.Muon (plus fused AdamW on the rest) in one process, both iterating in
    bf16 (torch's only dtype), on --peer-layers layers of the config's shape (every layer has the same matrices);
    the median of --rounds interleaved rounds after one untimed step each. Always printed."""
    import dataclasses

    model_cfg = dataclasses.replace(cfg.model, num_hidden_layers=min(args.peer_layers, cfg.model.num_hidden_layers))
    torch.manual_seed(0)
    model = spec_of(model_cfg).model_class(model_cfg)
    roles = param_roles([model])
    optim = OptimConfig(name="muon", muon_ns_dtype="bfloat16")
    runs = {}
    for name, make in (("muon", lambda ps: Muon(ps, cfg.train, optim)),
                       ("torch.optim.Muon", lambda ps: TorchPeer(ps, cfg.train, optim))):
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        runs[name] = (make([Param(q, roles[id(p)], q.shape) for q, p in zip(params, model.parameters())]), [])
    for _ in range(args.rounds + 1):
        for opt, times in runs.values():
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
    median = {name: statistics.median(times[1:]) for name, (_, times) in runs.items()}
    print(f"  against torch.optim.Muon, one process, Newton-Schulz in bf16 on both sides, "
          f"{model_cfg.num_hidden_layers} layers, median of {args.rounds} rounds: tetron {median['muon'] * 1e3:,.1f} "
          f"ms, torch {median['torch.optim.Muon'] * 1e3:,.1f} ms -> torch / tetron "
          f"{median['torch.optim.Muon'] / median['muon']:.2f} (>= 1: tetron as fast)")


def forward_backward_s(cfg, model: torch.nn.Module) -> float:
    """Seconds of one step's forward and backward passes (grad_acc micro-batches), the median of two after one."""
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.data.seq_len))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(cfg.train.grad_acc):
            model(tokens, targets=tokens).backward()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def zero1_rank(rank: int, args) -> None:
    """One of two ranks: tetron's dp2 ZeRO-1 optimizer step with AdamW and with Muon, timed in turn."""
    steps = {}
    for name in ("adamw", "muon"):
        cfg = load_config(args.config, [*args.overrides, "--parallel.dp=2", "--parallel.zero=1",
                                        f"--optim.name={name}", f"--optim.muon_ns_dtype={args.ns_dtype}"])
        mesh = Mesh(dp=2)
        model = parallelize(cfg, mesh, torch.device("cpu"))
        optimizer = build_optimizer(model, cfg, mesh)
        gen = torch.Generator().manual_seed(rank)
        for chunk in model.dp_chunks:
            for bucket in chunk.buckets:
                bucket.buffer.copy_(torch.randn(bucket.buffer.shape, generator=gen) * 1e-3)
        steps[name] = optimizer.step
    median = median_step_times(steps, steps=max(2, args.steps), per_round=1)
    if rank == 0:
        for name, t in median.items():
            print(f"  {name:18s} step {t * 1e3:9.1f} ms at dp2 ZeRO-1 (median of {max(2, args.steps)}, rank 0)")
        print(f"  muon / adamw at dp2 ZeRO-1: {median['muon'] / median['adamw']:.2f}x the optimizer step")


def ns_share(cfg, ns_steps: int) -> None:
    """Newton-Schulz FLOPs of the whole model against a training step's."""
    with torch.device("meta"):
        model = spec_of(cfg.model).model_class(cfg.model)
    roles = param_roles([model])
    matrices = [p for p in model.parameters() if roles[id(p)] == "matrix"]
    flops = sum(ns_flops(p.shape, ns_steps) for p in matrices)
    n = sum(p.numel() for p in model.parameters())
    tokens = cfg.train.micro_batch * cfg.train.grad_acc * cfg.data.seq_len  # per rank and step
    print(f"  Newton-Schulz: {flops / 1e12:.2f} TFLOP a step ({len(matrices)} matrices); a training step at {tokens} "
          f"tokens per rank: {6 * n * tokens / 1e12:.1f} TFLOP -> {flops / (6 * n * tokens):.1%} more (without ZeRO "
          f"every dp rank orthogonalises every matrix; under ZeRO each its own 1/dp)")


def wire_bytes(cfg, shards: int) -> None:
    """ZeRO-1 and ZeRO-3's bucket elements at dp `shards`, cut anywhere (AdamW) or each matrix whole on one rank
    (Muon), as the planner lays them out (plan/state.py: the same layout as data_parallel.py's, tested equal)."""
    for zero in (1, 3):
        sizes = {}
        for name in ("adamw", "muon"):
            run = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=shards, zero=zero, tp=1, pp=1,
                                                                        cp=1, ep=1, dp_shard=None),
                                      optim=dataclasses.replace(cfg.optim, name=name))
            sizes[name] = sum(b.padded for c in rank_chunks(run, 0) for b in chunk_buckets(run, c))
        # per step and rank: grads reduce-scattered (fp32), params all-gathered (bf16; ZeRO-3: forward and backward)
        per_elem = 4 + 2 * (2 if zero == 3 else 1)
        cut, whole = ((shards - 1) / shards * sizes[n] * per_elem / 2**20 for n in ("adamw", "muon"))
        print(f"  dp{shards} ZeRO-{zero}: {sizes['adamw']:,} elements in AdamW's buckets, {sizes['muon']:,} in Muon's "
              f"(matrices whole) ({sizes['muon'] / sizes['adamw']:.2f}x); per rank and step {cut:,.0f} MiB -> "
              f"{whole:,.0f} MiB sent (fp32 gradients, bf16 parameters)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="rows printed, in order: the one-process step (adamw, muon, muon / adamw, the overhead on a training "
               "step); against torch.optim.Muon (bf16 on both sides, --peer-layers, median of --rounds); dp2 ZeRO-1; "
               "Newton-Schulz FLOPs; bytes on the wire at dp --shards.\nexamples:\n"
               "  python bench/optimizer.py --tiny                      # a check that every row runs\n"
               "  python bench/optimizer.py                             # the SmolLM-135M shape, every row\n"
               "  python bench/optimizer.py --layers 4 --peer-layers 2 --rounds 5   # quicker, same ratios per layer")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "smollm-135m.yaml"))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: the config's)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: the config's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of the one-process and dp2 rows")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of the torch.optim.Muon row (median)")
    parser.add_argument("--peer-layers", type=int, default=2,
                        help="layers of the torch.optim.Muon row (bf16 matmuls are slow on a CPU; default 2)")
    parser.add_argument("--ns-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="a tiny model: check that it runs (no measurement)")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.intermediate = args.layers or 2, args.hidden or 72, args.intermediate or 192
    overrides = [f"--model.{key}={value}" for key, value in (("num_hidden_layers", args.layers),
                                                             ("hidden_size", args.hidden),
                                                             ("intermediate_size", args.intermediate)) if value]
    if args.tiny:
        overrides += ["--model.vocab_size=512", "--data.seq_len=64", "--train.micro_batch=2", "--train.grad_acc=2",
                      "--model.max_position_embeddings=64"]
    args.overrides = overrides
    cfg = load_config(args.config, overrides)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"{Path(args.config).name}: hidden {cfg.model.hidden_size}, {cfg.model.num_hidden_layers} layers; "
          f"Newton-Schulz in {args.ns_dtype}" + (" (--tiny: a check that it runs, not a measurement)"
                                                 if args.tiny else ""))
    step_times(cfg, args)
    torch_peer_row(cfg, args)
    args.ranks = 2
    launch(zero1_rank, args)
    full = load_config(args.config, overrides if args.tiny else [])
    print(f"{Path(args.config).name} ({full.model.num_hidden_layers} layers), bucket_mb {full.parallel.bucket_mb}:")
    ns_share(full, OptimConfig().muon_ns_steps)
    wire_bytes(full, args.shards)


if __name__ == "__main__":
    main()
