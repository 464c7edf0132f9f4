"""Closed-form communication costs: all-to-all (flat, HALO), pipeline P2P, ring all-reduce.

These stand in for `comm.netsim` until it exists; `alltoall_time` is the one function to swap.
Placement of a group on the machine is decided by its rank stride in the mesh:

    EP placement "local":  rank = (pp_i * DP + dp_i) * EP + ep_i   (EP innermost, the trainer's)
    EP placement "spread": rank = (ep_i * PP + pp_i) * DP + dp_i   (EP outermost)

A group of `size` members `stride` ranks apart, with G devices per node, has
`min(size, max(1, G // stride))` members per node (ranks of a node are consecutive).

All-to-all, uniform routing, B bytes leaving each rank's send buffer (its own share included):
    flat: max(intra / B_intra, inter / (eff * B_nic)) + per-peer message latency
    halo: phase I (intra) runs beside II -> III; II sends one packed message per remote node
          over every NIC of the node, III redistributes what arrived over the intra-node links:
          max(intra / B_intra, inter / B_nic + inter / B_intra) + per-remote-node latency
where intra = B * (local peers) / EP, inter = B * (remote peers) / EP and B_nic is one
device's share of its node's NICs. Published lower bound (REFERENCE 1.2): 4bskd / (EP B_nic)
for a forward dispatch + combine pair across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tuner.platform import Platform

__all__ = ["GroupPlacement", "placement", "alltoall_time", "p2p_time", "allreduce_time"]


@dataclass(frozen=True)
class GroupPlacement:
    """How a communication group of `size` ranks lies on nodes."""

    size: int
    per_node: int  # members sharing one node

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.per_node)

    @property
    def local_peers(self) -> int:
        return self.per_node - 1

    @property
    def remote_peers(self) -> int:
        return self.size - self.per_node


def placement(size: int, stride: int, gpus_per_node: int) -> GroupPlacement:
    """Members `stride` ranks apart, `gpus_per_node` consecutive ranks per node."""
    if size < 1 or stride < 1:
        raise ValueError(f"group size={size} and stride={stride} must be >= 1")
    per_node = min(size, max(1, gpus_per_node // stride))
    return GroupPlacement(size, per_node)


def alltoall_time(nbytes: float, group: GroupPlacement, algorithm: str, platform: Platform,
                  vendor_efficiency: float = 1.0) -> float:
    """Seconds for one all-to-all where each rank's send buffer holds `nbytes` spread evenly
    over the `group.size` ranks (the own share stays local)."""
    if group.size == 1 or nbytes <= 0:
        return 0.0
    share = nbytes / group.size
    intra = share * group.local_peers
    inter = share * group.remote_peers
    b_intra, b_nic = platform.intra_node_bandwidth, platform.nic_bandwidth_per_gpu
    lat_intra = platform.intra_node_latency if group.local_peers else 0.0
    if algorithm == "flat":
        # The vendor collective posts one message per peer; each costs a latency on the link
        # class it uses, and the link rates are scaled by the vendor efficiency.
        t = max(intra / b_intra, inter / b_nic) / vendor_efficiency
        return t + lat_intra * group.local_peers + platform.network_latency * group.remote_peers
    if algorithm == "halo":
        remote_nodes = group.nodes - 1
        phase1 = intra / b_intra
        phase23 = inter / b_nic + inter / b_intra if remote_nodes else 0.0
        msgs = platform.network_latency * remote_nodes + 2 * lat_intra
        return max(phase1, phase23) + msgs
    raise ValueError(f"all-to-all algorithm {algorithm!r}; valid: flat, halo")


def p2p_time(nbytes: float, inter_node: bool, platform: Platform) -> float:
    """One point-to-point transfer of `nbytes` between pipeline neighbours."""
    if nbytes <= 0:
        return 0.0
    if inter_node:
        # One device's send can use only its own NIC share: the others carry their own stages.
        return nbytes / platform.nic_bandwidth_per_gpu + platform.network_latency
    return nbytes / platform.intra_node_bandwidth + platform.intra_node_latency


def allreduce_time(nbytes: float, group: GroupPlacement, platform: Platform) -> float:
    """Ring all-reduce of `nbytes` per rank: 2 (n-1)/n of the data crosses each rank's
    slowest link, with 2 (n-1) latency steps."""
    n = group.size
    if n == 1 or nbytes <= 0:
        return 0.0
    if group.remote_peers:
        bw, lat = platform.nic_bandwidth_per_gpu, platform.network_latency
    else:
        bw, lat = platform.intra_node_bandwidth, platform.intra_node_latency
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
