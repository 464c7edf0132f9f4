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

import numpy as np

from comm.halo_plan import relay_table
from comm.topology import Topology

__all__ = [
    "CostModel",
    "choose_algorithm",
    "predict_flat",
    "predict_halo",
    "reference_predict_flat",
    "reference_predict_halo",
]


@dataclass(frozen=True)
class CostModel:
    """Machine parameters; defaults are placeholders, calibrate them for a real machine.

    nic_bandwidth: bytes/s per NIC per direction (rank2nic tells which NIC a rank uses).
    local_bandwidth: bytes/s one rank moves to a peer on its node.
    alpha_net / alpha_local: seconds of fixed cost per network / intra-node message.
    halo_overhead_s: fixed extra cost of HALO (two dependent phases, planning on the host).
    flat_pairwise: the flat collective runs R-1 dependent pairwise steps whose two
        directions serialise (a pessimistic default for gloo); False: all peers at once.
    flat_nic_bandwidth: bytes/s per NIC that the flat collective's concurrent flows reach,
        when it differs from HALO's (None: nic_bandwidth). `calibrate` measures it: gloo's
        all_to_all_single posts each send before the receive from the same peer, and its
        TCP pairs then move some pairs' two directions one after the other.
    """

    nic_bandwidth: float = 12.5e6  # 100 Mbit/s: the emulator's default shaped NIC
    local_bandwidth: float = 1.0e9
    alpha_net: float = 100e-6
    alpha_local: float = 20e-6
    halo_overhead_s: float = 200e-6
    flat_pairwise: bool = False
    flat_nic_bandwidth: float | None = None

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
        if self.flat_nic_bandwidth is not None and not self.flat_nic_bandwidth > 0:
            raise ValueError(f"flat_nic_bandwidth must be > 0 bytes/s or None, got "
                             f"{self.flat_nic_bandwidth}")
        for name in ("alpha_net", "alpha_local", "halo_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 s, got {getattr(self, name)}")


def _nic_time(bytes_by_nic: dict[tuple[int, int], float], bw: float) -> float:
    return max(bytes_by_nic.values(), default=0.0) / bw


