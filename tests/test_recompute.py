"""Activation recomputation (train.recompute): the same training, less activation memory.

Recomputation runs the same kernels on the same inputs in the same order, so every mode must train
exactly like "none", in one process and under every parallel axis; and it must hold less between the
forward and the backward pass: full only each layer's input, selective all but the attention kernel's own."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch._dynamo  # noqa: F401  checkpointing imports it on first use (~2 s): once here, not in each forked rank
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tetron.models.llama import Llama, LlamaConfig
from tetron.parallel.recompute import apply_recompute

from conftest import STEPS, run_parallel, tiny_config
from harness import run_ranks, saved_bytes

# Recomputation repeats the forward's kernels on the same inputs, so on CPU losses and weights come out
# bitwise equal (measured difference: 0). 1e-6 is a near-exact check that leaves only last-bit room; a
# real error is orders of magnitude above it (recomputing tensor parallelism's in-place all-reduce on a
# kept matmul output, a bug this suite caught, moved the losses by 7e-5 and the weights by 9e-3).
LOSS_RTOL = 1e-6  # per-step loss, relative
WEIGHT_ATOL = 1e-6  # final weights, absolute, fp32
MODES = ("selective", "full")


def _train(corpus, cache_dir, out, *, mode: str, model: dict | None = None, parallel: dict | None = None,
           grad_acc: int = 1) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Every rank's per-step losses, then metrics.jsonl's, and the saved model's weights after STEPS steps."""
    raw = tiny_config(corpus, cache_dir, out, model=model or {}, parallel=parallel or {"dp": 1},
                      train={"recompute": mode, "grad_acc": grad_acc})
    results, written = run_parallel(raw)
    return [*(r["losses"] for r in results), [m["loss"] for m in written["metrics"]]], written["model"]


def _check_modes_match_none(corpus, cache_dir, tmp_path, **kwargs) -> None:
    ref_losses, ref_state = _train(corpus, cache_dir, tmp_path / "none", mode="none", **kwargs)
    assert all(len(losses) == STEPS for losses in ref_losses)
    for mode in MODES:
        losses, state = _train(corpus, cache_dir, tmp_path / mode, mode=mode, **kwargs)
        for rank, (got, want) in enumerate(zip(losses, ref_losses)):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0,
                                       msg=lambda m, mode=mode, rank=rank: f"{mode}, losses {rank}: {m}")
        assert state.keys() == ref_state.keys()
        for name, value in state.items():
            torch.testing.assert_close(value, ref_state[name], rtol=0, atol=WEIGHT_ATOL,
                                       msg=lambda m, mode=mode, name=name: f"{mode}, {name}: {m}")


# ----------------------------------------------------------------------------- training parity


def test_single_process_matches_none(corpus, cache_dir, tmp_path):
    _check_modes_match_none(corpus, cache_dir, tmp_path)


LAYOUTS = {
    # row-parallel outputs all-reduced in place inside each layer (selective keeps that all-reduce's
    # result instead of running it twice); four layers so each pipeline stage holds two
    "tp2": {"parallel": {"tp": 2}},
    "tp2-sp-pp2": {"parallel": {"tp": 2, "sp": True, "pp": 2, "pp_schedule": "1f1b"}, "grad_acc": 2,
                   "model": {"num_hidden_layers": 4}},
    # ring attention's P2P inside each layer; bucketed gradient all-reduce overlapping the backward
    "dp2-cp2": {"parallel": {"dp": 2, "cp": 2, "bucket_mb": 0.01}},
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parallel_layouts_match_none(corpus, cache_dir, tmp_path, name):
    _check_modes_match_none(corpus, cache_dir, tmp_path, **LAYOUTS[name])


# ----------------------------------------------------------------------------- memory

B, T = 2, 128
MEMORY_MODEL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)


