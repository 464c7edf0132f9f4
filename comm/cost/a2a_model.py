"""The all-to-all cost model: flat and HALO time from bytes per NIC, message counts and link
rates. One model, two users (docs/architecture.md, "All-to-all cost: which model is used
where"):

    `auto` (comm.cost)      the loads of each exchange, read off its split matrix; the rates
                            calibrated online (`comm.calibrate`) or from a platform file
                            (`CostModel`, a `Rates` with auto's own extras)
    the planner (tuner)     the loads of a uniform exchange of a group placed on nodes
                            (`uniform_load`), the rates from a platform file
                            (`tuner.comms.rates`)

`comm.netsim` (flow-level simulation) is the reference that validates the model
(tests/test_tuner_comms.py, benchmarks/bench_tuner_validate.py).

Every term is an alpha-beta time, bytes / rate + messages * per-message cost, of the busiest
rank or NIC (`phase_time`; it works elementwise on numpy arrays of per-rank loads):

    flat  net = busiest NIC's bytes at the flat collective's NIC rate + the busiest rank's
                off-node messages;  local = the busiest rank's on-node bytes and messages
          t = net + local                                 (serial: gloo's one-thread TCP)
          t = max(net bytes, local bytes) + both message terms   (`flat_overlap`: NCCL/RCCL
                                                        drive NIC and node links at once)
    halo  I   intra-node: each rank's on-node rows, directly
          II  one packed message per (rank, remote node) into the relay's NIC
          III the relay forwards what it received to the other ranks of its node
          t = max(t_I, t_II + t_III) + halo_overhead_s       (I overlaps II -> III)

gloo's flat collective also has a pairwise, step-by-step form that needs the whole split
matrix (`CostModel.flat_pairwise`, comm.cost); the planner has no matrix and never uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Rates", "UniformLoad", "flat_time", "halo_time", "phase_time", "uniform_load",
           "uniform_time"]


@dataclass(frozen=True)
class Rates:
    """Link rates (bytes/s per direction) and per-message costs (s) of one machine.

    nic_bandwidth: one NIC. local_bandwidth: what one rank moves to a peer on its node.
    alpha_net / alpha_local: fixed cost of one network / intra-node message.
    halo_overhead_s: HALO's fixed extra (two dependent phases, planning on the host).
    flat_nic_bandwidth / flat_local_bandwidth: the rates the flat (vendor) collective reaches
        when they differ from HALO's (None: nic_bandwidth / local_bandwidth).
    flat_overlap: the flat collective moves its on-node and off-node bytes at once (NCCL,
        RCCL); False: one after the other (gloo).
    """

    nic_bandwidth: float = 12.5e6  # 100 Mbit/s: the namespace emulator's shaped NIC
    local_bandwidth: float = 1.0e9
    alpha_net: float = 100e-6
    alpha_local: float = 20e-6
    halo_overhead_s: float = 200e-6
    flat_nic_bandwidth: float | None = None
    flat_local_bandwidth: float | None = None
    flat_overlap: bool = False

    def __post_init__(self) -> None:
        for name in ("nic_bandwidth", "local_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 bytes/s, got {getattr(self, name)}")
        for name in ("flat_nic_bandwidth", "flat_local_bandwidth"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 bytes/s or None, got {v}")
        for name in ("alpha_net", "alpha_local", "halo_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 s, got {getattr(self, name)}")

    def rates(self) -> Rates:
        """The plain `Rates` of this object (drops a subclass's extras, e.g. CostModel's)."""
        return Rates(**{f: getattr(self, f) for f in Rates.__dataclass_fields__})


def phase_time(nbytes: Any, msgs: Any, bandwidth: float, alpha: float) -> Any:
    """bytes / bandwidth + messages * alpha: one link class's time (floats or arrays)."""
    return nbytes / bandwidth + msgs * alpha


def flat_time(nic_bytes: float, net_msgs: int, local_bytes: float, local_msgs: int,
              r: Rates) -> float:
    """The flat collective: the busiest NIC's bytes (sent or received), the most off-node
    messages of one rank, the most on-node bytes and messages of one rank."""
    net = nic_bytes / (r.flat_nic_bandwidth or r.nic_bandwidth)
    local = local_bytes / (r.flat_local_bandwidth or r.local_bandwidth)
    if r.flat_overlap:
        return max(net, local) + net_msgs * r.alpha_net + local_msgs * r.alpha_local
    return net + net_msgs * r.alpha_net + local + local_msgs * r.alpha_local


def halo_time(t_intra: float, t_inter: float, t_relay: float, r: Rates) -> float:
    """HALO from its phases' times (each the busiest rank's or NIC's `phase_time`):
    I (intra-node) overlaps II (packed, off-node) -> III (the relays forward)."""
    return max(t_intra, t_inter + t_relay) + r.halo_overhead_s


@dataclass(frozen=True)
class UniformLoad:
    """The loads of a uniform exchange (`uniform_load`), what `flat_time` and the HALO
    phases read: bytes of the busiest NIC / rank and message counts of one rank."""

    nic_bytes: float  # through one NIC per direction, every rank behind it exchanging alike
    net_msgs: int  # flat: one per off-node peer
    local_bytes: float  # to the rank's on-node peers
    local_msgs: int
    halo_msgs: int  # HALO phase II: one per remote node
    relay_bytes: float  # HALO phase III: what one relay forwards
    relay_msgs: int  # ... to this many ranks of its node


def uniform_load(nbytes: float, size: int, per_node: int, ranks_per_nic: float
                 ) -> UniformLoad:
    """Every rank of a group of `size` sends `nbytes` spread evenly over the group (its own
    share stays local); `per_node` members to a node, the node's ranks exchanging alike
    (`ranks_per_nic` of them behind each NIC: its busiest-NIC bytes). HALO's relays are
    rail-aligned (comm.collectives.halo_plan): each forwards the shares of one source per remote node
    to the other `per_node - 1` members of its node.

    On a matrix whose entries are all nbytes / size (comm.cost, `Topology.uniform` with the
    group filling its nodes) these are exactly the loads `auto` reads."""
    if size < 1 or not 1 <= per_node <= size:
        raise ValueError(f"group size={size} with per_node={per_node}: need "
                         "1 <= per_node <= size")
    share = nbytes / size
    remote_peers, remote_nodes = size - per_node, -(-size // per_node) - 1
    relayed = share * (per_node - 1) * remote_nodes
    return UniformLoad(nic_bytes=share * remote_peers * ranks_per_nic,
                       net_msgs=remote_peers, local_bytes=share * (per_node - 1),
                       local_msgs=per_node - 1, halo_msgs=remote_nodes,
                       relay_bytes=relayed, relay_msgs=per_node - 1 if relayed else 0)


def uniform_time(load: UniformLoad, algorithm: str, r: Rates) -> float:
    """Seconds of one uniform exchange (`uniform_load`) by `algorithm` ("flat" / "halo")."""
    if algorithm == "flat":
        return flat_time(load.nic_bytes, load.net_msgs, load.local_bytes, load.local_msgs, r)
    if algorithm == "halo":
        return halo_time(
            phase_time(load.local_bytes, load.local_msgs, r.local_bandwidth, r.alpha_local),
            phase_time(load.nic_bytes, load.halo_msgs, r.nic_bandwidth, r.alpha_net),
            phase_time(load.relay_bytes, load.relay_msgs, r.local_bandwidth, r.alpha_local),
            r)
    raise ValueError(f"all-to-all algorithm {algorithm!r}; valid: flat, halo")
