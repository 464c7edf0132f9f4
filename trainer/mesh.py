"""The one object that owns rank arithmetic: a PP x DP x EP mesh.

Rank layout (R = world size), by EP placement (the same two as `tuner.comms`):

    local  (default)  rank = (pp_idx * dp + dp_idx) * ep + ep_idx      EP innermost
    spread            rank = (ep_idx * pp + pp_idx) * dp + dp_idx      EP outermost

With "local" the EP group of a rank is a block of `ep` consecutive ranks (consecutive ranks
share a node under torchrun, which keeps the all-to-all inside a node when ep <= GPUs per
node), and the DP replicas of one expert shard are `ep` ranks apart. With "spread" the EP group
takes one rank from each of `ep` blocks of pp * dp ranks, so it spans nodes, while the pipeline
and DP neighbours sit close together.

Groups (each a `torch.distributed` process group, or None when it has one member):
    ep_group     ranks of the same (pp, dp): the all-to-all of MoE dispatch, expert migration
    dp_group     ranks of the same (pp, ep): expert gradients are averaged here
    stage_group  ranks of the same pp stage (dp x ep): non-expert gradients are averaged here
    pp_group     ranks of the same (dp, ep): pipeline point-to-point
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Mesh", "MeshError", "valid_divisors", "EP_PLACEMENTS"]

EP_PLACEMENTS = ("local", "spread")


class MeshError(ValueError):
    """The requested parallel layout cannot be built; the message says what would work."""


def valid_divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Mesh:
    world_size: int
    rank: int
    pp: int
    dp: int
    ep: int
    placement: str = "local"
    groups: dict[str, object] = field(default_factory=dict, repr=False)

    @staticmethod
    def plan(world_size: int, rank: int, pp: int, ep: int, dp: int = 0,
             placement: str = "local") -> Mesh:
        """Validate the degrees against the world size (no process groups are created)."""
        if placement not in EP_PLACEMENTS:
            raise MeshError(f"parallel.ep_placement={placement!r}; valid: {', '.join(EP_PLACEMENTS)}")
        for name, v in (("pp", pp), ("ep", ep)):
            if v < 1:
                raise MeshError(f"{name}={v} must be >= 1")
        if dp < 0:
            raise MeshError(f"dp={dp} must be >= 1 (or 0 to infer it from the world size)")
        if dp == 0:
            if world_size % (pp * ep):
                raise MeshError(
                    f"world size {world_size} is not divisible by pp={pp} x ep={ep} = {pp * ep}; "
                    f"launch a multiple of {pp * ep} processes, or pick pp x ep among the "
                    f"divisors of {world_size}: {valid_divisors(world_size)}"
                )
            dp = world_size // (pp * ep)
        if pp * dp * ep != world_size:
            raise MeshError(
                f"world size {world_size} does not match the mesh pp={pp} x dp={dp} x ep={ep} = "
                f"{pp * dp * ep}; launch {pp * dp * ep} processes (torchrun --nproc-per-node "
                f"{pp * dp * ep}) or set --parallel.dp=0 to infer dp"
            )
        return Mesh(world_size=world_size, rank=rank, pp=pp, dp=dp, ep=ep, placement=placement)

    # coordinates ---------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_idx, dp_idx, ep_idx) of `rank`; the inverse of `rank_of`."""
        if self.placement == "local":
            return rank // (self.dp * self.ep), (rank // self.ep) % self.dp, rank % self.ep
        return (rank // self.dp) % self.pp, rank % self.dp, rank // (self.pp * self.dp)

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
        return self.dp_idx * self.ep + self.ep_idx

    @property
    def n_data_shards(self) -> int:
        return self.dp * self.ep

    def rank_of(self, pp_idx: int, dp_idx: int, ep_idx: int) -> int:
        if self.placement == "local":
            return (pp_idx * self.dp + dp_idx) * self.ep + ep_idx
        return (ep_idx * self.pp + pp_idx) * self.dp + dp_idx

    def ep_ranks(self) -> list[int]:
        return [self.rank_of(self.pp_idx, self.dp_idx, e) for e in range(self.ep)]

    def dp_ranks(self) -> list[int]:
        return [self.rank_of(self.pp_idx, d, self.ep_idx) for d in range(self.dp)]

    def stage_ranks(self) -> list[int]:
        return [self.rank_of(self.pp_idx, d, e) for d in range(self.dp) for e in range(self.ep)]

    def pp_ranks(self) -> list[int]:
        return [self.rank_of(p, self.dp_idx, self.ep_idx) for p in range(self.pp)]

    # process groups ---------------------------------------------------------------------------
    def build_groups(self, timeout: timedelta | None = None) -> Mesh:
        """Create every process group. Collective: all ranks call it, in the same order.

        `timeout`: how long an operation on these groups may wait before failing (hang
        detection); None = torch's default."""
        if self.world_size == 1 or not dist.is_initialized():
            self.groups = {k: None for k in ("ep", "dp", "stage", "pp")}
            return self
        layouts = {
            "ep": [[self.rank_of(p, d, e) for e in range(self.ep)]
                   for p in range(self.pp) for d in range(self.dp)],
            "dp": [[self.rank_of(p, d, e) for d in range(self.dp)]
                   for p in range(self.pp) for e in range(self.ep)],
            "stage": [[self.rank_of(p, d, e) for d in range(self.dp) for e in range(self.ep)]
                      for p in range(self.pp)],
            "pp": [[self.rank_of(p, d, e) for p in range(self.pp)]
                   for d in range(self.dp) for e in range(self.ep)],
        }
        for kind, lists in layouts.items():
            mine = None
            for ranks in lists:
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
