"""A small alpha-beta cost model that picks flat or HALO per call (`algorithm="auto"`).

Inputs: the split matrix S [R, R] (rows), bytes per row, the Topology and `CostModel`
parameters (bandwidths in bytes/s, per-message costs in seconds). Both algorithms push the
same bytes through each node's NICs; they differ in messages and in the extra hop:
    flat: every rank sends one network message per remote rank it has rows for;
          t = max_node(net bytes / NIC capacity) + max_rank(net messages) * alpha_net
              + intra-node bytes / local bandwidth + local messages * alpha_local
    halo: one network message per (rank, remote node); phase III adds an intra-node hop and
          a second round of latency after phase II; phase I overlaps II -> III:
          t = max(t_I, t_II + t_III) + halo_overhead_s
The decision depends only on data every rank holds identically (S, topology, parameters),
so all ranks pick the same algorithm without another collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from comm.halo_plan import relay_rank
from comm.topology import Topology

__all__ = ["CostModel", "choose_algorithm", "predict_flat", "predict_halo"]


@dataclass(frozen=True)
class CostModel:
    """Machine parameters; defaults are placeholders, calibrate them for a real machine.

    nic_bandwidth: bytes/s per NIC per direction (rank2nic tells which NIC a rank uses).
    local_bandwidth: bytes/s one rank moves to a peer on its node.
    alpha_net / alpha_local: seconds of fixed cost per network / intra-node message.
    halo_overhead_s: fixed extra cost of HALO (two dependent phases, planning on the host).
    flat_pairwise: the flat collective runs R-1 dependent pairwise steps whose two
        directions serialise (gloo); False: all peers at once, full duplex (NCCL).
    """

    nic_bandwidth: float = 12.5e6  # 100 Mbit/s: the emulator's default shaped NIC
    local_bandwidth: float = 1.0e9
    alpha_net: float = 100e-6
    alpha_local: float = 20e-6
    halo_overhead_s: float = 200e-6
    flat_pairwise: bool = False

    @classmethod
    def for_backend(cls, backend: str, **overrides: float) -> CostModel:
        """Defaults for a torch.distributed backend; gloo's flat collective is pairwise.

        gloo's all_to_all_single walks the peers one step at a time (send to rank+i, receive
        from rank-i, wait) and its TCP pairs serialise the two directions of an exchange, so
        a 2-rank exchange of 4 MB each way at 100 Mbit/s takes 0.70 s instead of 0.34 s
        (measured on the emulator). NCCL / RCCL run all peers concurrently.
        """
        return cls(**{"flat_pairwise": backend == "gloo", **overrides})

    def __post_init__(self) -> None:
        for name in ("nic_bandwidth", "local_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 bytes/s, got {getattr(self, name)}")
        for name in ("alpha_net", "alpha_local", "halo_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 s, got {getattr(self, name)}")


def _nic_time(bytes_by_nic: dict[tuple[int, int], float], bw: float) -> float:
    return max(bytes_by_nic.values(), default=0.0) / bw


def _predict_flat_pairwise(
    S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
) -> float:
    """R-1 dependent steps; in step i rank s sends to s+i, then receives from s-i."""
    node, nic, R = topo.rank2node, topo.rank2nic, topo.world_size
    total = 0.0
    for i in range(1, R):
        rank_t, out, inn = 0.0, {}, {}
        for s in range(R):
            d, src = (s + i) % R, (s - i) % R
            t = 0.0
            for a, b, rows in ((s, d, S[s][d]), (src, s, S[src][s])):
                if rows == 0:
                    continue
                nbytes = rows * row_bytes
                if node[a] == node[b]:
                    t += nbytes / model.local_bandwidth + model.alpha_local
                else:
                    t += nbytes / model.nic_bandwidth + model.alpha_net
            remote = S[s][d] * row_bytes if node[d] != node[s] else 0
            out[(node[s], nic[s])] = out.get((node[s], nic[s]), 0.0) + remote
            inn[(node[d], nic[d])] = inn.get((node[d], nic[d]), 0.0) + remote
            rank_t = max(rank_t, t)
        total += max(rank_t, _nic_time(out, model.nic_bandwidth),
                     _nic_time(inn, model.nic_bandwidth))
    return total


def predict_flat(S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of the flat all-to-all (the slowest NIC / rank decides)."""
    if model.flat_pairwise:
        return _predict_flat_pairwise(S, row_bytes, topo, model)
    node, nic = topo.rank2node, topo.rank2nic
    out: dict[tuple[int, int], float] = {}
    inn: dict[tuple[int, int], float] = {}
    net_msgs, local_bytes, local_msgs = 0, 0.0, 0
    for s, row in enumerate(S):
        msgs, lb, lm = 0, 0.0, 0
        for d, rows in enumerate(row):
            if rows == 0 or d == s:
                continue
            b = rows * row_bytes
            if node[d] == node[s]:
                lb, lm = lb + b, lm + 1
            else:
                msgs += 1
                out[(node[s], nic[s])] = out.get((node[s], nic[s]), 0.0) + b
                inn[(node[d], nic[d])] = inn.get((node[d], nic[d]), 0.0) + b
        net_msgs, local_msgs = max(net_msgs, msgs), max(local_msgs, lm)
        local_bytes = max(local_bytes, lb)
    net = max(_nic_time(out, model.nic_bandwidth), _nic_time(inn, model.nic_bandwidth))
    local = local_bytes / model.local_bandwidth + local_msgs * model.alpha_local
    return net + net_msgs * model.alpha_net + local


