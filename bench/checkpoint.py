"""Checkpoints, side by side: tetron's save (sync, and async where `checkpoint.async_save` exists) against
PyTorch's `torch.distributed.checkpoint` (`dcp.save`, `dcp.async_save`), and a resume's start-up against
`dcp.load`, on the same state: a SmolLM-135M-shaped model's fp32 master weights and AdamW moments.

    python bench/checkpoint.py [--ranks 2 4] [--rounds 3] [--zero 3] [--hidden 576 --layers 30 --vocab 49152]

The state. Tetron is built the way `tetron train` builds it (tetron.config.from_dict with the model section
of configs/smollm-135m.yaml, `parallelize`, `build_optimizer`, ZeRO-3 at dp = ranks by default) and takes
one AdamW step, so its moments exist. DCP saves the very same tensors: every rank's ZeRO pieces (the fp32
master weights, exp_avg, exp_avg_sq of each piece of a parameter this rank updates) as plain tensors keyed
`{kind}/{parameter}@{offset}`. Under ZeRO those keys are distinct per rank, so each rank writes its own
shard, which is what DCP does best (no gather, no resharding metadata); under ZeRO-0 every rank holds the
same keys and DCP's planner writes each once. Both write the same bytes of tensors (printed). This is the
fairest equivalent we found: DTensors of tetron's flat buckets would add DCP's resharding but not change
the bytes written, and DCP's files are not a transformers folder, while tetron's are.

What is timed (each save after a barrier, the max over ranks, medians of `--rounds` interleaved rounds,
each round starting one save later than the one before):
blocking seconds (until every rank could train again), total seconds (until the files are written and
fsynced, all ranks past a barrier; nothing trains in between here), resume start-up (tetron: the checks
the launcher runs before starting ranks, `tetron.validate`'s checkpoint section, on rank 0, then
`load_checkpoint` into the model and optimizer on every rank; DCP: `dcp.load` into the same tensors, which
checks nothing before start). Before every load the tensors are zeroed and after it compared with what
was saved, so a load that reads nothing cannot look fast. The bytes the pre-start check reads are
/proc/thread-self/io's rchar around it (read() calls, so page-cache hits count, mmap reads would not),
printed as a fraction of the checkpoint's bytes. The page cache cannot be dropped here: every read may
come from memory, which favours whoever reads more. DCP's async save runs in a thread (the default
AsyncCheckpointerType.THREAD) on a gloo process group of its own, so its background collectives do not
interleave with the foreground's; its staging copy goes to plain CPU memory (pinned memory is for CUDA).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
import warnings
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import launch, rank_config
from torch import Tensor

import tetron.checkpoint.save as tetron_save_module
from tetron.checkpoint.load import load_checkpoint
from tetron.config import from_dict
from tetron.mesh import Mesh
from tetron.parallel.parallelize import build_optimizer, finish_gradients, parallelize
from tetron.parallel.pipeline_parallel import layer_ranks
from tetron.validate.paths import validate_checkpoint

CPU = torch.device("cpu")
SAVES = ("tetron", "dcp", "tetron_async", "dcp_async")
LABELS = {"tetron": "tetron save", "dcp": "dcp.save", "tetron_async": "tetron async save",
          "dcp_async": "dcp.async_save"}
RESUMES = ("tetron", "dcp")
# torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor (used by tetron), once per call site
warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use .*_single", category=FutureWarning)


def model_section(args: argparse.Namespace) -> dict[str, Any]:
    """configs/smollm-135m.yaml's model, with the flags given. A smaller --hidden keeps SmolLM's ratios
    unless told otherwise: heads of 64, a third as many kv heads, an MLP 8/3 as wide."""
    section: dict[str, Any] = {"name": "smollm-135m"}
    if args.hidden is not None:
        heads = args.heads or max(1, args.hidden // 64)
        section.update(hidden_size=args.hidden, num_attention_heads=heads,
                       num_key_value_heads=args.kv_heads or (heads // 3 if heads % 3 == 0 else heads),
                       intermediate_size=args.intermediate or args.hidden * 8 // 3)
    for flag, field in (("layers", "num_hidden_layers"), ("vocab", "vocab_size"), ("heads", "num_attention_heads"),
                        ("kv_heads", "num_key_value_heads"), ("intermediate", "intermediate_size")):
        if getattr(args, flag) is not None:
            section[field] = getattr(args, flag)
    return section


def build_tetron(args: argparse.Namespace, out: str) -> SimpleNamespace:
    """Tetron's model and optimizer as `tetron train` builds them, after one AdamW step on random tokens."""
    seq = 16
    cfg = from_dict({"model": model_section(args), "parallel": {"dp": args.ranks, "zero": args.zero},
                     "data": {"seq_len": seq}, "train": {"micro_batch": 1, "steps": 10, "seed": 0}, "out": out})
    mesh = Mesh(dp=args.ranks)
    model = parallelize(cfg, mesh, CPU)
    optimizer = build_optimizer(model, cfg, mesh)
    g = torch.Generator().manual_seed(1000 + mesh.rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=g)
    loss = model.dp_chunks[0](tokens[:, :-1], torch.arange(seq), targets=tokens[:, 1:]) / seq  # head and loss
    loss.backward()
    finish_gradients(model, mesh, optimizer)
    optimizer.step()
    model.zero_grad()
    return SimpleNamespace(cfg=cfg, mesh=mesh, model=model, optimizer=optimizer)


