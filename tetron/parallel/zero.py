"""ZeRO and mixed precision: an optimizer (tetron/optim) over fp32 master weights, sharded over the dp*cp group (or,
under HSDP, over the `dp_shard` group it is given: the replicas across groups hold the same slices). Each bucket
knows its group: expert-parallel shards' buckets are sliced over `edp_shard` (data_parallel.py), the ranks
holding the same experts, and a slice is gathered (after the step, or ZeRO-3's per unit) over its own.

Megatron's distributed optimizer in ordinary PyTorch, on top of the gradient buckets of
data_parallel.py (every gradient lives in an fp32 bucket buffer, padded to a multiple of N = dp*cp).

Master weights. The optimizer updates fp32 master copies, which are then cast into the parameters that the
forward pass uses. With fp32 parameters and no ZeRO the masters *are* the parameters (the plain optimizer,
nothing copied). With bf16 parameters (`train.dtype: bfloat16`) they keep the fp32 precision that
bf16 would round small updates away with; gradients are accumulated and averaged in fp32.

ZeRO-1 (`parallel.zero: 1`). Each bucket is cut into N equal slices and rank r owns slice r: the
reduce-scatter in data_parallel.py hands it the averaged gradients of its slice only; it keeps the
masters and the optimizer's state of that slice only (1/N of it), updates them, and
the updated slices are all-gathered into every rank's parameters, which live in one flat buffer per
bucket for that. ZeRO-2 (`zero: 2`) also releases the full gradient buffers once reduced, so only
the slices outlive the backward pass.

A parameter can straddle two ranks' slices: what a rank holds of one parameter is a `Piece`, and
pieces, not parameters, are what the optimizer sees, each with its parameter's role (AdamW: weight decay on
pieces of matrices, as on matrices). Whatever state tensors the optimizer declares are kept per piece, so
they are sharded as the masters are. An optimizer that needs whole matrices (Muon) gets each of them whole
on one owner rank: data parallelism then lays their buckets out so that no slice cuts one
(data_parallel.py's `whole`), and each such piece is a whole parameter, flat (`Param.shape` gives its shape).
Gradient finishing (sequence-parallel and tied-embedding sums) and clipping work on the pieces,
where the reduced gradients are; checkpoints stay full logical tensors by name: `full_tensor`
assembles one from every rank's pieces and `load` takes this rank's pieces back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tetron.config import OptimConfig, TrainConfig
from tetron.optim import Optimizer, Param, Role, TensorSplit
from tetron.parallel.comm import all_gather_flat
from tetron.parallel.data_parallel import DataParallel, DataParallelBucket, _Bucket
from tetron.parallel.layout import layout_of
from tetron.parallel.qk_clip import QKClip
from tetron.parallel.timers import timer
from tetron.parallel.zero3 import ParameterSharding


@dataclass
class Piece:
    """The elements [start, start + master.numel()) of a flattened parameter that this rank updates."""

    param: nn.Parameter
    start: int  # offset in the parameter's flattened elements
    bucket: _Bucket | None  # None: the plain case, the piece is the whole parameter and its own master
    slice_offset: int  # offset in the bucket's reduced gradients (this rank's slice, or the whole buffer)
    master: nn.Parameter  # fp32 [numel] (or the parameter itself in the plain case): what the optimizer updates

    @property
    def grad(self) -> Tensor | None:
        """The averaged fp32 gradient of the piece, where the data-parallel reduction left it."""
        if self.bucket is None:
            return self.param.grad
        n = self.master.numel()
        return self.bucket.reduced_grad()[self.slice_offset:self.slice_offset + n]


def _split(param: nn.Parameter, tp_group: dist.ProcessGroup | None) -> TensorSplit | None:
    """How tensor parallelism cuts `param` (parallel/layout.py's record), for an optimizer that needs it whole."""
    shard = layout_of(param).tp
    if shard is None or shard.count == 1 or tp_group is None:
        return None
    return TensorSplit(tp_group, shard.dim, shard.index, shard.count)


class ShardedOptimizer:
    """The optimizer `kind` over this rank's pieces of the parameters (`roles`: each parameter's, by id)."""

    def __init__(self, params: list[nn.Parameter], dp_chunks: list[DataParallel], t: TrainConfig, *,
                 kind: type[Optimizer], roles: dict[int, Role], zero: int, dtype: torch.dtype,
                 group: dist.ProcessGroup, optim: OptimConfig | None = None,
                 tp_group: dist.ProcessGroup | None = None,
                 fill: Callable[[list[nn.Parameter]], None] | None = None) -> None:
        self.zero, self.group, self.kind, self.roles = zero, group, kind, roles
        self.shards = dist.get_world_size(group) if zero >= 1 else 1
        # fp32 with nothing to shard (no ZeRO, or dp*cp = 1): the masters are the parameters themselves
        self.plain = self.shards == 1 and dtype == torch.float32
        self.masters_in_slices = dtype == torch.float32 and self.shards > 1  # ... or views of their slices
        self.buckets: list[_Bucket] = []
        if self.plain:
            self.pieces = [Piece(p, 0, None, 0, p) for p in params]
        else:
            for chunk in dp_chunks:
                if not isinstance(chunk, DataParallelBucket):
                    raise ValueError("fp32 master weights and ZeRO need parallel.dp_impl=bucket")
                self.buckets += chunk.buckets
            self.pieces = []
            # Bucket by bucket: with `fill` (ZeRO's hollow parameters, parallelize.py) one bucket is whole in fp32 at
            # a time; under ZeRO-3 (one unit a bucket) one is whole at all
            for bucket in self.buckets:
                if fill is not None:
                    fill(bucket.params)
                pieces = self._pieces(bucket)
                self._to_compute_dtype(dtype, bucket)
                if self.masters_in_slices:
                    for piece in pieces:
                        # fp32 under ZeRO: the master *is* this rank's slice of the parameters, updated in place
                        start = piece.slice_offset
                        piece.master = nn.Parameter(bucket.params_slice[start:start + piece.master.numel()])
                if fill is not None and self.zero == 3:  # the unit's slice is taken: its whole parameters go
                    # (zero3.py gathers them when they run)
                    bucket.params_flat.untyped_storage().resize_(0)
                self.pieces += pieces
            for chunk in dp_chunks:
                chunk.zero_grad()  # re-attach the gradient views to parameters of the new dtype
        # ZeRO-3: parameters sharded too, gathered unit by unit as the forward and backward passes need them
        self.sharding = ParameterSharding(dp_chunks) if zero == 3 and self.shards > 1 else None
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.piece_of = {id(piece.param): [] for piece in self.pieces}
        for piece in self.pieces:
            self.piece_of[id(piece.param)].append(piece)
        masters = [piece.master for piece in self.pieces]
        if kind.needs_whole_matrices and any(piece.master.numel() != piece.param.numel() for piece in self.pieces
                                             if roles[id(piece.param)] in kind.whole_roles):
            raise ValueError(f"optim.name={kind.name} needs whole parameters, and a ZeRO slice cuts one: build data "
                             f"parallelism with whole= naming its whole_roles")
        self.inner = kind([Param(piece.master, roles[id(piece.param)], piece.param.shape,
                                 _split(piece.param, tp_group)) for piece in self.pieces], t, optim)
        self.name, self.state_names = kind.name, kind.state_names()
        self.masters = masters
        # Optimizer steps called (or loaded) and, on the device, those its found_inf skipped: the same on
        # every rank, even one whose slices hold only padding.
        self.calls = 0.0
        self.skipped = torch.zeros((), device=masters[0].device if masters else "cpu")
        self.qk_clip: QKClip | None = None  # optim.qk_clip_tau's, set by parallelize.build_optimizer

    def state_names_of(self, param: nn.Parameter) -> tuple[str, ...]:
        """The state names a checkpoint holds for `param` (those of its role)."""
        return self.kind.state_names(self.roles[id(param)])

    @property
    def steps(self) -> float:
        """Optimizer steps taken (reading it waits for the device)."""
        return self.calls - float(self.skipped)

    def _pieces(self, bucket: _Bucket) -> list[Piece]:
        """This rank's pieces of the bucket's parameters: their overlap with its slice (over the bucket's group)."""
        lo, hi = bucket.mine.start, bucket.mine.stop
        pieces = []
        for p in bucket.params:
            begin, end = bucket.offsets[p], bucket.offsets[p] + p.numel()
            a, b = max(begin, lo), min(end, hi)
            if a < b:
                values = p.detach().reshape(-1)[a - begin:b - begin]
                # fp32 under ZeRO: a placeholder, replaced by a view of the slice once it exists
                master = nn.Parameter(values if self.masters_in_slices else values.float().clone())
                pieces.append(Piece(p, a - begin, bucket, a - lo if self.shards > 1 else a, master))
        return pieces

    def _to_compute_dtype(self, dtype: torch.dtype, bucket: _Bucket) -> None:
        """The bucket's parameters in the compute dtype; under ZeRO as views into one flat buffer, which the
        all-gather after each step fills, and this rank's slice of it kept apart."""
        for p in bucket.params:
            p.grad = None
        if self.shards == 1:
            for p in bucket.params:
                p.data = p.data.to(dtype)
            return
        flat = torch.zeros(bucket.padded, dtype=dtype, device=bucket.device)
        for p in bucket.params:
            view = flat[bucket.offsets[p]:bucket.offsets[p] + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
        bucket.params_flat = flat
        # this rank's slice: where the all-gather after each step starts from (in place), or under
        # ZeRO-3 the parameters' only copy between uses
        bucket.params_slice = flat[bucket.mine].clone() if self.zero == 3 else flat[bucket.mine]

    # ------------------------------------------------------------------------------ the step

    def set_lr(self, lr: float) -> None:
        self.inner.set_lr(lr)

    def tensors(self) -> list[Tensor]:
        """Every tensor the optimizer holds (its state, the masters), for memory accounting."""
        return self.inner.tensors()

    @torch.no_grad()
    def step(self, found_inf: Tensor | None = None) -> None:
        """The optimizer on the masters (their .grad: the pieces' averaged gradients), then the parameters
        from the masters: cast in place, or all-gathered from every rank's slice under ZeRO. Where the
        device scalar `found_inf` is 1 nothing changes (no update, no state decay, no step counted)."""
        if not self.plain:
            for piece in self.pieces:
                piece.master.grad = piece.grad
        self.inner.step(found_inf)
        if self.qk_clip is not None:  # on the masters, before the parameters are refreshed from them
            self.qk_clip.apply(self.pieces, found_inf)
        if found_inf is not None:
            self.skipped += found_inf
        self.calls += 1
        if self.plain:
            return
        for piece in self.pieces:
            piece.master.grad = None
        if self.shards == 1:
            for piece in self.pieces:
                piece.param.view(-1)[piece.start:piece.start + piece.master.numel()].copy_(piece.master)
            return
        if self.sharding is not None:
            self.sharding.free_all()  # nothing gathered may outlive the update of its slices
        for piece in self.pieces if not self.masters_in_slices else []:
            piece.bucket.params_slice[piece.slice_offset:piece.slice_offset + piece.master.numel()].copy_(piece.master)
        if self.sharding is not None:
            return  # ZeRO-3: each unit's forward gathers the slices it needs
        with timer("dp"):
            for bucket in (b for b in self.buckets if b.world > 1):  # expert shards on one rank: in place
                all_gather_flat(bucket.params_flat, bucket.params_slice, group=bucket.group)

    def grads(self) -> list[tuple[Tensor, nn.Parameter]]:
        """Every averaged gradient this rank holds, with its parameter: whole parameters' without ZeRO,
        this rank's pieces with it (each element on exactly one rank of dp*cp)."""
        return [(piece.grad, piece.param) for piece in self.pieces if piece.grad is not None]

    # ------------------------------------------------------------------------------ whole tensors

    def _assemble(self, param: nn.Parameter, parts: list[tuple[Piece, Tensor]]) -> Tensor:
        """The parameter-shaped fp32 tensor whose pieces are `parts` on their ranks (the others zero)."""
        full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        for piece, values in parts:
            full[piece.start:piece.start + values.numel()] = values.reshape(-1)
        bucket = self.bucket_of.get(id(param))  # over its group: dp_shard, or edp_shard for experts
        if self.shards > 1 and bucket is not None and bucket.world > 1:
            dist.all_reduce(full, group=bucket.group)  # each element is nonzero on one rank at most: exact
        return full.view_as(param)

    def full_tensor(self, param: nn.Parameter, kind: str) -> Tensor:
        """The fp32 master weights ("master") or a declared state tensor of `param` as a whole (this rank's tp part).
        Under ZeRO every rank of dp*cp calls this for the same parameters in the same order."""
        pieces = self.piece_of.get(id(param), [])
        if kind == "master":
            if self.plain:
                return param.detach()
            return self._assemble(param, [(piece, piece.master.detach()) for piece in pieces])
        parts = [(piece, self.inner.state_tensor(piece.master, kind)) for piece in pieces]
        if self.plain:
            return parts[0][1]
        return self._assemble(param, parts)

    def local_parts(self, param: nn.Parameter, kind: str) -> list[tuple[int, Tensor]]:
        """This rank's pieces of the master weights or a state tensor of `param` (its tp part): (offset in its
        flattened elements, values), without copying; checkpoints in the background copy them."""
        pieces = self.piece_of.get(id(param), [])
        if kind == "master":
            return [(piece.start, piece.master.detach()) for piece in pieces]
        return [(piece.start, self.inner.state_tensor(piece.master, kind)) for piece in pieces]

    def piece_ranges(self, param: nn.Parameter) -> list[tuple[int, int, int]]:
        """(rank in its bucket's group: the shard group, or edp_shard for an expert shard; offset, length) of each
        rank's piece of `param` (contiguous in its bucket, so one piece per rank at most): where a checkpoint gathers
        it."""
        if self.shards == 1:
            return [(0, 0, param.numel())]
        bucket = self.bucket_of[id(param)]
        begin, size = bucket.offsets[param], bucket.slice_size
        spans = [(q, max(begin, q * size), min(begin + param.numel(), (q + 1) * size)) for q in range(bucket.shards)]
        return [(q, a - begin, b - a) for q, a, b in spans if a < b]

    def full_grad(self, param: nn.Parameter) -> Tensor:
        """The averaged gradient of `param` as a whole: without ZeRO the gradient itself, no copy."""
        pieces = self.piece_of.get(id(param), [])
        if self.shards == 1 and len(pieces) == 1 and pieces[0].master.numel() == param.numel():
            return pieces[0].grad.view_as(param)
        return self._assemble(param, [(piece, piece.grad) for piece in pieces])

    def set_full_grad(self, param: nn.Parameter, grad: Tensor) -> None:
        """Write this rank's pieces of a parameter-shaped gradient back where the reduction left them."""
        flat = grad.reshape(-1)
        for piece in self.piece_of.get(id(param), []):
            if piece.grad.data_ptr() != flat.data_ptr():  # full_grad handed out the gradient itself
                piece.grad.view(-1).copy_(flat[piece.start:piece.start + piece.master.numel()])

    def has_state(self) -> bool:
        """Whether the optimizer has state to save (not before its first step). The same on every rank."""
        return self.calls > 0

    @torch.no_grad()
    def load(self, param: nn.Parameter, *, master: Tensor | None = None, state: dict[str, Tensor] | None = None,
             step: float | None = None) -> None:
        """Take this rank's pieces of whole (tp-local, fp32) tensors: master weights and/or the optimizer's
        state (every declared name) as after `step` steps.
        The parameters themselves are the caller's to fill, except under ZeRO-3, where only their
        slices exist between uses: those are filled here."""
        if step is not None:
            self.calls, self.skipped = float(step), torch.zeros_like(self.skipped)
        for piece in self.piece_of.get(id(param), []):
            n = piece.master.numel()
            part = slice(piece.start, piece.start + n)
            if master is not None and not self.plain:
                piece.master.copy_(master.reshape(-1)[part])
            if master is not None and self.sharding is not None:
                piece.bucket.params_slice[piece.slice_offset:piece.slice_offset + n].copy_(master.reshape(-1)[part])
            if state is not None:
                self.inner.load_state(piece.master, {name: value.reshape(-1)[part] for name, value in state.items()},
                                      step=float(step))
