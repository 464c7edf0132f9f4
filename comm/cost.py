"""`algorithm="auto"`: flat or HALO per call, by the all-to-all model of comm.a2a_model.

Inputs: the split matrix S [R, R] (rows), bytes per row, the Topology and a `CostModel`
(comm.a2a_model.Rates, the link rates, plus what only `auto` needs: gloo's pairwise flat
collective, measured corrections, where the numbers came from). This module reads the loads
the model takes off S (bytes through the busiest NIC, message counts, what each relay
forwards), exactly, in plain loops (`reference_predict_*`, the definition), vectorised
(`predict_flat`, `predict_halo`), in one pass for small groups, in blocked passes for
node-major topologies, or bracketed from per-row summaries (`decide_from_summaries`); the
times themselves are always comm.a2a_model's `flat_time`, `phase_time` and `halo_time`.
The decision depends only on data every rank holds identically (S, topology, parameters),
so all ranks pick the same algorithm without another collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from comm.a2a_model import Rates, flat_time, halo_time, phase_time
from comm.halo_plan import relay_table
from comm.platform import PLATFORM_DIR, load_platform_file
from comm.topology import Topology

__all__ = [
    "PLATFORM_DIR",
    "CostModel",
    "busiest_nic_bytes",
    "choose_algorithm",
    "decide_from_summaries",
    "predict_flat",
    "predict_halo",
    "reference_predict_flat",
    "reference_predict_halo",
    "row_summary",
    "summary_bracket",
    "summary_width",
]


@dataclass(frozen=True)
class CostModel(Rates):
    """The all-to-all model's parameters as `auto` uses them. Where they come from is the
    caller's choice and `source` says it: `comm.calibrate` (measured on the job's own links,
    what the trainer uses), `from_platform` (a configs/platforms file's link rates),
    `emulator` (the namespace emulator's shaped NIC).
    The field defaults are the emulator's 100 Mbit/s NIC: placeholders for tests and the
    emulator, never a machine's numbers, and `all_to_all(..., algorithm="auto")` refuses to
    run across nodes without a model rather than fall back to them.

    The link rates and per-message costs are `comm.a2a_model.Rates`'s fields (rank2nic
    tells which NIC a rank uses); besides them:
    flat_pairwise: the flat collective runs R-1 dependent pairwise steps whose two
        directions serialise (a pessimistic default for gloo); False: all peers at once.
    (flat_nic_bandwidth, a Rates field: `calibrate` measures it; gloo's all_to_all_single
        posts each send before the receive from the same peer, and its TCP pairs then move
        some pairs' two directions one after the other.)
    corrections: measured / predicted time of each algorithm at the exchanges `calibrate`
        timed, as (busiest-NIC bytes, flat factor, HALO factor) sorted by bytes. `auto`
        scales its two predictions by the factors interpolated at the call's busiest-NIC
        bytes (log scale, held constant beyond the ends), so the decision reproduces the
        measurement where one was taken and the alpha-beta model shapes it in between
        (what a few parameters miss on a loaded host: CPU-bound copies, transport quirks).
        Empty: the raw model.
    flat_empty_messages: the flat collective exchanges a message with every peer, empty
        ones included (gloo's all_to_all_single: a 1 KB skewed exchange with 7 of 16 pairs
        empty takes as long as the balanced one at 8x2), so its message counts are the peer
        counts; False counts only the peers with rows (HALO always does).
    """

    flat_pairwise: bool = False
    corrections: tuple[tuple[float, float, float], ...] = ()
    flat_empty_messages: bool = False
    source: str = field(default="placeholder defaults (the emulator's 100 Mbit/s NIC)",
                        compare=False)

    @classmethod
    def for_backend(cls, backend: str, **overrides: Any) -> CostModel:
        """The backend's flags (gloo's flat collective is pairwise) on the placeholder link
        rates unless `overrides` (any CostModel fields: rates, flags, `source`) sets them.

        gloo's all_to_all_single walks the peers one step at a time (send to rank+i, receive
        from rank-i, wait) and its TCP pairs serialise the two directions of an exchange, so
        a 2-rank exchange of 4 MB each way at 100 Mbit/s takes 0.70 s instead of 0.34 s
        (measured on the emulator). NCCL / RCCL run all peers concurrently, on-node and
        off-node links at once (`flat_overlap`).
        """
        gloo = backend == "gloo"
        return cls(**{"flat_pairwise": gloo, "flat_empty_messages": gloo,
                      "flat_overlap": not gloo, **overrides})

    @classmethod
    def emulator(cls, nic_mbit: float = 100.0, backend: str = "gloo") -> CostModel:
        """The namespace emulator (`python -m comm.emulate`): NICs shaped at `nic_mbit`,
        the other parameters the placeholders."""
        if not nic_mbit > 0:
            raise ValueError(f"nic_mbit must be > 0, got {nic_mbit}")
        return cls.for_backend(backend, nic_bandwidth=nic_mbit * 1e6 / 8,
                               source=f"emulator: {nic_mbit:g} Mbit/s NICs ({backend})")

    @classmethod
    def from_platform(cls, name_or_path: str | Path,
                      directory: str | Path | None = None) -> CostModel:
        """Link rates of a platform file (configs/platforms/<name>.toml, or a path to one):
        [network] nic_bandwidth_gbs, network_latency_us; [node] intra_node_bandwidth_gbs,
        intra_node_latency_us; `backend` sets the flat collective's flags (`for_backend`).
        The files carry no HALO overhead: one network latency stands for it (HALO's second
        dependent round). Values a file marks "assumed" stay assumptions; `comm.calibrate`
        measures all of them on the job's own links."""
        pf = load_platform_file(name_or_path, directory)
        values = {key: pf.number(section, key, scale)
                  for section, key, scale in (("network", "nic_bandwidth_gbs", 1e9),
                                              ("network", "network_latency_us", 1e-6),
                                              ("node", "intra_node_bandwidth_gbs", 1e9),
                                              ("node", "intra_node_latency_us", 1e-6))}
        backend = str(pf.data.get("backend", "nccl"))
        return cls.for_backend(
            backend, nic_bandwidth=values["nic_bandwidth_gbs"],
            local_bandwidth=values["intra_node_bandwidth_gbs"],
            alpha_net=values["network_latency_us"], alpha_local=values["intra_node_latency_us"],
            halo_overhead_s=values["network_latency_us"],
            source=f"platform {pf.name!r} ({pf.path}), {backend}")

    def describe(self) -> str:
        """One line for a log: where the numbers come from and the main ones."""
        flat = self.flat_nic_bandwidth or self.nic_bandwidth
        return (f"all-to-all cost model from {self.source}: NIC {self.nic_bandwidth / 1e6:.1f} "
                f"MB/s (HALO), {flat / 1e6:.1f} MB/s (flat), intra-node "
                f"{self.local_bandwidth / 1e6:.0f} MB/s, per message {1e6 * self.alpha_net:.0f} "
                f"us, HALO overhead {1e6 * self.halo_overhead_s:.0f} us")

    def __post_init__(self) -> None:
        super().__post_init__()
        points = [tuple(c) for c in self.corrections]
        if any(len(c) != 3 or not all(v > 0 for v in c) for c in points) or any(
                a[0] >= b[0] for a, b in zip(points, points[1:], strict=False)):
            raise ValueError("corrections must be (busiest-NIC bytes, flat factor, HALO "
                             f"factor) triples of positive numbers, bytes increasing, got "
                             f"{self.corrections!r}")
        object.__setattr__(self, "corrections", tuple(points))

    def correction(self, nic_bytes: float) -> tuple[float, float]:
        """(flat, HALO) factors at `nic_bytes` busiest-NIC bytes; (1, 1) without corrections."""
        if not self.corrections:
            return 1.0, 1.0
        points = self.corrections
        if nic_bytes <= points[0][0]:
            return points[0][1], points[0][2]
        for (x0, f0, h0), (x1, f1, h1) in zip(points, points[1:], strict=False):
            if nic_bytes <= x1:  # plain python: this runs on every `auto` call
                w = math.log(nic_bytes / x0) / math.log(x1 / x0)
                return f0 + w * (f1 - f0), h0 + w * (h1 - h0)
        return points[-1][1], points[-1][2]


