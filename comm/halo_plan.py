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
        s's rows for all ranks of m (ascending destination rank). The relay stores the messages
        it receives in its `stage` buffer, ordered by ascending source rank.
    III redistribute: a relay sends each rank d of its node one message with the rows of every
        source it relayed for d (ascending source), straight from `stage` into y_d.
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

__all__ = ["Message", "RankPlan", "halo_plan", "relay_rank", "transpose"]

Segment = tuple[int, int]  # (first row, number of rows) inside one buffer


@dataclass(frozen=True)
class Message:
    """Rows exchanged with `peer`: the concatenation of `segments` of the local buffer."""

    peer: int
    segments: tuple[Segment, ...]

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
    src_node, nic = topo.rank2node[src], topo.rank2nic[src]
    same_nic = [r for r in topo.node_ranks(src_node) if topo.rank2nic[r] == nic]
    position = same_nic.index(src)
    nics = sorted({topo.rank2nic[r] for r in topo.node_ranks(node)})
    target_nic = nics[sorted({topo.rank2nic[r] for r in topo.node_ranks(src_node)}).index(nic)
                      % len(nics)]
    candidates = [r for r in topo.node_ranks(node) if topo.rank2nic[r] == target_nic]
    return candidates[position % len(candidates)]


def _validate(S: Sequence[Sequence[int]], topo: Topology) -> list[list[int]]:
    R = topo.world_size
    if len(S) != R or any(len(row) != R for row in S):
        shape = (len(S), sorted({len(row) for row in S}))
        raise ValueError(f"split matrix must be {R}x{R} for this topology, got rows/cols {shape}")
    M = [[int(v) for v in row] for row in S]
    if any(v < 0 for row in M for v in row):
        raise ValueError(f"split matrix entries must be >= 0, got {M}")
    return M


def halo_plan(S: Sequence[Sequence[int]], topo: Topology) -> list[RankPlan]:
    """One RankPlan per rank; every send has the matching receive on its peer."""
    S = _validate(S, topo)
    R = topo.world_size
    x_off = [[sum(S[s][:d]) for d in range(R)] for s in range(R)]
    y_off = [[sum(S[k][d] for k in range(s)) for s in range(R)] for d in range(R)]
    node = topo.rank2node
    nodes = range(topo.num_nodes)
    relay = {(s, m): relay_rank(topo, s, m) for s in range(R) for m in nodes if m != node[s]}
    # stage_off[(s, d)] = where relay(s, node[d]) keeps s's rows for d.
    stage_off: dict[tuple[int, int], int] = {}
    stage_rows = [0] * R
    inter_recvs: list[list[Message]] = [[] for _ in range(R)]
    inter_sends: list[list[Message]] = [[] for _ in range(R)]
    for s in range(R):
        for m in nodes:
            if m == node[s]:
                continue
            r = relay[(s, m)]
            dests = topo_ranks_sorted(topo, m)
            rows = sum(S[s][d] for d in dests)
            if rows == 0:
                continue
            inter_sends[s].append(Message(r, _coalesce([(x_off[s][d], S[s][d]) for d in dests])))
            inter_recvs[r].append(Message(s, ((stage_rows[r], rows),)))
            for d in dests:
                stage_off[(s, d)] = stage_rows[r]
                stage_rows[r] += S[s][d]
    plans = []
    for me in range(R):
        mine = topo_ranks_sorted(topo, node[me])
        intra_sends = [Message(d, ((x_off[me][d], S[me][d]),)) for d in mine
                       if d != me and S[me][d]]
        intra_recvs = [Message(s, ((y_off[me][s], S[s][me]),)) for s in mine
                       if s != me and S[s][me]]
        self_copies = [((x_off[me][me], S[me][me]), (y_off[me][me], S[me][me]))] \
            if S[me][me] else []
        relayed = [s for s in range(R) if node[s] != node[me] and relay[(s, node[me])] == me]
        relay_sends, stage_copies = [], []
        for d in mine:
            pieces = [(stage_off[(s, d)], S[s][d]) for s in relayed if S[s][d]]
            if d == me:
                stage_copies = [((stage_off[(s, d)], S[s][d]), (y_off[d][s], S[s][d]))
                                for s in relayed if S[s][d]]
            elif pieces:
                relay_sends.append(Message(d, _coalesce(pieces)))
        relay_recvs = []
        for r in mine:
            if r == me:
                continue
            srcs = [s for s in range(R) if node[s] != node[me] and relay[(s, node[me])] == r]
            segs = _coalesce([(y_off[me][s], S[s][me]) for s in srcs])
            if segs:
                relay_recvs.append(Message(r, segs))
        plans.append(
            RankPlan(
                rank=me,
                x_rows=sum(S[me]),
                y_rows=sum(S[s][me] for s in range(R)),
                stage_rows=stage_rows[me],
                out_splits=tuple(S[s][me] for s in range(R)),
                self_copies=tuple(self_copies),
                intra_sends=tuple(intra_sends),
                intra_recvs=tuple(intra_recvs),
                inter_sends=tuple(inter_sends[me]),
                inter_recvs=tuple(inter_recvs[me]),
                stage_copies=tuple(stage_copies),
                relay_sends=tuple(relay_sends),
                relay_recvs=tuple(relay_recvs),
            )
        )
    return plans


def topo_ranks_sorted(topo: Topology, node: int) -> list[int]:
    """Ranks of `node` in ascending rank order (the order packed messages use)."""
    return sorted(topo.node_ranks(node))
