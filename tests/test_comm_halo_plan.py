"""The HALO plan, executed on python lists of row ids (no processes), vs the flat definition."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.collectives.halo_plan import Message, RankPlan, halo_plan, transpose
from comm.topology import Topology
from comm.topology.relay import relay_rank


def flat_reference(S: list[list[int]]) -> list[list[tuple[int, int]]]:
    """y_d as (source, row index in x_s) pairs: the all_to_all_single definition."""
    R = len(S)
    return [
        [(s, sum(S[s][:d]) + i) for s in range(R) for i in range(S[s][d])] for d in range(R)
    ]


def _gather(buf: list, segments: tuple[tuple[int, int], ...]) -> list:
    return [row for start, n in segments for row in buf[start : start + n]]


def _scatter(buf: list, segments: tuple[tuple[int, int], ...], rows: list) -> None:
    it = iter(rows)
    for start, n in segments:
        for i in range(start, start + n):
            assert buf[i] is None, f"row slot {i} written twice"
            buf[i] = next(it)
    assert next(it, None) is None, "message longer than its receive segments"


def _deliver(plans: list[RankPlan], sends: str, recvs: str, src_bufs: list, dst_bufs: list,
             per_source: bool = False):
    """Match every send with the peer's receive: one message per pair and phase, or with
    per_source (phase III) one per pair and original source, matched on that source."""
    posted = {}
    for p in plans:
        for m in getattr(p, sends):
            key = (p.rank, m.peer, m.source if per_source else -1)
            assert key not in posted, f"two {sends} messages {key}"
            assert (m.source >= 0) == per_source, f"{sends} source {m.source}"
            posted[key] = _gather(src_bufs[p.rank], m.segments)
    for p in plans:
        for m in getattr(p, recvs):
            rows = posted.pop((m.peer, p.rank, m.source if per_source else -1))
            assert len(rows) == m.rows > 0, f"{recvs} size mismatch {m}"
            assert all(src == m.source for src, _ in rows) or not per_source
            _scatter(dst_bufs[p.rank], m.segments, rows)
    assert not posted, f"unmatched {sends}: {sorted(posted)}"


def simulate(S: list[list[int]], topo: Topology) -> list[list]:
    plans = halo_plan(S, topo)
    R = len(S)
    xs = [[(s, i) for i in range(sum(S[s]))] for s in range(R)]
    ys: list[list] = [[None] * p.y_rows for p in plans]
    stages: list[list] = [[None] * p.stage_rows for p in plans]
    for p in plans:  # local copies of phase I
        for src, dst in p.self_copies:
            _scatter(ys[p.rank], (dst,), _gather(xs[p.rank], (src,)))
    _deliver(plans, "intra_sends", "intra_recvs", xs, ys)
    _deliver(plans, "inter_sends", "inter_recvs", xs, stages)
    assert all(None not in st for st in stages), "stage buffer not filled by phase II"
    for p in plans:
        for src, dst in p.stage_copies:
            _scatter(ys[p.rank], (dst,), _gather(stages[p.rank], (src,)))
    _deliver(plans, "relay_sends", "relay_recvs", stages, ys, per_source=True)
    for p in plans:  # each phase only talks to the peers it should
        node = topo.rank2node
        assert all(node[m.peer] == node[p.rank] for m in p.intra_sends + p.relay_sends)
        assert all(node[m.peer] != node[p.rank] for m in p.inter_sends)
        assert len({node[m.peer] for m in p.inter_sends}) == len(p.inter_sends)
        assert p.out_splits == tuple(S[s][p.rank] for s in range(R))
    return ys


@st.composite
def topology_and_splits(draw: st.DrawFn) -> tuple[Topology, list[list[int]]]:
    nodes = draw(st.integers(1, 5))
    per_node = [draw(st.integers(1, 4)) for _ in range(nodes)]
    nics = [draw(st.integers(1, g)) for g in per_node]
    ranks = list(range(sum(per_node)))
    draw(st.randoms(use_true_random=False)).shuffle(ranks)  # ranks need not be contiguous
    node, local, nic = {}, {}, {}
    it = iter(ranks)
    for n, g in enumerate(per_node):
        for i in range(g):
            r = next(it)
            node[r], local[r], nic[r] = n, i, i * nics[n] // g
    order = sorted(node, key=lambda r: r)
    first_seen = list(dict.fromkeys(node[r] for r in order))  # nodes numbered by lowest rank
    topo = Topology(
        rank2node=tuple(first_seen.index(node[r]) for r in order),
        rank2local=tuple(local[r] for r in order),
        rank2domain=(0,) * len(order),
        rank2group=(0,) * len(order),
        rank2nic=tuple(nic[r] for r in order),
    )
    R = topo.world_size
    zero_p = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    S = [[0 if draw(st.floats(0, 1)) < zero_p else draw(st.integers(0, 4)) for _ in range(R)]
         for _ in range(R)]
    return topo, S


@settings(max_examples=150, deadline=None)
@given(topology_and_splits())
def test_plan_delivers_every_row_once_in_order(case: tuple[Topology, list[list[int]]]) -> None:
    topo, S = case
    assert simulate(S, topo) == flat_reference(S)
    assert simulate(transpose(S), topo) == flat_reference(transpose(S))  # the backward


@pytest.mark.parametrize("nodes,gpus,nics", [(2, 2, 2), (4, 2, 2), (3, 3, 3), (2, 8, 4)])
def test_plan_on_uniform_topologies_with_empty_ranks(nodes: int, gpus: int, nics: int) -> None:
    topo = Topology.uniform(nodes, gpus, nics_per_node=nics)
    R = topo.world_size
    rng = random.Random(nodes * 100 + gpus)
    S = [[rng.randint(0, 3) for _ in range(R)] for _ in range(R)]
    for d in range(R):
        S[1][d] = 0  # rank 1 sends nothing
        S[d][R - 1] = 0  # the last rank receives nothing
    assert simulate(S, topo) == flat_reference(S)
    assert simulate([[0] * R for _ in range(R)], topo) == [[] for _ in range(R)]


def test_relays_spread_over_every_nic_and_pack_per_node() -> None:
    """Balanced splits on 4 nodes x 8 ranks, 4 NICs: each NIC receives equal traffic, and a
    rank sends one network message per remote node instead of one per remote rank."""
    topo = Topology.uniform(4, 8, nics_per_node=4)
    R = topo.world_size
    plans = halo_plan([[2] * R for _ in range(R)], topo)
    nic_in: dict[tuple[int, int], int] = {}
    for p in plans:
        assert len(p.inter_sends) == topo.num_nodes - 1
        for m in p.inter_sends:
            key = (topo.rank2node[m.peer], topo.rank2nic[m.peer])
            nic_in[key] = nic_in.get(key, 0) + m.rows
    assert len(nic_in) == 4 * 4 and len(set(nic_in.values())) == 1
    # Rail alignment: a sender's relay sits behind the NIC with the same index.
    assert all(
        topo.rank2nic[relay_rank(topo, s, m)] == topo.rank2nic[s]
        for s in range(R)
        for m in range(4)
        if m != topo.rank2node[s]
    )


def test_plan_rejects_bad_matrix() -> None:
    topo = Topology.uniform(2, 2)
    with pytest.raises(ValueError, match="4x4"):
        halo_plan([[1, 1], [1, 1]], topo)
    with pytest.raises(ValueError, match=">= 0"):
        halo_plan([[0, 0, 0, -1]] + [[0] * 4] * 3, topo)
    assert Message(0, ((0, 2), (5, 3))).rows == 5


@pytest.mark.parametrize("pattern", ["balanced", "skewed"])
def test_phase_two_sends_largest_first_and_awaits_smallest_first(pattern: str) -> None:
    """The executor posts inter_sends and awaits inter_recvs in list order: the biggest flow
    goes out first (ties: node + 1, node + 2, ... so that no node is everyone's first
    target), and a relay awaits the smallest message first (ties: node - 1 first, whose
    rotation reaches this node first)."""
    topo = Topology.uniform(4, 2)
    R, N, node = topo.world_size, topo.num_nodes, topo.rank2node
    S = [[3] * R for _ in range(R)] if pattern == "balanced" else \
        [[12 // (1 + (d - s) % R) for d in range(R)] for s in range(R)]
    for p in halo_plan(S, topo):
        me = p.rank

        def to_node(m: int, me: int = me) -> int:
            return sum(S[me][d] for d in range(R) if node[d] == m)

        want = sorted((m for m in range(N) if m != node[me] and to_node(m)),
                      key=lambda m: (-to_node(m), (m - node[me]) % N))
        assert [node[m.peer] for m in p.inter_sends] == want
        assert [m.rows for m in p.inter_sends] == [to_node(m) for m in want]
        got = [(m.rows, (node[me] - node[m.peer]) % N, m.peer) for m in p.inter_recvs]
        assert got == sorted(got) and len(got) == len({m.peer for m in p.inter_recvs})
        if pattern == "balanced":  # a rotation: node + 1 first
            assert want == [(node[me] + k) % N for k in range(1, N)]
