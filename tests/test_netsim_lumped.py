"""Lumped simulation (interchangeable nodes merged) equals the full simulation (rel 1e-9);
scale: 1024 GPUs (128 Frontier nodes) flat, full (~10^6 flows, slow) and lumped."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from comm.netsim import (
    dgx_fat_tree,
    flat_all_to_all,
    frontier,
    halo_all_to_all,
    place,
    simulate,
    uniform_splits,
)
from comm.netsim.lumped import lumped_all_to_all


@pytest.mark.parametrize("algo", ["flat", "halo"])
@pytest.mark.parametrize("placement,nodes,nonminimal", [("packed", 16, 0.0),
                                                         ("spread", 10, 0.5),
                                                         ("random", 12, 0.3)])
def test_lumped_equals_full_on_frontier(algo, placement, nodes, nonminimal):
    build = functools.partial(frontier, 384, nonminimal=nonminimal)
    full = build()
    rank2gpu, topo = place(full, nodes, placement, seed=1)
    b = 3e5
    S = uniform_splits(8 * nodes, b)
    tr = flat_all_to_all(S) if algo == "flat" else halo_all_to_all(S, topo)
    want = simulate(full, tr, rank2gpu, message_gap=1e-6)
    net, lumped, lr2g = lumped_all_to_all(build, full, rank2gpu, topo, algo, b)
    got = simulate(net, lumped, lr2g, message_gap=1e-6)
    assert lumped.mult.sum() == want.flows
    assert got.time == pytest.approx(want.time, rel=1e-9)
    for phase, t in want.phase_end.items():
        assert got.phase_end[phase] == pytest.approx(t, rel=1e-9)
    if placement != "random":
        assert got.classes < want.classes


def test_lumped_on_dgx_scalable_units():
    """On the rail-optimised fat tree a whole scalable unit is one super node."""
    build = functools.partial(dgx_fat_tree, 64, taper=2.0)
    full = build()
    rank2gpu, topo = place(full, 40)
    S = uniform_splits(320, 1e5)
    for algo, tr in (("flat", flat_all_to_all(S)), ("halo", halo_all_to_all(S, topo))):
        want = simulate(full, tr, rank2gpu)
        net, lumped, lr2g = lumped_all_to_all(build, full, rank2gpu, topo, algo, 1e5)
        assert net.num_nodes == 2
        assert simulate(net, lumped, lr2g).time == pytest.approx(want.time, rel=1e-9)


def test_lumped_rejects_partial_nodes():
    build = functools.partial(frontier, 8)
    full = build()
    with pytest.raises(ValueError, match="whole nodes"):
        lumped_all_to_all(build, full, np.arange(6), None, "flat", 1.0)
    rank2gpu, topo = place(full, 2)
    with pytest.raises(ValueError, match="algo"):
        lumped_all_to_all(build, full, rank2gpu, topo, "ring", 1.0)


GB = 1e9
# 128 nodes fill one group; every switch pair has its own 25 GB/s link (32 x 32 flows of b:
# 1.3 ms at b = 1 MB), so the 4 NICs of a node bound it: 8 * 1016 * b / 100 GB/s.
NIC_BOUND_1024 = 8 * 1016 * 1e6 / (100 * GB)


def test_lumped_1024_gpus_hits_nic_bound():
    build = functools.partial(frontier, 128)
    full = build()
    rank2gpu, topo = place(full, 128)
    net, lumped, lr2g = lumped_all_to_all(build, full, rank2gpu, topo, "flat", 1e6)
    assert lumped.mult.sum() == 1024 * 1023
    assert simulate(net, lumped, lr2g).time == pytest.approx(NIC_BOUND_1024, rel=1e-9)


@pytest.mark.slow
def test_flat_all_to_all_1024_gpus_under_60s():
    t0 = time.perf_counter()
    net = frontier(128)
    rank2gpu, _ = place(net, 128)
    res = simulate(net, flat_all_to_all(uniform_splits(1024, 1e6)), rank2gpu)
    elapsed = time.perf_counter() - t0
    assert res.flows == 1024 * 1023
    assert res.time == pytest.approx(NIC_BOUND_1024, rel=1e-9)
    assert elapsed < 60, f"took {elapsed:.1f} s"