class _LiveStorages(TorchDispatchMode):
    """Remembers the storage of every tensor an op creates; `held_bytes` sums those still alive. This
    sees what checkpointing keeps outside autograd's saved tensors: selective recomputation's cache."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t.untyped_storage()) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def held_bytes(self, exclude: set[int]) -> int:
        gc.collect()
        alive = {s.data_ptr(): s.nbytes() for s in (r() for r in self.refs) if s is not None}
        return sum(n for ptr, n in alive.items() if ptr not in exclude)


def _forward_memory(model: Llama) -> tuple[int, int]:
    """(bytes autograd saves, bytes of forward-made storages alive after it) for one forward pass,
    the weights and the logits left out: the activation memory held until the backward pass."""
    ids = torch.randint(0, MEMORY_MODEL.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    live = _LiveStorages()
    with live, saved_bytes(model) as saved:
        logits = model(ids)
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()} | {logits.untyped_storage().data_ptr()}
    held = live.held_bytes(exclude)
    logits.sum().backward()  # the graph is complete: recomputation really runs
    return sum(saved.values()), held


def test_memory_full_keeps_layer_inputs_selective_all_but_the_kernels_lse():
    torch.manual_seed(0)
    base = Llama(MEMORY_MODEL)
    saved, held = {}, {}
    for mode in ("none", *MODES):
        saved[mode], held[mode] = _forward_memory(apply_recompute(copy.deepcopy(base), mode))
    outer_model = copy.deepcopy(base)
    outer_model.model.layers = torch.nn.ModuleDict()
    outer, _ = _forward_memory(outer_model)  # embedding, final norm, head: what no mode recomputes

    c, L, f32 = MEMORY_MODEL, MEMORY_MODEL.num_hidden_layers, 4
    layer_input = B * T * c.hidden_size * f32
    cos_sin = 2 * T * c.head_dim * f32  # RoPE tables: inputs of every layer, the same two tensors
    # full: each layer keeps exactly its inputs (x, cos, sin), nothing else; the outer part is as without
    # layers, since the final norm then saves the embedding output instead of the last layer's output.
    assert L * layer_input <= saved["full"] - outer <= L * layer_input + cos_sin, saved
    # none: a layer's backward needs about 18 tensors of the residual stream's size here (norms in fp32,
    # q/k/v before and after RoPE, GQA-repeated k/v, attention output, MLP's gate/up/silu/product).
    assert saved["none"] - outer > 10 * L * layer_input, saved
    # selective (Korthikanti's): what none keeps but the attention kernel's log-sum-exp (its output stays,
    # o_proj's input), exactly; the kernel runs again in the backward from the q, k and v none keeps too.
    lse = B * c.num_attention_heads * T * f32
    assert saved["none"] - saved["selective"] == L * lse, saved
    assert held["none"] - held["selective"] == L * lse, held
    # The live count agrees with autograd's where nothing is cached (all but the input ids, made before
    # the forward): a check of the live count itself, which relies on storages' weak references.
    ids_bytes = B * T * 8
    assert all(held[m] == saved[m] - ids_bytes for m in ("none", *MODES)), (saved, held)


def _ring_math_memory() -> tuple[dict[str, int], float]:
    """On each of 2 cp ranks: bytes held per mode, and the largest gradient difference from "none", with
    ring attention's blocks on the plain-math path that devices other than the CPU take."""
    from tetron.mesh import Mesh
    from tetron.parallel import context_parallel

    # This forked rank only: the math blocks, whose [Tq, Tk] scores come from bmm inside the Function.
    context_parallel.block_attention = context_parallel._math_block
    context_parallel.block_attention_backward = context_parallel._math_block_backward
    mesh = Mesh(cp=2)
    mine = context_parallel.shard_indices(T, 2, mesh.local_rank("cp"))
    ids = torch.randint(0, MEMORY_MODEL.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))[:, mine]
    torch.manual_seed(0)
    base = Llama(MEMORY_MODEL)
    held, grads = {}, {}
    for mode in ("none", *MODES):
        model = context_parallel.apply_context_parallel(copy.deepcopy(base), mesh)
        apply_recompute(model, mode)
        live = _LiveStorages()
        with live:
            logits = model(ids, mine)
        held[mode] = live.held_bytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        logits.sum().backward()
        grads[mode] = [p.grad for p in model.parameters()]
    diff = max((g - r).abs().max().item() for mode in MODES for g, r in zip(grads[mode], grads["none"]))
    return held, diff


