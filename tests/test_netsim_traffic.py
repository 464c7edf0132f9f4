"""Traffic generators against comm's HALO plan and the all_to_all definition; placements."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.netsim import (
    emulator,
    flat_all_to_all,
    frontier,
    halo_all_to_all,
    halo_traffic_from_plan,
    place,
    simulate,
    uniform_splits,
)
from comm.topology import Topology


def _multiset(tr) -> list[tuple[int, int, float, int]]:
    """Bytes per (src, dst, phase). HALO's plan sends phase III as one message per relayed
    source (the relay forwards each as it arrives); the simulator moves them as one flow per
    (relay, destination): same bytes over the same endpoints and links."""
    total: dict[tuple[int, int, int], float] = {}
    for s, d, b, p in zip(tr.src.tolist(), tr.dst.tolist(), tr.nbytes.tolist(),
                          tr.phase.tolist(), strict=True):
        total[(s, d, p)] = total.get((s, d, p), 0.0) + b
    return sorted((s, d, b, p) for (s, d, p), b in total.items())


@settings(max_examples=30)
@given(
    nodes=st.integers(1, 4),
    gpn_nics=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (8, 4)]),
    seed=st.integers(0, 2**16),
    zeros=st.floats(0.0, 0.7),
)
def test_halo_traffic_matches_halo_plan(nodes, gpn_nics, seed, zeros):
    """The vectorised generator moves exactly the messages of comm.collectives.halo_plan."""
    gpn, nics = gpn_nics
    topo = Topology.uniform(nodes, gpn, nics_per_node=nics)
    R = topo.world_size
    rng = np.random.default_rng(seed)
    S = rng.integers(1, 6, (R, R)) * (rng.random((R, R)) >= zeros)
    row_bytes = 3
    assert _multiset(halo_all_to_all(S * row_bytes, topo)) == \
        _multiset(halo_traffic_from_plan(S, topo, row_bytes))


def test_halo_traffic_on_a_placed_topology():
    """Same check on the Topology `place` builds for a spread Frontier job."""
    net = frontier(256)
    _, topo = place(net, 3, "spread", groups=2)
    S = np.arange(24 * 24).reshape(24, 24) % 5
    assert _multiset(halo_all_to_all(S, topo)) == _multiset(halo_traffic_from_plan(S, topo))


def test_gloo_order_flat_serialises_the_half_way_pairs():
    """R=4: the pairs at offset 2 (0<->2, 1<->3) go one direction after the other."""
    S = np.full((4, 4), 8.0)
    tr = flat_all_to_all(S, send_first_half=True)
    phase = {(s, d): p for s, d, p in zip(tr.src.tolist(), tr.dst.tolist(),
                                          tr.phase.tolist(), strict=True)}
    assert {k for k, p in phase.items() if p == 1} == {(0, 2), (1, 3)}
    assert {k for k, p in phase.items() if p == 2} == {(2, 0), (3, 1)}
    assert sum(p == 0 for p in phase.values()) == 16 - 4
    assert tr.deps == ((), (), (1,))
    # 2 ranks on 2 nodes, 1 MB each way over 1 MB/s NICs: 1 s at once, 2 s in gloo's order.
    net = emulator(2, 1, mbit=8.0)
    S2 = np.array([[0.0, 1e6], [1e6, 0.0]])
    assert simulate(net, flat_all_to_all(S2), np.arange(2)).time == pytest.approx(1.0)
    assert simulate(net, flat_all_to_all(S2, send_first_half=True),
                    np.arange(2)).time == pytest.approx(2.0)
    # Odd R has no such pair: the same single phase as the concurrent model.
    assert flat_all_to_all(np.ones((3, 3)), send_first_half=True).phases == ("all",)


def test_flat_traffic_is_the_split_matrix():
    S = np.array([[0, 2, 0], [1, 5, 3], [4, 0, 0]], dtype=float)
    tr = flat_all_to_all(S)
    got = np.zeros_like(S)
    got[tr.src, tr.dst] = tr.nbytes
    np.testing.assert_array_equal(got, S)


def test_halo_bytes_reach_every_destination():
    """Bytes arriving at d through phases I and III plus its own relayed share equal the
    column sum of S without the diagonal (conservation)."""
    topo = Topology.uniform(3, 4, nics_per_node=2)
    rng = np.random.default_rng(1)
    S = rng.integers(0, 9, (12, 12)).astype(float)
    tr = halo_all_to_all(S, topo)
    node = np.array(topo.rank2node)
    # Phase II bytes leaving a node equal the bytes it owes other nodes.
    for n in range(3):
        owed = S[node == n][:, node != n].sum()
        assert tr.nbytes[(tr.phase == 1) & (node[tr.src] == n)].sum() == owed
    assert (node[tr.src] == node[tr.dst])[tr.phase != 1].all()  # I and III stay on the node


def test_placements():
    net = frontier(512)
    r2g, topo = place(net, 8, "packed")
    np.testing.assert_array_equal(r2g, np.arange(64))
    assert len(set(topo.rank2domain)) == 2
    _, topo = place(net, 8, "spread")
    assert sorted(set(topo.rank2group)) == [0, 1, 2, 3]
    r2g, topo = place(net, 16, "random", seed=3)
    assert len(set(r2g.tolist())) == 128 and topo.num_nodes == 16
    assert np.array_equal(r2g, place(net, 16, "random", seed=3)[0])
    # NIC affinity carried into the Topology: locals 2k, 2k+1 share NIC k.
    assert topo.rank2nic[:8] == (0, 0, 1, 1, 2, 2, 3, 3)
    with pytest.raises(ValueError, match="placement"):
        place(net, 8, "scattered")
    with pytest.raises(ValueError, match="1..512"):
        place(net, 513)
    with pytest.raises(ValueError, match="groups=5"):
        place(net, 8, "spread", groups=5)


def test_bad_split_matrix():
    with pytest.raises(ValueError, match="square"):
        flat_all_to_all(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=">= 0"):
        flat_all_to_all(-np.ones((2, 2)))
    with pytest.raises(ValueError, match="R=8"):
        halo_all_to_all(uniform_splits(4, 1.0), Topology.uniform(2, 4))
