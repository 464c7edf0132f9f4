"""Event-driven simulation against closed-form times: NIC bound, tapered links, phases."""

from __future__ import annotations

import numpy as np
import pytest

from comm.netsim import (
    emulator,
    flat_all_to_all,
    frontier,
    generic,
    halo_all_to_all,
    place,
    simulate,
    uniform_splits,
)
from comm.netsim.engine import Traffic

GB = 1e9


@pytest.mark.parametrize("nodes,gpus,nics", [(2, 1, 1), (5, 1, 1), (4, 4, 2), (3, 8, 4)])
def test_all_to_all_on_nonblocking_switch_reaches_nic_bound(nodes, gpus, nics):
    """One switch, unmodelled intra-node: each NIC sends (gpus/nics) * (nodes-1) * gpus
    messages of b bytes, so T = that * b / B, for flat and for HALO."""
    B, b = 12.5 * GB, 2e6
    net = generic(nodes, gpus, nics, nic_bw=B, intra_bw=None, nodes_per_switch=nodes)
    rank2gpu, topo = place(net, nodes)
    S = uniform_splits(nodes * gpus, b)
    expect = (gpus / nics) * (nodes - 1) * gpus * b / B
    assert simulate(net, flat_all_to_all(S), rank2gpu).time == pytest.approx(expect, rel=1e-9)
    halo = simulate(net, halo_all_to_all(S, topo), rank2gpu)
    assert halo.time == pytest.approx(expect, rel=1e-9)


