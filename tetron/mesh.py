"""The process layout: one object over DeviceMesh with this rank's coordinates, groups and neighbours.

Axes are ordered (pp, dp, cp, tp): tp innermost so tensor-parallel ranks are neighbours
(same node, fastest links), pp outermost. HSDP (`dp_shard` < dp*cp) cuts each dp*cp group into
shard groups of `dp_shard` consecutive ranks (ZeRO's slices; the nearest ranks, so its gathers and
reduce-scatters stay on the fastest links) and replicate groups across them (the same slice on each).
Expert parallelism (`ep` > 1) cuts each dp*cp group the same way: `ep` groups of ep consecutive ranks (which
hold an MoE layer's experts between them) and `edp` groups across them (the ranks holding the same experts);
ZeRO shards the expert shards over `edp_shard`, edp's ranks in this rank's shard group (all of edp without
HSDP; with it, ep divides dp_shard, so a shard group holds whole ep groups and its replicas are edp's rest).
Every group (each axis, dp*cp over which gradients are averaged, ZeRO's shards and replicas, the
tied-embedding pairs, cp*tp where an MoE layer sums its expert counts over a sequence's pieces) is built
explicitly from the rank grid with `new_group` and the run's timeout, and the DeviceMesh is assembled from the
axis groups (`DeviceMesh.from_group`): groups that init_device_mesh or new_group create on their own wait
torch's default 30 minutes, not `parallel.timeout_s`.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

AXES = ("pp", "dp", "cp", "tp")
DP_CP_GROUPS = ("dp_cp", "dp_shard", "dp_replicate", "ep", "edp", "edp_shard")  # groups cut out of dp*cp


class Mesh:
    """This rank's place in the pp x dp x cp x tp grid. Requires an initialised process group.

    `timeout`: how long any collective of its groups may wait (parallel.timeout_s); None: torch's default."""

    def __init__(self, *, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, dp_shard: int | None = None,
                 ep: int = 1, device_type: str = "cpu", timeout: timedelta | None = None) -> None:
        self.sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        self.dp_shard = dp * cp if dp_shard is None else dp_shard
        self.ep = ep
        self.world_size = pp * dp * cp * tp
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"world size {dist.get_world_size()} != pp*dp*cp*tp = {self.world_size}")
        self.rank = dist.get_rank()
        self.device_type = device_type
        self.timeout = timeout
        # [pp, dp, cp, tp] grid of global ranks
        self.grid = torch.arange(self.world_size).reshape(pp, dp, cp, tp)
        coords = (self.grid == self.rank).nonzero()[0].tolist()
        self.coords = dict(zip(AXES, coords))
        self.groups = {axis: self._new_group_over((axis,)) for axis in AXES}
        self.device_mesh = DeviceMesh.from_group([self.groups[a] for a in AXES], device_type, mesh=self.grid,
                                                 mesh_dim_names=AXES)
        self.groups["dp_cp"] = self._new_group_over(("dp", "cp"))
        hsdp = self.dp_shard < self.size("dp_cp")
        self.groups["dp_shard"], self.groups["dp_replicate"] = (self._split_dp_cp(self.dp_shard) if hsdp
                                                                else (self.groups["dp_cp"], None))
        self.groups["ep"], self.groups["edp"] = self._split_dp_cp(ep) if ep > 1 else (None, self.groups["dp_cp"])
        self.groups["edp_shard"] = (self.groups["dp_shard"] if ep == 1 else
                                    self._expert_shard_group() if hsdp else self.groups["edp"])
        # cp x tp: the ranks holding pieces of the same sequences under cp and sequence parallelism (MoE counts)
        self.groups["cp_tp"] = self._new_group_over(("cp", "tp")) if cp > 1 and tp > 1 else None
        if pp > 1:
            self.groups["embed"] = self._embedding_group()
        self._checkpoint_groups: dict[str, dist.ProcessGroup] | None = None

    def checkpoint_groups(self) -> dict[str, dist.ProcessGroup]:
        """"tp", "dp_cp", "world" and (expert parallelism) "ep" again, over the same ranks, on gloo: for
        checkpoints written by a background thread, whose collectives must never interleave with the training
        thread's on one group (and which work on CPU copies). Made on first use, which every rank reaches at
        the same save."""
        if self._checkpoint_groups is None:
            self._checkpoint_groups = {"tp": self._new_group_over(("tp",), "gloo"),
                                       "dp_cp": self._new_group_over(("dp", "cp"), "gloo"),
                                       "world": self._new_group_over(AXES, "gloo")}
            if self.ep > 1:
                self._checkpoint_groups["ep"] = self._split_dp_cp(self.ep, "gloo", across=False)[0]
        return self._checkpoint_groups

    def _new_group_over(self, axes: tuple[str, ...], backend: str | None = None) -> dist.ProcessGroup:
        """A group of the ranks that differ only along `axes`; every rank creates every such group, in order."""
        keep = [AXES.index(a) for a in axes]
        other = [i for i in range(len(AXES)) if i not in keep]
        # [*other sizes, *kept sizes] -> one row per group
        rows = self.grid.permute(*other, *keep).reshape(-1, math.prod(self.sizes[a] for a in axes))
        mine = None
        for row in rows.tolist():
            group = dist.new_group(row, timeout=self.timeout, backend=backend)
            if self.rank in row:
                mine = group
        assert mine is not None
        return mine

    def _split_dp_cp(self, inner: int, backend: str | None = None, *,
                     across: bool = True) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """(inner, across): each dp*cp row [R * S] cut into R inner groups of S = `inner` consecutive ranks
        (HSDP's shards, ep's experts) and S groups across them of every S-th (HSDP's replicas, edp), the latter
        only with `across`. Every rank creates all of them, in order."""
        n = self.size("dp_cp")
        rows = self.grid.permute(0, 3, 1, 2).reshape(-1, n // inner, inner)  # [pp*tp, R, S]
        mine: dict[str, dist.ProcessGroup | None] = {"inner": None, "across": None}
        cuts = {"inner": rows.reshape(-1, inner), "across": rows.transpose(1, 2).reshape(-1, n // inner)}
        for kind, groups in cuts.items() if across else list(cuts.items())[:1]:
            for row in groups.tolist():
                group = dist.new_group(row, timeout=self.timeout, backend=backend)
                if self.rank in row:
                    mine[kind] = group
        assert mine["inner"] is not None
        return mine["inner"], mine["across"]

    def _expert_shard_group(self) -> dist.ProcessGroup:
        """HSDP with ep: the ranks of this rank's shard group that hold its experts, every ep-th (ep divides
        dp_shard). Every rank creates all of them, in order."""
        n, shard, ep = self.size("dp_cp"), self.dp_shard, self.ep
        # [pp*tp, replicas, shard/ep, ep] -> one row per (shard group, ep rank)
        rows = self.grid.permute(0, 3, 1, 2).reshape(-1, n // shard, shard // ep, ep).transpose(2, 3)
        mine = None
        for row in rows.reshape(-1, shard // ep).tolist():
            group = dist.new_group(row, timeout=self.timeout)
            if self.rank in row:
                mine = group
        assert mine is not None
        return mine

    def _embedding_group(self) -> dist.ProcessGroup | None:
        """The first and the last pipeline stage of this rank's (dp, cp, tp) column: with tied embeddings
        both hold the tensor. Every rank creates every such group, in order; None off the two ends."""
        ends = self.grid[[0, -1]].permute(1, 2, 3, 0).reshape(-1, 2)  # [dp*cp*tp, 2]: (first, last)
        mine = None
        for pair in ends.tolist():
            group = dist.new_group(pair, timeout=self.timeout)
            if self.rank in pair:
                mine = group
        return mine

    def size(self, axis: str) -> int:
        """Number of ranks along `axis` ("pp", "dp", "cp", "tp", "dp_cp", "dp_shard", "dp_replicate", "ep",
        "edp" or "edp_shard")."""
        if axis in DP_CP_GROUPS:
            n = self.sizes["dp"] * self.sizes["cp"]
            return {"dp_cp": n, "dp_shard": self.dp_shard, "dp_replicate": n // self.dp_shard, "ep": self.ep,
                    "edp": n // self.ep, "edp_shard": self.dp_shard // self.ep}[axis]
        return self.sizes[axis]

    def local_rank(self, axis: str) -> int:
        """This rank's index along `axis`."""
        if axis in DP_CP_GROUPS:
            index = self.coords["dp"] * self.sizes["cp"] + self.coords["cp"]
            return {"dp_cp": index, "dp_shard": index % self.dp_shard, "dp_replicate": index // self.dp_shard,
                    "ep": index % self.ep, "edp": index // self.ep,
                    "edp_shard": index % self.dp_shard // self.ep}[axis]
        return self.coords[axis]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The group of `axis` (or "dp_cp", "dp_shard"); "embed": first + last pipeline stage, None elsewhere or
        without pp; "dp_replicate": HSDP's replicas of this rank's ZeRO slices, None without HSDP; "ep": this
        rank's expert-parallel group, None without; "edp": the ranks holding its experts (dp*cp without ep);
        "edp_shard": those of them in its shard group, over which ZeRO shards the experts (edp without HSDP);
        "cp_tp": the cp x tp ranks of this rank's (pp, dp) coordinates, None unless cp > 1 and tp > 1."""
        return self.groups.get(axis) if axis in ("embed", "dp_replicate", "ep", "cp_tp") else self.groups[axis]

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's (dp, cp, tp) column."""
        return int(self.grid[stage, self.coords["dp"], self.coords["cp"], self.coords["tp"]])

    def _neighbour(self, axis: str, step: int) -> int:
        index = list(self.coords[a] for a in AXES)
        i = AXES.index(axis)
        index[i] = (index[i] + step) % self.sizes[axis]
        return int(self.grid[tuple(index)])

    @property
    def pp_prev(self) -> int | None:
        """Global rank of the previous pipeline stage, None on the first stage."""
        return None if self.is_first_stage else self._neighbour("pp", -1)

    @property
    def pp_next(self) -> int | None:
        """Global rank of the next pipeline stage, None on the last stage."""
        return None if self.is_last_stage else self._neighbour("pp", 1)

    @property
    def cp_prev(self) -> int:
        """Global rank that sends to this one around the context-parallel ring."""
        return self._neighbour("cp", -1)

    @property
    def cp_next(self) -> int:
        """Global rank this one sends to around the context-parallel ring."""
        return self._neighbour("cp", 1)

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.sizes["pp"] - 1

    def __repr__(self) -> str:
        coords = " ".join(f"{a}={self.coords[a]}/{self.sizes[a]}" for a in AXES)
        return f"Mesh(rank={self.rank} {coords})"