def dcp_state_dict(st: SimpleNamespace) -> dict[str, Tensor]:
    """This rank's ZeRO pieces: master weights and the optimizer's state, its own tensors (no copy)."""
    names = {id(p): name for chunk in st.model.chunks for name, p in chunk.named_parameters()}
    state: dict[str, Tensor] = {}
    for piece in st.optimizer.pieces:
        key = f"{names[id(piece.param)]}@{piece.start}"
        state[f"master/{key}"] = piece.master.detach()
        for kind in st.optimizer.state_names:
            state[f"{kind}/{key}"] = st.optimizer.inner.state_tensor(piece.master, kind)
    return state


# ------------------------------------------------------------------ the call sites, one small function each


def tetron_save(st: SimpleNamespace, out: str, *, async_save: bool) -> Any:
    """tetron's save of step 1 into OUT; with async_save, what it returns goes to tetron_wait."""
    cfg = st.cfg
    if async_save:
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_save=True))
    layout = {"dp": st.mesh.size("dp"), "tp": 1, "pp": 1, "cp": 1, "pp_virtual": 1, "world_size": st.mesh.world_size}
    state = {"step": 1, "tokens": 0, "loader": None, "config": st.cfg.to_dict(), "layout": layout}
    return tetron_save_module.save_checkpoint(out, st.model.chunks, st.mesh, cfg=cfg, optimizer=st.optimizer,
                                              trainer_state=state, layer_ranks=layer_ranks(cfg), tokenizer=None)


def tetron_wait(handle: Any) -> None:
    """Until tetron's background save is durable: a handle's wait(), or the module's wait_for_save()."""
    wait = getattr(handle, "wait", None) or getattr(tetron_save_module, "wait_for_save", None)
    if wait is None:
        raise RuntimeError("bench/checkpoint.py: adapt tetron_wait to how tetron waits for an async save")
    wait()


def tetron_prestart(st: SimpleNamespace, folder: str) -> None:
    """What the launcher checks of a checkpoint before it starts the ranks of a resume."""
    validate_checkpoint(dataclasses.replace(st.cfg, checkpoint=dataclasses.replace(st.cfg.checkpoint,
                                                                                    resume=folder)))


def tetron_load(st: SimpleNamespace, folder: str) -> None:
    load_checkpoint(folder, chunks=st.model.chunks, optimizer=st.optimizer, loader=SimpleNamespace(step=0),
                    mesh=st.mesh, cfg=st.cfg)


def dcp_save(state: dict[str, Tensor], folder: str) -> None:
    dcp.save(state, checkpoint_id=folder)


