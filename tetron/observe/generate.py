"""Sampling text from a trained model: temperature and top-k, one token at a time."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from tetron.checkpoint.check import inspect_checkpoint, read_model_config
from tetron.checkpoint.load import load_model
from tetron.data.tokenizer import Tokenizer, load_tokenizer
from tetron.errors import CheckpointError
from tetron.fs import find_latest
from tetron.models.attention import sdpa_attention
from tetron.models.llama import Llama


class KVCache:
    """An attention function that remembers keys and values: installed as each attention module's
    `attn_fn` (the model's one seam for attention), a step then runs only the new token through the
    model, attending over every earlier token's cached key and value."""

    def __init__(self) -> None:
        self.k: Tensor | None = None  # [B, kv_heads, T so far, head_dim], RoPE applied
        self.v: Tensor | None = None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, docs: object = None, window: int | None = None, *,
                 scale: float | None = None, softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
        if docs is not None:  # generation continues one text: no packed documents
            raise ValueError("the KV cache generates one sequence per row; it takes no document mask")
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        if q.shape[2] == k.shape[2]:  # the prompt: causal over itself
            return sdpa_attention(q, k, v, window=window, scale=scale, softcap=softcap, sinks=sinks)
        # one new query, after every cached key: nothing to mask but what a sliding window leaves out
        if window is not None:
            k, v = k[:, :, -window:], v[:, :, -window:]  # [B, kv_heads, <= window, head_dim]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, heads, T, head_dim]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if softcap is None and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        # the math path (as models/attention.py's scored_attention), one query row: no mask to build
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # [B, heads, 1, T]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:  # a column of sink logits, softmaxed with the scores, then dropped
            B, H = q.shape[:2]
            scores = torch.cat([scores, sinks.float().view(1, H, 1, 1).expand(B, H, 1, 1)], dim=-1)
        probs = scores.softmax(dim=-1)[..., :k.shape[2]]
        return (probs @ v.float()).to(q.dtype)


@contextlib.contextmanager
def kv_cache(model: Llama) -> Iterator[None]:
    """Every attention module of `model` caches its keys and values inside the block."""
    modules = [m for m in model.modules() if hasattr(m, "attn_fn")]
    saved = [m.attn_fn for m in modules]
    for m in modules:
        m.attn_fn = KVCache()
    try:
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.attn_fn = fn


def _next_id(logits: Tensor, vocab: int, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy (temperature 0) or top-k sampling from one position's logits [vocab]."""
    logits = logits.float()[:vocab]  # rows past the tokenizer's vocabulary are never data
    if temperature <= 0:
        return int(logits.argmax())
    # From the largest logit down and in float64, so that a tiny temperature (1e-300 is 0 in float32) gives 0
    # and -inf, never inf - inf or 0 / 0 = nan: greedy in the limit
    logits = (logits.double() - logits.max()) / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.no_grad()
def sample(model: Llama, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int = 200,
           temperature: float = 0.8, top_k: int = 50, context: int | None = None, seed: int = 0,
           use_cache: bool = True) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens (stops early at EOS). With `use_cache`
    each new token costs one position's forward pass; past the context length, the window of the last
    `context` tokens is recomputed each step (as without the cache)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    context = context or model.config.max_position_embeddings
    ids = tokenizer.encode(prompt) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [0])
    tokens = torch.tensor([ids], device=device)  # [1, T]
    model.eval()
    new: list[int] = []
    with kv_cache(model) if use_cache else contextlib.nullcontext():
        logits = model(tokens[:, -context:])[0, -1]  # [vocab]
        for _ in range(max_new_tokens):
            next_id = _next_id(logits, tokenizer.vocab_size, temperature, top_k, generator)
            if next_id == tokenizer.eos_id:
                break
            new.append(next_id)
            tokens = torch.cat([tokens, torch.tensor([[next_id]], device=device)], dim=1)
            if use_cache and tokens.shape[1] <= context:
                position = torch.tensor([tokens.shape[1] - 1], device=device)
                logits = model(tokens[:, -1:], position)[0, -1]
            else:
                with contextlib.nullcontext() if not use_cache else kv_cache(model):  # a fresh, shifted window
                    logits = model(tokens[:, -context:])[0, -1]
    return prompt + tokenizer.decode(new)


def find_model(run: Path) -> tuple[Path, str | None]:
    """The folder to sample from: RUN/model, a model (or checkpoint) folder itself, or, for a run that stopped
    before its end (no RUN/model), its latest checkpoint, with a note saying so."""
    if (run / "model" / "config.json").is_file():
        return run / "model", None
    if (run / "config.json").is_file():
        return run, None
    latest = find_latest(run) if run.is_dir() else None
    if latest is not None and (latest / "config.json").is_file():
        return latest, (f"{run} has no final model (the run stopped before its last step): sampling from its "
                        f"latest checkpoint, {latest}")
    raise CheckpointError(f"{run}: no trained model here (expected {run}/model/config.json, or a checkpoint "
                          f"under {run}/checkpoints)")


def model_folder(run: Path, *, note: Callable[[str], None] | None = None) -> tuple[Path, Tokenizer]:
    """The model folder of a run (find_model; `note` gets the line saying a checkpoint stands in), checked
    without loading it (JSON, safetensors headers, every tensor's shape against its config.json), and its
    tokenizer, which must fit the model's vocabulary. Problems raise one-line UserErrors naming the file."""
    folder, why = find_model(Path(run))
    if why is not None and note is not None:
        note(why)
    inspect_checkpoint(folder, require_state=False)
    tokenizer = load_tokenizer(str(folder), data_spec=None, cache_dir=folder)
    vocab = read_model_config(folder).vocab_size
    if tokenizer.vocab_size > vocab:
        raise CheckpointError(f"{folder}: its tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                              f"vocab_size={vocab}: the tokenizer does not belong to these weights")
    return folder, tokenizer


def check_finite(model: Llama, folder: Path) -> None:
    """A model folder whose weights hold NaN or inf (saved from a run that diverged) samples nothing but
    noise or fails inside torch.multinomial: one line naming the first such tensor instead."""
    for name, param in model.named_parameters():
        if not bool(torch.isfinite(param).all()):
            raise CheckpointError(f"{folder}: the weights of {name} hold NaN or inf (saved from a run that "
                                  f"diverged?); sample from an earlier checkpoint (RUN/checkpoints/step_N)")


def sample_from_run(run: Path, *, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                    top_k: int = 50, device: torch.device | str = "cpu", seed: int = 0,
                    note: Callable[[str], None] | None = None) -> str:
    """Sample from the model folder a run wrote (RUN/model, or a model folder itself; a stopped run's latest
    checkpoint, said to `note`)."""
    folder, tokenizer = model_folder(run, note=note)
    model = load_model(folder, device=device)
    check_finite(model, folder)
    return sample(model, tokenizer, prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_k=top_k, seed=seed)
