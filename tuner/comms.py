"""Communication costs for the planner: all-to-all (flat, HALO, dedup, auto), pipeline P2P,
ring all-reduce.

All-to-all times come from the one all-to-all model, `comm.cost.a2a_model` (the one `auto` decides
with at run time): this module only supplies its inputs, the link rates of a platform file
(`rates`) and the loads of a uniform exchange of a group placed on nodes
(`comm.cost.a2a_model.uniform_load`). `netsim_alltoall_time` runs the same exchange through
`comm.netsim`, the flow-level simulator that validates the model (tests/test_tuner_comms.py:
within 3 % inside one locality domain) and that `tuner.estimate` uses instead when the
assumptions say `alltoall_model = "netsim"`. See docs/architecture.md, "All-to-all cost:
which model is used where".

Placement of a group on the machine is decided by its rank stride in the mesh:

    EP placement "local":  rank = (pp_i * DP + dp_i) * EP + ep_i   (EP innermost, the trainer's)
    EP placement "spread": rank = (ep_i * PP + pp_i) * DP + dp_i   (EP outermost)

A group of `size` members `stride` ranks apart, with G devices per node, has
`min(size, max(1, G // stride))` members per node (ranks of a node are consecutive).

Deduplicated dispatch ("dedup", DeepEP-style; issue 26): a token routed to several experts on
one remote node crosses the network to that node once, to the rail-aligned relay that fans it
out inside the node (HALO's phase III), and on the way back the node's outputs for that
token are summed on the node so one row returns. Its phases are HALO's with the off-node bytes
of phase II scaled by the share of (token, remote node) pairs that are distinct:

    distinct remote nodes per token / routed copies sent off-node
        = (n - 1) (1 - P(a node gets none of the k)) / (k (n - 1) / n)
    P(none of the k) = C(E - E/n, k) / C(E, k)     (k distinct experts of E, E/n per node)
                     -> (1 - 1/n)^k                 (E >> k: independent picks)
    expected distinct nodes of a token = n (1 - P(none))   (`expected_distinct_nodes`)

for uniform routing over n nodes (tests/test_tuner_comms.py checks both forms against a
Monte Carlo count). "auto" is the cheapest of the algorithms the trainer's `--comm.alltoall
auto` chooses among (`comm.collectives.alltoall.ALGORITHMS` but auto itself: flat and HALO today; dedup
joins when comm runs it).

The model assumes the group's traffic meets no congestion beyond its own NIC share (every
device of a node exchanging alike): true inside one locality domain (one switch), which the
planner enforces for EP groups. Published lower bound (docs/reference.md 1.2):
4bskd / (EP B_nic) for a forward dispatch + combine pair across nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from comm.cost.a2a_model import Rates, uniform_load, uniform_time
from tuner.platform import Platform

__all__ = ["GroupPlacement", "placement", "alltoall_time", "netsim_alltoall_time", "p2p_time",
           "allreduce_time", "reduce_time", "broadcast_time", "measured_collective_time",
           "rates", "expected_distinct_nodes", "dedup_factor", "auto_choices",
           "auto_considers_dedup"]


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


def rates(platform: Platform, vendor_efficiency: float = 1.0) -> Rates:
    """The all-to-all model's parameters from a platform's link rates, as
    `comm.CostModel.from_platform` reads them from the same file: NIC and intra-node rates
    and latencies, one network latency as HALO's fixed overhead, the flat collective's
    on-node and off-node transfers overlapping unless the backend is gloo. The vendor
    collective reaching `vendor_efficiency` of the link rates scales the flat rates."""
    if not 0.0 < vendor_efficiency <= 1.0:
        raise ValueError(f"vendor_efficiency={vendor_efficiency} must be in (0, 1]")
    scaled = vendor_efficiency != 1.0
    return Rates(nic_bandwidth=platform.nic_bandwidth,
                 local_bandwidth=platform.intra_node_bandwidth,
                 alpha_net=platform.network_latency, alpha_local=platform.intra_node_latency,
                 halo_overhead_s=platform.network_latency,
                 flat_nic_bandwidth=platform.nic_bandwidth * vendor_efficiency if scaled
                 else None,
                 flat_local_bandwidth=platform.intra_node_bandwidth * vendor_efficiency
                 if scaled else None,
                 flat_overlap=platform.backend != "gloo")


def expected_distinct_nodes(n: int, k: int, n_experts: int = 0) -> float:
    """Expected number of distinct nodes among a token's k experts, routing uniform over n
    nodes holding E / n experts each (module docstring): exact for k distinct experts of
    `n_experts` = E, the independent-pick limit n (1 - (1 - 1/n)^k) for E = 0."""
    if n < 1 or k < 1:
        raise ValueError(f"n={n} nodes and k={k} experts per token must be >= 1")
    if n_experts:
        if n_experts % n or k > n_experts:
            raise ValueError(f"E={n_experts} experts over n={n} nodes with top-k={k}: need E "
                             f"divisible by n and k <= E")
        none = math.comb(n_experts - n_experts // n, k) / math.comb(n_experts, k)
    else:
        none = (1.0 - 1.0 / n) ** k
    return n * (1.0 - none)


def dedup_factor(n: int, k: int, n_experts: int = 0) -> float:
    """Off-node bytes of a deduplicated dispatch / a flat one's, for one token routed to k
    experts over n nodes: distinct remote nodes (n - 1) (1 - P(none)) over the k (n - 1) / n
    copies sent off-node. 1 for k = 1 or n = 1."""
    if n == 1:
        return 1.0
    distinct_remote = expected_distinct_nodes(n, k, n_experts) * (n - 1) / n
    return distinct_remote / (k * (n - 1) / n)


def auto_choices() -> tuple[str, ...]:
    """The algorithms `--comm.alltoall auto` picks among at run time (comm.alltoall)."""
    from comm.collectives.alltoall import ALGORITHMS

    return tuple(a for a in ALGORITHMS if a != "auto")


def auto_considers_dedup(nodes: int, top_k: int, n_experts: int) -> bool:
    """Whether the trainer's `--comm.alltoall=auto` weighs dedup for an EP group over `nodes`
    nodes (`trainer.build.trial_candidates`): several nodes and top-k > 1 (the planner also
    needs the experts divisible by the nodes for its expected distinct nodes). The trainer
    times dedup against the per-call flat / HALO choice and runs the faster; the planner
    prices both and takes the cheaper (`alltoall_time`)."""
    return nodes > 1 and top_k > 1 and n_experts > 0 and n_experts % nodes == 0


def alltoall_time(nbytes: float, group: GroupPlacement, algorithm: str, platform: Platform,
                  vendor_efficiency: float = 1.0, top_k: int = 1, n_experts: int = 0) -> float:
    """Seconds for one all-to-all where each rank's send buffer holds `nbytes` spread evenly
    over the `group.size` ranks (the own share stays local): `comm.cost.a2a_model` on the loads
    of that exchange, every device of a node exchanging alike. "dedup" needs the routing
    (`top_k` routed copies of each token among `n_experts`) to know how many copies share a
    node; "auto" is what the trainer's auto runs where its trial (`trainer.a2a_trial`) finds
    the fastest: the cheapest of `auto_choices()` (comm's per-call flat / HALO choice) and,
    where `auto_considers_dedup`, dedup."""
    if group.size == 1 or nbytes <= 0:
        return 0.0
    if algorithm == "auto":
        algs = auto_choices() + (("dedup",) if auto_considers_dedup(group.nodes, top_k,
                                                                    n_experts) else ())
        return min(alltoall_time(nbytes, group, a, platform, vendor_efficiency, top_k, n_experts)
                   for a in algs)
    load = uniform_load(nbytes, group.size, group.per_node,
                        platform.gpus_per_node / platform.nics_per_node)
    if algorithm == "dedup":
        f = dedup_factor(group.nodes, top_k, n_experts if n_experts % group.nodes == 0 else 0)
        load = dataclasses.replace(load, nic_bytes=load.nic_bytes * f)
        algorithm = "halo"
    return uniform_time(load, algorithm, rates(platform, vendor_efficiency))


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


def measured_collective_time(kind: str, nbytes: float, group: GroupPlacement,
                             platform: Platform) -> float | None:
    """Seconds of the `kind` collective ("all_reduce", "reduce", "broadcast") of `nbytes` per
    rank from the platform's measured fit for a group of this size inside one node
    (`Platform.collective_fit`: latency + bytes / bandwidth, what `tuner measure` fitted to
    gloo's own collective), or None where the platform has no such fit."""
    if group.remote_peers:
        return None
    fit = platform.collective_fit(kind, group.size)
    if fit is None:
        return None
    latency, bandwidth = fit
    return latency + nbytes / bandwidth


def reduce_time(nbytes: float, group: GroupPlacement, platform: Platform) -> float:
    """Reduce of `nbytes` per rank to one owner: the measured fit where the platform has one,
    else a reduce-scatter's time (half of `allreduce_time`: its fit, or the ring)."""
    if group.size == 1 or nbytes <= 0:
        return 0.0
    t = measured_collective_time("reduce", nbytes, group, platform)
    return t if t is not None else allreduce_time(nbytes, group, platform) / 2


def broadcast_time(nbytes: float, group: GroupPlacement, platform: Platform) -> float:
    """Broadcast of `nbytes` from one owner to the group: the measured fit where the platform
    has one, else an all-gather's time (half of `allreduce_time`: its fit, or the ring)."""
    if group.size == 1 or nbytes <= 0:
        return 0.0
    t = measured_collective_time("broadcast", nbytes, group, platform)
    return t if t is not None else allreduce_time(nbytes, group, platform) / 2


def allreduce_time(nbytes: float, group: GroupPlacement, platform: Platform) -> float:
    """All-reduce of `nbytes` per rank: the platform's measured fit for this group size where
    it has one (`measured_collective_time`), else a ring: 2 (n-1)/n of the data crosses each
    rank's slowest link, with 2 (n-1) latency steps."""
    n = group.size
    if n == 1 or nbytes <= 0:
        return 0.0
    t = measured_collective_time("all_reduce", nbytes, group, platform)
    if t is not None:
        return t
    if group.remote_peers:
        bw, lat = platform.nic_bandwidth_per_gpu, platform.network_latency
    else:
        bw, lat = platform.intra_node_bandwidth, platform.intra_node_latency
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
