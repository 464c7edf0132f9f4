"""The cost model in one pass of plain Python over the split matrix, for small groups:
`comm.cost.predict(..., method="one-pass")`, what `auto` runs up to SMALL_GROUP ranks.

numpy pays ~5-10 us per operation when its code is cold in the cache, as it is between
exchanges: ~250 us for the two vectorised predictions of 8 ranks, 4x that in wall time
with 8 ranks on 2 cores. One pass of plain Python over R^2 split entries costs less
up to a few dozen ranks. `scan_row` and `pack_row` are the per-row pass, shared with the
row summaries (comm/cost/summary.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from comm.cost.a2a_model import flat_time, halo_time, phase_time
from comm.cost.layout import Layout
from comm.cost.model import CostModel
from comm.cost.reference import Prediction

__all__ = ["one_pass", "pack_row", "scan_row"]


def scan_row(row: Sequence[int], peers: Sequence[tuple[int, int, int, int]], my_node: int,
             per_node: list[int], flat_in: list[int], relayed: list[int] | None = None,
             relay_peers: list[int] | None = None) -> tuple[int, int, int, int]:
    """One source row's pass over its peers (`Layout.lists[3][s]`: destination, its node,
    its NIC, the relay forwarding to it or -1). Adds the off-node rows to `per_node` [N] by
    destination node and `flat_in` [NICs] by destination NIC, and the rows a relay forwards
    to `relayed[r]` and `relay_peers[r]` (a bit mask of their destinations) when given.
    Returns (off-node messages, on-node rows, on-node messages, forwarded rows)."""
    msgs = lr = lm = fwd = 0
    for d, d_node, d_nic, r in peers:
        v = row[d]
        if not v:
            continue
        if d_node == my_node:
            lr += v
            lm += 1
            continue
        msgs += 1
        per_node[d_node] += v
        flat_in[d_nic] += v
        if r >= 0:
            fwd += v
            if relayed is not None:
                relayed[r] += v
            if relay_peers is not None:
                relay_peers[r] |= 1 << d
    return msgs, lr, lm, fwd


def pack_row(per_node: Sequence[int], relay_nic: Sequence[int], halo_in: list[int]
             ) -> tuple[int, int]:
    """HALO phase II of one source: one packed message per remote node with rows, into the
    NIC of that node's relay (`relay_nic[m]`), added to `halo_in` [NICs]. Returns (rows
    sent off-node, messages)."""
    sent = packed = 0
    for m, v in enumerate(per_node):
        if v:
            sent += v
            packed += 1
            halo_in[relay_nic[m]] += v
    return sent, packed


def one_pass(S: Sequence[Sequence[int]], row_bytes: int, L: Layout, model: CostModel
             ) -> Prediction:
    """(concurrent flat, HALO, busiest-NIC bytes) in one pass over S (lists)."""
    node, nic, relay_nic, peers = L.lists
    R, N = len(node), int(L.onehot.shape[1])
    out, inn_flat, inn_halo = [0] * L.n_nics, [0] * L.n_nics, [0] * L.n_nics
    relayed, relay_peers = [0] * R, [0] * R  # rows a relay forwards; bit mask of their d
    flat_msgs = halo_msgs = local_rows = local_msgs = 0
    t_intra = 0.0
    for s, row in enumerate(S):
        per_node = [0] * N
        msgs, lr, lm, _ = scan_row(row, peers[s], node[s], per_node, inn_flat, relayed,
                                   relay_peers)
        sent, packed = pack_row(per_node, relay_nic[s], inn_halo)
        out[nic[s]] += sent
        halo_msgs = max(halo_msgs, packed)
        flat_msgs = max(flat_msgs, msgs)
        local_rows, local_msgs = max(local_rows, lr), max(local_msgs, lm)
        t_intra = max(t_intra, phase_time(lr * row_bytes, lm, model.local_bandwidth,
                                          model.alpha_local))
    busiest = max(max(out), max(inn_flat)) * row_bytes
    if model.flat_empty_messages:
        flat_msgs, local_msgs = L.peers_max
    flat = flat_time(busiest, flat_msgs, local_rows * row_bytes, local_msgs, model)
    t_inter = phase_time(max(max(out), max(inn_halo)) * row_bytes, halo_msgs,
                         model.nic_bandwidth, model.alpha_net)
    t_relay = max(phase_time(v * row_bytes, bin(mask).count("1"), model.local_bandwidth,
                             model.alpha_local)
                  for v, mask in zip(relayed, relay_peers, strict=True))
    return Prediction(flat, halo_time(t_intra, t_inter, t_relay, model), busiest)
