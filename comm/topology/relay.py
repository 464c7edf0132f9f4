"""HALO's relays: which rank of a node receives a source's packed phase-II message.

Relay choice (why all NICs carry traffic): every rank sends its own packed messages, so each
NIC of the sending node carries the traffic of the ranks behind it; on the receiving node the
relay is the rank behind the NIC with the same index as the sender's (modulo the NIC count
of node m, rail-aligned as in a rail-optimised fat tree), spread over that NIC's ranks by the
sender's position among its own NIC's ranks. With balanced splits every NIC sends and
receives the same number of bytes.

The choice depends only on the topology, so it sits here, below the cost model and the HALO
plan that both read it (comm/cost/, comm/collectives/halo_plan.py).
"""

from __future__ import annotations

from comm.topology.core import Topology

__all__ = ["relay_rank", "relay_table"]


def relay_rank(topo: Topology, src: int, node: int) -> int:
    """The rank of `node` that receives `src`'s packed phase-II message (see module doc)."""
    src_ranks, dst_ranks = topo.node_ranks(topo.rank2node[src]), topo.node_ranks(node)
    nic = topo.rank2nic[src]
    src_nics = sorted({topo.rank2nic[r] for r in src_ranks})
    dst_nics = sorted({topo.rank2nic[r] for r in dst_ranks})
    target_nic = dst_nics[src_nics.index(nic) % len(dst_nics)]
    position = [r for r in src_ranks if topo.rank2nic[r] == nic].index(src)
    candidates = [r for r in dst_ranks if topo.rank2nic[r] == target_nic]
    return candidates[position % len(candidates)]


def relay_table(topo: Topology) -> tuple[tuple[int, ...], ...]:
    """relay[s][m] = relay_rank(topo, s, m) (s itself for its own node), memoised on `topo`.

    The memo lives on the immutable Topology instance (not in a module-level cache): the
    cost model asks for it on every `auto` call and it costs O(R * nodes * G) to build.
    """
    memo = topo.__dict__.get("_relay_table")
    if memo is None:
        node = topo.rank2node
        memo = tuple(
            tuple(s if m == node[s] else relay_rank(topo, s, m) for m in range(topo.num_nodes))
            for s in range(topo.world_size)
        )
        object.__setattr__(topo, "_relay_table", memo)
    return memo
