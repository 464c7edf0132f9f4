"""`auto` from row summaries: a bracket, and a decision or "run the full model".

Every rank evaluating the model on the whole split matrix costs O(R^2) Python per call,
3-7 % of a small exchange in wall time with 8-16 ranks on 2 cores. Instead each rank
summarises its own row (O(R)) and sends the summary to every peer with the row itself
(`comm.all_to_all`). From the R summaries every rank gets the flat prediction and HALO's
phases I and II exactly, and brackets HALO's relay hop (phase III) between what the
busiest relay forwards at least and at most. When the whole bracket lies on one side of
flat the decision is the model's; otherwise the caller runs `choose_algorithm` on the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from comm.cost.a2a_model import flat_time, halo_time, phase_time
from comm.cost.layout import layout
from comm.cost.model import CostModel
from comm.cost.onepass import pack_row, scan_row
from comm.cost.reference import Prediction, decide
from comm.topology import Topology

__all__ = ["SUMMARY_FIELDS", "decide_from_summaries", "row_summary", "summary_bracket",
           "summary_width"]

SUMMARY_FIELDS = 6  # remote rows, flat messages, HALO messages, local rows, local messages,
# remote rows that a relay forwards (to a rank other than itself)


def summary_width(topo: Topology) -> int:
    """Length of `row_summary`: the fields plus off-node rows per NIC (flat, and HALO's
    relay NICs when a node has more than one NIC)."""
    L = layout(topo)
    return SUMMARY_FIELDS + L.n_nics * (1 if L.one_nic else 2)


def row_summary(row: list[int], rank: int, topo: Topology) -> list[int]:
    """What `decide_from_summaries` needs of rank `rank`'s split row, as `summary_width`
    python ints (`one_pass`'s per-row pass over this single row)."""
    L = layout(topo)
    node, _, relay_nic, peers = L.lists
    n = L.n_nics
    per_node, flat_in = [0] * topo.num_nodes, [0] * n
    flat_msgs, local_rows, local_msgs, forwarded = scan_row(row, peers[rank], node[rank],
                                                            per_node, flat_in)
    halo_in = [0] * n  # with one NIC per node HALO's relays use the flat NICs: not sent
    sent, halo_msgs = pack_row(per_node, relay_nic[rank], halo_in)
    head = [sent, flat_msgs, halo_msgs, local_rows, local_msgs, forwarded]
    return head + flat_in if L.one_nic else head + flat_in + halo_in


def summary_bracket(
    values: Sequence[int] | np.ndarray, offset: int, stride: int, row_bytes: int, topo: Topology,
    model: CostModel,
) -> tuple[float, float, float, float]:
    """(flat, HALO at least, HALO at most, busiest-NIC bytes) from the rows' summaries:
    values[offset + s * stride:][:summary_width] is `row_summary` of rank s (values: a list
    or a 1-D integer array of R * stride entries).

    Flat and the busiest-NIC bytes equal `one_pass` (the same expressions on the
    same integers); HALO lies in the bracket. The concurrent flat model only.
    """
    L = layout(topo)
    R, n = len(L.node), L.n_nics
    # [R, summary]: numpy reads the R x n per-NIC columns (O(R^2) ints at one NIC per rank)
    # without a Python int per entry; the O(R) rest is plain Python on exact ints.
    V = np.asarray(values)[:R * stride].reshape(R, stride)[:, offset:offset + summary_width(topo)]
    sent, flat_msgs, halo_msgs, lrows, lmsgs, forwarded = V[:, :SUMMARY_FIELDS].T.tolist()
    out = [0] * n
    for k, v in zip(L.lists[1], sent, strict=True):
        out[k] += v
    cols = V[:, SUMMARY_FIELDS:].sum(axis=0, dtype=np.int64).tolist()
    flat_in = cols[:n]
    halo_in = flat_in if L.one_nic else cols[n:]
    rb, bw_local, a_local = row_bytes, model.local_bandwidth, model.alpha_local
    busiest = max(max(out), max(flat_in)) * rb
    n_msgs, n_local = L.peers_max if model.flat_empty_messages else (max(flat_msgs),
                                                                       max(lmsgs))
    flat = flat_time(busiest, n_msgs, max(lrows) * rb, n_local, model)
    t_intra = max(phase_time(lr * rb, lm, bw_local, a_local)
                  for lr, lm in zip(lrows, lmsgs, strict=True))
    t_inter = phase_time(max(max(out), max(halo_in)) * rb, max(halo_msgs), model.nic_bandwidth,
                         model.alpha_net)
    total = sum(forwarded)
    low = high = 0.0
    if total:
        # Every forwarded row passes one relay: the busiest forwards >= the mean over R ranks
        # to >= 1 peer, and no relay more than all rows entering its node, to <= G - 1 peers.
        node_in = [0] * topo.num_nodes
        for m, v in zip(L.nic_node, halo_in, strict=True):
            node_in[m] += v
        low = phase_time(total / R * rb, 1, bw_local, a_local)
        high = phase_time(min(total, max(node_in)) * rb, L.g_max - 1, bw_local, a_local)
    return (flat, halo_time(t_intra, t_inter, low, model),
            halo_time(t_intra, t_inter, high, model), busiest)


def decide_from_summaries(
    values: Sequence[int] | np.ndarray, offset: int, stride: int, row_bytes: int, topo: Topology,
    model: CostModel,
) -> str | None:
    """"flat" / "halo" where `summary_bracket` decides (then it is what `choose_algorithm`
    decides on the whole matrix), None where HALO's bracket straddles flat."""
    if model.flat_pairwise:
        raise ValueError("decide_from_summaries needs the concurrent flat model "
                         "(flat_pairwise=False); use choose_algorithm")
    flat, halo_low, halo_high, busiest = summary_bracket(values, offset, stride, row_bytes,
                                                         topo, model)
    if decide(Prediction(flat, halo_low, busiest), model) == "flat":
        return "flat"
    if decide(Prediction(flat, halo_high, busiest), model) == "halo":
        return "halo"
    return None