def test_selective_keeps_q_k_v_only_under_ring_attention():
    c, L, f32, tl = MEMORY_MODEL, MEMORY_MODEL.num_hidden_layers, 4, T // 2
    for held, diff in run_ranks(2, _ring_math_memory):
        assert diff <= WEIGHT_ATOL  # the same reasoning as for the weights above (measured: 0)
        # Ring attention's Function saves what its backward needs itself (never [T/2, T/2] score blocks, on the
        # math path too): q, its own k and v, the merged output and log-sum-exp. Selective keeps q, k and v (none
        # keeps them too) and runs the ring's forward again in the backward, so each layer drops exactly its
        # output (o_proj takes a transposed copy of it) and its log-sum-exp.
        out, lse = B * c.num_attention_heads * tl * c.head_dim * f32, B * c.num_attention_heads * tl * f32
        assert held["none"] - held["selective"] == L * (out + lse), held
        assert held["full"] < held["selective"], held


# ----------------------------------------------------------------------------- the model is unchanged


def test_none_is_identity_and_names_stay():
    torch.manual_seed(0)
    base = Llama(MEMORY_MODEL)
    ids = torch.randint(0, MEMORY_MODEL.vocab_size, (B, T))
    expected = base(ids)
    model = copy.deepcopy(base)
    assert apply_recompute(model, "none") is model
    assert torch.equal(model(ids), expected)  # bit-identical
    for mode in MODES:
        model = apply_recompute(copy.deepcopy(base), mode)
        # Hugging Face names: checkpoints and transformers see the same keys and tensors.
        assert list(model.state_dict()) == list(base.state_dict()), mode
        assert all(torch.equal(v, base.state_dict()[k]) for k, v in model.state_dict().items())
        assert [n for n, _ in model.named_modules()] == [n for n, _ in base.named_modules()], mode
        assert torch.equal(model(ids), expected), mode  # the forward computes the same thing
    with pytest.raises(ValueError, match="recompute"):
        apply_recompute(copy.deepcopy(base), "some")


def _live_tensors_per_step(raw: dict) -> list[int]:
    """On a rank of tp=2: the tensors alive (gc-tracked) after each of 6 selective-recompute steps."""
    from tetron import train as tt
    from tetron.config import from_dict
    from tetron.mesh import Mesh

    # What the forked rank inherited from the test process (a heap of imported modules) is set aside: a leak is
    # made by the steps, and a collection that walks only what came after costs milliseconds, not a second.
    gc.freeze()
    run = tt.build_run(from_dict(raw), Mesh(tp=2), torch.device("cpu"))
    counts = []
    for step in range(6):
        tt.train_step(run, step)
        gc.collect()
        counts.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    return counts


def test_selective_under_tp_frees_each_step(corpus, cache_dir, tmp_path):
    # Stopping the recomputation early left the kept outputs of tp's in-place all-reduce unconsumed, in a
    # cycle through the autograd graph: every step leaked about a layer's activations (+13 tensors a step
    # on this model). After the first steps (optimizer moments, caches) the count must stay flat.
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", parallel={"tp": 2},
                      train={"recompute": "selective", "steps": 6})
    from tetron.config import from_dict
    from tetron.data.loader import prepare_data

    prepare_data(from_dict(raw))
    for counts in run_ranks(2, _live_tensors_per_step, raw):
        # A leak adds its tensors at every step, so the fewest alive over the last two steps would exceed the
        # fewest over steps 3-4 by 26. A tensor that is only passing through when gc counts (gloo's
        # in-flight work: seen once, +1 at one step) leaves the minimum alone.
        assert min(counts[4:]) <= min(counts[2:4]), counts