SMALL_GROUP = 32  # up to this many ranks `choose_algorithm` runs `_predict_both_loops`


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
        t_intra = max(t_intra, phase_time(lb, lm, model.local_bandwidth, model.alpha_local))
    nic_bytes = max(max(out.values(), default=0.0), max(inn.values(), default=0.0))
    t_inter = phase_time(nic_bytes, net_msgs, model.nic_bandwidth, model.alpha_net)
    t_relay = max(
        (phase_time(relayed[r], len(relay_peers[r]), model.local_bandwidth, model.alpha_local)
         for r in range(R)),
        default=0.0,
    )
    return halo_time(t_intra, t_inter, t_relay, model)


# ---- vectorised predictions (what `auto` runs on every call) -----------------------------
# Every rank evaluates the model on every call; with 16 ranks on 2 cores the plain loops
# cost ~3 ms of CPU per rank per call (~25 ms of wall time on the emulator). Everything that
# depends only on the topology is built once and memoised on the (immutable) Topology, so a
# call costs a few small numpy operations on the split matrix.


@dataclass(frozen=True)
class _Layout:
    node: np.ndarray  # [R] node of each rank
    nic: np.ndarray  # [R] global NIC id (node, NIC index) of each rank
    n_nics: int
    remote: np.ndarray  # [R, R] bool: s and d on different nodes
    local: np.ndarray  # [R, R] bool: same node, s != d
    onehot: np.ndarray  # [R, N] float: rank d on node m
    relay_nic: np.ndarray  # [R, N] NIC of the relay receiving s's rows for node m
    hop: np.ndarray  # [R, R] who relays s's rows for d (d's node's relay for s)
    forwarding: np.ndarray  # [R, R] bool: remote and relayed by someone other than d
    lists: tuple  # the same as python lists, for `_predict_both_loops`
    nic_node: tuple[int, ...]  # node of each NIC
    one_nic: bool  # every node has exactly one NIC (HALO's relays then use the same NICs)
    g_max: int  # most ranks on one node
    peers_max: tuple[int, int]  # most off-node / other on-node peers of one rank
    # Node-major with G ranks on every node, else None: then `_predict_blocked` reads S in
    # [R, N, G] blocks.
    blocked: _Blocked | None = None


