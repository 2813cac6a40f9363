"""Measuring a decoder layer instead of describing it: what the planner's memory model counts for a layer's saved
activations, from the family's own code.

One decoder layer of the model (of each kind: dense, MoE) is built by the run's own recipe (parallelize.build_chunk:
the family's module, split by its parallel plan under the layout's tp and sp, its experts over ep, its attention
under cp's ring or Ulysses) on fake tensors (shapes, no storage), with a fake process group of the axes' size, and
run forward at the rank's real shapes as a chunk runs its layers, each call on the previous one's output, under
each recompute mode in turn; observe/memory.py's ActivationMeter counts what each call adds to what autograd holds
for the backward, as it counts it in a real run (each storage once, parameters left out; what layers share, such
as the RoPE tables, counted by the first call). The layer runs the CPU's code path; where CUDA's differs (its
grouped_mm pads each expert's rows to 8) that is not added. The measurement is cached by what decides it, so a
search over thousands of layouts measures each distinct layer shape once, and a family adds no code here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tetron.config import Config
from tetron.mesh import Mesh
from tetron.models import family
from tetron.observe.memory import ActivationMeter
from tetron.plan.keys import PerObject
from tetron.torch_private import grouped_mm_available
from tetron.torch_private.fake import fake_store, fake_tensor_mode


@dataclass(frozen=True)
class Probe:
    """What decides a layer's measurement: hashable, so equal layouts share one (plan/sizes.py keeps it)."""

    model_repr: str  # what the model config below is (configs are not hashable; a dataclass's repr names every field)
    tp: int
    sp: bool
    regather: bool
    cp: int
    cp_impl: str
    cp_layout: str
    ep: int
    seq_len: int
    micro_batch: int
    bf16: bool
    reset_positions: bool
    qk_clip: bool  # optim.qk_clip_tau: the attention records its logits' maxima
    model: object = dataclasses.field(compare=False, hash=False, repr=False)  # one layer of the kind asked for
    config: object = dataclasses.field(compare=False, hash=False, repr=False)  # the run's: the rest of the recipe


def probe_of(cfg: Config, moe: bool) -> Probe:
    """What measures `cfg`'s decoder layer of the kind asked for (dense, or `moe`) on a rank of its layout."""
    p = cfg.parallel
    one, text = _one_layer(cfg.model, moe)
    sp = p.sp and p.tp > 1
    return Probe(model_repr=text, model=one, tp=p.tp, sp=sp, regather=sp and p.sp_regather, cp=p.cp,
                 cp_impl=p.cp_impl if p.cp > 1 else "ring", cp_layout=p.cp_layout if p.cp > 1 else "zigzag",
                 ep=p.ep if moe else 1, seq_len=cfg.data.seq_len, micro_batch=cfg.train.micro_batch,
                 bf16=cfg.train.dtype == "bfloat16", reset_positions=cfg.data.reset_positions,
                 qk_clip=cfg.optim.qk_clip_tau is not None, config=cfg)


_ONE_LAYER = {False: PerObject(), True: PerObject()}  # by kind (dense, MoE): per model config, its layer and repr


def _one_layer(model: object, moe: bool) -> tuple[object, str]:
    """One layer of `model`'s kind, on a one-token vocabulary (a layer's shapes do not depend on it), and its repr:
    made once per model config object, which a search shares between its layouts."""
    def make(model: object) -> tuple[object, str]:
        one = model.layer_of_kind(moe) if hasattr(model, "layer_of_kind") else model.one_layer(0)
        one = dataclasses.replace(one, vocab_size=1, tie_word_embeddings=False)
        return one, repr(one)

    return _ONE_LAYER[moe].get(model, make)


MODES = ("none", "selective", "full")  # train.recompute's
_MEASURED: dict[tuple[Probe, str], int] = {}


