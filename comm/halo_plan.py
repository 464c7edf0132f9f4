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

Relay choice (why all NICs carry traffic): every rank sends its own packed messages, so each
NIC of the sending node carries the traffic of the ranks behind it; on the receiving node the
relay is the rank behind the NIC with the same index as the sender's (modulo the NIC count
of node m, rail-aligned as in a rail-optimised fat tree), spread over that NIC's ranks by the
sender's position among its own NIC's ranks. With balanced splits every NIC sends and
receives the same number of bytes.

Messages with zero rows are never planned (RCCL can hang on zero-size uneven exchanges).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from comm.topology import Topology

__all__ = [
    "Message",
    "RankPlan",
    "halo_plan",
    "rank_plan",
    "relay_rank",
    "relay_table",
    "transpose",
]

Segment = tuple[int, int]  # (first row, number of rows) inside one buffer


@dataclass(frozen=True)
class Message:
    """Rows exchanged with `peer`: the concatenation of `segments` of the local buffer."""

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


def _validate(S: Sequence[Sequence[int]], topo: Topology) -> list[list[int]]:
    R = topo.world_size
    if len(S) != R or any(len(row) != R for row in S):
        shape = (len(S), sorted({len(row) for row in S}))
        raise ValueError(f"split matrix must be {R}x{R} for this topology, got rows/cols {shape}")
    M = [list(map(int, row)) for row in S]
    if min(map(min, M)) < 0:  # (every rank runs this per exchange: no per-entry generator)
        raise ValueError(f"split matrix entries must be >= 0, got {M}")
    return M


def halo_plan(S: Sequence[Sequence[int]], topo: Topology) -> list[RankPlan]:
    """One RankPlan per rank; every send has the matching receive on its peer."""
    S = _validate(S, topo)
    return [_rank_plan(S, topo, me) for me in range(topo.world_size)]


def rank_plan(S: Sequence[Sequence[int]], topo: Topology, me: int) -> RankPlan:
    """The plan of rank `me` alone: O(R * ranks per node) work, what each rank runs."""
    if not 0 <= me < topo.world_size:
        raise ValueError(f"rank {me} out of range 0..{topo.world_size - 1}")
    return _rank_plan(_validate(S, topo), topo, me)


def _prefix(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out


def _rank_plan(S: list[list[int]], topo: Topology, me: int) -> RankPlan:
    R, node = topo.world_size, topo.rank2node
    mine = sorted(topo.node_ranks(node[me]))  # ascending rank: the packing order
    x_off = _prefix(S[me])  # x_off[d] in my input
    y_off = _prefix([S[s][me] for s in range(R)])  # y_off[s] in my output
    remote = [s for s in range(R) if node[s] != node[me]]
    table = relay_table(topo)
    relay_of = {s: table[s][node[me]] for s in remote}  # who relays s into my node

    self_copies = ((x_off[me], S[me][me]), (y_off[me], S[me][me]))
    intra_sends = [Message(d, ((x_off[d], S[me][d]),)) for d in mine if d != me and S[me][d]]
    intra_recvs = [Message(s, ((y_off[s], S[s][me]),)) for s in mine if s != me and S[s][me]]

    # Largest message first (ties: the next node first, a rotation): the exchange ends when
    # its biggest flow does, and a send posted early gets its socket buffer filled first.
    N = topo.num_nodes
    packed = []
    for m in range(N):
        if m == node[me]:
            continue
        segs = _coalesce([(x_off[d], S[me][d]) for d in sorted(topo.node_ranks(m))])
        if segs:
            message = Message(table[me][m], segs)
            packed.append((-message.rows, (m - node[me]) % N, message))
    inter_sends = [message for _, _, message in sorted(packed)]

    # My stage buffer: packed messages of the sources I relay, ascending source rank, each
    # holding rows for my node's ranks in ascending rank order.
    inter_recvs, stage_off, stage_rows = [], {}, 0
    for s in remote:
        if relay_of[s] != me:
            continue
        rows = sum(S[s][d] for d in mine)
        if rows == 0:
            continue
        inter_recvs.append(Message(s, ((stage_rows, rows),)))
        for d in mine:
            stage_off[(s, d)] = stage_rows
            stage_rows += S[s][d]
    # The order to await them in: smallest first (under fair sharing the small ones arrive
    # first, and awaiting a later one would hold back forwarding those already in), ties
    # from the previous node first (it posts to this node first, see inter_sends).
    inter_recvs.sort(key=lambda m: (m.rows, (node[me] - node[m.peer]) % N, m.peer))
    relayed = [s for s in remote if relay_of[s] == me]
    relay_sends, stage_copies = [], []
    for d in mine:
        if d == me:
            stage_copies = [((stage_off[(s, d)], S[s][d]), (y_off[s], S[s][d]))
                            for s in relayed if S[s][d]]
            continue
        relay_sends += [Message(d, ((stage_off[(s, d)], S[s][d]),), s)
                        for s in relayed if S[s][d]]
    relay_recvs = [Message(r, ((y_off[s], S[s][me]),), s)
                   for r in mine if r != me
                   for s in remote if relay_of[s] == r and S[s][me]]
    return RankPlan(
        rank=me,
        x_rows=sum(S[me]),
        y_rows=sum(S[s][me] for s in range(R)),
        stage_rows=stage_rows,
        out_splits=tuple(S[s][me] for s in range(R)),
        self_copies=(self_copies,) if S[me][me] else (),
        intra_sends=tuple(intra_sends),
        intra_recvs=tuple(intra_recvs),
        inter_sends=tuple(inter_sends),
        inter_recvs=tuple(inter_recvs),
        stage_copies=tuple(stage_copies),
        relay_sends=tuple(relay_sends),
        relay_recvs=tuple(relay_recvs),
    )
