"""Closed-form communication costs: all-to-all (flat, HALO), pipeline P2P, ring all-reduce.

The network simulator exists (`comm.netsim`, flow-level): `netsim_alltoall_time` below runs
an exchange through it, and `tuner.estimate` uses it instead of `alltoall_time` when the
assumptions say `alltoall_model = "netsim"`; the closed forms here are the fast default.
Placement of a group on the machine is decided by its rank stride in the mesh:

    EP placement "local":  rank = (pp_i * DP + dp_i) * EP + ep_i   (EP innermost, the trainer's)
    EP placement "spread": rank = (ep_i * PP + pp_i) * DP + dp_i   (EP outermost)

A group of `size` members `stride` ranks apart, with G devices per node, has
`min(size, max(1, G // stride))` members per node (ranks of a node are consecutive).

The closed form assumes the group's traffic meets no congestion beyond its own NIC share:
true inside one locality domain (one switch), which the planner enforces for EP groups;
`netsim_alltoall_time` runs the same exchange through `comm.netsim` (flow-level, every
concurrent EP group of the nodes involved) and is what the tests compare against.

All-to-all, uniform routing, B bytes leaving each rank's send buffer (its own share included):
    flat: max(intra / B_intra, inter / (eff * B_nic)) + per-peer message latency
    halo: phase I (intra) runs beside II -> III; II sends one packed message per remote node
          over every NIC of the node, III redistributes what arrived over the intra-node links
          (not needed with one member per node):
          max(intra / B_intra, inter / B_nic + inter / B_intra) + per-remote-node latency
where intra = B * (local peers) / EP, inter = B * (remote peers) / EP and B_nic is one
device's share of its node's NICs. Published lower bound (docs/reference.md 1.2):
4bskd / (EP B_nic) for a forward dispatch + combine pair across nodes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from tuner.platform import Platform

__all__ = ["GroupPlacement", "placement", "alltoall_time", "netsim_alltoall_time", "p2p_time",
           "allreduce_time"]


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
        # Phase III exists only when the relay that received a packed message is not the
        # destination itself, i.e. when the group has several members per node.
        hop3 = inter / b_intra if group.per_node > 1 else 0.0
        phase23 = inter / b_nic + hop3 if remote_nodes else 0.0
        msgs = platform.network_latency * remote_nodes + 2 * lat_intra
        return max(phase1, phase23) + msgs
    raise ValueError(f"all-to-all algorithm {algorithm!r}; valid: flat, halo")


@functools.lru_cache(maxsize=1024)
def netsim_alltoall_time(nbytes: float, group: GroupPlacement, algorithm: str,
                         platform: Platform) -> float:
    """`alltoall_time` by flow-level simulation: the nodes the group spans, each fully
    populated with groups laid out like this one (members `per_node` to a node, at the same
    local indices), all exchanging at once; per-message latency = the platform's."""
    import numpy as np

    from comm import netsim

    if group.size == 1 or nbytes <= 0:
        return 0.0
    if algorithm not in ("flat", "halo"):
        raise ValueError(f"all-to-all algorithm {algorithm!r}; valid: flat, halo")
    g, nodes = platform.gpus_per_node, group.nodes
    net = netsim.from_platform(platform.to_dict(), nodes)
    rank2gpu, topo = netsim.place(net, nodes)
    R = nodes * g
    # Rank r = node * g + local; its group: a block of per_node consecutive locals on each of
    # `nodes` nodes (local placement), or one local index across nodes (per_node == 1).
    node, local = np.divmod(np.arange(R), g)
    gid = local // group.per_node + (g // group.per_node) * (node // nodes)
    S = np.where(gid[:, None] == gid[None, :], nbytes / group.size, 0.0)
    tr = netsim.flat_all_to_all(S) if algorithm == "flat" else netsim.halo_all_to_all(S, topo)
    return float(netsim.simulate(net, tr, rank2gpu, message_overhead=platform.network_latency).time)


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