def _layout(topo: Topology) -> _Layout:
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
        memo = _Layout(node=node, nic=nic, n_nics=len(ids), remote=remote,
                       local=~remote & ~np.eye(R, dtype=bool),
                       onehot=(node[:, None] == np.arange(N)[None, :]).astype(np.float64),
                       relay_nic=nic[relay], hop=hop, forwarding=forwarding,
                       lists=(node.tolist(), nic.tolist(), nic[relay].tolist(), peers),
                       nic_node=tuple(k[0] for k in ids), one_nic=len(ids) == N,
                       g_max=max(topo.ranks_per_node()),
                       peers_max=(R - min(topo.ranks_per_node()), max(topo.ranks_per_node()) - 1),
                       blocked=_blocked_facts(topo, relay))
        object.__setattr__(topo, "_cost_layout", memo)
    return memo


@dataclass(frozen=True)
class _Blocked:
    """A node-major topology of N nodes x G ranks (rank = node * G + local) whose relays are
    rail-aligned: s's rows for node m go to the rank of m with s's local index (what
    `relay_rank` picks whenever every node lays its ranks on its NICs alike). Then
    `_predict_blocked` reads every HALO term off S's [N, G, N, G] blocks."""

    G: int


def _blocked_facts(topo: Topology, relay: np.ndarray) -> _Blocked | None:
    R, N = topo.world_size, topo.num_nodes
    G = R // N
    if N < 2 or N * G != R or any(topo.node_ranks(m) != tuple(range(m * G, (m + 1) * G))
                                  for m in range(N)):
        return None
    rail = (np.arange(N) * G)[None, :] + (np.arange(R) % G)[:, None]  # [R, N]
    return _Blocked(G) if np.array_equal(relay, rail) else None


