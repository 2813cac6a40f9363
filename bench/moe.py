"""Mixture of experts, side by side, in one invocation:

  1. one process: tetron's Qwen3-MoE against transformers' Qwen3MoeForCausalLM on the same weights (the names
     are equal) and batch, forward and backward: the losses checked equal (equal work), then tokens/s in
     interleaved rounds; also tetron with its experts the way it does not pick (the per-expert loop where
     torch._grouped_mm runs), and the first MoE block alone (the experts are all its time). transformers 5 picks
     its experts' code by `config._experts_implementation`: the ratio is against its default (it resolves to
     "grouped_mm", torch's grouped matmul, on the CPU too); "eager", its loop over the experts hit, is timed
     too; "batched_mm" is not (a copy of the expert weights per assignment: 1.5 GiB a layer here).
  2. expert parallelism: tetron's own training step (train.dispatch_step) on forked ranks, dp = ep = ranks
     against ep = 1 (gloo, or NCCL with a GPU per rank): the first losses checked equal, tokens/s, and one
     step's all-to-all bytes counted (each expert_parallel.all_to_all_rows call: rows sent to another rank)
     against the formula: dispatch and combine, forward and backward, 4 * rows sent off-rank * hidden *
     bytes per MoE layer and micro-batch, over all ranks; exact with the routing's own off-rank counts,
     (ep-1)/ep of tokens * top_k under uniform routing.

    python bench/moe.py [--part both|one|ep] [--device cpu|cuda] [--dtype float32|bfloat16] [--hidden 256]
                        [--layers 4] [--experts 16] [--top-k 2] [--seq 256] [--batch 4] [--rounds 5]
                        [--family qwen3_moe|gpt_oss|deepseek_v3]

`--family gpt_oss` runs the same against transformers' GptOssForCausalLM (sinks, alternating windows of
128, biased routers and experts, the clamped SwiGLU); its attention is transformers' eager one (gpt-oss takes
no SDPA there). `--family deepseek_v3` against DeepseekV3ForCausalLM (multi-head latent attention, sigmoid
group-limited routing, a shared expert; every layer MoE).

About a minute on 2 CPU cores; `--device cuda` has larger defaults (GPU_SIZES). Speeds are printed, not
asserted. The balancing loss coefficient is 0: both models compute the cross entropy only. bench/gpu_check.py
uses `compare_models` and `experts_path` for its MoE rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import rank_config
from torch import Tensor, nn

import tetron.models.experts as experts_module
import tetron.parallel.expert_parallel as ep_module
from tetron.config import from_dict
from tetron.data.batch import MicroBatch
from tetron.device import synchronize
from tetron.launch import setup_rank
from tetron.mesh import Mesh
from tetron.models.deepseek_v3 import DeepseekV3Config
from tetron.models.gpt_oss import GptOssConfig
from tetron.models.moe import moe_blocks
from tetron.models.qwen3_moe import MoeConfig
from tetron.observe.step_report import read_back
from tetron.parallel.init import seeded_model
from tetron.parallel.parallelize import build_optimizer, parallelize, sequence_positions
from tetron.parallel.pipeline_parallel import layer_ranks
from tetron.train import Run, dispatch_step
from tetron.validate import validate

CPU_SIZES = dict(hidden=256, layers=4, experts=16, top_k=2, expert_width=256, seq=256, batch=4, vocab=4096)
GPU_SIZES = dict(hidden=1024, layers=4, experts=64, top_k=8, expert_width=512, seq=2048, batch=4, vocab=32768)
HF_IMPLS = (None, "eager")  # transformers' default (None) first: the ratio's peer


def moe_config(s: dict) -> MoeConfig:
    """A Qwen3-MoE (or, with s["family"] "gpt_oss", a gpt-oss; "deepseek_v3", a DeepSeek-V3) of the sizes `s`
    (CPU_SIZES' keys): GQA 8/4 heads (DeepSeek-V3: 8 heads of latent attention, q/k 32 + 16 wide, v 32, latents of
    hidden/2 and hidden/4, one shared expert, sigmoid routing in 4 groups), every layer MoE, no balancing loss."""
    sizes = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["expert_width"],
                 moe_intermediate_size=s["expert_width"], num_hidden_layers=s["layers"], num_attention_heads=8,
                 max_position_embeddings=s["seq"], num_experts=s["experts"], num_experts_per_tok=s["top_k"],
                 router_aux_loss_coef=0.0)
    if s.get("family") == "deepseek_v3":
        return DeepseekV3Config(**sizes, num_key_value_heads=8, q_lora_rank=s["hidden"] // 2,
                                kv_lora_rank=s["hidden"] // 4, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                v_head_dim=32, first_k_dense_replace=0, n_shared_experts=1, n_group=4, topk_group=2)
    config_class = GptOssConfig if s.get("family") == "gpt_oss" else MoeConfig
    return config_class(**sizes, num_key_value_heads=4)


# ------------------------------------------------------------------------------------------ 1. one process


def build_pair(s: dict, device: torch.device, dtype: torch.dtype,
               impls: tuple[str | None, ...] = HF_IMPLS) -> tuple[nn.Module, dict[str, nn.Module]]:
    """tetron's model (seeded as a run starts it) and transformers' class of its family (Qwen3MoeForCausalLM,
    GptOssForCausalLM) on its weights for each experts implementation (None: transformers' default), named by
    the one it resolved."""
    import transformers

    cfg = moe_config(s)
    ours = seeded_model(cfg, seed=0, device=device)
    attention = "eager" if cfg.model_type == "gpt_oss" else "sdpa"  # GptOss takes no SDPA
    hfs = {}
    for impl in impls:
        with torch.device(device):
            hf = getattr(transformers, cfg.hf_architecture)(transformers.AutoConfig.for_model(
                **cfg.to_hf(), attn_implementation=attention, experts_implementation=impl))
        hf.load_state_dict(ours.state_dict(), strict=True)
        resolved = hf.config._experts_implementation
        hfs[f"default ({resolved})" if impl is None else resolved] = hf.to(dtype)
    return ours.to(dtype), hfs


def model_steps(ours: nn.Module, hfs: dict[str, nn.Module], ids: Tensor, targets: Tensor) -> dict[str, Callable]:
    """Forward and backward of each model on one batch, returning the mean cross entropy: tetron's model
    computes it from the targets (its chunked head and loss), transformers' from its logits."""
    def tetron_step() -> Tensor:
        loss = ours(ids, targets=targets) / targets.numel()
        loss.backward()
        ours.zero_grad(set_to_none=True)
        return loss.detach()

    def hf_step(hf: nn.Module) -> Tensor:
        logits = hf(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        hf.zero_grad(set_to_none=True)
        return loss.detach()

    return {"tetron": tetron_step, **{f"transformers {k}": lambda hf=hf: hf_step(hf) for k, hf in hfs.items()}}


def block_steps(ours: nn.Module, hfs: dict[str, nn.Module], x: Tensor, dout: Tensor) -> dict[str, Callable]:
    """Forward and backward of the first layer's MoE block alone, from the output gradient `dout`."""
    def step(block: nn.Module) -> Tensor:
        leaf = x.detach().requires_grad_()
        out = block(leaf)
        out = out[0] if isinstance(out, tuple) else out  # GptOssMLP returns (output, router scores)
        out.backward(dout)
        block.zero_grad(set_to_none=True)
        return out.detach().float().abs().mean()

    blocks = {"tetron": ours.model.layers["0"].mlp,
              **{f"transformers {k}": hf.model.layers[0].mlp for k, hf in hfs.items()}}
    return {name: lambda b=b: step(b) for name, b in blocks.items()}


def time_rounds(fns: dict[str, Callable], device: torch.device, *, rounds: int, per_round: int,
                warmup: int = 1) -> dict[str, list[list[float]]]:
    """Seconds of each call, per round: the functions take turns (`per_round` calls each), so drift in the
    machine's load hits them alike. `warmup` calls of each first, untimed."""
    for fn in [fn for fn in fns.values() for _ in range(warmup)]:
        fn()
    times: dict[str, list[list[float]]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append([])
            for _ in range(per_round):
                synchronize(device)
                start = time.perf_counter()
                fn()
                synchronize(device)
                times[name][-1].append(time.perf_counter() - start)
    return times


def median(rounds: list[list[float]]) -> float:
    return statistics.median(t for r in rounds for t in r)


def check_same_loss(fns: dict[str, Callable], dtype: torch.dtype) -> dict[str, float]:
    """Each function's loss on the batch, checked equal to tetron's (fp32: 1e-5 relative; bf16: 2e-2, the
    two models round their bf16 activations at different places)."""
    losses = {name: float(fn()) for name, fn in fns.items()}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, loss in losses.items():
        assert abs(loss - losses["tetron"]) <= tol * abs(losses["tetron"]), f"loss of {name} {loss} != {losses}"
    return losses


def compare_models(s: dict, device: torch.device, dtype: torch.dtype, *, rounds: int, per_round: int,
                   impls: tuple[str | None, ...] = HF_IMPLS, block: bool = True, other_path: bool = True) -> dict:
    """Part 1: the losses and the timings (per round) of the whole models (with `other_path`, also tetron's
    with its experts computed the way it does not choose here) and (`block`) of the first MoE block alone."""
    g = torch.Generator().manual_seed(0)
    ids, targets = (torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g).to(device) for _ in range(2))
    ours, hfs = build_pair(s, device, dtype, impls)
    grouped = not uses_grouped(ours)  # tetron's other way: grouped where it loops, the loop where grouped

    def with_other(steps: dict[str, Callable]) -> dict[str, Callable]:
        if other_path:
            steps[f"tetron, {'grouped_mm' if grouped else 'loop'} (forced)"] = lambda fn=steps["tetron"]: (
                experts_path(grouped)(fn)())
        return steps

    steps = with_other(model_steps(ours, hfs, ids, targets))
    out = {"losses": check_same_loss(steps, dtype), "tokens": ids.numel(),
           "model": time_rounds(steps, device, rounds=rounds, per_round=per_round)}
    if block:
        x, dout = (torch.randn(s["batch"], s["seq"], s["hidden"], generator=g).to(device, dtype) for _ in range(2))
        out["block"] = time_rounds(with_other(block_steps(ours, hfs, x, dout)), device, rounds=rounds,
                                   per_round=per_round)
    return out


def print_timings(title: str, times: dict[str, list[list[float]]], tokens: int, ours: str = "tetron") -> None:
    """Tokens/s of each (median over every timed call) and `ours`' ratio to each other, with the spread of
    the rounds' own ratios."""
    print(f"  {title}")
    for name, rounds in times.items():
        print(f"    {name:34s} {tokens / median(rounds):>10,.0f} tokens/s  (median {median(rounds) * 1e3:8.1f} ms)")
    for name in [n for n in times if n != ours]:
        per_round = [statistics.median(p) / statistics.median(t) for t, p in zip(times[ours], times[name])]
        print(f"    {ours} / {name}: {median(times[name]) / median(times[ours]):.2f}x tokens/s "
              f"(rounds {min(per_round):.2f}-{max(per_round):.2f})")


# ------------------------------------------------------------------------------------------ tetron's experts' path


@contextlib.contextmanager
def experts_path(grouped: bool) -> Iterator[None]:
    """tetron's experts by torch._grouped_mm (`grouped`) or by one matmul per expert, wherever they run,
    instead of what Experts.forward picks (grouped wherever torch._grouped_mm runs)."""
    supported = experts_module.grouped_mm_supported
    experts_module.grouped_mm_supported = lambda x, *weights: grouped
    try:
        yield
    finally:
        experts_module.grouped_mm_supported = supported


def uses_grouped(model: nn.Module) -> bool:
    """Whether tetron's experts take the grouped path on this model's device and dtype."""
    weight = moe_blocks(model)[0].experts.gate_up_proj
    return experts_module.grouped_mm_supported(weight[0, :0], weight)


# ------------------------------------------------------------------------------------------ 2. expert parallelism


def trainer_run(args: argparse.Namespace, ep: int, device: torch.device):
    """A train.Run as build_run makes it, less the data (the batches are given): dp = ranks, this ep."""
    cfg = from_dict({"model": dataclasses.asdict(moe_config(vars(args))),
                     "parallel": {"dp": args.ranks, "ep": ep, "device": device.type},
                     "data": {"seq_len": args.seq},
                     "train": {"micro_batch": args.batch, "grad_acc": 1, "lr": 1e-3, "warmup_steps": 0,
                               "schedule": "constant", "seed": 0, "dtype": args.dtype}})
    validate(cfg, world_size=args.ranks)
    mesh = Mesh(dp=args.ranks, ep=ep, device_type=device.type)
    model = parallelize(cfg, mesh, device)
    positions = sequence_positions(cfg, mesh)
    local_tokens = args.batch * args.seq
    return Run(cfg=cfg, mesh=mesh, device=device, tokenizer=None, loader=None, model=model,
               optimizer=build_optimizer(model, cfg, mesh), dtype=getattr(torch, args.dtype),
               loss_fn=lambda summed: summed / local_tokens, positions=positions,
               device_positions=positions.to(device), pipeline=None, layer_ranks=layer_ranks(cfg))


def train_one(run, step: int, batch) -> float:
    """One optimizer step by tetron's own code, read back: the global batch's mean loss."""
    return read_back([dispatch_step(run, step, batch)])[0].loss


@contextlib.contextmanager
def counting_exchange(run, totals: Tensor) -> Iterator[None]:
    """While inside: totals[0] += the bytes this rank sends to other ranks by all_to_all_rows (the tokens
    and, in the backward pass, their gradients); totals[1] += the assignments this rank's MoE blocks send
    to experts on other ranks (from the counts each forward gives its exchange)."""
    rows_fn, rank = ep_module.all_to_all_rows, run.mesh.local_rank("ep")
    blocks = moe_blocks(run.model.chunks[0])

    def all_to_all_rows(x: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        totals[0] += (sum(send) - send[dist.get_rank(group)]) * x[0].numel() * x.element_size()
        return rows_fn(x, send, recv, group)

    def counted(exchange: Callable) -> Callable:
        def experts_fn(tokens: Tensor, counts: Tensor) -> Tensor:
            local = counts.numel() // exchange.ep
            totals[1] += int(counts.sum() - counts[rank * local:(rank + 1) * local].sum())
            return exchange(tokens, counts)
        return experts_fn

    exchanges = [b.experts_fn for b in blocks]
    ep_module.all_to_all_rows = all_to_all_rows
    for block, exchange in zip(blocks, exchanges):
        block.experts_fn = counted(exchange)
    try:
        yield
    finally:
        ep_module.all_to_all_rows = rows_fn
        for block, exchange in zip(blocks, exchanges):
            block.experts_fn = exchange


def ep_rank_main(rank: int, args: argparse.Namespace) -> None:
    """Both layouts on this rank: the first step's losses compared, one ep step's bytes counted, then
    the steps timed in interleaved rounds (each after a barrier); rank 0 prints."""
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(rank)
    ids, targets = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(2))
    batch = [MicroBatch(ids, targets, torch.arange(args.seq, device=device))]
    layouts = {1: trainer_run(args, 1, device), args.ranks: trainer_run(args, args.ranks, device)}
    totals = torch.zeros(2, dtype=torch.float64)
    first = {1: train_one(layouts[1], 0, batch)}
    with counting_exchange(layouts[args.ranks], totals):
        first[args.ranks] = train_one(layouts[args.ranks], 0, batch)
    tol = 1e-5 if args.dtype == "float32" else 1e-2  # bf16: the experts' matmuls see other row counts
    assert abs(first[1] - first[args.ranks]) <= tol * abs(first[1]), f"first-step losses differ: {first}"

    def step(run) -> None:
        dist.barrier()
        train_one(run, 1, batch)  # the step's number only sets the (constant) learning rate

    fns = {f"ep {ep}": lambda run=run: step(run) for ep, run in layouts.items()}
    times = time_rounds(fns, device, rounds=args.rounds, per_round=args.per_round)
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(args.ranks)]
    dist.all_gather(gathered, totals.to(device) if device.type == "cuda" else totals)
    if rank == 0:
        print_ep(args, first, times, [t.cpu().tolist() for t in gathered], layouts[args.ranks])


def print_ep(args: argparse.Namespace, first: dict, times: dict, per_rank: list[list[float]], run) -> None:
    ep, cfg, layers = args.ranks, run.cfg.model, len(moe_blocks(run.model.chunks[0]))
    row_bytes = cfg.hidden_size * getattr(torch, args.dtype).itemsize
    measured, off_rank = (sum(column) for column in zip(*per_rank))
    assignments = ep * layers * args.batch * args.seq * cfg.num_experts_per_tok  # of a step, over the ranks
    print(f"expert parallelism, {ep} ranks ({'NCCL' if args.device == 'cuda' else 'gloo'}), dp {ep}, {layers} MoE "
          f"layers of {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, micro-batch {args.batch}x{args.seq} "
          f"per rank, {args.dtype}; first-step loss ep 1 {first[1]:.6f}, ep {ep} {first[ep]:.6f}")
    print_timings("training step (global batch)", times, ep * args.batch * args.seq, ours=f"ep {ep}")
    print(f"  all-to-all rows sent to another rank in one ep {ep} step, all ranks (per rank: "
          f"{', '.join(f'{b / 2**20:.3f}' for b, _ in per_rank)} MiB)")
    for name, rows in (("measured", measured / row_bytes / 4), (f"formula, this routing ({off_rank / assignments:.3f}"
                       " off-rank)", off_rank), (f"formula, uniform routing ({(ep - 1) / ep:.3f} off-rank)",
                                                 assignments * (ep - 1) / ep)):
        print(f"    {name:42s} 4 x {rows:>9,.0f} rows x {row_bytes} B = {4 * rows * row_bytes / 2**20:8.3f} MiB"
              f"   (measured / this = {measured / (4 * rows * row_bytes):.4f})")


def _ep_entry(rank: int, args: argparse.Namespace, init_file: str) -> None:
    _, restore = setup_rank(rank_config(args.ranks, device=args.device), ranks_per_node=args.ranks)  # as `tetron train`
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=args.ranks,
                            timeout=timedelta(seconds=600))
    try:
        ep_rank_main(rank, args)
    finally:
        dist.destroy_process_group()
        restore()


