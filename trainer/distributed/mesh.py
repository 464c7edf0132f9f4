"""The run's process groups, built from its `trainer.layout.Layout`.

`trainer.layout` owns the rank arithmetic (coordinates, the rank of a coordinate, who belongs
to which group, for the "local" and "spread" EP placements) as pure functions that the
planner uses too; this module asks it and creates the `torch.distributed` groups:

    ep_group     ranks of the same (pp, dp): the all-to-all of MoE dispatch, expert migration
    dp_group     ranks of the same (pp, ep): expert gradients are averaged here
    stage_group  every rank of a pp stage (dp x ep): expert counts, ZeRO-2's norm, and the
                 gradients of replicated weights that are partial sums over TP (`tp` > 1)
    dense_group  the stage's ranks with the same tp index (layout group "stage"): TP-sharded
                 and TP-replicated non-expert gradients are averaged here (= stage_group at tp=1)
    tp_group     tp consecutive ranks of a stage (only built at tp > 1), with `tp_mesh`, its
                 DeviceMesh for torch.distributed.tensor (trainer/distributed/tensor_parallel.py)
    pp_group     ranks of the same (dp, ep): pipeline point-to-point

The trainer runs cp = etp = 1 (`Layout` describes more for the planner; see
`trainer.layout.not_runnable_because`); with those and tp = 1 the layout is PP x DP x EP:

    local  (default)  rank = (pp_idx * dp + dp_idx) * ep + ep_idx      EP innermost
    spread            rank = (ep_idx * pp + pp_idx) * dp + dp_idx      EP outermost
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..layout import EP_PLACEMENTS, Layout, LayoutError, divisors

__all__ = ["Mesh", "MeshError", "valid_divisors", "EP_PLACEMENTS"]

MeshError = LayoutError  # the requested parallel layout cannot be built; the message says why
valid_divisors = divisors

_KINDS = ("ep", "dp", "stage", "pp")  # the groups the trainer creates, in creation order
_TP_KINDS = ("tp", "dense")  # created after those, only at tp > 1


@dataclass
class Mesh:
    layout: Layout
    rank: int
    groups: dict[str, object] = field(default_factory=dict, repr=False)

    @staticmethod
    def plan(world_size: int, rank: int, pp: int, ep: int, dp: int = 0,
             placement: str = "local", vpp: int = 1, tp: int = 1) -> Mesh:
        """Validate the degrees against the world size (no process groups are created);
        `vpp`: virtual pipeline stages per rank (--parallel.n_virtual); `tp`: tensor parallel
        of the dense side, folded into the stage (world = pp x dp x ep, tp | dp x ep)."""
        return Mesh(Layout.infer(world_size, pp=pp, ep=ep, dp=dp, tp=tp, vpp=vpp,
                                 placement=placement), rank)

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def placement(self) -> str:
        return self.layout.placement

    @property
    def tp_idx(self) -> int:
        return self.layout.coords(self.rank).tp

    # coordinates ---------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_idx, dp_idx, ep_idx) of `rank`; the inverse of `rank_of`."""
        c = self.layout.coords(rank)
        return c.pp, c.dp, c.ep

    @property
    def pp_idx(self) -> int:
        return self.coords(self.rank)[0]

    @property
    def dp_idx(self) -> int:
        return self.coords(self.rank)[1]

    @property
    def ep_idx(self) -> int:
        return self.coords(self.rank)[2]

    @property
    def data_idx(self) -> int:
        """Index of this rank's data shard: every rank of a stage reads different sequences."""
        return self.layout.data_idx(self.rank)

    @property
    def n_data_shards(self) -> int:
        return self.layout.n_data_shards

    def rank_of(self, pp_idx: int, dp_idx: int, ep_idx: int) -> int:
        return self.layout.rank_of(pp=pp_idx, dp=dp_idx, ep=ep_idx)

    def ep_ranks(self) -> list[int]:
        return self.layout.group("ep", self.rank)

    def dp_ranks(self) -> list[int]:
        return self.layout.group("dp", self.rank)

    def stage_ranks(self) -> list[int]:
        return self.layout.group("stage", self.rank)

    def pp_ranks(self) -> list[int]:
        return self.layout.group("pp", self.rank)

    def tp_ranks(self) -> list[int]:
        return self.layout.group("tp", self.rank)

    def _stage_all(self) -> list[list[int]]:
        """Every rank of each stage (the layout's "stage" groups split them by tp index)."""
        return [sorted(self.layout.stage_ranks(p)) for p in range(self.pp)]

    def _groups_of(self, kind: str) -> list[list[int]]:
        if kind == "stage" and self.tp > 1:
            return self._stage_all()
        return self.layout.groups("stage" if kind == "dense" else kind)

    # process groups ---------------------------------------------------------------------------
    def build_groups(self, timeout: timedelta | None = None) -> Mesh:
        """Create every process group. Collective: all ranks call it, in the same order.

        `timeout`: how long an operation on these groups may wait before failing (hang
        detection); None = torch's default."""
        if self.world_size == 1 or not dist.is_initialized():
            self.groups = dict.fromkeys(_KINDS + _TP_KINDS)
            return self
        # at tp = 1 no group is added, so the communicators (and losses) are those of before
        for kind in _KINDS + (_TP_KINDS if self.tp > 1 else ()):
            mine = None
            for ranks in self._groups_of(kind):
                # new_group must be called by every rank for every group, even non-members.
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    mine = g
            self.groups[kind] = mine
        if self.tp == 1:
            self.groups["dense"], self.groups["tp"] = self.groups["stage"], None
        return self

    def tp_mesh(self, device_type: str):
        """The 1-D DeviceMesh of this rank's TP group (torch.distributed.tensor); None at
        tp = 1. Not collective: it wraps the group `build_groups` created."""
        if self.tp == 1:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        if "tp_mesh" not in self.groups:
            group: Any = self.groups["tp"]
            self.groups["tp_mesh"] = DeviceMesh.from_group(
                group, device_type, mesh=self.tp_ranks(), mesh_dim_names=("tp",))
        return self.groups["tp_mesh"]

    @property
    def ep_group(self):
        return self.groups.get("ep")

    @property
    def dp_group(self):
        return self.groups.get("dp")

    @property
    def stage_group(self):
        return self.groups.get("stage")

    @property
    def pp_group(self):
        return self.groups.get("pp")

    @property
    def dense_group(self):
        return self.groups.get("dense")

    @property
    def tp_group(self):
        return self.groups.get("tp")

    def describe(self) -> str:
        where = (f"EP groups of {self.ep} consecutive ranks" if self.placement == "local" else
                 f"EP groups spread: ranks {self.pp * self.dp} apart")
        tp = (f"; TP groups of {self.tp} consecutive ranks (attn_dp={self.layout.attn_dp})"
              if self.tp > 1 else "")
        return (f"mesh pp={self.pp} x dp={self.dp} x ep={self.ep} (world {self.world_size}); "
                f"{where}{tp}")
