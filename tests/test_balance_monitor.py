"""Monitor window, imbalance and trigger policy, against plain numpy bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from balance import MigrationPolicy, Monitor, apply_swaps


def _skewed(rng: np.random.Generator, layers: int, experts: int) -> np.ndarray:
    # Expert 0 of every layer gets ~10x the others: rank 0 is overloaded under contiguous
    # placement.
    counts = rng.integers(10, 20, size=(layers, experts))
    counts[:, 0] *= 10
    return counts


def test_window_sum_and_imbalance_match_numpy() -> None:
    rng = np.random.default_rng(0)
    mon = Monitor(2, 8, 4, MigrationPolicy(window=3))
    history = []
    for _ in range(7):
        c = rng.integers(0, 100, size=(2, 8))
        history.append(c)
        mon.record(torch.as_tensor(c))
    ref = np.sum(history[-3:], axis=0)
    np.testing.assert_array_equal(mon.load(), ref)
    placement = np.array([[0, 0, 1, 1, 2, 2, 3, 3], [3, 2, 1, 0, 0, 1, 2, 3]])
    for layer in range(2):
        per_rank = [ref[layer][placement[layer] == r].sum() for r in range(4)]
        assert mon.imbalance(placement)[layer] == pytest.approx(max(per_rank) / np.mean(per_rank))


def test_trigger_threshold_window_cooldown() -> None:
    rng = np.random.default_rng(1)
    pol = MigrationPolicy(threshold=1.2, window=2, cooldown=3, max_swaps=4)
    mon = Monitor(1, 8, 4, pol)
    placement = [[0, 0, 1, 1, 2, 2, 3, 3]]
    mon.record(_skewed(rng, 1, 8))
    assert mon.due(0, placement) == []  # window not full yet
    mon.record(_skewed(rng, 1, 8))
    assert mon.imbalance(placement)[0] > 1.2
    plans = mon.plan(1, placement)
    assert list(plans) == [0] and 0 < len(plans[0]) <= 4
    new = [apply_swaps(placement[0], plans[0])]
    assert mon.imbalance(new)[0] < mon.imbalance(placement)[0]
    assert mon.events[-1]["executed"] and mon.events[-1]["step"] == 1
    mon.record(_skewed(rng, 1, 8))
    assert mon.due(2, placement) == [] and mon.due(3, placement) == []  # cooling down
    assert mon.due(4, placement) == [0]


def test_balanced_layer_is_not_due_and_small_gain_is_skipped() -> None:
    mon = Monitor(1, 4, 2, MigrationPolicy(threshold=1.0, window=1, min_gain=0.5))
    mon.record([[10, 12, 11, 10]])
    # Imbalance 22/21.5 > 1.0 so the layer is planned, but no plan gains 50 %.
    assert mon.plan(0, [[0, 0, 1, 1]]) == {}
    assert mon.events[-1]["executed"] is False


def test_state_dict_round_trip() -> None:
    rng = np.random.default_rng(2)
    pol = MigrationPolicy(window=4, cooldown=2)
    a = Monitor(2, 8, 2, pol)
    for _ in range(5):
        a.record(_skewed(rng, 2, 8))
    a.plan(4, [[e // 4 for e in range(8)]] * 2)
    b = Monitor(2, 8, 2, pol)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.load(), b.load())
    c = _skewed(rng, 2, 8)
    a.record(c)
    b.record(c)
    place = [[e // 4 for e in range(8)]] * 2
    assert [a.due(s, place) for s in range(4, 9)] == [b.due(s, place) for s in range(4, 9)]


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="threshold must be >= 1.0"):
        MigrationPolicy(threshold=0.5)
    with pytest.raises(ValueError, match="unknown method 'x'"):
        MigrationPolicy(method="x")
    with pytest.raises(ValueError, match="n_experts=6 is not a multiple of n_ranks=4"):
        Monitor(1, 6, 4)
    mon = Monitor(2, 4, 2)
    with pytest.raises(ValueError, match=r"counts must have shape \[L, E\] = \[2, 4\]"):
        mon.record(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="rank 0 hosts 3 experts"):
        mon.imbalance([[0, 0, 0, 1], [0, 0, 1, 1]])
    with pytest.raises(ValueError, match="does not match|window"):
        mon.load_state_dict({"ring": np.zeros((3, 2, 4)), "steps_recorded": 0, "last_event": [0, 0]})
