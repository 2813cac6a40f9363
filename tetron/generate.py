"""Sampling text from a trained model: temperature and top-k, one token at a time."""

from __future__ import annotations

from pathlib import Path

import torch

from tetron.checkpoint_load import load_model
from tetron.model import Llama
from tetron.tokenizer import Tokenizer, load_tokenizer


@torch.no_grad()
def sample(model: Llama, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int = 200,
           temperature: float = 0.8, top_k: int = 50, context: int | None = None, seed: int = 0) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens (stops early at EOS).

    No KV cache: each token re-runs the (cropped) context, which is plenty for the small models
    sampled here and keeps the model file free of inference-only state."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = context or model.config.max_position_embeddings
    ids = tokenizer.encode(prompt) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [0])
    tokens = torch.tensor([ids], device=device)  # [1, T]
    model.eval()
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -context:])[0, -1].float()  # [vocab]
        logits = logits[: tokenizer.vocab_size]  # rows past the tokenizer's vocabulary are never data
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
        if next_id == tokenizer.eos_id:
            break
        new.append(next_id)
        tokens = torch.cat([tokens, torch.tensor([[next_id]], device=device)], dim=1)
    return prompt + tokenizer.decode(new)


def sample_from_run(run: Path, *, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                    top_k: int = 50, device: torch.device | str = "cpu", seed: int = 0) -> str:
    """Sample from the model folder a run wrote (RUN/model, or a model folder itself)."""
    run = Path(run)
    folder = run / "model" if (run / "model" / "config.json").is_file() else run
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{run}: no trained model here (expected {run}/model/config.json)")
    model = load_model(folder, device=device)
    tokenizer = load_tokenizer(str(folder), data_spec=None, cache_dir=folder)
    return sample(model, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_k=top_k, seed=seed)