def predict_halo(S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of HALO: max(phase I, phase II + phase III) + fixed overhead."""
    node, nic, R = topo.rank2node, topo.rank2nic, topo.world_size
    out: dict[tuple[int, int], float] = {}
    inn: dict[tuple[int, int], float] = {}
    relayed = [0.0] * R  # bytes each relay forwards to other ranks of its node
    relay_peers: list[set[int]] = [set() for _ in range(R)]
    net_msgs, t_intra = 0, 0.0
    relay = [[relay_rank(topo, s, m) if m != node[s] else s for m in range(topo.num_nodes)]
             for s in range(R)]
    for s, row in enumerate(S):
        per_node: dict[int, float] = {}
        lb, lm = 0.0, 0
        for d, rows in enumerate(row):
            if rows == 0 or d == s:
                continue
            if node[d] == node[s]:
                lb, lm = lb + rows * row_bytes, lm + 1
            else:
                per_node[node[d]] = per_node.get(node[d], 0.0) + rows * row_bytes
                r = relay[s][node[d]]
                if r != d:
                    relayed[r] += rows * row_bytes
                    relay_peers[r].add(d)
        for m, b in per_node.items():
            r = relay[s][m]
            out[(node[s], nic[s])] = out.get((node[s], nic[s]), 0.0) + b
            inn[(m, nic[r])] = inn.get((m, nic[r]), 0.0) + b
        net_msgs = max(net_msgs, len(per_node))
        t_intra = max(t_intra, lb / model.local_bandwidth + lm * model.alpha_local)
    t_inter = max(_nic_time(out, model.nic_bandwidth), _nic_time(inn, model.nic_bandwidth))
    t_inter += net_msgs * model.alpha_net
    t_relay = max(
        (relayed[r] / model.local_bandwidth + len(relay_peers[r]) * model.alpha_local
         for r in range(R)),
        default=0.0,
    )
    return max(t_intra, t_inter + t_relay) + model.halo_overhead_s


def choose_algorithm(
    S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
) -> str:
    """"halo" when it is predicted strictly faster, else "flat" (the safe default)."""
    if topo.num_nodes == 1:
        return "flat"  # nothing to aggregate: HALO degenerates to flat plus overhead
    flat = predict_flat(S, row_bytes, topo, model)
    halo = predict_halo(S, row_bytes, topo, model)
    return "halo" if halo < flat else "flat"
