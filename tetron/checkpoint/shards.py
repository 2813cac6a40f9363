"""Who writes which tensor of a checkpoint, and the writing: every rank writes its share.

Each tensor lives on one pipeline stage. It is gathered whole there (over dp*cp under ZeRO, over tp; an
expert-parallel shard over edp under ZeRO, then over ep) and written by one rank of that stage, its writer.
Under ZeRO a bucket's slices hold most tensors whole on one rank: that rank writes them and nothing crosses
the network for them (a tensor a slice boundary cuts goes to the rank holding most of it). Without ZeRO every
rank holds every tensor, and writers are chosen by bytes: the largest tensor first, each to the least loaded
rank of its stage (longest processing time first), the same plan on every rank from the config and layout.
Under ZeRO each stage's first rank plans its stage (the pieces' places, which its ranks share) and one
all-reduce of the writers tells every rank, so that rank 0 knows every file name before any is written. A
writer streams its tensors, in the model's order, into shards of its own (`{prefix}-XXXXX-of-YYYYY.safetensors`,
numbered over all writers); the index that maps each tensor to its file is written by rank 0 once all are done.

Why whole tensors and not DCP's HuggingFaceStorageWriter: that writer saves each rank's local pieces into
files of its own, which transformers cannot load until a consolidation pass reads every byte back and
writes it again. Gathering each tensor to its writer costs at most the traffic of the pieces' first write
(under ZeRO, with writers where the pieces are, far less) and leaves files transformers loads as they are,
with no second pass.

Each tensor's crc32 is computed from the bytes in memory as they are written (the file is never read back)
and listed in trainer_state.json; every rank that reads a tensor, whole or a slice, checks it
(load.TensorReader). The few collectives of a save besides the gathers (the temporary folder's name, who
failed, the crc32s, the generator states) are at the end.
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.checkpoint.safetensors_stream import SafetensorsWriter
from tetron.mesh import Mesh
from tetron.models.spec import ParallelPlan, piece_shapes, spec_of, split_stored
from tetron.parallel.comm import all_gather_dim
from tetron.parallel.layout import layout_of

Spec = tuple[str, str, torch.dtype, tuple[int, ...]]  # (key in the file, parameter name, dtype, full shape)
# where a model folder keeps a tensor (models.spec.stored_as_of): its MoE experts one by one, as the hub does
Layout = Callable[[str], str | list[list[str]] | None]
LINE_BYTES = 2048  # the longest error line one rank hands the others


def nbytes(spec: Spec) -> int:
    return torch.Size(spec[3]).numel() * spec[2].itemsize


def file_entries(spec: Spec, layout: Layout | None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors a spec is written as: (name, dtype, shape) of itself, or of its pieces under `layout`."""
    key, _, dtype, shape = spec
    stored = layout(key) if layout is not None else None
    return [(name, dtype, piece) for name, piece in piece_shapes(stored or key, shape)]


def file_keys(specs: list[Spec], layout: Layout | None) -> list[str]:
    """Every tensor name the specs are written as, in order."""
    return [name for spec in specs for name, *_ in file_entries(spec, layout)]


def stage_of(name: str, layer_ranks: list[int], plan: ParallelPlan) -> int:
    """The pipeline rank that holds parameter `name`: layers by `layer_ranks`, the embedding with the
    first layer, the final norm and head with the last (under zbv both on rank 0)."""
    part = plan.stage_part(name)
    if part == "layer":
        return layer_ranks[plan.layer_index(name)]
    return layer_ranks[0] if part == "embedding" else layer_ranks[-1]


def assign_writers(specs: list[Spec], stages: list[int], stage_ranks: list[list[int]],
                   held: Callable[[int, int], int] | None = None) -> list[int]:
    """The writer (global rank) of each spec: `stages[i]` is the pipeline rank holding spec i, and
    `stage_ranks[s]` the global ranks of stage s; `held(i, rank)`: the bytes of spec i that `rank` holds
    already (ZeRO's pieces; None: every rank alike). Each to the rank of its stage holding the most of it, and
    among those (all, without ZeRO) largest first to the least loaded (ties: the lowest rank): without ZeRO no
    rank writes more than its stage's share plus one tensor; under ZeRO, whose slices give each rank of a shard
    group an equal share of every bucket, a rank writes about its share, and receives only the smaller parts
    of the few tensors a slice boundary cuts."""
    load = {r: 0 for ranks in stage_ranks for r in ranks}
    owners = [0] * len(specs)
    for i in sorted(range(len(specs)), key=lambda i: (-nbytes(specs[i]), i)):
        have = {r: held(i, r) if held is not None else 0 for r in stage_ranks[stages[i]]}
        owners[i] = min(have, key=lambda r: (-have[r], load[r], r))
        load[owners[i]] += nbytes(specs[i])
    return owners