def compare_ep(args: argparse.Namespace) -> None:
    """Part 2 on forked ranks (before this process touches CUDA, so that forking is safe)."""
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        print(f"expert parallelism: skipped, {args.ranks} ranks need {args.ranks} GPUs "
              f"({torch.cuda.device_count()} here); `--device cpu` measures it on gloo")
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_ep_entry, args=(args, os.path.join(tmp, "init")), nprocs=args.ranks,
                           start_method="fork")


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("both", "one", "ep"), default="both")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: float32 on the CPU, bfloat16 on CUDA")
    for name in CPU_SIZES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {CPU_SIZES[name]} (CPU), {GPU_SIZES[name]} (CUDA)")
    parser.add_argument("--ranks", type=int, default=2, help="expert parallelism: ranks = dp = ep")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--family", choices=("qwen3_moe", "gpt_oss", "deepseek_v3"), default="qwen3_moe")
    parser.add_argument("--per-round", type=int, default=2, help="consecutive steps of each per round")
    args = parser.parse_args()
    defaults = GPU_SIZES if args.device == "cuda" else CPU_SIZES
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.part in ("both", "ep"):
        compare_ep(args)
    if args.part in ("both", "one"):
        one_process(args)


def one_process(args: argparse.Namespace) -> None:
    device, dtype, cfg = torch.device(args.device), getattr(torch, args.dtype), moe_config(vars(args))
    result = compare_models(vars(args), device, dtype, rounds=args.rounds, per_round=args.per_round)
    print(f"one process ({device.type}, {args.dtype}, {torch.get_num_threads()} threads), {cfg.num_params() / 1e6:.1f}"
          f"M params ({cfg.num_params(active=True) / 1e6:.1f}M active), {args.layers} MoE layers of {args.experts} "
          f"experts of width {args.expert_width}, top-{args.top_k}, batch {args.batch}x{args.seq}: loss "
          f"{result['losses']['tetron']:.6f} on every model")
    print_timings("forward + backward, whole model", result["model"], result["tokens"])
    print_timings("forward + backward, one MoE layer alone", result["block"], result["tokens"])



if __name__ == "__main__":
    main()
