"""Scale: a flat all-to-all over 1024 GPUs (128 Frontier nodes, ~10^6 flows) in < 60 s."""

from __future__ import annotations

import time

import pytest

from comm.netsim import flat_all_to_all, frontier, place, simulate, uniform_splits

GB = 1e9


@pytest.mark.slow
def test_flat_all_to_all_1024_gpus_under_60s():
    t0 = time.perf_counter()
    net = frontier(128)
    rank2gpu, _ = place(net, 128)
    b = 1e6
    res = simulate(net, flat_all_to_all(uniform_splits(1024, b)), rank2gpu)
    elapsed = time.perf_counter() - t0
    assert res.flows == 1024 * 1023
    # 128 nodes fill one group: every switch pair has its own link (32 x 32 flows of b at
    # 25 GB/s: 1.3 ms), so the 4 NICs of a node bound it: 8 * 1016 * b / 100 GB/s.
    assert res.time == pytest.approx(8 * 1016 * b / (100 * GB), rel=1e-9)
    assert elapsed < 60, f"took {elapsed:.1f} s"