def saved_bytes(probe: Probe, mode: str) -> int:
    """What the layer of `probe` leaves saved for its backward under recompute `mode`, for one micro-batch. What a
    layer keeps is affine in the micro-batch's
    sequences (everything per token or per sequence; an MoE block's few per-expert counts besides), so a larger
    micro-batch is read off the measurements of two: a search over micro-batches of 1 to 512 measures each shape
    two or three times, not ten (tests/test_probe.py holds the extrapolation to a measurement). Under sequence
    parallelism one sequence is the exception (the gathered input is then contiguous and shared, which two or more
    are not): there the line goes through two and three."""
    probe = in_two_ranks(probe)
    low = 2 if probe.sp else 1
    if probe.micro_batch <= low + 1:
        return _measured(probe, mode)
    a, b = (_measured(dataclasses.replace(probe, micro_batch=n), mode) for n in (low, low + 1))
    more = probe.micro_batch - low
    return a + (b - a) * more


def in_two_ranks(probe: Probe) -> Probe:
    """The probe of a ring-attention layer on cp ranks as the same layer on 2 ranks holding as many tokens each:
    the ring passes key/value blocks around for cp steps and keeps for its backward only what the last step
    leaves (q, k, v, the output and its log-sum-exp of this rank's tokens), so both save the same bytes, while the
    forward under fake tensors costs cp steps of dispatch (Llama-3-8B at cp 64: 1.8 s, at 2: 0.2 s; a search
    measures every cp it tries). tests/test_probe.py holds the two measurements equal. Ulysses' layer is not
    alike: its all-to-all gives each rank the whole sequence for heads/cp heads."""
    if probe.cp_impl != "ring" or probe.cp <= 2:
        return probe
    return dataclasses.replace(probe, cp=2, seq_len=probe.seq_len * 2 // probe.cp)


def _measured(probe: Probe, mode: str) -> int:
    """Measured once per process, every mode at once (a search asks for the same shape for many layouts)."""
    if (probe, mode) not in _MEASURED:
        _MEASURED.update({(probe, m): found for m, found in _measure(probe, fake=not _small(probe)).items()})
    return _MEASURED[(probe, mode)]


# A layer this small is measured on real tensors: the same bytes (tests/test_probe.py holds the two equal) in a
# fifth of the time, since under fake tensors every op pays a Python dispatch (a hidden-32 layer: 0.09 s fake, 0.02 s
# real) while the real ops on a few thousand numbers cost less. A search over a tiny model measures dozens of shapes,
# and `tetron train` measures its own before it starts.
REAL_MAX_WORK = 1 << 24  # the layer's parameters x its tokens on a rank: about the multiply-adds of one forward


def _small(probe: Probe) -> bool:
    count = getattr(probe.model, "num_params", None)
    tokens = probe.micro_batch * probe.seq_len // probe.cp
    return count is not None and count(include_embedding=False) * tokens <= REAL_MAX_WORK


@contextlib.contextmanager
def _fake_group(world: int):
    """Rank 0 of a fake process group of `world` ranks, for one measurement. The planner runs where no group exists
    yet (tetron plan, tetron train's check before its ranks start, the dry run before each fake rank); a process
    with a group of its own (a rank) is refused: the two would be one global state. A one-rank layer in a one-rank
    group (a single process's own, as bench/gpu_check.py runs the planner beside its training) needs no other: no
    collective is called, and the group is the process's to keep."""
    if dist.is_initialized():
        if world == 1 and dist.get_world_size() == 1:
            yield
            return
        raise RuntimeError("the planner measures a layer in a process group of its own: call it before "
                           "init_process_group (or after destroy_process_group)")
    dist.init_process_group("fake", rank=0, world_size=world, store=fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _measure(probe: Probe, *, fake: bool = True) -> dict[str, int]:
    """The layer of `probe` under each recompute mode, built once, by the run's own recipe (parallelize.build_chunk:
    one stage of one layer, on a fake process group of its axes). `fake=False`: the same on real tensors (small
    shapes: `_small`; the tests hold the fake figures to them)."""
    from tetron.parallel.parallelize import build_chunk
    from tetron.plan.dry_modes import DryRunMode

    cfg = _config(probe)
    spec = family(probe.model.model_type)
    dtype = torch.bfloat16 if probe.bf16 else torch.float32
    grouped_mm_available("cpu")  # probed on real tensors: under fake ones the probe would fail
    with warnings.catch_warnings(), _fake_group(probe.ep * probe.cp * probe.tp):
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        mesh = Mesh(dp=probe.ep, cp=probe.cp, tp=probe.tp, ep=probe.ep)
        # the dry run's mode answers what fake tensors cannot (an MoE block's routing counts, positions on the host)
        with fake_tensor_mode() if fake else contextlib.nullcontext(), DryRunMode():
            chunk, _, _ = build_chunk(cfg, mesh, torch.device("cpu"), range(1), first=True, last=True)
            for param in chunk.parameters():  # as the optimizer casts them (parallel/zero.py)
                param.data = param.data.to(dtype)
            layer = spec.plan.layers_of(chunk)["0"]
            return _saved(layer, _layer_inputs(chunk, layer, probe, cfg, mesh))


def _config(probe: Probe) -> Config:
    """The run's config cut to one layer of the probe's kind on one pipeline stage, its axes the probe's (dp: the
    ep ranks the experts need), without ZeRO (no parameter is touched), recomputation (measured mode by mode) or
    compilation (what a compiled layer saves is the compiler's choice, not measured here)."""
    c = probe.config
    p = dataclasses.replace(c.parallel, pp=1, pp_virtual=1, dp=probe.ep, tp=probe.tp, sp=probe.sp,
                            sp_regather=probe.regather, cp=probe.cp, cp_impl=probe.cp_impl, cp_layout=probe.cp_layout,
                            ep=probe.ep, zero=0, dp_shard=None)
    return dataclasses.replace(
        c, model=probe.model, parallel=p,
        data=dataclasses.replace(c.data, seq_len=probe.seq_len, reset_positions=probe.reset_positions),
        train=dataclasses.replace(c.train, micro_batch=probe.micro_batch, grad_acc=1, recompute="none",
                                  compile=False))


def _saved(layer: torch.nn.Module, args: tuple) -> dict[str, int]:
    """The bytes one call of `layer` leaves saved for its backward, under each recompute mode. The layer runs as a
    chunk's layers do, each call on the previous one's output, and everything stays held: first once without
    recomputation, whose saved tensors include what layers share (RoPE tables, Ulysses' position orders); then
    once per mode, which adds that mode's own. No backward is run."""
    from tetron.parallel.recompute import recompute_layer

    x, rest = torch.empty_like(args[0]).requires_grad_(), args[1:]
    meter = ActivationMeter(layer.parameters())
    held, measured = [], {}
    with meter:
        held.append(layer(x * 1, *rest))  # x * 1: made inside, as the previous layer's output is
        for mode in MODES:
            recompute_layer(layer, mode)
            before = meter.live_bytes
            held.append(layer(held[-1], *rest))  # held: its graph, and what it saved, live as long as it does
            measured[mode] = meter.live_bytes - before
    return measured


class _Captured(Exception):
    pass


def _layer_inputs(chunk: torch.nn.Module, layer: torch.nn.Module, probe: Probe, cfg: Config, mesh: Mesh) -> tuple:
    """What the chunk's forward passes its first layer (hidden states, RoPE tables, documents), as it makes them
    for this rank's positions: the forward is run up to that call."""
    from tetron.parallel.parallelize import sequence_positions

    n = probe.seq_len // probe.cp
    positions = sequence_positions(cfg, mesh)
    positions = positions[None].expand(probe.micro_batch, n) if probe.reset_positions else positions
    captured = []

    def capture(module, args):
        captured.extend(args)
        raise _Captured

    handle = layer.register_forward_pre_hook(capture)
    try:
        with torch.no_grad():
            chunk(torch.zeros(probe.micro_batch, n, dtype=torch.long), positions)
    except _Captured:
        pass
    finally:
        handle.remove()
    return tuple(captured)
