"""Max-min fair rates: analytic cases and the defining property on random networks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.netsim import emulator, max_min_rates, simulate
from comm.netsim.engine import Traffic


def _csr(paths: list[list[tuple[int, float]]]):
    """Segments from explicit (link, fraction) lists; segment 0 stays empty."""
    ptr, links, fracs = [0, 0], [], []
    for p in paths:
        links += [lk for lk, _ in p]
        fracs += [f for _, f in p]
        ptr.append(len(links))
    return (np.array(ptr), np.array(links, dtype=np.int64), np.array(fracs, dtype=np.float64))


def _rates(paths, mult, capacity):
    ptr, links, fracs = _csr(paths)
    segs = np.arange(1, len(paths) + 1)[:, None]
    return max_min_rates(segs, np.asarray(mult, float), ptr, links, fracs,
                         np.asarray(capacity, float))[0]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64])
def test_one_link_shared_by_n_flows(n):
    rates = _rates([[(0, 1.0)]] * n, [1] * n, [10.0])
    np.testing.assert_allclose(rates, 10.0 / n, rtol=1e-12)
    # The same n flows as one class of multiplicity n.
    np.testing.assert_allclose(_rates([[(0, 1.0)]], [n], [10.0]), 10.0 / n, rtol=1e-12)


def test_parking_lot():
    """Links 0, 1 of capacity 1; flow A crosses both, B only link 0, C and D only link 1:
    link 1 splits three ways (1/3 each), B takes what A leaves on link 0 (2/3)."""
    rates = _rates([[(0, 1.0), (1, 1.0)], [(0, 1.0)], [(1, 1.0)], [(1, 1.0)]],
                   [1, 1, 1, 1], [1.0, 1.0])
    np.testing.assert_allclose(rates, [1 / 3, 2 / 3, 1 / 3, 1 / 3], rtol=1e-12)


def test_multipath_fraction():
    """A flow split 1/4 : 3/4 over links of capacity 1 and 3 runs at 4; with a second flow
    alone on the small link, the small link saturates first at rate r: r/4 + r = 1."""
    np.testing.assert_allclose(_rates([[(0, 0.25), (1, 0.75)]], [1], [1.0, 3.0]), [4.0])
    rates = _rates([[(0, 0.25), (1, 0.75)], [(0, 1.0)]], [1, 1], [1.0, 3.0])
    np.testing.assert_allclose(rates, [0.8, 0.8], rtol=1e-12)


def test_unconstrained_class_is_infinite():
    rates, _ = max_min_rates(np.zeros((2, 3), dtype=np.int64), np.ones(2), np.array([0, 0]),
                             np.zeros(0, np.int64), np.zeros(0), np.array([1.0]))
    assert np.isinf(rates).all()


def test_bad_multiplicity_raises():
    with pytest.raises(ValueError, match="multiplicities"):
        _rates([[(0, 1.0)]], [0], [1.0])


@settings(max_examples=40)
@given(st.data())
def test_max_min_property(data):
    """Definition of max-min fairness: feasible, and every flow crosses a saturated link on
    which no flow is faster (its bottleneck)."""
    L = data.draw(st.integers(1, 6))
    F = data.draw(st.integers(1, 10))
    cap = np.array(data.draw(st.lists(st.floats(0.5, 10), min_size=L, max_size=L)))
    paths = [sorted({(lk, 1.0) for lk in data.draw(st.lists(st.integers(0, L - 1),
                                                           min_size=1, max_size=L))})
             for _ in range(F)]
    mult = np.array(data.draw(st.lists(st.integers(1, 4), min_size=F, max_size=F)), float)
    rates = _rates(paths, mult, cap)
    load = np.zeros(L)
    for p, r, m in zip(paths, rates, mult, strict=True):
        for lk, _ in p:
            load[lk] += r * m
    assert np.all(load <= cap * (1 + 1e-9))
    saturated = load >= cap * (1 - 1e-9)
    for f, p in enumerate(paths):
        on = [lk for lk, _ in p if saturated[lk]
              and all(rates[g] <= rates[f] * (1 + 1e-9) for g, q in enumerate(paths)
                      if lk in {x for x, _ in q})]
        assert on, f"flow {f} (rate {rates[f]}) has no bottleneck link"


def test_processor_sharing_completion_times():
    """n flows of sizes b_1 < ... < b_n from the ranks of one emulated node to another share
    its NIC equally; flow k ends at sum_j (b_j - b_{j-1}) (n - j + 1) / C."""
    n, mbit = 4, 100.0
    C = mbit * 1e6 / 8
    net = emulator(2, n, mbit=mbit)
    sizes = np.array([1e5, 3e5, 4e5, 9e5])
    tr = Traffic(np.arange(n), np.arange(n) + n, sizes, np.zeros(n, dtype=np.int64))
    res = simulate(net, tr, np.arange(2 * n))
    steps = np.diff(np.concatenate([[0.0], sizes])) * (n - np.arange(n)) / C
    np.testing.assert_allclose(res.flow_end, np.cumsum(steps), rtol=1e-9)