def _reference_flat_pairwise(
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


def reference_predict_flat(
    S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
) -> float:
    """Plain-loop definition of the flat prediction (what `predict_flat` vectorises)."""
    if model.flat_pairwise:
        return _reference_flat_pairwise(S, row_bytes, topo, model)
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
    bw = model.flat_nic_bandwidth or model.nic_bandwidth
    net = max(_nic_time(out, bw), _nic_time(inn, bw))
    local = local_bytes / model.local_bandwidth + local_msgs * model.alpha_local
    return net + net_msgs * model.alpha_net + local


def reference_predict_halo(
    S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel
) -> float:
    """Plain-loop definition of the HALO prediction (what `predict_halo` vectorises)."""
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
        t_intra = max(t_intra, lb / model.local_bandwidth + lm * model.alpha_local)
    t_inter = max(_nic_time(out, model.nic_bandwidth), _nic_time(inn, model.nic_bandwidth))
    t_inter += net_msgs * model.alpha_net
    t_relay = max(
        (relayed[r] / model.local_bandwidth + len(relay_peers[r]) * model.alpha_local
         for r in range(R)),
        default=0.0,
    )
    return max(t_intra, t_inter + t_relay) + model.halo_overhead_s


# ---- vectorised predictions (what `auto` runs on every call) -----------------------------
# Every rank evaluates the model on every call; with 16 ranks on 2 cores the plain loops
# cost ~3 ms of CPU per rank per call (~25 ms of wall time on the emulator), numpy ~0.2 ms.


def _arrays(
    S: list[list[int]], row_bytes: int, topo: Topology
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    B = np.asarray(S, dtype=np.float64) * row_bytes  # B[s, d] bytes
    node = np.asarray(topo.rank2node)
    nic_ids = {key: i for i, key in enumerate(dict.fromkeys(zip(topo.rank2node, topo.rank2nic,
                                                                 strict=True)))}
    nic = np.asarray([nic_ids[k] for k in zip(topo.rank2node, topo.rank2nic, strict=True)])
    remote = node[:, None] != node[None, :]
    local = ~remote & ~np.eye(len(node), dtype=bool)
    return B, node, nic, len(nic_ids), remote, local


def _nic_max(owner: np.ndarray, nbytes: np.ndarray, n_nics: int, bw: float) -> float:
    return float(np.bincount(owner.ravel(), nbytes.ravel(), minlength=n_nics).max()) / bw


def predict_flat(S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of the flat all-to-all (the slowest NIC / rank decides)."""
    B, node, nic, n_nics, remote, local = _arrays(S, row_bytes, topo)
    R = len(node)
    if model.flat_pairwise:
        ar = np.arange(R)
        steps = np.arange(1, R)[:, None]
        dst, src = (ar + steps) % R, (ar - steps) % R  # [R-1, R]
        send, recv = B[ar, dst], B[src, ar]
        send_remote, recv_remote = remote[ar, dst], remote[src, ar]

        def cost(nbytes: np.ndarray, far: np.ndarray) -> np.ndarray:
            bw = np.where(far, model.nic_bandwidth, model.local_bandwidth)
            alpha = np.where(far, model.alpha_net, model.alpha_local)
            return np.where(nbytes > 0, nbytes / bw + alpha, 0.0)

        rank_t = (cost(send, send_remote) + cost(recv, recv_remote)).max(axis=1)
        wire = (send * send_remote).ravel()
        base = (np.arange(R - 1)[:, None] * n_nics).repeat(R, 1)  # one NIC table per step
        size = (R - 1) * n_nics
        out = np.bincount((base + nic[None, :]).ravel(), wire, minlength=size)
        inn = np.bincount((base + nic[dst]).ravel(), wire, minlength=size)
        nic_t = np.maximum(out.reshape(R - 1, n_nics).max(axis=1),
                           inn.reshape(R - 1, n_nics).max(axis=1)) / model.nic_bandwidth
        return float(np.maximum(rank_t, nic_t).sum())
    far = B * remote
    bw = model.flat_nic_bandwidth or model.nic_bandwidth
    net = max(_nic_max(nic[:, None].repeat(R, 1), far, n_nics, bw),
              _nic_max(nic[None, :].repeat(R, 0), far, n_nics, bw))
    net_msgs = int(((B > 0) & remote).sum(axis=1).max())
    local_bytes = float((B * local).sum(axis=1).max())
    local_msgs = int(((B > 0) & local).sum(axis=1).max())
    return (net + net_msgs * model.alpha_net + local_bytes / model.local_bandwidth
            + local_msgs * model.alpha_local)


def predict_halo(S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of HALO: max(phase I, phase II + phase III) + fixed overhead."""
    B, node, nic, n_nics, remote, local = _arrays(S, row_bytes, topo)
    R, N = len(node), topo.num_nodes
    relay = np.asarray(relay_table(topo))  # [R, N]
    far = B * remote
    per_node = np.stack([far[:, node == m].sum(axis=1) for m in range(N)], axis=1)  # [R, N]
    out_t = _nic_max(nic[:, None].repeat(N, 1), per_node, n_nics, model.nic_bandwidth)
    in_t = _nic_max(nic[relay], per_node, n_nics, model.nic_bandwidth)
    net_msgs = int((per_node > 0).sum(axis=1).max())
    t_inter = max(out_t, in_t) + net_msgs * model.alpha_net
    hop = relay[:, node]  # hop[s, d]: who relays s's rows for d
    forwarded = remote & (B > 0) & (hop != np.arange(R)[None, :])
    relayed = np.bincount(hop[forwarded], B[forwarded], minlength=R)
    pairs = np.unique(hop[forwarded] * R + np.nonzero(forwarded)[1])
    peers = np.bincount(pairs // R, minlength=R)
    t_relay = float((relayed / model.local_bandwidth + peers * model.alpha_local).max())
    t_intra = float(((B * local).sum(axis=1) / model.local_bandwidth
                     + ((B > 0) & local).sum(axis=1) * model.alpha_local).max())
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