def dcp_async_save(state: dict[str, Tensor], folder: str, group: dist.ProcessGroup) -> Any:
    """dcp.async_save: returns once the state is staged; its future's result() waits for the files."""
    return dcp.async_save(state, checkpoint_id=folder, process_group=group)


def dcp_load(state: dict[str, Tensor], folder: str) -> None:
    dcp.load(state, checkpoint_id=folder)


# ------------------------------------------------------------------ timing


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def rchar() -> int:
    """Bytes this thread has passed through read() calls so far."""
    with open("/proc/thread-self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def timed_save(start_save: Callable[[], Any], wait: Callable[[Any], None] | None) -> tuple[float, float]:
    """(blocking, total) seconds of one save on every rank, the max over ranks."""
    dist.barrier()
    start = time.perf_counter()
    handle = start_save()
    blocking = time.perf_counter() - start
    if wait is not None:
        wait(handle)
    dist.barrier()
    blocking, total = max_over_ranks([blocking, time.perf_counter() - start])
    return blocking, total


def save_round(st: SimpleNamespace, folders: dict[str, str], group: dist.ProcessGroup,
               has_async: bool, first: int = 0) -> dict[str, tuple[float, float]]:
    """Every save once, in turn, each into its own folder, starting at the `first`-th: rounds rotate the order,
    so that no save always follows the same one (the disk still writing back the one before, or freeing the
    last round's folders)."""
    state = dcp_state_dict(st)
    runs: dict[str, tuple[Callable[[], Any], Callable[[Any], None] | None]] = {
        "tetron": (lambda: tetron_save(st, folders["tetron"], async_save=False), None),
        "dcp": (lambda: dcp_save(state, folders["dcp"]), None),
        "tetron_async": (lambda: tetron_save(st, folders["tetron_async"], async_save=True), tetron_wait),
        "dcp_async": (lambda: dcp_async_save(state, folders["dcp_async"], group), lambda f: f.result()),
    }
    if not has_async:
        runs.pop("tetron_async")
    names = list(runs)
    first %= len(names)
    return {name: timed_save(*runs[name]) for name in names[first:] + names[:first]}


def zero_and_check(st: SimpleNamespace, saved: dict[str, Tensor] | None) -> None:
    """Without `saved`: zero the state a load must fill. With it: the load gave back exactly what was saved."""
    for key, tensor in dcp_state_dict(st).items():
        if saved is None:
            tensor.zero_()
        elif not torch.equal(tensor, saved[key]):
            raise AssertionError(f"bench/checkpoint.py: {key} differs after the load")


def resume_round(st: SimpleNamespace, folders: dict[str, str], saved: dict[str, Tensor]) -> dict[str, list[float]]:
    """Tetron's pre-start check (rank 0) and load, then dcp.load: [seconds, pre-start seconds, bytes read]."""
    out = {}
    for name in RESUMES:
        zero_and_check(st, None)
        dist.barrier()
        start = time.perf_counter()
        prestart, read = 0.0, 0
        if name == "tetron":
            folder = os.path.join(folders["tetron"], "checkpoints", "step_1")
            if st.mesh.rank == 0:
                before = rchar()
                tetron_prestart(st, folder)
                prestart, read = time.perf_counter() - start, rchar() - before
            dist.barrier()  # the ranks start once the launcher's checks pass
            tetron_load(st, folder)
        else:
            dcp_load(dcp_state_dict(st), folders["dcp"])
        dist.barrier()
        out[name] = max_over_ranks([time.perf_counter() - start, prestart, float(read)])
        zero_and_check(st, saved)
    return out


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def rank_main(rank: int, args: argparse.Namespace) -> None:
    st = build_tetron(args, args.dir)
    group = dist.new_group(backend="gloo")  # dcp.async_save's background collectives, apart from ours
    has_async = hasattr(st.cfg.checkpoint, "async_save")
    saved = {key: t.clone() for key, t in dcp_state_dict(st).items()}
    saves: dict[str, list[tuple[float, float]]] = {}
    resumes: dict[str, list[list[float]]] = {name: [] for name in RESUMES}
    sizes: dict[str, int] = {}
    for r in range(args.rounds):
        folders = {name: os.path.join(args.dir, f"{args.ranks}-{name}-{r}") for name in SAVES}
        for name, times in save_round(st, folders, group, has_async, first=r).items():
            saves.setdefault(name, []).append(times)
        for name, figures in resume_round(st, folders, saved).items():
            resumes[name].append(figures)
        dist.barrier()
        if rank == 0:
            sizes = {name: folder_bytes(folder) for name, folder in folders.items() if os.path.isdir(folder)}
            for folder in folders.values():
                shutil.rmtree(folder, ignore_errors=True)
    tensor_bytes = torch.tensor(float(sum(t.numel() * t.element_size() for t in saved.values())))
    dist.all_reduce(tensor_bytes)
    if rank == 0:
        report(args, st, saves, resumes, sizes, int(tensor_bytes), has_async)


# ------------------------------------------------------------------ the report


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(args: argparse.Namespace, st: SimpleNamespace, saves: dict, resumes: dict, sizes: dict[str, int],
           tensor_bytes: int, has_async: bool) -> None:
    m, mib = st.cfg.model, 2**20
    print(f"checkpoints, {args.ranks} ranks (gloo, {torch.get_num_threads()} threads each), ZeRO-{args.zero}, "
          f"{m.num_params() / 1e6:.1f}M params ({m.num_hidden_layers} layers, hidden {m.hidden_size}, vocab "
          f"{m.vocab_size}), fp32 masters + AdamW moments; medians of {args.rounds} interleaved rounds; "
          f"reads may come from the page cache")
    if args.zero >= 1:  # distinct pieces on every rank: their sum is the state, each element once
        print(f"  tensors of the pieces DCP saves, all ranks: {tensor_bytes / mib:,.1f} MiB")
    print("  folders: " + ", ".join(f"{LABELS[n]} {b / mib:,.1f} MiB" for n, b in sizes.items()))
    blocking = {n: median([b for b, _ in saves[n]]) for n in saves}
    total = {n: median([t for _, t in saves[n]]) for n in saves}
    for name in SAVES:
        if name not in saves:
            print(f"  {LABELS[name]:18s} not in this tree (cfg.checkpoint has no async_save)")
            continue
        print(f"  {LABELS[name]:18s} blocking {blocking[name]:8.3f} s   total {total[name]:8.3f} s")
    resume = {n: median([f[0] for f in resumes[n]]) for n in RESUMES}
    prestart = median([f[1] for f in resumes["tetron"]])
    read = median([f[2] for f in resumes["tetron"]])
    print(f"  resume, tetron: {resume['tetron']:.3f} s (pre-start check {prestart:.3f} s, reading {read / mib:,.1f} "
          f"MiB = {read / sizes.get('tetron', 1):.1%} of the checkpoint's bytes; goal < 5%)")
    print(f"  resume, dcp.load: {resume['dcp']:.3f} s (no pre-start check: the launcher reads nothing)")
    print(f"  ratios tetron/DCP: sync save {total['tetron'] / total['dcp']:.2f} (goal <= 1)   "
          f"resume {resume['tetron'] / resume['dcp']:.2f}")
    if has_async:
        print(f"  ratios tetron/DCP async: blocking {blocking['tetron_async'] / blocking['dcp_async']:.2f} "
              f"(goal <= 1.2)   total {total['tetron_async'] / total['dcp_async']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="one run per rank count")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    for flag in ("hidden", "layers", "vocab", "heads", "kv-heads", "intermediate"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="default: configs/smollm-135m.yaml's")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="tetron-bench-ckpt-", dir=args.dir)
    try:
        for ranks in args.ranks:
            # the ranks set up as `tetron train` sets up its ranks for this model and ZeRO stage
            launch(rank_main, argparse.Namespace(**{**vars(args), "ranks": ranks, "dir": root}),
                   cfg=rank_config(ranks, zero=args.zero, model=model_section(args)))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
