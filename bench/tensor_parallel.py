"""Tensor parallelism, side by side: tetron's tp step against PyTorch's own tensor parallel
(`torch.distributed.tensor.parallel`: ColwiseParallel/RowwiseParallel over DTensor, with its
vocab-parallel `loss_parallel`) on the same model shape and batch, in one invocation.

    python bench/tensor_parallel.py [--ranks 2] [--steps 20] [--hidden 256] [--layers 4]

Each rank runs both in interleaved rounds; rank 0 prints the median step times and the ratio.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import add_model_args, add_timing_args, launch, median_step_times, model_config
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from tetron.models.llama import Llama, LlamaConfig
from tetron.parallel.init import init_weights_, materialize_
from tetron.parallel.tensor_parallel import apply_tensor_parallel, vocab_parallel_cross_entropy


def tetron_model(config: LlamaConfig, group) -> tuple[Llama, int]:
    with torch.device("meta"):
        model = Llama(config)
    apply_tensor_parallel(model, group)
    materialize_(model, torch.device("cpu"))
    init_weights_(model, seed=0, std=0.02)
    per_rank = model.lm_head.weight.shape[0]
    return model, dist.get_rank(group) * per_rank


def torch_tp_model(config: LlamaConfig, mesh) -> Llama:
    model = Llama(config)
    init_weights_(model, seed=0, std=0.02)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),  # for loss_parallel
    }
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def rank_main(rank: int, args) -> None:
    mesh = init_device_mesh("cpu", (args.ranks,))
    config = model_config(args)
    g = torch.Generator().manual_seed(0)  # tensor parallelism: every rank sees the same batch
    inputs = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)

    ours, vocab_start = tetron_model(config, mesh.get_group())
    theirs = torch_tp_model(config, mesh)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
    tokens = inputs.numel()

    def step_ours() -> float:
        loss = vocab_parallel_cross_entropy(ours(inputs), targets, mesh.get_group(), vocab_start=vocab_start,
                                            vocab_size=args.vocab) / tokens
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return loss.item()

    def step_theirs() -> float:
        logits = theirs(inputs)  # DTensor, sharded over the vocabulary
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt_theirs.step()
        opt_theirs.zero_grad(set_to_none=True)
        return loss.full_tensor().item()

    runs = {"tetron": step_ours, "torch": step_theirs}
    first = {name: fn() for name, fn in runs.items()}  # warm-up, and a check that both compute the same loss
    med = median_step_times(runs, steps=args.steps, per_round=args.per_round)
    if rank == 0:
        n_params = config.num_params()
        print(f"tensor parallel, tp={args.ranks} (gloo), {n_params / 1e6:.1f}M params, batch {args.batch}x{args.seq}, "
              f"{args.steps} steps each")
        print(f"  first-step loss: tetron {first['tetron']:.6f}  torch {first['torch']:.6f}")
        print(f"  tetron tp            median step {med['tetron'] * 1e3:8.1f} ms")
        print(f"  torch DTensor tp     median step {med['torch'] * 1e3:8.1f} ms")
        print(f"  tetron / torch = {med['tetron'] / med['torch']:.3f}   (1 or below: tetron is not slower)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(parser)
    add_model_args(parser)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    launch(rank_main, args)

if __name__ == "__main__":
    main()
