"""The cost model on node-major topologies of equal nodes (N nodes x G ranks, rail-aligned
relays), read off S's [N, G, N, G] blocks in a few numpy passes: what `auto` runs beyond
SMALL_GROUP ranks. `comm.cost.predict(..., method="blocked")`; `decide_blocked` settles a
decision with HALO's relay fan-out counted only where the answer hinges on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from comm.cost.a2a_model import flat_time, halo_time, phase_time
from comm.cost.layout import Layout
from comm.cost.model import CostModel
from comm.cost.reference import Prediction

__all__ = ["BlockedTerms", "blocked_terms", "decide_blocked", "predict_blocked"]


def predict_blocked(S: np.ndarray, row_bytes: int, L: Layout, model: CostModel) -> Prediction:
    """(concurrent flat, HALO, busiest-NIC bytes) of an integer split matrix S [R, R] on a
    node-major topology of N nodes x G ranks: what the vectorised model computes, in four
    passes over the R^2 entries plus O(R * N) work (its [R, R] x [R, N] product and fancy
    indexing took ~150 ms at R = 1024). See `blocked_terms` for the layouts read."""
    t = blocked_terms(S, row_bytes, L, model)
    return Prediction(t.flat, t.halo(t.relay_peers()), t.busiest)


class BlockedTerms(NamedTuple):
    """The model's terms of one split matrix, all but HALO's relay fan-out (which relay
    forwards to how many ranks of its node: the priciest pass, `relay_peers`, run only when
    the decision hinges on it)."""

    flat: float
    busiest: float  # busiest-NIC bytes
    t_intra: float  # HALO phase I
    t_inter: float  # HALO phase II
    relayed: np.ndarray  # [R] rows each relay forwards in phase III
    row_bytes: int
    model: CostModel
    relay_peers: Callable[[], np.ndarray]  # [R] ranks each relay forwards to (exact)

    def halo(self, peers: np.ndarray) -> float:
        """HALO's time with `peers` [R] (the exact fan-out, or a bound on it: the time is
        monotone in it, so bounds give bounds, bit for bit in float arithmetic)."""
        m = self.model
        t_relay = float(phase_time(self.relayed * self.row_bytes, peers, m.local_bandwidth,
                                   m.alpha_local).max())
        return halo_time(self.t_intra, self.t_inter, t_relay, m)

    def halo_bounds(self, G: int) -> tuple[float, float]:
        """HALO at least / at most: a relay that forwards rows forwards them to 1 to
        min(G - 1, rows) ranks, one that forwards none to none."""
        r = self.relayed
        return self.halo(r > 0), self.halo(np.minimum(r, G - 1))


def blocked_terms(S: np.ndarray, row_bytes: int, L: Layout, model: CostModel
                   ) -> BlockedTerms:
    """`predict_blocked`'s passes over S, the relay fan-out left as a function. S is read
    in place when one of its axes is unit-strided: a C-ordered matrix, a row-strided view
    of the exchanged ints (`settle_plan` keeps the matrix there: copying 8 MB at R = 1024
    cost more than the model), or the transposed view of either (the mirrored exchange,
    read as A^T)."""
    assert L.blocked is not None
    G = L.blocked.G
    R = S.shape[0]
    N = R // G
    ar, node = np.arange(R), L.node
    if S.strides[1] == S.itemsize:
        A, transposed = S, False
    elif S.strides[0] == S.itemsize:
        A, transposed = S.T, True  # S = A^T, A's rows unit-strided
    else:
        A, transposed = np.ascontiguousarray(S), False
    if A.dtype.itemsize < 8 and G * int(A.max(initial=0)) >= 2**31:
        A = A.astype(np.int64)  # node sums would overflow A's dtype
    # einsum sums the G ranks of a node at memory speed along either axis of A
    # (.sum(axis=2) over 8-wide groups, a transposing copy, or casting inside the sum took
    # ~10-20 ms each at R = 1024): per_node[s, m] = rows s sends to node m, from
    # sums[r, m] = A[r, node m] (S = A) or sums[m, c] = A[node m, c] (S = A^T); the other
    # direction needs only per-rank totals, a plain sum along A's axis.
    if transposed:
        sums = np.einsum("mgc->mc", A.reshape(N, G, R)).astype(np.int64, copy=False)
        per_node, totals_in = sums.T, A.sum(axis=1, dtype=np.int64)
    else:
        sums = np.einsum("rng->rn", A.reshape(R, N, G)).astype(np.int64, copy=False)
        per_node, totals_in = sums, A.sum(axis=0, dtype=np.int64)
    blocks = A.reshape(N, G, N, G)[np.arange(N), :, np.arange(N), :]  # [N, G, G] on-node
    if transposed:
        blocks = blocks.transpose(0, 2, 1)
    own_out = blocks.sum(axis=2, dtype=np.int64).reshape(R)  # on-node, self included
    own_in = blocks.sum(axis=1, dtype=np.int64).reshape(R)
    remote_out = per_node.sum(axis=1) - own_out  # off-node rows each rank sends
    remote_in = totals_in - own_in  # ... and receives
    diag = A[ar, ar].astype(np.int64, copy=False)
    local_rows = own_out - diag
    nic_out = np.bincount(L.nic, remote_out, minlength=L.n_nics)
    busiest = max(float(nic_out.max()),
                  float(np.bincount(L.nic, remote_in, minlength=L.n_nics).max()))
    own_nz = (blocks > 0).sum(axis=2).reshape(R) - (diag > 0)  # other on-node peers with rows
    ZA = A > 0
    if model.flat_empty_messages:
        flat_msgs, local_msgs = L.peers_max
    else:
        nz = ZA.sum(axis=0 if transposed else 1)  # peers each rank sends rows to
        flat_msgs = int((nz - own_nz - (diag > 0)).max())
        local_msgs = int(own_nz.max())
    flat = flat_time(busiest * row_bytes, flat_msgs, float(local_rows.max()) * row_bytes,
                     local_msgs, model)

    # HALO phase II: one message per (rank, remote node) into the relay's NIC; relay
    # r = m * G + g (rail-aligned, `Blocked`) receives from the sources n * G + g, n != m:
    # into[m, g] = sum over n of far[n * G + g, m]
    far = per_node  # einsum's own output (a fresh array: remote_out is taken)
    far[ar, node] = 0
    if transposed:  # far = sums^T: sums[m, n * G + g]
        into = sums.reshape(N, N, G).sum(axis=1)
    else:  # far = sums [n * G + g, m]
        into = sums.reshape(N, G, N).sum(axis=0).T
    into = into.reshape(R)
    halo_in = np.bincount(L.nic, into, minlength=L.n_nics)
    t_inter = phase_time(max(float(nic_out.max()), float(halo_in.max())) * row_bytes,
                         int((far > 0).sum(axis=1).max()), model.nic_bandwidth, model.alpha_net)
    # Phase III: relay r forwards what it received minus its own rows, S[n * G + g, r]
    # (n != m): the diagonal of S's G x G blocks, a strided view of A (no gather).
    # diag4[a, b, g] = A[a * G + g, b * G + g]; for S = A^T it is S[b * G + g, a * G + g].
    diag4 = np.diagonal(A.reshape(N, G, N, G), axis1=1, axis2=3)
    own = diag4.sum(axis=1 if transposed else 0, dtype=np.int64).reshape(R) - diag
    relayed = (into - own).astype(np.float64)  # rows: exact in float64
    t_intra = float(phase_time(local_rows * row_bytes, own_nz, model.local_bandwidth,
                               model.alpha_local).max())

    def relay_peers() -> np.ndarray:
        # Relay m * G + g forwards to h != g of its node when some source n * G + g,
        # n != m, has rows for m * G + h: count the sources with rows per (g, m, h) over
        # S's [N, G, N, G] bools in one pass, less the own node's (the on-node blocks).
        Z4 = ZA.reshape(N, G, N, G)
        on_node = Z4[np.arange(N), :, np.arange(N), :]  # [N, G, G]: A's own-node blocks
        if transposed:  # S4[n, g, m, h] = Z4[m, h, n, g]
            hits = (Z4.sum(axis=2) - on_node > 0).transpose(0, 2, 1)  # [m, g, h]
        else:
            hits = Z4.sum(axis=0).transpose(1, 0, 2) - on_node > 0  # [m, g, h]
        hits[:, np.arange(G), np.arange(G)] = False  # a relay's own rows are not forwarded
        return hits.sum(axis=2).reshape(R)

    return BlockedTerms(flat, busiest * row_bytes, t_intra, t_inter, relayed, row_bytes,
                         model, relay_peers)


def decide_blocked(S: np.ndarray, row_bytes: int, L: Layout, model: CostModel) -> str:
    """What `decide(predict_blocked(...), model)` returns, with the relay fan-out pass run
    only where HALO's bounds straddle flat."""
    assert L.blocked is not None
    t = blocked_terms(S, row_bytes, L, model)
    c_flat, c_halo = model.correction(t.busiest)
    flat = t.flat * c_flat
    # HALO is monotone in the relay fan-out: where its bounds lie on one side of flat
    # the exact value does too (the same float operations, bit for bit), so the pass
    # that counts the fan-out runs only where the answer hinges on it
    low, high = t.halo_bounds(L.blocked.G)
    if low * c_halo >= flat:
        return "flat"
    if high * c_halo < flat:
        return "halo"
    return "halo" if t.halo(t.relay_peers()) * c_halo < flat else "flat"
