"""Exact lumping of interchangeable nodes, so all-to-alls over 512+ nodes stay small.

Shape legend: P super nodes, k_i job nodes in super node i, g ranks per node, n = sum k_i.

With uniform splits (every rank sends every rank b bytes) two job nodes whose NICs attach
to the same switches are interchangeable: swapping them maps the network and the traffic
onto themselves, so (max-min rates being unique) both see identical rates and finish times.
Lumping them is then exact: one super node per set of k interchangeable nodes, whose node
links (GPU links, PCIe, NIC <-> switch) have k times the capacity, carries
    intra-node flows        with multiplicity k_i,
    flows between two nodes k_i * k_j (i != j) or k_i * (k_i - 1) (two nodes of one set),
on the unchanged switch fabric. A link of the super node carries the load of its k copies
against k times the capacity, so it saturates exactly when each copy would. The
simulator's classes, rank-level dependencies and per-rank message counts (`rank_mult`)
carry over. Tests compare lumped against full simulations.

HALO's relay choice again comes from `comm.topology.relay.relay_rank` (via
`traffic._relay_local`): the relay of a source at local index l is local relay_local[l].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from comm.netsim.engine import Traffic
from comm.netsim.network import Network
from comm.netsim.traffic import HALO_DEPS, HALO_PHASES, _relay_local
from comm.topology import Topology

__all__ = ["lumped_all_to_all"]


def _super_nodes(full: Network, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Representative node and count k of every set of job nodes on the same switches."""
    n_nics = len(full.nic2switch) // full.num_nodes
    keys = full.nic2switch.reshape(full.num_nodes, n_nics)[chosen]
    uniq, first, counts = np.unique(keys, axis=0, return_index=True, return_counts=True)
    return chosen[first], counts.astype(np.float64)


def lumped_all_to_all(
    build: Callable[..., Network],
    full: Network,
    rank2gpu: np.ndarray,
    topo: Topology,
    algo: str,
    bytes_per_pair: float,
) -> tuple[Network, Traffic, np.ndarray]:
    """(lumped network, lumped traffic, its rank2gpu) for a uniform all-to-all.

    build(sites=..., scale=...) must rebuild the machine `full` came from (e.g.
    functools.partial(frontier, 512, groups=74)); rank2gpu / topo are what `place` returned.
    """
    if algo not in ("flat", "halo"):
        raise ValueError(f"algo {algo!r} is not one of ('flat', 'halo')")
    if not bytes_per_pair >= 0:
        raise ValueError(f"bytes_per_pair must be >= 0, got {bytes_per_pair}")
    g = full.gpus_per_node
    rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
    if len(rank2gpu) % g or np.any(rank2gpu.reshape(-1, g) % g != np.arange(g)):
        raise ValueError("lumping needs whole nodes with ranks in local order (from `place`)")
    chosen = rank2gpu[::g] // g
    sites, k = _super_nodes(full, chosen)
    net = build(sites=sites.tolist(), scale=k.tolist())
    P, n, b = len(sites), int(k.sum()), float(bytes_per_pair)
    pair = np.outer(k, k) - np.diag(k)  # node pairs between super nodes i and j
    # Intra-node flows (flat, and HALO phase I): i, l != m.
    i, l, m = (a.ravel() for a in np.meshgrid(np.arange(P), np.arange(g), np.arange(g),
                                              indexing="ij"))
    off = l != m
    intra = (i[off] * g + l[off], i[off] * g + m[off], np.full(off.sum(), b), k[i[off]])
    if algo == "flat":
        i, l, j, m = (a.ravel() for a in np.meshgrid(np.arange(P), np.arange(g), np.arange(P),
                                                     np.arange(g), indexing="ij"))
        parts = [(*intra, 0, False),
                 (i * g + l, j * g + m, np.full(len(i), b), pair[i, j], 0, True)]
        phases: tuple[str, ...] = ("all",)
        deps: tuple[tuple[int, ...], ...] = ((),)
    else:
        parts = [(*intra, 0, False)]
        if n > 1:
            relay = _relay_local(topo)
            i, l, j = (a.ravel() for a in np.meshgrid(np.arange(P), np.arange(g), np.arange(P),
                                                      indexing="ij"))
            parts.append((i * g + l, j * g + relay[l], np.full(len(i), g * b), pair[i, j],
                          1, True))
            # Relay r of node j forwards to each other local m the rows of the n - 1 remote
            # nodes' sources it relays: (n - 1) * #{l: relay[l] == r} * b bytes.
            cnt = np.bincount(relay, minlength=g)
            j, r, m = (a.ravel() for a in np.meshgrid(np.arange(P), np.flatnonzero(cnt),
                                                      np.arange(g), indexing="ij"))
            fwd = r != m
            j, r, m = j[fwd], r[fwd], m[fwd]
            parts.append((j * g + r, j * g + m, (n - 1) * cnt[r] * b, k[j], 2, False))
        phases, deps = HALO_PHASES, HALO_DEPS
    cat = [np.concatenate([np.broadcast_to(np.asarray(p[c]), len(p[0])) for p in parts])
           for c in range(6)]
    traffic = Traffic(cat[0], cat[1], cat[2], cat[4].astype(np.int64), phases, deps,
                      mult=cat[3], remote=cat[5].astype(bool), rank_mult=np.repeat(k, g))
    return net, traffic, np.arange(P * g)
