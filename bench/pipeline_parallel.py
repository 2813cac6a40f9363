"""Pipeline parallelism, side by side: tetron's 1F1B, ZB-V and DualPipeV against PyTorch's
`torch.distributed.pipelining` Schedule1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV, each pair training the
same model, cut the same way, on the same micro-batches, in one invocation; then the bubble of each tetron
schedule (afab, 1f1b, interleaved, zbh1, zbv, dualpipev), measured from per-rank timestamps, against the theory.
DualPipeV needs at least 2 * ranks micro-batches (--micro-batches); with fewer its pair is left out.

    python bench/pipeline_parallel.py [--steps 10] [--hidden 256] [--layers 8] [--micro-batches 8]

Each rank runs both implementations in turn, in interleaved rounds (so machine noise hits both
alike), and rank 0 prints the median step time of each and their ratio. A step is the schedule
(every forward and backward), the optimizer step and zeroing the gradients.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import add_model_args, add_timing_args, launch, median_step_times, model_config
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleZBVZeroBubble

from tetron.mesh import Mesh
from tetron.models.llama import Llama, LlamaConfig
from tetron.parallel.init import init_weights_, materialize_
from tetron.parallel.pipeline_parallel import (
    Pipeline,
    PipelineTrace,
    apply_pipeline_stage,
    measure_bubble,
    split_layers,
)
from tetron.parallel.pipeline_schedules import simulate, stage_of, style_of, theoretical_bubble


def make_chunks(config: LlamaConfig, *, pp: int, virtual: int, rank: int, style: str = "loop") -> list[Llama]:
    """This rank's chunks (virtual stages rank, rank+pp, ...; in a V: rank, 2*pp-1-rank), initialised as
    the whole model would be."""
    ranges = split_layers(config.num_hidden_layers, pp * virtual)
    chunks = []
    for c in range(virtual):
        s = stage_of(c, rank, pp=pp, style=style)
        with torch.device("meta"):
            model = Llama(config)
        apply_pipeline_stage(model, ranges[s], first=s == 0, last=s == pp * virtual - 1)
        materialize_(model, torch.device("cpu"))
        init_weights_(model, seed=0, std=0.02)
        chunks.append(model)
    return chunks


def per_rank_median(steps: list[list[float]]) -> list[float]:
    """[step][rank] -> [rank]: the median over steps."""
    return [statistics.median(step[r] for step in steps) for r in range(len(steps[0]))]


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def rank_main(rank: int, args) -> None:
    p, m, mb, seq = args.ranks, args.micro_batches, args.micro_batch, args.seq
    mesh = Mesh(pp=p)
    config = model_config(args)
    g = torch.Generator().manual_seed(0)  # the same batch on every rank
    inputs = torch.randint(0, args.vocab, (m * mb, seq), generator=g)  # [m*mb, T]
    targets = torch.randint(0, args.vocab, (m * mb, seq), generator=g)
    micro_batches = list(zip(inputs.chunk(m), targets.chunk(m)))

    def tetron_pipeline(name: str, virtual: int) -> tuple[Pipeline, torch.optim.Optimizer]:
        chunks = make_chunks(config, pp=p, virtual=virtual, rank=rank, style=style_of(name))
        # sum over tokens / (tokens per micro-batch * m): the mean over the batch, as torch's below
        pipeline = Pipeline(chunks, mesh, schedule_name=name, micro_batches=m, shape=(mb, seq, args.hidden),
                            positions=torch.arange(seq), loss_fn=lambda summed: summed / (mb * seq * m))
        pipeline.watcher = PipelineTrace(rank=rank)  # each step's actions, for the bubble
        params = [q for c in chunks for q in c.parameters()]
        return pipeline, torch.optim.AdamW(params, lr=1e-4)

    # tetron's 1F1B and torch's Schedule1F1B on identical stages (each its own copy of the weights)
    ours, our_opt = tetron_pipeline("1f1b", 1)
    [stage_model] = make_chunks(config, pp=p, virtual=1, rank=rank)
    stage = PipelineStage(stage_model, rank, p, torch.device("cpu"))
    # scale_grads (the default) divides the summed micro-batch gradients by m: each micro-batch's
    # mean loss / m, the same gradient as tetron's
    theirs = Schedule1F1B(stage, m, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    their_opt = torch.optim.AdamW(stage_model.parameters(), lr=1e-4)

    def torch_v(schedule_class: type) -> tuple[object, torch.optim.Optimizer]:
        """torch's schedule of two stages per rank in a V, cut as tetron's."""
        v_models = make_chunks(config, pp=p, virtual=2, rank=rank, style="v")
        v_stages = [PipelineStage(model, stage_of(c, rank, pp=p, style="v"), 2 * p, torch.device("cpu"))
                    for c, model in enumerate(v_models)]
        schedule = schedule_class(v_stages, m, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1),
                                                                                       y.flatten()))
        return schedule, torch.optim.AdamW([q for model in v_models for q in model.parameters()], lr=1e-4)

    # tetron's ZB-V and DualPipeV against torch's: two stages per rank in a V, the same cut
    ours_v, our_opt_v = tetron_pipeline("zbv", 2)
    theirs_v, their_opt_v = torch_v(ScheduleZBVZeroBubble)
    dual = m >= 2 * p  # DualPipeV's least number of micro-batches (torch's and tetron's)
    if dual:
        ours_d, our_opt_d = tetron_pipeline("dualpipev", 2)
        theirs_d, their_opt_d = torch_v(ScheduleDualPipeV)

    def step_tetron(pipeline: Pipeline, opt: torch.optim.Optimizer) -> float:
        loss = pipeline.step(micro_batches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    def step_torch(schedule, opt: torch.optim.Optimizer, *, first: bool, last: bool) -> float:
        losses: list[torch.Tensor] = []
        args_in = (inputs,) if first else ()
        schedule.step(*args_in, **({"target": targets, "losses": losses} if last else {}))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(sum(loss.detach() for loss in losses) / m) if losses else 0.0

    runs = {"tetron 1f1b": lambda: step_tetron(ours, our_opt),
            "torch 1f1b": lambda: step_torch(theirs, their_opt, first=rank == 0, last=rank == p - 1),
            "tetron zbv": lambda: step_tetron(ours_v, our_opt_v),
            "torch zbv": lambda: step_torch(theirs_v, their_opt_v, first=rank == 0, last=rank == 0)}
    if dual:
        runs["tetron dualpipev"] = lambda: step_tetron(ours_d, our_opt_d)
        runs["torch dualpipev"] = lambda: step_torch(theirs_d, their_opt_d, first=rank == 0, last=rank == 0)
    first = {impl: fn() for impl, fn in runs.items()}  # warm-up (torch infers shapes on its first step)
    for fn in runs.values():
        fn()
    med = median_step_times(runs, steps=args.steps, per_round=args.per_round)

    # the bubble of each schedule, from every rank's action timestamps
    bubbles = {}
    for name, virtual in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbv", 2),
                          *([("dualpipev", 2)] if dual else [])):
        pipeline, opt = tetron_pipeline(name, virtual)
        measured, replayed, peaks = [], [], []
        for k in range(args.bubble_steps + 1):
            dist.barrier()
            pipeline.step(micro_batches)
            opt.zero_grad(set_to_none=True)
            traces: list = [None] * p
            dist.all_gather_object(traces, pipeline.watcher)  # in-memory objects between ranks
            if k:  # the first is warm-up
                measured.append(measure_bubble(traces))
                # the same actions with their measured compute times, communication free: what is
                # left is the schedule's own bubble (with these stages' imbalance), not the network's
                durations = [[end - start for _, _, _, start, end in t.events] for t in traces]
                replayed.append(simulate(name, pp=p, virtual=virtual, micro_batches=m,
                                         duration=lambda r, i, action, d=durations: d[r][i]))
                peaks = [t.peak_in_flight for t in traces]
        bubbles[name] = (virtual, per_rank_median(measured), per_rank_median(replayed), peaks)

    if rank == p - 1:
        n_params = sum(q.numel() for q in ours.chunks[0].parameters())
        print(f"last stage: {n_params / 1e6:.2f}M params; first-step loss tetron 1f1b {first['tetron 1f1b']:.6f}, "
              f"torch 1f1b {first['torch 1f1b']:.6f}", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"first-step loss (rank 0 holds the last stage of the V): tetron zbv {first['tetron zbv']:.6f}, "
              f"torch zbv {first['torch zbv']:.6f}" + (f"; tetron dualpipev {first['tetron dualpipev']:.6f}, torch "
                                                       f"dualpipev {first['torch dualpipev']:.6f}" if dual else ""))
        print(f"pipeline parallel, {p} ranks (gloo), {args.layers} layers hidden {args.hidden} vocab {args.vocab}, "
              f"{m} micro-batches of {mb}x{seq}, {args.steps} steps each")
        pairs = [("tetron 1f1b", "torch 1f1b", "Schedule1F1B"), ("tetron zbv", "torch zbv", "ScheduleZBVZeroBubble"),
                 *([("tetron dualpipev", "torch dualpipev", "ScheduleDualPipeV")] if dual else [])]
        for ours_name, theirs_name, label in pairs:
            print(f"  {ours_name:16s} median step {med[ours_name] * 1e3:8.1f} ms   torch {label:22s} "
                  f"{med[theirs_name] * 1e3:8.1f} ms   tetron / torch = {med[ours_name] / med[theirs_name]:.3f}"
                  f"   (1.00 or below: tetron is not slower)")
        print(f"  bubble: idle fraction of the step per rank, median of {args.bubble_steps} steps; measured from "
              f"action timestamps, replayed (measured compute, free communication), theory with B = 2F "
              f"(W = B = F under zbh1, zbv, dualpipev)")
        for name, (virtual, measured, replayed, peaks) in bubbles.items():
            theory = theoretical_bubble(name, pp=p, virtual=virtual, micro_batches=m)
            print(f"    {name:11s} v={virtual}  measured [{fmt(measured)}]  replayed [{fmt(replayed)}]  "
                  f"theory {theory:.3f}   peak (chunk, micro-batch) pairs held per rank {peaks}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(parser)
    parser.add_argument("--bubble-steps", type=int, default=3, help="measured steps per schedule for the bubble")
    add_model_args(parser, layers=8, vocab=256)  # pipeline: a small vocab, so the last stage's head costs little
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args()
    launch(rank_main, args)

if __name__ == "__main__":
    main()
