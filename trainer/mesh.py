"""The run's process groups, built from its `trainer.layout.Layout`.

`trainer.layout` owns the rank arithmetic (coordinates, the rank of a coordinate, who belongs
to which group, for the "local" and "spread" EP placements) as pure functions that the
planner uses too; this module asks it and creates the `torch.distributed` groups:

    ep_group     ranks of the same (pp, dp): the all-to-all of MoE dispatch, expert migration
    dp_group     ranks of the same (pp, ep): expert gradients are averaged here
    stage_group  ranks of the same pp stage (dp x ep): non-expert gradients are averaged here
    pp_group     ranks of the same (dp, ep): pipeline point-to-point

The trainer runs tp = cp = etp = 1 (`Layout` describes more for the planner; see
`trainer.layout.not_runnable_because`); with those the layout is PP x DP x EP:

    local  (default)  rank = (pp_idx * dp + dp_idx) * ep + ep_idx      EP innermost
    spread            rank = (ep_idx * pp + pp_idx) * dp + dp_idx      EP outermost
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from .layout import EP_PLACEMENTS, Layout, LayoutError, divisors

__all__ = ["Mesh", "MeshError", "valid_divisors", "EP_PLACEMENTS"]

MeshError = LayoutError  # the requested parallel layout cannot be built; the message says why
valid_divisors = divisors

_KINDS = ("ep", "dp", "stage", "pp")  # the groups the trainer creates, in creation order


@dataclass
class Mesh:
    layout: Layout
    rank: int
    groups: dict[str, object] = field(default_factory=dict, repr=False)

    @staticmethod
    def plan(world_size: int, rank: int, pp: int, ep: int, dp: int = 0,
             placement: str = "local", vpp: int = 1) -> Mesh:
        """Validate the degrees against the world size (no process groups are created);
        `vpp`: virtual pipeline stages per rank (--parallel.n_virtual)."""
        return Mesh(Layout.infer(world_size, pp=pp, ep=ep, dp=dp, vpp=vpp, placement=placement),
                    rank)

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
    def placement(self) -> str:
        return self.layout.placement

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

    # process groups ---------------------------------------------------------------------------
    def build_groups(self, timeout: timedelta | None = None) -> Mesh:
        """Create every process group. Collective: all ranks call it, in the same order.

        `timeout`: how long an operation on these groups may wait before failing (hang
        detection); None = torch's default."""
        if self.world_size == 1 or not dist.is_initialized():
            self.groups = dict.fromkeys(_KINDS)
            return self
        for kind in _KINDS:
            mine = None
            for ranks in self.layout.groups(kind):
                # new_group must be called by every rank for every group, even non-members.
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if self.rank in ranks:
                    mine = g
            self.groups[kind] = mine
        return self

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

    def describe(self) -> str:
        where = (f"EP groups of {self.ep} consecutive ranks" if self.placement == "local" else
                 f"EP groups spread: ranks {self.pp * self.dp} apart")
        return f"mesh pp={self.pp} x dp={self.dp} x ep={self.ep} (world {self.world_size}); {where}"
