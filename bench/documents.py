"""What keeping packed documents apart costs (data.mask_documents with data.reset_positions): forward and
backward of one micro-batch whose rows hold several documents, tetron's model given the documents against
transformers' LlamaForCausalLM given the same packing as a 4D mask and per-document position ids (the
way it takes packed rows with its sdpa attention), and against tetron's plain causal pass.

    python bench/documents.py [--rounds 5] [--seq 512 2048] [--doc-len 300]

Same weights on both sides (the logits are asserted equal first). Documents end at random positions,
`--doc-len` tokens apart on average. The three alternate within each round; medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tetron.data.documents import document_positions  # noqa: E402
from tetron.models.attention import document_mask  # noqa: E402
from tetron.models.llama import LlamaConfig  # noqa: E402
from tetron.parallel.init import seeded_model  # noqa: E402


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    c = model.config
    hf = LlamaForCausalLM(HFConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                                   num_attention_heads=c.num_attention_heads,
                                   num_key_value_heads=c.num_key_value_heads,
                                   max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
                                   attn_implementation="sdpa"))
    hf.load_state_dict(model.state_dict())
    return hf


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(seq: int, args: argparse.Namespace) -> dict[str, float]:
    config = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=seq)
    model = seeded_model(config, seed=0, device=torch.device("cpu"))
    hf = _transformers_model(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (args.batch, seq), generator=g)
    docs = (torch.rand(args.batch, seq, generator=g) < 1 / args.doc_len).long().cumsum(dim=1)
    positions, pos = document_positions(docs), torch.arange(seq)
    mask = document_mask(docs, pos, pos)  # [B, 1, T, T] bool

    def ours() -> None:
        model(ids, positions, docs).float().mean().backward()

    def causal() -> None:
        model(ids).float().mean().backward()

    def theirs() -> None:
        hf(input_ids=ids, position_ids=positions, attention_mask=mask).logits.float().mean().backward()

    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions, docs),
                                   hf(input_ids=ids, position_ids=positions, attention_mask=mask).logits,
                                   rtol=1e-4, atol=1e-4)
    runs = {"tetron masked": ours, "transformers masked": theirs, "tetron causal": causal}
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=300)
    args = parser.parse_args()
    print("| seq | tetron masked ms | transformers masked ms | ratio | tetron causal ms | masked / causal |")
    print("|---|---|---|---|---|---|")
    for seq in args.seq:
        m = bench(seq, args)
        print(f"| {seq} | {m['tetron masked'] * 1e3:.0f} | {m['transformers masked'] * 1e3:.0f} | "
              f"{m['tetron masked'] / m['transformers masked']:.2f} | {m['tetron causal'] * 1e3:.0f} | "
              f"{m['tetron masked'] / m['tetron causal']:.2f} |")


if __name__ == "__main__":
    main()