def _bytes(S: list[list[int]] | np.ndarray, row_bytes: int) -> np.ndarray:
    return np.asarray(S, dtype=np.float64) * row_bytes  # B[s, d] bytes


def _nic_load(L: _Layout, far: np.ndarray) -> tuple[float, float]:
    """Bytes out of / into the busiest NIC for the off-node bytes `far` [R, R]."""
    return (float(np.bincount(L.nic, far.sum(axis=1), minlength=L.n_nics).max()),
            float(np.bincount(L.nic, far.sum(axis=0), minlength=L.n_nics).max()))


def _flat(B: np.ndarray, L: _Layout, model: CostModel) -> float:
    R = len(L.node)
    if model.flat_pairwise:
        ar = np.arange(R)
        steps = np.arange(1, R)[:, None]
        dst, src = (ar + steps) % R, (ar - steps) % R  # [R-1, R]
        send, recv = B[ar, dst], B[src, ar]
        send_remote, recv_remote = L.remote[ar, dst], L.remote[src, ar]

        def cost(nbytes: np.ndarray, far: np.ndarray) -> np.ndarray:
            bw = np.where(far, model.nic_bandwidth, model.local_bandwidth)
            alpha = np.where(far, model.alpha_net, model.alpha_local)
            if model.flat_empty_messages:
                return nbytes / bw + alpha
            return np.where(nbytes > 0, nbytes / bw + alpha, 0.0)

        rank_t = (cost(send, send_remote) + cost(recv, recv_remote)).max(axis=1)
        wire = (send * send_remote).ravel()
        base = (np.arange(R - 1)[:, None] * L.n_nics).repeat(R, 1)  # one NIC table per step
        size = (R - 1) * L.n_nics
        out = np.bincount((base + L.nic[None, :]).ravel(), wire, minlength=size)
        inn = np.bincount((base + L.nic[dst]).ravel(), wire, minlength=size)
        nic_t = np.maximum(out.reshape(R - 1, L.n_nics).max(axis=1),
                           inn.reshape(R - 1, L.n_nics).max(axis=1)) / model.nic_bandwidth
        return float(np.maximum(rank_t, nic_t).sum())
    nonzero = np.ones_like(B, dtype=bool) if model.flat_empty_messages else B > 0
    net_msgs = int((nonzero & L.remote).sum(axis=1).max())
    local_bytes = float((B * L.local).sum(axis=1).max())
    local_msgs = int((nonzero & L.local).sum(axis=1).max())
    return flat_time(max(_nic_load(L, B * L.remote)), net_msgs, local_bytes, local_msgs, model)


def _halo(B: np.ndarray, L: _Layout, model: CostModel) -> float:
    R = len(L.node)
    per_node = (B * L.remote) @ L.onehot  # [R, N] bytes s sends to node m
    out_b = float(np.bincount(L.nic, per_node.sum(axis=1), minlength=L.n_nics).max())
    in_b = float(np.bincount(L.relay_nic.ravel(), per_node.ravel(), minlength=L.n_nics).max())
    net_msgs = int((per_node > 0).sum(axis=1).max())
    t_inter = phase_time(max(out_b, in_b), net_msgs, model.nic_bandwidth, model.alpha_net)
    forwarded = L.forwarding & (B > 0)
    hops, dsts = L.hop[forwarded], np.nonzero(forwarded)[1]
    relayed = np.bincount(hops, B[forwarded], minlength=R)
    seen = np.zeros((R, R), dtype=bool)  # seen[r, d]: relay r forwards something to d
    seen[hops, dsts] = True
    t_relay = float(phase_time(relayed, seen.sum(axis=1), model.local_bandwidth,
                               model.alpha_local).max())
    t_intra = float(phase_time((B * L.local).sum(axis=1), ((B > 0) & L.local).sum(axis=1),
                               model.local_bandwidth, model.alpha_local).max())
    return halo_time(t_intra, t_inter, t_relay, model)


