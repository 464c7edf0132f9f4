"""The HALO plan: which rows move where in each phase, as a pure function of splits + topology.

Shape legend: R ranks, S[s][d] rows rank s sends to rank d (the split matrix, same on every
rank), node(r) / local(r) from the Topology.

Layout algebra (offsets are row indices):
    x_s = [ rows for d=0 | rows for d=1 | ... ]        x_off[s][d] = sum(S[s][:d])
    y_d = [ rows from s=0 | rows from s=1 | ... ]      y_off[d][s] = sum(S[:s][d])
    rows x_s[x_off[s][d] : x_off[s][d] + S[s][d]] must land at y_d[y_off[d][s] : ... ].

Phases, seen from rank s on node n:
    I   intra-node: for every d on node n, x_s -> y_d directly (d == s is a local copy).
    II  inter-node: for every remote node m, one packed message x_s -> relay(s, m) on m holding
        s's rows for all ranks of m (ascending destination rank), posted largest first (ties:
        node + 1, node + 2, ...). The relay stores the messages it receives in its `stage`
        buffer, ordered by ascending source rank, and lists them in the order it awaits them:
        smallest first.
    III redistribute: for every source it relayed (ascending) and every rank d of its node, a
        relay sends s's rows for d straight from `stage` into y_d, one message per source, so
        it can forward each source as soon as that source's phase-II message has arrived.
Phase I does not depend on II/III, so the executor overlaps them.

Relay choice: `comm.topology.relay` (rail-aligned, every NIC carries traffic).

Messages with zero rows are never planned (RCCL can hang on zero-size uneven exchanges).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import numpy as np

from comm.topology import Topology
from comm.topology.relay import relay_table

__all__ = [
    "Message",
    "RankPlan",
    "SplitPlans",
    "halo_plan",
    "rank_plan",
    "transpose",
]

Segment = tuple[int, int]  # (first row, number of rows) inside one buffer


class Message(NamedTuple):
    """Rows exchanged with `peer`: the concatenation of `segments` of the local buffer.
    (A NamedTuple: a rank plan holds O(R) of them, built per split matrix, and a frozen
    dataclass costs ~3x more to make.)"""

    peer: int
    segments: tuple[Segment, ...]
    source: int = -1  # phase III: the original sender of the rows (-1 elsewhere)

    @property
    def rows(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True)
class RankPlan:
    """What one rank does. Buffers: x (input), y (output), stage (phase II landing zone).

    intra_*: phase I, x -> y.  inter_*: phase II, x -> stage.  relay_*: phase III, stage -> y.
    self_copies: x -> y segments pairs; stage_copies: stage -> y (relay's own rows).
    """

    rank: int
    x_rows: int
    y_rows: int
    stage_rows: int
    out_splits: tuple[int, ...]
    self_copies: tuple[tuple[Segment, Segment], ...]
    intra_sends: tuple[Message, ...]
    intra_recvs: tuple[Message, ...]
    inter_sends: tuple[Message, ...]
    inter_recvs: tuple[Message, ...]
    stage_copies: tuple[tuple[Segment, Segment], ...]
    relay_sends: tuple[Message, ...]
    relay_recvs: tuple[Message, ...]


def transpose(S: Sequence[Sequence[int]]) -> list[list[int]]:
    """S^T: the split matrix of the mirrored (backward) exchange."""
    return [list(col) for col in zip(*S, strict=True)]


def _coalesce(segments: list[Segment]) -> tuple[Segment, ...]:
    """Merge touching segments so contiguous rank layouts become one slice, drop empties."""
    out: list[Segment] = []
    for start, n in segments:
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return tuple(out)


def _as_matrix(S: Sequence[Sequence[int]] | np.ndarray, topo: Topology) -> np.ndarray:
    """S as a read-only int64 array [R, R], or ValueError naming what is wrong. Vectorised:
    a per-entry Python loop here cost 67-91 ms per call at R = 1024."""
    R = topo.world_size
    if not isinstance(S, np.ndarray) and (len(S) != R or any(len(row) != R for row in S)):
        shape = (len(S), sorted({len(row) for row in S}))
        raise ValueError(f"split matrix must be {R}x{R} for this topology, got rows/cols {shape}")
    M = np.asarray(S)
    if M.shape != (R, R):
        raise ValueError(f"split matrix must be {R}x{R} for this topology, got shape {M.shape}")
    if M.dtype.kind not in "iu":
        if M.dtype.kind not in "f" or not np.array_equal(M, np.floor(M)):
            raise ValueError(f"split matrix entries must be integers, got dtype {M.dtype}")
    if M.size and M.min() < 0:
        raise ValueError(f"split matrix entries must be >= 0, got {M.tolist()}")
    M = np.array(M, dtype=np.int64)  # our own copy: read-only from here on
    M.flags.writeable = False
    return M


class SplitPlans:
    """A split matrix S [R, R] (read-only int64, identical on every rank) and the rank plans
    made from it, each at most once.

    HALO's forward runs the plan of S, its backward the plan of S^T; the mirrored exchange
    (combine, `AllToAllPlan.reverse`) runs S^T and its backward S again. `transposed()` is
    the SplitPlans of S^T (a view, no copy) and shares its cache both ways, so the four
    exchanges of an MoE layer build two rank plans instead of four, and none revalidates S.
    """

    __slots__ = ("matrix", "topology", "_plans", "_transposed")

    def __init__(self, S: Sequence[Sequence[int]] | np.ndarray, topo: Topology,
                 _checked: bool = False) -> None:
        if _checked:  # internal: an integer array (or view) of rows validated at the source
            assert isinstance(S, np.ndarray), "_checked matrices come from settle_plan"
            M = S
            M.flags.writeable = False
        else:
            M = _as_matrix(S, topo)
        self.matrix: np.ndarray = M
        self.topology = topo
        self._plans: dict[int, RankPlan] = {}
        self._transposed: SplitPlans | None = None

    def rank_plan(self, rank: int) -> RankPlan:
        """The plan of rank `rank` (computed on first use, then reused)."""
        plan = self._plans.get(rank)
        if plan is None:
            if not 0 <= rank < self.topology.world_size:
                raise ValueError(f"rank {rank} out of range 0..{self.topology.world_size - 1}")
            plan = self._plans[rank] = _rank_plan(self.matrix, self.topology, rank)
        return plan

    def transposed(self) -> SplitPlans:
        """The SplitPlans of S^T: the mirrored (backward) exchange."""
        if self._transposed is None:
            t = SplitPlans.__new__(SplitPlans)
            t.matrix, t.topology, t._plans, t._transposed = self.matrix.T, self.topology, {}, self
            self._transposed = t
        return self._transposed


def halo_plan(S: Sequence[Sequence[int]], topo: Topology) -> list[RankPlan]:
    """One RankPlan per rank; every send has the matching receive on its peer."""
    M = _as_matrix(S, topo)
    return [_rank_plan(M, topo, me) for me in range(topo.world_size)]


def rank_plan(S: Sequence[Sequence[int]] | np.ndarray, topo: Topology, me: int) -> RankPlan:
    """The plan of rank `me` alone: O(R * ranks per node) work, what each rank runs."""
    if not 0 <= me < topo.world_size:
        raise ValueError(f"rank {me} out of range 0..{topo.world_size - 1}")
    return _rank_plan(_as_matrix(S, topo), topo, me)


@dataclass(frozen=True)
class _NodeFacts:
    """What `_rank_plan` needs of the topology alone, memoised on it (built in O(R * N))."""

    sorted_ranks: tuple[tuple[int, ...], ...]  # node -> its ranks, ascending (packing order)
    consecutive: tuple[bool, ...]  # node -> its ranks are first, first + 1, ..., last
    relayed: tuple[tuple[int, ...], ...]  # rank r -> remote sources r relays into its node


def _node_facts(topo: Topology) -> _NodeFacts:
    memo = topo.__dict__.get("_halo_node_facts")
    if memo is None:
        node, table = topo.rank2node, relay_table(topo)
        relayed: list[list[int]] = [[] for _ in range(topo.world_size)]
        for s in range(topo.world_size):  # ascending s: every list comes out ascending
            for m, r in enumerate(table[s]):
                if m != node[s]:
                    relayed[r].append(s)
        ranks = tuple(tuple(sorted(topo.node_ranks(m))) for m in range(topo.num_nodes))
        memo = _NodeFacts(
            sorted_ranks=ranks,
            consecutive=tuple(r[-1] - r[0] == len(r) - 1 for r in ranks),
            relayed=tuple(map(tuple, relayed)))
        object.__setattr__(topo, "_halo_node_facts", memo)
    return memo


_tuple_new = tuple.__new__  # Message(...) without NamedTuple's keyword handling, ~3x faster


def _rank_plan(M: np.ndarray, topo: Topology, me: int) -> RankPlan:
    """Rank `me`'s plan from the checked matrix M [R, R]: reads row `me`, column `me` and the
    [sources I relay] x [my node's ranks] block, O(R * G) entries, never all of M. The plan
    holds O(R) messages; building them is most of the ~0.3 ms (R = 256) it takes."""
    node, N = topo.rank2node, topo.num_nodes
    facts = _node_facts(topo)
    mine = facts.sorted_ranks[node[me]]  # ascending rank: the packing order
    row = M[me].tolist()  # row[d] = S[me][d]
    col = M[:, me].tolist()  # col[s] = S[s][me]
    x_off = list(accumulate(row, initial=0))  # x_off[d] in my input (R + 1 entries)
    y_off = list(accumulate(col, initial=0))  # y_off[s] in my output

    self_copies = ((x_off[me], row[me]), (y_off[me], row[me]))
    intra_sends = [Message(d, ((x_off[d], row[d]),)) for d in mine if d != me and row[d]]
    intra_recvs = [Message(s, ((y_off[s], col[s]),)) for s in mine if s != me and col[s]]

    # Largest message first (ties: the next node first, a rotation): the exchange ends when
    # its biggest flow does, and a send posted early gets its socket buffer filled first.
    table = relay_table(topo)[me]
    packed = []
    for m in range(N):
        if m == node[me]:
            continue
        ranks = facts.sorted_ranks[m]
        if facts.consecutive[m]:  # one slice of x (zero rows drop out of it)
            first, n = x_off[ranks[0]], x_off[ranks[-1] + 1] - x_off[ranks[0]]
            segs: tuple[Segment, ...] = ((first, n),) if n else ()
        else:
            segs = _coalesce([(x_off[d], row[d]) for d in ranks])
        if segs:
            message = Message(table[m], segs)
            packed.append((-message.rows, (m - node[me]) % N, message))
    inter_sends = [message for _, _, message in sorted(packed)]

    # My stage buffer: packed messages of the sources I relay, ascending source rank, each
    # holding rows for my node's ranks in ascending rank order.
    relayed = facts.relayed[me]
    inter_recvs, stage_rows = [], 0
    relay_sends: list[Message] = []
    stage_copies: list[tuple[Segment, Segment]] = []
    if relayed:
        block = M[np.ix_(relayed, mine)].astype(np.int64)  # [sources I relay, mine]
        flat = block.reshape(-1)
        # stage row of each block entry (annotated: numpy's stubs type reshape(shape) 0-d)
        at: np.ndarray = (np.cumsum(flat) - flat).reshape(block.shape)
        stage_rows = int(flat.sum())
        for s, first, n in zip(relayed, at[:, 0].tolist(), block.sum(axis=1).tolist(),
                               strict=True):
            if n:
                inter_recvs.append(_tuple_new(Message, (s, ((first, n),), -1)))
        for d, at_d, rows_d in zip(mine, at.T.tolist(), block.T.tolist(), strict=True):
            if d == me:
                stage_copies = [((a, n), (y_off[s], n))
                                for s, a, n in zip(relayed, at_d, rows_d, strict=True) if n]
            else:
                relay_sends += [_tuple_new(Message, (d, ((a, n),), s))
                                for s, a, n in zip(relayed, at_d, rows_d, strict=True) if n]
    # The order to await them in: smallest first (under fair sharing the small ones arrive
    # first, and awaiting a later one would hold back forwarding those already in), ties
    # from the previous node first (it posts to this node first, see inter_sends).
    inter_recvs.sort(key=lambda m: (m.rows, (node[me] - node[m.peer]) % N, m.peer))
    relay_recvs = [_tuple_new(Message, (r, ((y_off[s], col[s]),), s))
                   for r in mine if r != me
                   for s in facts.relayed[r] if col[s]]
    return RankPlan(
        rank=me,
        x_rows=x_off[-1],
        y_rows=y_off[-1],
        stage_rows=stage_rows,
        out_splits=tuple(col),
        self_copies=(self_copies,) if row[me] else (),
        intra_sends=tuple(intra_sends),
        intra_recvs=tuple(intra_recvs),
        inter_sends=tuple(inter_sends),
        inter_recvs=tuple(inter_recvs),
        stage_copies=tuple(stage_copies),
        relay_sends=tuple(relay_sends),
        relay_recvs=tuple(relay_recvs),
    )
