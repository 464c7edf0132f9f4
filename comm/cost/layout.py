"""What the fast cost implementations know of a topology, built once per Topology.

Every rank evaluates the model on every call; with 16 ranks on 2 cores the plain loops
cost ~3 ms of CPU per rank per call (~25 ms of wall time on the emulator). Everything that
depends only on the topology is built once by `layout(topo)` and memoised on the (immutable)
Topology, so a call costs a few small numpy operations on the split matrix, or one pass of
plain Python over precomputed peer tuples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from comm.topology import Topology
from comm.topology.relay import relay_table

__all__ = ["Blocked", "Layout", "bytes_matrix", "layout", "nic_load"]

@dataclass(frozen=True)
class Layout:
    """A topology's facts for the fast implementations, as numpy arrays and python lists."""

    node: np.ndarray  # [R] node of each rank
    nic: np.ndarray  # [R] global NIC id (node, NIC index) of each rank
    n_nics: int
    remote: np.ndarray  # [R, R] bool: s and d on different nodes
    local: np.ndarray  # [R, R] bool: same node, s != d
    onehot: np.ndarray  # [R, N] float: rank d on node m
    relay_nic: np.ndarray  # [R, N] NIC of the relay receiving s's rows for node m
    hop: np.ndarray  # [R, R] who relays s's rows for d (d's node's relay for s)
    forwarding: np.ndarray  # [R, R] bool: remote and relayed by someone other than d
    lists: tuple  # the same as python lists, for `one_pass`
    nic_node: tuple[int, ...]  # node of each NIC
    one_nic: bool  # every node has exactly one NIC (HALO's relays then use the same NICs)
    g_max: int  # most ranks on one node
    peers_max: tuple[int, int]  # most off-node / other on-node peers of one rank
    # Node-major with G ranks on every node, else None: then `predict_blocked` reads S in
    # [R, N, G] blocks.
    blocked: Blocked | None = None


def layout(topo: Topology) -> Layout:
    """`topo`'s Layout, built on the first call and memoised on the Topology."""
    memo = topo.__dict__.get("_cost_layout")
    if memo is None:
        node = np.asarray(topo.rank2node)
        keys = list(zip(topo.rank2node, topo.rank2nic, strict=True))
        ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        nic = np.asarray([ids[k] for k in keys])
        R, N = len(node), topo.num_nodes
        remote = node[:, None] != node[None, :]
        relay = np.asarray(relay_table(topo))  # [R, N]
        hop = relay[:, node]
        forwarding = remote & (hop != np.arange(R)[None, :])
        # Per source s: (d, node of d, NIC of d, relay forwarding s's rows for d or -1).
        peers = tuple(tuple((d, int(node[d]), int(nic[d]),
                             int(hop[s, d]) if forwarding[s, d] else -1)
                            for d in range(R) if d != s) for s in range(R))
        memo = Layout(node=node, nic=nic, n_nics=len(ids), remote=remote,
                      local=~remote & ~np.eye(R, dtype=bool),
                      onehot=(node[:, None] == np.arange(N)[None, :]).astype(np.float64),
                      relay_nic=nic[relay], hop=hop, forwarding=forwarding,
                      lists=(node.tolist(), nic.tolist(), nic[relay].tolist(), peers),
                      nic_node=tuple(k[0] for k in ids), one_nic=len(ids) == N,
                      g_max=max(topo.ranks_per_node()),
                      peers_max=(R - min(topo.ranks_per_node()), max(topo.ranks_per_node()) - 1),
                      blocked=blocked_facts(topo, relay))
        object.__setattr__(topo, "_cost_layout", memo)
    return memo


@dataclass(frozen=True)
class Blocked:
    """A node-major topology of N nodes x G ranks (rank = node * G + local) whose relays are
    rail-aligned: s's rows for node m go to the rank of m with s's local index (what
    `relay_rank` picks whenever every node lays its ranks on its NICs alike). Then
    `predict_blocked` reads every HALO term off S's [N, G, N, G] blocks."""

    G: int


def blocked_facts(topo: Topology, relay: np.ndarray) -> Blocked | None:
    R, N = topo.world_size, topo.num_nodes
    G = R // N
    if N < 2 or N * G != R or any(topo.node_ranks(m) != tuple(range(m * G, (m + 1) * G))
                                  for m in range(N)):
        return None
    rail = (np.arange(N) * G)[None, :] + (np.arange(R) % G)[:, None]  # [R, N]
    return Blocked(G) if np.array_equal(relay, rail) else None


def bytes_matrix(S: list[list[int]] | np.ndarray, row_bytes: int) -> np.ndarray:
    """B[s, d]: the bytes s sends d, as float64 (exact for integer byte counts < 2**53)."""
    return np.asarray(S, dtype=np.float64) * row_bytes  # B[s, d] bytes


def nic_load(L: Layout, far: np.ndarray) -> tuple[float, float]:
    """Bytes out of / into the busiest NIC for the off-node bytes `far` [R, R]."""
    return (float(np.bincount(L.nic, far.sum(axis=1), minlength=L.n_nics).max()),
            float(np.bincount(L.nic, far.sum(axis=0), minlength=L.n_nics).max()))
