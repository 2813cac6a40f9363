"""The 2026 dense families, one process each, against transformers' class on the same weights and batch
(issue 35): tetron's OLMo 3 against Olmo3ForCausalLM and Gemma 3's text model against Gemma3ForCausalLM,
forward and backward; the losses checked equal (equal work), then tokens/s in interleaved rounds and tetron's
ratio (goal >= 1.0). Windows shorter than the sequence, so that the sliding layers' masks are in the work.

    python bench/families.py [--family olmo3 gemma3_text] [--device cpu|cuda] [--dtype float32|bfloat16]
                             [--hidden 256] [--layers 6] [--seq 512] [--window 128] [--batch 2] [--rounds 5]

About a minute on 2 CPU cores. Speeds are printed, not asserted. transformers runs its default attention
(sdpa).
"""

from __future__ import annotations

import argparse

import torch
import transformers
from moe import check_same_loss, model_steps, print_timings, time_rounds

from tetron.models import family
from tetron.models.llama import Llama

HF_CLASSES = {"olmo3": transformers.Olmo3ForCausalLM, "gemma3_text": transformers.Gemma3ForCausalLM}


def family_config(name: str, args: argparse.Namespace):
    """A small model of the family: 4 heads of hidden/4 (2 kv heads), MLP 4x, its kinds of layer alternating."""
    heads = 4
    fields = dict(vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
                  head_dim=args.hidden // heads, max_position_embeddings=args.seq, sliding_window=args.window,
                  bos_token_id=2, eos_token_id=1)
    if name == "gemma3_text":
        fields.update(query_pre_attn_scalar=args.hidden // heads, rope_scaling={"rope_type": "linear", "factor": 8.0})
    return family(name).config_class(**fields)


def build_pair(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    cfg = family_config(name, args)
    torch.manual_seed(0)
    hf = HF_CLASSES[name](transformers.AutoConfig.for_model(**cfg.to_hf())).to(device, dtype).train()
    ours = Llama(cfg).to(device, dtype).train()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours, hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="+", default=sorted(HF_CLASSES), choices=sorted(HF_CLASSES))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=2)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    for name in args.family:
        ours, hf = build_pair(name, args, device, dtype)
        g = torch.Generator().manual_seed(1)
        ids, targets = (torch.randint(3, 4096, (args.batch, args.seq), generator=g).to(device) for _ in range(2))
        steps = model_steps(ours, {"sdpa": hf}, ids, targets)
        losses = check_same_loss(steps, dtype)
        times = time_rounds(steps, device, rounds=args.rounds, per_round=args.per_round)
        print(f"{name}: hidden {args.hidden}, {args.layers} layers, seq {args.seq} (window {args.window}), batch "
              f"{args.batch}, {args.dtype} on {args.device}; loss {losses['tetron']:.5f} in both")
        print_timings("forward + backward", times, ids.numel())


if __name__ == "__main__":
    main()
