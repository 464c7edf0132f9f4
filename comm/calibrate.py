"""Calibrate `CostModel` on the running job: five timed exchanges, one agreed result.

Collective: every rank of `group` calls it with the same arguments. It times flat and HALO
with one row per rank pair (fixed costs dominate) and with `large_rows` rows per pair
(bandwidth dominates), takes the median of `repeats` after a warm-up, and the maximum over
ranks (the slowest rank ends the collective). Every rank then fits the same numbers, so the
returned model is identical everywhere and `algorithm="auto"` stays deadlock-free:
    alpha_net = alpha_local  flat small time / messages of the flat schedule (2 per
                             pairwise step when the backend serialises directions)
    local_bandwidth          intra-node bytes per rank / flat time of an intra-node-only
                             exchange (less its fixed costs)
    halo_overhead_s          HALO small time - HALO small prediction without overhead
    nic_bandwidth            busiest-NIC bytes of the large case / (HALO large - HALO small
                             - the predicted relay hop)
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from comm.alltoall import all_to_all
from comm.cost import CostModel, predict_halo
from comm.topology import Topology

__all__ = ["calibrate", "time_all_to_all"]


def time_all_to_all(
    group: dist.ProcessGroup | None,
    topo: Topology,
    S: list[list[int]],
    row_numel: int,
    algorithm: str,
    repeats: int = 3,
    warmup: int = 1,
    model: CostModel | None = None,
) -> float:
    """Median over repeats of the slowest rank's time for one exchange of S (seconds)."""
    rank = dist.get_rank(group)
    x = torch.randn(sum(S[rank]), row_numel)
    samples = []
    for i in range(warmup + repeats):
        dist.barrier(group)
        t0 = time.perf_counter()
        all_to_all(x, S[rank], group, algorithm, topology=topo, cost_model=model)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            samples.append(float(dt.item()))
    return statistics.median(samples)


def _busiest_nic_bytes(S: list[list[int]], row_bytes: int, topo: Topology) -> float:
    out: dict[tuple[int, int], float] = {}
    inn: dict[tuple[int, int], float] = {}
    node, nic = topo.rank2node, topo.rank2nic
    for s, row in enumerate(S):
        for d, rows in enumerate(row):
            if node[s] != node[d]:
                out[(node[s], nic[s])] = out.get((node[s], nic[s]), 0.0) + rows * row_bytes
                inn[(node[d], nic[d])] = inn.get((node[d], nic[d]), 0.0) + rows * row_bytes
    return max([*out.values(), *inn.values()], default=0.0)


def calibrate(
    group: dist.ProcessGroup | None,
    topo: Topology,
    row_numel: int = 256,
    large_rows: int = 64,
    repeats: int = 3,
    base: CostModel | None = None,
) -> CostModel:
    """Fit alpha, HALO overhead and NIC bandwidth of `base` (default: for the backend)."""
    R = dist.get_world_size(group)
    if topo.world_size != R:
        raise ValueError(f"topology has {topo.world_size} ranks, the group {R}")
    if large_rows < 2 or row_numel < 1:
        raise ValueError(f"need large_rows >= 2 and row_numel >= 1, got {large_rows}, {row_numel}")
    base = base or CostModel.for_backend(dist.get_backend(group))
    row_bytes = 4 * row_numel  # float32 rows
    small = [[1] * R for _ in range(R)]
    large = [[large_rows] * R for _ in range(R)]
    flat_small = time_all_to_all(group, topo, small, row_numel, "flat", repeats)
    if topo.num_nodes == 1:
        return dataclasses.replace(base, alpha_net=flat_small / max(1, R - 1),
                                   alpha_local=flat_small / max(1, R - 1))
    halo_small = time_all_to_all(group, topo, small, row_numel, "halo", repeats)
    halo_large = time_all_to_all(group, topo, large, row_numel, "halo", repeats)
    # The flat model charges a send and a receive per pairwise step, one per peer otherwise.
    messages = 2 * (R - 1) if base.flat_pairwise else R - 1
    alpha = flat_small / messages
    fitted = dataclasses.replace(base, alpha_net=alpha, alpha_local=alpha, halo_overhead_s=0.0)
    G = max(topo.ranks_per_node())
    if G > 1:
        # Intra-node rows only: what HALO's phase III costs per byte. On 2 shared cores the
        # loopback TCP hop is far slower than the 1 GB/s default and decides flat vs HALO.
        node = topo.rank2node
        local = [[large_rows if node[s] == node[d] else 0 for d in range(R)] for s in range(R)]
        flat_local = time_all_to_all(group, topo, local, row_numel, "flat", repeats)
        per_rank = (G - 1) * large_rows * row_bytes * (2 if base.flat_pairwise else 1)
        spent = max(flat_local - flat_small * (G - 1) / max(R - 1, 1), 1e-9)
        fitted = dataclasses.replace(fitted, local_bandwidth=per_rank / spent)
    overhead = max(0.0, halo_small - predict_halo(small, row_bytes, topo, fitted))
    # HALO large = small + NIC time + relay hop: strip the (fitted) hop to get the NIC rate.
    no_nic = dataclasses.replace(fitted, nic_bandwidth=1e30)
    hop = predict_halo(large, row_bytes, topo, no_nic) - predict_halo(small, row_bytes, topo,
                                                                      no_nic)
    extra = max(halo_large - halo_small - hop, 1e-9)
    bandwidth = _busiest_nic_bytes(large, row_bytes, topo) / extra
    return dataclasses.replace(fitted, halo_overhead_s=overhead, nic_bandwidth=bandwidth)
