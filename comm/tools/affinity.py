"""Pinning each local CPU rank to its own cores (`--train.cpu_affinity`).

On a single-node CPU run whose processes x intra-op threads exactly fill the cores this job
may use (its affinity mask), "auto" pins local rank r to the r-th block of `threads` cores.
Left to the OS, two ranks on this project's 2-core VM ran an EP step 6-15 % and a DP step
2-9 % longer, and a profiled DP step showed the same work taking ~25 % longer on one rank
than on the other (docs/planner.md, "Pinned ranks"; which OS placement costs it was not
separated). Where the processes share cores, leave some to other jobs, or the job spans
several nodes (which may be emulated on one machine, `comm.emulate`), nothing is pinned: a
fixed split would stack the other processes on the same cores. GPU runs are not touched
(their CPU binding is the launcher's, e.g. `srun --cpu-bind`).

`tuner measure` pins its workers by the same rule, so a platform is measured the way the
trainer runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["AFFINITY_MODES", "rank_cores", "pin_local_rank", "check_mode"]

AFFINITY_MODES = ("auto", "none")


def check_mode(mode: str, where: str = "train.cpu_affinity") -> None:
    if mode not in AFFINITY_MODES:
        raise ValueError(f"{where}={mode!r}; valid: {', '.join(AFFINITY_MODES)}")


def rank_cores(local_rank: int, local_world: int, threads: int,
               available: Sequence[int]) -> list[int] | None:
    """The cores `local_rank` of `local_world` (each with `threads` intra-op threads) is
    pinned to: its own block of `threads` of `available` (sorted) when local_world x threads
    equals their number; None otherwise (shared or spare cores: left to the OS)."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local_rank={local_rank} outside 0..{local_world - 1}")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    cores = sorted(available)
    if local_world < 2 or local_world * threads != len(cores):
        return None
    return cores[local_rank * threads:(local_rank + 1) * threads]


def pin_local_rank(mode: str, local_rank: int, local_world: int, threads: int,
                   world: int | None = None) -> list[int] | None:
    """Apply `mode` ("auto" / "none") to this process, one of `local_world` on this node of a
    job of `world` processes (default: all local); the cores it is now pinned to, or None
    where it left the placement to the OS (a multi-node job, shared or spare cores, a
    platform without the affinity call)."""
    check_mode(mode)
    world = local_world if world is None else world
    if mode == "none" or world != local_world or not hasattr(os, "sched_setaffinity"):
        return None
    cores = rank_cores(local_rank, local_world, threads, sorted(os.sched_getaffinity(0)))
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores
