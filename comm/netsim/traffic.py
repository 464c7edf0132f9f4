"""Traffic generators (flat and HALO all-to-all) and node placements.

Shape legend: R ranks, n job nodes, g ranks per node, S [R, R] bytes rank s sends rank d.

HALO's routing is not re-implemented here: the relay of every (source rank, remote node)
comes from `comm.topology.relay.relay_rank`, and for small groups the traffic is read straight
off `comm.collectives.halo_plan.halo_plan` (`halo_traffic_from_plan`). `halo_all_to_all` computes the
same bytes with numpy for thousands of ranks: when every node has the same local -> NIC
layout, relay(s, m) is node m's rank at the local index that `relay_rank` picks on a
two-node restriction of the topology, so `relay_rank` is called once per local index.
Tests check both against each other.
"""

from __future__ import annotations

import numpy as np

from comm.collectives.halo_plan import halo_plan
from comm.netsim.engine import Traffic
from comm.netsim.network import Network
from comm.topology import Topology
from comm.topology.relay import relay_rank

__all__ = ["HALO_PHASES", "flat_all_to_all", "halo_all_to_all", "halo_traffic_from_plan",
           "place", "uniform_splits"]

HALO_PHASES = ("I", "II", "III")
HALO_DEPS = ((), (), (1,))  # I || (II -> III)
PLACEMENTS = ("packed", "spread", "random")


def uniform_splits(ranks: int, bytes_per_pair: float) -> np.ndarray:
    """S [R, R]: every rank sends every rank (itself included) the same bytes."""
    if ranks < 1 or bytes_per_pair < 0:
        raise ValueError(f"need ranks >= 1 and bytes_per_pair >= 0, got {ranks}, {bytes_per_pair}")
    return np.full((ranks, ranks), float(bytes_per_pair))


def _check_splits(S: np.ndarray, R: int | None = None) -> np.ndarray:
    S = np.asarray(S, dtype=np.float64)
    if S.ndim != 2 or S.shape[0] != S.shape[1] or (R is not None and S.shape[0] != R):
        raise ValueError(f"split matrix must be square [R, R] with R={R}, got {S.shape}")
    if S.size and S.min() < 0:
        raise ValueError(f"split matrix bytes must be >= 0, got min {S.min()}")
    return S


def flat_all_to_all(S: np.ndarray, send_first_half: bool = False) -> Traffic:
    """One flow per ordered rank pair with S[s, d] > 0 (the vendor collective).

    send_first_half=False: one phase, every flow at once (NCCL / RCCL, MPI).
    send_first_half=True: gloo's schedule. Its all_to_all_single posts, in step i = 1..R-1,
    the send to rank s+i before the receive from rank s-i, so for even R the pairs at
    offset R/2 have both ends posting their send first, and gloo's TCP pair then moves the
    two directions one after the other (measured on the emulator: a 2-rank exchange posted
    send-first reaches 0.48 of the shaped rate, receive-first 0.92). Those pairs become two
    phases: "first" (s -> s + R/2 for s < R/2) and "second" (the way back, after the
    first direction reached its destination); the other pairs run at once in phase "all".
    """
    S = _check_splits(S)
    src, dst = np.nonzero(S)
    R = S.shape[0]
    if not send_first_half or R % 2:
        return Traffic(src, dst, S[src, dst], np.zeros(len(src), dtype=np.int64))
    half = (dst - src) % R == R // 2
    phase = np.where(half, np.where(src < R // 2, 1, 2), 0)
    return Traffic(src, dst, S[src, dst], phase, ("all", "first", "second"), ((), (), (1,)))


def halo_traffic_from_plan(S: np.ndarray, topo: Topology, row_bytes: int = 1) -> Traffic:
    """HALO traffic read off `halo_plan` (S in rows, message bytes = rows * row_bytes)."""
    rows = np.asarray(S, dtype=np.int64)
    plans = halo_plan(rows.tolist(), topo)
    src, dst, nbytes, phase = [], [], [], []
    for plan in plans:
        for p, msgs in enumerate((plan.intra_sends, plan.inter_sends, plan.relay_sends)):
            for m in msgs:
                src.append(plan.rank)
                dst.append(m.peer)
                nbytes.append(m.rows * row_bytes)
                phase.append(p)
    return Traffic(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
                   np.array(nbytes, dtype=np.float64), np.array(phase, dtype=np.int64),
                   HALO_PHASES, HALO_DEPS)


def _relay_local(topo: Topology) -> np.ndarray:
    """relay_local[l]: local index on any remote node of the relay for a source of local l."""
    layouts = {tuple(topo.rank2nic[r] for r in topo.node_ranks(n)) for n in range(topo.num_nodes)}
    if len(layouts) != 1:
        raise ValueError(f"halo_all_to_all needs the same local -> NIC layout on every node, "
                         f"got {sorted(layouts)}; use halo_traffic_from_plan")
    two = topo.restrict(list(topo.node_ranks(0)) + list(topo.node_ranks(1)))
    g = len(topo.node_ranks(0))
    return np.array([two.rank2local[relay_rank(two, lo, 1)] for lo in range(g)], dtype=np.int64)


def halo_all_to_all(S: np.ndarray, topo: Topology) -> Traffic:
    """HALO traffic for byte matrix S [R, R] on `topo` (phases I, II, III; III after II)."""
    R = topo.world_size
    S = _check_splits(S, R)
    node = np.asarray(topo.rank2node, dtype=np.int64)
    local = np.asarray(topo.rank2local, dtype=np.int64)
    n, g = topo.num_nodes, int(np.bincount(node).max())
    if np.any(np.bincount(node) != g):
        raise ValueError(f"halo_all_to_all needs equal ranks per node, got {np.bincount(node)}")
    # node_rank[m, l]: the rank at local index l of node m.
    node_rank = np.empty((n, g), dtype=np.int64)
    node_rank[node, local] = np.arange(R)
    same = node[:, None] == node[None, :]
    # Phase I: straight to same-node peers.
    s1, d1 = np.nonzero(same & (S > 0) & ~np.eye(R, dtype=bool))
    parts = [(s1, d1, S[s1, d1], 0)]
    if n > 1:
        relay_local = _relay_local(topo)
        # Phase II: one packed message per (source rank, remote node).
        by_node = np.argsort(node, kind="stable")
        to_node = np.add.reduceat(S[:, by_node], np.arange(0, R, g), axis=1)  # [s, m]
        s2, m2 = np.nonzero((node[:, None] != np.arange(n)[None, :]) & (to_node > 0))
        parts.append((s2, node_rank[m2, relay_local[local[s2]]], to_node[s2, m2], 1))
        # Phase III: the relay at local j of node(d) forwards to d the rows of every remote
        # source whose local index l has relay_local[l] == j: U[j, d] bytes. comm sends them
        # as one message per relayed source (forwarded as each arrives); here they are one
        # flow per (relay, destination): the same bytes between the same endpoints, without
        # the extra messages' per-message cost.
        remote = np.where(same, 0.0, S)
        by_local = np.argsort(local, kind="stable")
        T = np.add.reduceat(remote[by_local], np.arange(0, R, n), axis=0)  # [l, d]
        U = np.zeros((g, R))
        np.add.at(U, relay_local, T)
        j3, d3 = np.nonzero(U)
        r3 = node_rank[node[d3], j3]
        fwd = r3 != d3
        parts.append((r3[fwd], d3[fwd], U[j3, d3][fwd], 2))
    src = np.concatenate([p[0] for p in parts])
    dst = np.concatenate([p[1] for p in parts])
    nbytes = np.concatenate([p[2] for p in parts])
    phase = np.concatenate([np.full(len(p[0]), p[3], dtype=np.int64) for p in parts])
    return Traffic(src, dst, nbytes, phase, HALO_PHASES, HALO_DEPS)


def place(net: Network, nodes: int, how: str = "packed", groups: int | None = None,
          seed: int = 0) -> tuple[np.ndarray, Topology]:
    """Choose `nodes` of the network's nodes for a job; returns (rank2gpu [R], Topology).

    packed: nodes 0..n-1 (fills switches, then groups, in order); spread: round-robin over
    `groups` Dragonfly groups (default all); random: a seeded random subset.
    Ranks are numbered node by node in local order, as `Topology.uniform` does.
    """
    M = net.num_nodes
    if how not in PLACEMENTS:
        raise ValueError(f"placement {how!r} is not one of {PLACEMENTS}")
    if not isinstance(nodes, int) or not 1 <= nodes <= M:
        raise ValueError(f"nodes must be an int in 1..{M} (the network's nodes), got {nodes!r}")
    npg = net.nodes_per_group or M
    n_groups = -(-M // npg)
    if how == "packed":
        chosen = np.arange(nodes)
    elif how == "random":
        chosen = np.sort(np.random.default_rng(seed).choice(M, size=nodes, replace=False))
    else:
        G = n_groups if groups is None else groups
        if not 1 <= G <= n_groups or -(-nodes // G) > npg:
            raise ValueError(f"spread over groups={G}: need 1 <= groups <= {n_groups} and "
                             f"{nodes} nodes fitting in {G} groups of {npg}")
        i = np.arange(nodes)
        chosen = np.sort((i % G) * npg + i // G)
    g = net.gpus_per_node
    rank2gpu = (chosen[:, None] * g + np.arange(g)[None, :]).ravel()
    nic = net.gpu2nic[rank2gpu]
    topo = Topology(
        rank2node=tuple(int(v) for v in np.repeat(np.arange(nodes), g)),
        rank2local=tuple(int(v) for v in np.tile(np.arange(g), nodes)),
        # A node's locality domain: the switch of its first NIC (Frontier: its only switch;
        # DGX: the rail-0 leaf, i.e. its scalable unit).
        rank2domain=tuple(int(v) for v in np.repeat(net.nic2switch[chosen * _nics(net)], g)),
        rank2group=tuple(int(v) for v in np.repeat(chosen // npg, g)),
        rank2nic=tuple(int(v) for v in np.where(nic >= 0, nic % max(1, _nics(net)), 0)),
    )
    return rank2gpu, topo


def _nics(net: Network) -> int:
    """NICs per node of a network built by `assemble` (the same on every node)."""
    return len(net.nic2switch) // net.num_nodes