def test_tapered_uplink_bounds_cross_traffic():
    """4 nodes, 2 per leaf, uplinks B/2 (taper 4): the 4 cross-leaf flows of each direction
    share an uplink at B/8 each, so T = 8 b / B; the intra-leaf flow ends at 4 b / (3 B)."""
    B, b = 1 * GB, 1e6
    net = generic(4, 1, 1, nic_bw=B, intra_bw=None, nodes_per_switch=2, taper=4.0)
    tr = flat_all_to_all(uniform_splits(4, b))
    res = simulate(net, tr, np.arange(4))
    assert res.time == pytest.approx(8 * b / B, rel=1e-9)
    intra = ((tr.src // 2) == (tr.dst // 2)) & (tr.src != tr.dst)  # self flows are skipped
    np.testing.assert_allclose(res.flow_end[intra], 4 * b / (3 * B), rtol=1e-9)


@pytest.mark.parametrize("nonminimal", [0.0, 0.5])
def test_dragonfly_switch_link_taper(nonminimal):
    """8 Frontier nodes on 2 switches: 32 x 32 flows cross the one 25 GB/s link between the
    switches, (1 - f) of each on the minimal path: T = (1 - f) 1024 b / 25 GB/s (the NICs
    alone would need 8 * 56 b / 100 GB/s, less)."""
    b = 1e6
    net = frontier(8, nonminimal=nonminimal)
    rank2gpu, _ = place(net, 8)
    res = simulate(net, flat_all_to_all(uniform_splits(64, b)), rank2gpu)
    assert res.time == pytest.approx((1 - nonminimal) * 1024 * b / (25 * GB), rel=1e-9)


def test_dragonfly_global_links_bound_cross_group():
    """4 nodes spread over 2 groups (2 per group, one switch each): 16 x 16 flows per
    direction over the 4 global links of 25 GB/s: T = 256 b / 100 GB/s."""
    b = 1e6
    net = frontier(256)
    rank2gpu, topo = place(net, 4, "spread", groups=2)
    assert sorted(set(topo.rank2group)) == [0, 1]
    res = simulate(net, flat_all_to_all(uniform_splits(32, b)), rank2gpu)
    assert res.time == pytest.approx(256 * b / (100 * GB), rel=1e-9)


def _phase_net() -> tuple:
    X, Y = 4 * GB, 1 * GB  # per-GPU intra-node link, per-node NIC
    return generic(2, 2, 1, nic_bw=Y, intra_bw=X, nodes_per_switch=2), X, Y


@pytest.mark.parametrize("a,b,c", [(1e6, 1e6, 1e6), (2e7, 1e6, 1e6), (1e5, 4e6, 8e6)])
def test_phase_dependency_I_parallel_II_then_III(a, b, c):
    """I: gpu0 -> gpu1 (intra, a); II: gpu0 -> gpu2 (NIC, b); III: gpu2 -> gpu3 after II."""
    net, X, Y = _phase_net()
    tr = Traffic([0, 0, 2], [1, 2, 3], [a, b, c], [0, 1, 2], ("I", "II", "III"),
                 ((), (), (1,)))
    res = simulate(net, tr, np.arange(4))
    assert res.phase_end["I"] == pytest.approx(a / X, rel=1e-9)
    assert res.phase_end["II"] == pytest.approx(b / Y, rel=1e-9)
    assert res.phase_end["III"] == pytest.approx(b / Y + c / X, rel=1e-9)
    assert res.time == pytest.approx(max(a / X, b / Y + c / X), rel=1e-9)


def test_rank_sync_versus_phase_barrier():
    """Two phase-II flows share the NIC (b1 < b2); rank 2's phase III starts when its own
    receive is done (rank sync) or when all of phase II is (barrier)."""
    net, X, Y = _phase_net()
    b1, b2, c = 1e6, 3e6, 2e6
    tr = Traffic([0, 1, 2], [2, 3, 3], [b1, b2, c], [0, 0, 1], ("II", "III"), ((), (0,)))
    rank = simulate(net, tr, np.arange(4), sync="rank")
    barrier = simulate(net, tr, np.arange(4), sync="phase")
    assert rank.flow_end[2] == pytest.approx(2 * b1 / Y + c / X, rel=1e-9)
    assert barrier.flow_end[2] == pytest.approx((b1 + b2) / Y + c / X, rel=1e-9)


def test_overhead_latency_and_gap():
    """One rank sends k messages of b over a NIC of B; links of latency lam (2 on the path):
    T = o + k b / B + 2 lam, or release + k g + 2 lam when posting is the slower part."""
    lam, o, b, k = 3e-6, 5e-6, 1e5, 3
    net = emulator(2, 4, mbit=800.0, link_latency=lam)
    B = 100e6
    tr = Traffic([0] * k, [4, 5, 6], [b] * k, [0] * k)
    res = simulate(net, tr, np.arange(8), message_overhead=o)
    assert res.time == pytest.approx(o + k * b / B + 2 * lam, rel=1e-9)
    gap = 2e-3  # slower than the 3 ms of bytes
    res = simulate(net, tr, np.arange(8), message_overhead=o, message_gap=gap)
    assert res.time == pytest.approx(k * gap + 2 * lam, rel=1e-9)


def test_classes_aggregate_identical_flows():
    """On the emulator all g x g rank pairs of a node pair share one route: one class; the
    unmodelled (instant) intra-node flows of every node have no route: one class in all."""
    net = emulator(3, 4)
    res = simulate(net, flat_all_to_all(uniform_splits(12, 1e5)), np.arange(12))
    assert res.flows == 12 * 11
    assert res.classes == 3 * 2 + 1


def test_bad_inputs_raise():
    net = emulator(2, 2)
    tr = flat_all_to_all(uniform_splits(4, 1.0))
    with pytest.raises(ValueError, match="sync"):
        simulate(net, tr, np.arange(4), sync="never")
    with pytest.raises(ValueError, match="distinct"):
        simulate(net, tr, np.array([0, 0, 1, 2]))
    with pytest.raises(ValueError, match="rank2gpu has 3"):
        simulate(net, tr, np.arange(3))
    with pytest.raises(ValueError, match="deps"):
        Traffic([0], [1], [1.0], [0], ("a",), ((0,),))
    with pytest.raises(ValueError, match="cycle"):
        Traffic([0], [1], [1.0], [0], ("a", "b", "c"), ((2,), (0,), (1,)))


def test_emulator_groups_share_the_global_link():
    """4 nodes x 1 rank in 2 groups, NICs X, global link Z < X: the 4 cross-group flows of
    each direction share Z, T = 4 b / Z; the in-group flows end at b / (X - 2 Z / 4)."""
    X_mbit, Z_mbit, b = 100.0, 40.0, 1e6
    net = emulator(4, 1, mbit=X_mbit, groups=2, global_mbit=Z_mbit)
    tr = flat_all_to_all(uniform_splits(4, b))
    res = simulate(net, tr, np.arange(4))
    X, Z = X_mbit * 1e6 / 8, Z_mbit * 1e6 / 8
    assert res.time == pytest.approx(4 * b / Z, rel=1e-9)
    local = ((tr.src // 2) == (tr.dst // 2)) & (tr.src != tr.dst)
    np.testing.assert_allclose(res.flow_end[local], b / (X - 2 * Z / 4), rtol=1e-9)
