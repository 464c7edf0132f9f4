"""The all-to-all cost model's definition, in plain loops over the split matrix.

`reference_predict(S, row_bytes, topo, model)` is what `comm.cost.predict` returns for
`method="loops"`: the flat and HALO times and the bytes through the busiest NIC, read off S
one entry at a time. Every faster implementation (comm/cost/onepass.py, vectorised.py,
blocked.py) is tested against it; the times themselves are comm.cost.a2a_model's `flat_time`,
`phase_time` and `halo_time` everywhere.
"""

from __future__ import annotations

from typing import NamedTuple

from comm.cost.a2a_model import flat_time, halo_time, phase_time
from comm.cost.model import CostModel
from comm.topology import Topology
from comm.topology.relay import relay_table

__all__ = ["Prediction", "decide", "reference_busiest_nic_bytes", "reference_predict",
           "reference_predict_flat", "reference_predict_halo"]


class Prediction(NamedTuple):
    """One split matrix's predicted seconds of flat and of HALO (before `model.corrections`)
    and the bytes through the busiest NIC direction (where the corrections are read)."""

    flat: float
    halo: float
    busiest: float


def _nic_time(bytes_by_nic: dict[tuple[int, int], float], bw: float) -> float:
    return max(bytes_by_nic.values(), default=0.0) / bw


def _reference_flat_pairwise(
    S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
) -> float:
    """R-1 dependent steps; in step i rank s sends to s+i, then receives from s-i."""
    node, nic, R = topo.rank2node, topo.rank2nic, topo.world_size
    total = 0.0
    for i in range(1, R):
        rank_t = 0.0
        out: dict[tuple[int, int], float] = {}
        inn: dict[tuple[int, int], float] = {}
        for s in range(R):
            d, src = (s + i) % R, (s - i) % R
            t = 0.0
            for a, b, rows in ((s, d, S[s][d]), (src, s, S[src][s])):
                if rows == 0 and not model.flat_empty_messages:
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


def reference_predict_flat(
    S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
) -> float:
    """Plain-loop definition of the flat prediction."""
    if model.flat_pairwise:
        return _reference_flat_pairwise(S, row_bytes, topo, model)
    node, nic = topo.rank2node, topo.rank2nic
    out: dict[tuple[int, int], float] = {}
    inn: dict[tuple[int, int], float] = {}
    net_msgs, local_bytes, local_msgs = 0, 0.0, 0
    for s, row in enumerate(S):
        msgs, lb, lm = 0, 0.0, 0
        for d, rows in enumerate(row):
            if d == s or (rows == 0 and not model.flat_empty_messages):
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
    nic_bytes = max(max(out.values(), default=0.0), max(inn.values(), default=0.0))
    return flat_time(nic_bytes, net_msgs, local_bytes, local_msgs, model)


def reference_predict_halo(
    S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
) -> float:
    """Plain-loop definition of the HALO prediction."""
    node, nic, R = topo.rank2node, topo.rank2nic, topo.world_size
    out: dict[tuple[int, int], float] = {}
    inn: dict[tuple[int, int], float] = {}
    relayed = [0.0] * R  # bytes each relay forwards to other ranks of its node
    relay_peers: list[set[int]] = [set() for _ in range(R)]
    net_msgs, t_intra = 0, 0.0
    relay = relay_table(topo)
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
        t_intra = max(t_intra, phase_time(lb, lm, model.local_bandwidth, model.alpha_local))
    nic_bytes = max(max(out.values(), default=0.0), max(inn.values(), default=0.0))
    t_inter = phase_time(nic_bytes, net_msgs, model.nic_bandwidth, model.alpha_net)
    t_relay = max(
        (phase_time(relayed[r], len(relay_peers[r]), model.local_bandwidth, model.alpha_local)
         for r in range(R)),
        default=0.0,
    )
    return halo_time(t_intra, t_inter, t_relay, model)


def reference_busiest_nic_bytes(S: list[list[int]], row_bytes: int, topo: Topology) -> float:
    """Bytes through the busiest NIC direction (sent or received off-node), in loops."""
    node, nic = topo.rank2node, topo.rank2nic
    out: dict[tuple[int, int], float] = {}
    inn: dict[tuple[int, int], float] = {}
    for s, row in enumerate(S):
        for d, rows in enumerate(row):
            if node[d] != node[s]:
                out[(node[s], nic[s])] = out.get((node[s], nic[s]), 0.0) + rows * row_bytes
                inn[(node[d], nic[d])] = inn.get((node[d], nic[d]), 0.0) + rows * row_bytes
    return max(max(out.values(), default=0.0), max(inn.values(), default=0.0))


def reference_predict(S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
                      ) -> Prediction:
    """The definition: flat, HALO and busiest-NIC bytes, each in its own plain loops."""
    return Prediction(reference_predict_flat(S, row_bytes, topo, model),
                      reference_predict_halo(S, row_bytes, topo, model),
                      reference_busiest_nic_bytes(S, row_bytes, topo))


def decide(p: Prediction, model: CostModel) -> str:
    """The decision on a prediction: "halo" when it is strictly faster once both times are
    scaled by `model.correction` at the busiest-NIC bytes, else "flat" (the safe default)."""
    flat, halo = p.flat, p.halo
    if model.corrections:
        c_flat, c_halo = model.correction(p.busiest)
        flat, halo = flat * c_flat, halo * c_halo
    return "halo" if halo < flat else "flat"