@dataclass
class Shard:
    """One safetensors file: its name, the rank that writes it, its tensors in order."""

    file: str
    writer: int
    specs: list[Spec]


def plan_files(prefix: str, specs: list[Spec], owners: list[int], shard_bytes: int, *,
               single_file: bool = False) -> list[Shard]:
    """Each writer's tensors (in spec order) grouped into shards of at most `shard_bytes` (a larger tensor
    gets its own), numbered over all writers in rank order. With `single_file` and one shard in all:
    `{prefix}.safetensors`, as transformers writes a small model."""
    groups: list[tuple[int, list[Spec]]] = []
    for writer in sorted(set(owners)):
        size = 0
        current: list[Spec] = []
        for spec, owner in zip(specs, owners):
            if owner != writer:
                continue
            if current and size + nbytes(spec) > shard_bytes:
                groups.append((writer, current))
                current, size = [], 0
            current.append(spec)
            size += nbytes(spec)
        if current:
            groups.append((writer, current))
    if single_file and len(groups) == 1:
        return [Shard(f"{prefix}.safetensors", groups[0][0], groups[0][1])]
    return [Shard(f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors", w, s) for i, (w, s) in enumerate(groups)]


def tensor_crc32(tensor: Tensor) -> int:
    """The crc32 of a tensor's bytes as stored (any dtype: viewed as bytes)."""
    data = tensor.detach().contiguous().cpu().reshape(-1)
    return zlib.crc32(data.view(torch.uint8).numpy()) if data.numel() else 0


def full_tensor(local: Tensor, param: nn.Parameter, tp_group: dist.ProcessGroup,
                ep_group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole tensor of which `local` (the parameter or a state of the same shape) is this rank's part; an
    expert shard's experts are gathered over `ep_group`, which every rank of it must join."""
    experts = layout_of(param).ep
    if experts is not None:
        return all_gather_dim(local, experts.dim, ep_group)
    shard = layout_of(param).tp
    if shard is None:
        return local
    full = all_gather_dim(local, shard.dim, tp_group)
    return full.narrow(shard.dim, 0, shard.logical_size or full.shape[shard.dim])


@dataclass
class Pieces:
    """Where a save takes each tensor from: `parts(param, kind)`, this rank's pieces of it (offset in its
    flattened elements, values; its tp part), and `ranges(param)`, every rank's (rank in its shard group,
    offset, length) when the pieces are ZeRO's (`sharded`); else each rank holds the whole tp part. Pieces
    travel over `group`, dp*cp's; ZeRO's shard groups are its runs of `shard` consecutive ranks (all of it
    but under HSDP, whose replicas each hold every piece: a writer takes them from its own shard group). An
    expert shard's pieces are over its edp ranks in the shard group (rank q there is dp*cp rank: the shard
    group's first + q * ep + the ep rank; ep divides `shard`): each gathers on its rank in the writer's ep
    group, which lies in the writer's shard group."""

    parts: Callable[[nn.Parameter, str], list[tuple[int, Tensor]]]
    ranges: Callable[[nn.Parameter], list[tuple[int, int, int]]]
    sharded: bool
    group: dist.ProcessGroup | None
    device: torch.device
    shard: int = 1

    def gather(self, param: nn.Parameter, kind: str, *, dst: int, me: int, sends: list) -> Tensor | None:
        """The fp32 `param`-shaped tp part on rank `dst` of dp*cp (None elsewhere): each other rank sends
        its piece there, the least traffic (an all-reduce would move twice the tensor through every rank).
        The sends are not waited for (they go on while this rank gathers its own): `sends` collects them,
        for the caller to wait on before the pieces change. An expert shard goes to the writer's ep group
        instead: rank `dst` there gets the tp part of its own experts."""
        parts = self.parts(param, kind)
        experts = layout_of(param).ep
        start = dst - dst % self.shard  # the writer's shard group starts at this rank of dp*cp
        sends_here = me - me % self.shard == start
        base, stride = start, 1
        if experts is not None:  # this rank's edp ranks there: start + q * ep + its ep rank; its one in dst's ep group
            stride = experts.count
            base = start + me % stride
            dst = dst - dst % stride + me % stride
        if me != dst:
            for _, values in parts if self.sharded and sends_here else []:
                sends.append(dist.isend(values.reshape(-1).contiguous(), group_dst=dst, group=self.group))
            return None
        if len(parts) == 1 and parts[0][1].numel() == param.numel():
            return parts[0][1].view(param.shape)  # this rank holds it all: no copy
        whole = torch.empty(param.numel(), dtype=torch.float32, device=self.device)
        for start, values in parts:
            whole[start:start + values.numel()].copy_(values.reshape(-1))
        works = [dist.irecv(whole[start:start + n], group_src=base + q * stride, group=self.group)
                 for q, start, n in self.ranges(param) if base + q * stride != me]
        for work in works:
            work.wait()
        return whole.view(param.shape)


def dp_cp_rank(mesh: Mesh, rank: int) -> int:
    """Global `rank`'s rank in its dp*cp group (Mesh: the grid is arange(world) as [pp, dp, cp, tp])."""
    cp, tp = mesh.size("cp"), mesh.size("tp")
    return (rank // (cp * tp)) % mesh.size("dp") * cp + (rank // tp) % cp


def choose_writers(specs: list[Spec], stages: list[int], mesh: Mesh, chunks: list[nn.Module], pieces: Pieces,
                   world: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """assign_writers for a save: under ZeRO (`pieces.sharded`) by where the pieces are, planned by each stage's
    first rank for its stage and all-reduced (MAX over `world`) to every rank; else by bytes alone, on every
    rank alike. An expert shard's pieces are counted as nowhere (its writer gathers over ep anyway)."""
    stage_ranks = [mesh.grid[s].flatten().tolist() for s in range(mesh.size("pp"))]
    if not pieces.sharded:
        return assign_writers(specs, stages, stage_ranks)
    pp_rank = mesh.local_rank("pp")
    mine = {name: p for chunk in chunks for name, p in chunk.named_parameters(remove_duplicate=False)}

    def held(i: int, rank: int) -> int:
        param = mine.get(specs[i][1])
        if stages[i] != pp_rank or param is None or layout_of(param).ep is not None or not param.numel():
            return 0
        q = dp_cp_rank(mesh, rank) % pieces.shard  # its rank in its shard group
        return nbytes(specs[i]) * sum(n for r, _, n in pieces.ranges(param) if r == q) // param.numel()

    planned = assign_writers(specs, stages, stage_ranks, held)
    first = mesh.rank == stage_ranks[pp_rank][0]
    owners = torch.tensor([o if first and s == pp_rank else -1 for o, s in zip(planned, stages)], dtype=torch.int64)
    owners = owners.to(device)
    dist.all_reduce(owners, op=dist.ReduceOp.MAX, group=world)
    return owners.cpu().tolist()


@torch.no_grad()
def gather_to_writers(chunks: list[nn.Module], mesh: Mesh, specs: list[Spec], owners: list[int], *,
                      layer_ranks: list[int], local: Callable[[nn.Parameter, str, int, int], Tensor | None],
                      tp_group: dist.ProcessGroup, buffers: dict[str, Tensor],
                      ep_group: dist.ProcessGroup | None = None) -> Iterator[tuple[str, Tensor]]:
    """Yield (key, whole tensor on the CPU) for every spec this rank writes, in order. Every rank of a
    tensor's stage calls `local(param, key, dst, me)`: its tp part on rank `dst` of dp*cp (the writer's),
    None on the others (this rank is `me` there); the ranks that have it gather it over tp. An expert shard
    is had by every rank of the writer's ep group (their own experts), which all gather it over `ep_group`:
    they see the same specs in the same order, so each ep group's gathers match. A writer outside
    the stage (OUT/model's rank 0) gets it from the stage's first rank. `buffers` (by name: the state that is
    no parameter, whole and the same on every rank of its stage) are taken as they are."""
    pp_rank, plan = mesh.local_rank("pp"), spec_of(chunks[0].config).plan
    mine = {name: p for chunk in chunks for name, p in chunk.named_parameters(remove_duplicate=False)}
    device = next(iter(mine.values())).device
    me = dp_cp_rank(mesh, mesh.rank)
    for (key, name, dtype, shape), owner in zip(specs, owners):
        stage = stage_of(name, layer_ranks, plan)
        sender = int(mesh.grid[stage].flatten()[0])  # the stage's first rank
        if stage == pp_rank:
            if name in buffers:
                whole = buffers[name].to(device=device, dtype=dtype).contiguous()
            else:
                part = local(mine[name], key, dp_cp_rank(mesh, owner), me)
                if part is None:
                    continue
                whole = full_tensor(part, mine[name], tp_group, ep_group).contiguous()
            if owner == mesh.rank:
                yield key, whole.cpu()
            elif mesh.rank == sender and not bool((mesh.grid[stage] == owner).any()):
                dist.send(whole, dst=owner)
        elif owner == mesh.rank:
            whole = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(whole, src=sender)
            yield key, whole.cpu()


class ShardWriter:
    """This rank's shards of one prefix, filled tensor by tensor from a stream in spec order. Each tensor is
    written, and summed (crc32) block by block as it goes out, on a thread of its own while the stream gathers
    the next one (at most one waits), so the disk, the sums and the network work at once (zlib and file writes
    let go of the GIL). A failed write (a full disk) is kept and the rest of the stream
    still consumed, so that this rank goes on taking part in the gathers of the others; `error` is read once
    the stream ends. With a `layout`, a tensor kept in pieces is written as its pieces (`crc32` by piece)."""

    def __init__(self, folder: Path | None, shards: list[Shard], rank: int, *, layout: Layout | None = None) -> None:
        self.folder = folder
        self.layout = layout
        self.pending = iter([s for s in shards if s.writer == rank])
        self.current: Shard | None = None
        self.writer: SafetensorsWriter | None = None
        self.left = 0
        self.crc32: dict[str, int] = {}
        self.error: BaseException | None = None

    def consume(self, stream: Iterator[tuple[str, Tensor]]) -> None:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tetron-write") as pool:
            writing: Future | None = None
            for key, tensor in stream:
                stored = self.layout(key) if self.layout is not None else None
                pieces = split_stored(stored or key, tensor) if self.error is None else []
                if writing is not None:
                    writing.result()  # one tensor in flight at most
                writing = pool.submit(self._write, pieces) if self.error is None else None

    def _write(self, pieces: list[tuple[str, Tensor]]) -> None:
        """Write one tensor: its pieces (one, unless the layout keeps it in pieces), keeping their crc32."""
        if self.error is not None:
            return
        try:
            if self.left == 0:
                self.current = next(self.pending)
                self.left = len(self.current.specs)
                if self.folder is not None:
                    self.writer = SafetensorsWriter(self.folder / self.current.file,
                                                    [entry for spec in self.current.specs
                                                     for entry in file_entries(spec, self.layout)],
                                                    metadata={"format": "pt"})
            for name, piece in pieces:
                self.crc32[name] = self.writer.write(name, piece) if self.writer is not None else tensor_crc32(piece)
            self.left -= 1
            if self.left == 0 and self.writer is not None:
                self.writer.close()
                self.writer = None
        except Exception as err:  # reported after the stream ends, on every rank at once
            if isinstance(err, OSError) and not err.filename and self.current is not None and self.folder is not None:
                err.filename = str(self.folder / self.current.file)  # a failed write() names no file
            if self.writer is not None:
                self.writer.abort()  # the folder is removed; its descriptor must not outlive it
            self.error = err


# --------------------------------------------------------------------------- a save's own collectives


@dataclass
class Comm:
    """Where a save's collectives go: the training groups (a save in the foreground) or the checkpoint
    groups (in the background, on CPU tensors). None: the default group."""

    tp: dist.ProcessGroup | None
    world: dist.ProcessGroup | None
    device: torch.device
    ep: dist.ProcessGroup | None = None  # expert parallelism's; None without


def send_line(line: str, src: int, comm: Comm) -> str:
    """Rank `src`'s `line` on every rank (one tensor broadcast; an empty line says all went well)."""
    buf = torch.zeros(LINE_BYTES, dtype=torch.uint8)
    raw = line.encode()[:LINE_BYTES]
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
    buf = buf.to(comm.device)
    dist.broadcast(buf, src=src, group=comm.world)  # the world's group ranks are the global ranks
    return bytes(buf.cpu().numpy()).rstrip(b"\0").decode(errors="replace")


def gather_rng(states: dict[str, Tensor], group: dist.ProcessGroup | None, device: torch.device,
               world: int) -> dict[str, Tensor]:
    """Every rank's generator states (CPU "rank_{i}", and "cuda_rank_{i}" on GPUs). All the same size, so a
    tensor all-gather carries them (all_gather_object would pickle)."""
    out: dict[str, Tensor] = {}
    for prefix, state in states.items():
        parts = [torch.empty_like(state, device=device) for _ in range(world)]
        dist.all_gather(parts, state.to(device), group=group)
        out.update({f"{prefix}_{i}": part.cpu() for i, part in enumerate(parts)})
    return out