def _predict_blocked(
    S: np.ndarray, row_bytes: int, L: _Layout, model: CostModel
) -> tuple[float, float, float]:
    """(concurrent flat, HALO, busiest-NIC bytes) of an integer split matrix S [R, R] on a
    node-major topology of N nodes x G ranks: what `_flat` and `_halo` compute, in four
    passes over the R^2 entries plus O(R * N) work (`_halo`'s [R, R] x [R, N] product and
    fancy indexing took ~150 ms at R = 1024). See `_blocked_terms` for the layouts read."""
    t = _blocked_terms(S, row_bytes, L, model)
    return t.flat, t.halo(t.relay_peers()), t.busiest


class _BlockedTerms(NamedTuple):
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


def _blocked_terms(S: np.ndarray, row_bytes: int, L: _Layout, model: CostModel
                   ) -> _BlockedTerms:
    """`_predict_blocked`'s passes over S, the relay fan-out left as a function. S is read
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
    # r = m * G + g (rail-aligned, `_Blocked`) receives from the sources n * G + g, n != m:
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

    return _BlockedTerms(flat, busiest * row_bytes, t_intra, t_inter, relayed, row_bytes,
                         model, relay_peers)


def _predict_both_loops(
    S: list[list[int]], row_bytes: int, L: _Layout, model: CostModel
) -> tuple[float, float, float]:
    """(concurrent flat, HALO, busiest-NIC bytes) in one pass over S, for small groups.

    numpy pays ~5-10 us per operation when its code is cold in the cache, as it is between
    exchanges: ~250 us for the two vectorised predictions of 8 ranks, 4x that in wall time
    with 8 ranks on 2 cores. One pass of plain Python over R^2 split entries costs less
    up to a few dozen ranks (`choose_algorithm` switches at SMALL_GROUP).
    """
    node, nic, relay_nic, peers = L.lists
    R, N = len(node), int(L.onehot.shape[1])
    out, inn_flat, inn_halo = [0] * L.n_nics, [0] * L.n_nics, [0] * L.n_nics
    relayed, relay_peers = [0] * R, [0] * R  # rows a relay forwards; bit mask of their d
    flat_msgs = halo_msgs = local_rows = local_msgs = 0
    t_intra = 0.0
    for s, row in enumerate(S):
        my_node = node[s]
        per_node = [0] * N
        msgs = lr = lm = 0
        for d, d_node, d_nic, r in peers[s]:
            v = row[d]
            if not v:
                continue
            if d_node == my_node:
                lr += v
                lm += 1
                continue
            msgs += 1
            per_node[d_node] += v
            inn_flat[d_nic] += v
            if r >= 0:
                relayed[r] += v
                relay_peers[r] |= 1 << d
        sent = packed = 0
        for m, v in enumerate(per_node):
            if v:
                sent += v
                packed += 1
                inn_halo[relay_nic[s][m]] += v
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
    return flat, halo_time(t_intra, t_inter, t_relay, model), busiest


# ---- `auto` from row summaries: a bracket, and a decision or "run the full model" ---------
# Every rank evaluating the model on the whole split matrix costs O(R^2) Python per call,
# 3-7 % of a small exchange in wall time with 8-16 ranks on 2 cores. Instead each rank
# summarises its own row (O(R)) and sends the summary to every peer with the row itself
# (`comm.all_to_all`). From the R summaries every rank gets the flat prediction and HALO's
# phases I and II exactly, and brackets HALO's relay hop (phase III) between what the
# busiest relay forwards at least and at most. When the whole bracket lies on one side of
# flat the decision is the model's; otherwise the caller runs `choose_algorithm` on the rows.

SUMMARY_FIELDS = 6  # remote rows, flat messages, HALO messages, local rows, local messages,
# remote rows that a relay forwards (to a rank other than itself)


def summary_width(topo: Topology) -> int:
    """Length of `row_summary`: the fields plus off-node rows per NIC (flat, and HALO's
    relay NICs when a node has more than one NIC)."""
    L = _layout(topo)
    return SUMMARY_FIELDS + L.n_nics * (1 if L.one_nic else 2)


def row_summary(row: list[int], rank: int, topo: Topology) -> list[int]:
    """What `decide_from_summaries` needs of rank `rank`'s split row, as `summary_width`
    python ints (one pass of `_predict_both_loops` over a single row)."""
    L = _layout(topo)
    node, _, relay_nic, peers = L.lists
    my_node, n = node[rank], L.n_nics
    per_node = [0] * topo.num_nodes
    flat_in = [0] * n
    flat_msgs = local_rows = local_msgs = forwarded = 0
    for d, d_node, d_nic, r in peers[rank]:
        v = row[d]
        if not v:
            continue
        if d_node == my_node:
            local_rows += v
            local_msgs += 1
            continue
        flat_msgs += 1
        per_node[d_node] += v
        flat_in[d_nic] += v
        if r >= 0:
            forwarded += v
    halo_in = flat_in if L.one_nic else [0] * n
    sent = halo_msgs = 0
    for m, v in enumerate(per_node):
        if v:
            sent += v
            halo_msgs += 1
            if not L.one_nic:
                halo_in[relay_nic[rank][m]] += v
    head = [sent, flat_msgs, halo_msgs, local_rows, local_msgs, forwarded]
    return head + flat_in if L.one_nic else head + flat_in + halo_in


def summary_bracket(
    values: Sequence[int] | np.ndarray, offset: int, stride: int, row_bytes: int, topo: Topology,
    model: CostModel,
) -> tuple[float, float, float, float]:
    """(flat, HALO at least, HALO at most, busiest-NIC bytes) from the rows' summaries:
    values[offset + s * stride:][:summary_width] is `row_summary` of rank s (values: a list
    or a 1-D integer array of R * stride entries).

    Flat and the busiest-NIC bytes equal `_predict_both_loops` (the same expressions on the
    same integers); HALO lies in the bracket. The concurrent flat model only.
    """
    L = _layout(topo)
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
    if model.corrections:
        c_flat, c_halo = model.correction(busiest)
        flat, halo_low, halo_high = flat * c_flat, halo_low * c_halo, halo_high * c_halo
    if flat <= halo_low:
        return "flat"
    if halo_high < flat:
        return "halo"
    return None


def predict_flat(S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of the flat all-to-all (the slowest NIC / rank decides)."""
    return _flat(_bytes(S, row_bytes), _layout(topo), model)


def predict_halo(S: list[list[int]], row_bytes: int, topo: Topology, model: CostModel) -> float:
    """Predicted seconds of HALO: max(phase I, phase II + phase III) + fixed overhead."""
    return _halo(_bytes(S, row_bytes), _layout(topo), model)


def busiest_nic_bytes(S: list[list[int]], row_bytes: int, topo: Topology) -> float:
    """Bytes through the busiest NIC direction (sent or received off-node); both algorithms
    move the same."""
    L = _layout(topo)
    return max(_nic_load(L, _bytes(S, row_bytes) * L.remote))


def choose_algorithm(
    S: list[list[int]] | np.ndarray, row_bytes: int, topo: Topology, model: CostModel
) -> str:
    """"halo" when it is predicted strictly faster, else "flat" (the safe default).

    S is lists or an integer array [R, R]. Per call: one pass of plain Python up to
    SMALL_GROUP ranks, `_predict_blocked` (a few numpy passes) on node-major topologies of
    equal nodes beyond, the general vectorised model otherwise.

    The predictions are scaled by `model.correction` at the exchange's busiest-NIC bytes.
    """
    if topo.num_nodes == 1:
        return "flat"  # nothing to aggregate: HALO degenerates to flat plus overhead
    L = _layout(topo)
    if topo.world_size <= SMALL_GROUP and not model.flat_pairwise:
        rows = S.tolist() if isinstance(S, np.ndarray) else S
        flat, halo, busiest = _predict_both_loops(rows, row_bytes, L, model)
    elif L.blocked is not None and not model.flat_pairwise:
        t = _blocked_terms(np.asarray(S), row_bytes, L, model)
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
    else:
        B = _bytes(S, row_bytes)
        flat, halo = _flat(B, L, model), _halo(B, L, model)
        busiest = max(_nic_load(L, B * L.remote)) if model.corrections else 0.0
    if model.corrections:
        c_flat, c_halo = model.correction(busiest)
        flat, halo = flat * c_flat, halo * c_halo
    return "halo" if halo < flat else "flat"
