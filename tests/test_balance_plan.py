"""Swap planners: validity properties (hypothesis), hand-computed cases, edge cases, errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balance import (
    METHODS,
    Swap,
    apply_swaps,
    as_placement,
    count_moves,
    greedy_repack,
    lower_bound,
    plan_swaps,
    rank_loads,
    slot_lower_bound,
    swaps_between,
)


@st.composite
def layers(draw: st.DrawFn, max_ranks: int = 8, max_slots: int = 6) -> tuple:
    """(load [E], placement [E], n_ranks): a random layer with equal slot counts."""
    n_ranks = draw(st.integers(1, max_ranks))
    slots = draw(st.integers(1, max_slots))
    e = n_ranks * slots
    ints = draw(st.booleans())
    elem = st.integers(0, 1000) if ints else st.floats(0, 1e6, allow_nan=False)
    load = draw(st.lists(elem, min_size=e, max_size=e))
    placement = draw(st.permutations([r for r in range(n_ranks) for _ in range(slots)]))
    return load, list(placement), n_ranks


@settings(max_examples=200, deadline=None)
@given(layer=layers(), method=st.sampled_from(METHODS), max_swaps=st.none() | st.integers(0, 12))
def test_plan_properties(layer: tuple, method: str, max_swaps: int | None) -> None:
    load, placement, n_ranks = layer
    swaps = plan_swaps(load, placement, n_ranks, max_swaps, method)
    assert all(isinstance(s, Swap) for s in swaps)
    if max_swaps is not None:
        assert len(swaps) <= max_swaps
    after = apply_swaps(placement, swaps)
    # Valid: every expert on exactly one rank in range, every rank keeps E/R slots.
    as_placement(after, n_ranks, len(load))
    assert sorted(after) == sorted(placement)
    before_max = rank_loads(load, placement, n_ranks).max()
    after_max = rank_loads(load, after, n_ranks).max()
    assert after_max <= before_max
    assert after_max >= slot_lower_bound(load, n_ranks) * (1 - 1e-12)
    # Deterministic, and pure (the inputs are not modified).
    assert plan_swaps(load, list(placement), n_ranks, max_swaps, method) == swaps
    assert apply_swaps(placement, swaps) == after


@settings(max_examples=100, deadline=None)
@given(layer=layers(), max_swaps=st.none() | st.integers(0, 12))
def test_minmax_never_worse_than_hill_climb(layer: tuple, max_swaps: int | None) -> None:
    # minmax keeps the (pruned) hill-climbing plan as a candidate: with tolerance 0 its max
    # is at most hill-climbing's, with tolerance t at most (1 + t) times it.
    load, placement, n_ranks = layer

    def max_after(method: str, **kw: float) -> float:
        swaps = plan_swaps(load, placement, n_ranks, max_swaps, method, **kw)
        return rank_loads(load, apply_swaps(placement, swaps), n_ranks).max()

    hc = max_after("hill-climb")
    assert max_after("minmax", tolerance=0.0) <= hc
    assert max_after("minmax", tolerance=0.05) <= hc * 1.05 * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(layer=layers(max_ranks=3, max_slots=3))
def test_slot_lower_bound_below_exhaustive_optimum(layer: tuple) -> None:
    load, _, n_ranks = layer
    e = len(load)
    w = np.asarray(load, dtype=np.float64)
    slots = e // n_ranks
    base = [r for r in range(n_ranks) for _ in range(slots)]
    best = min(
        np.bincount(list(p), weights=w, minlength=n_ranks).max()
        for p in set(itertools.permutations(base))
    )
    assert lower_bound(load, n_ranks) <= slot_lower_bound(load, n_ranks) <= best * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(a=layers(), seed=st.integers(0, 2**31 - 1))
def test_swaps_between_reaches_target(a: tuple, seed: int) -> None:
    _, before, n_ranks = a
    after = list(np.random.default_rng(seed).permutation(before))
    swaps = swaps_between(before, after, n_ranks)
    assert apply_swaps(before, swaps) == after
    assert len(swaps) <= count_moves(before, after)


def test_hill_climb_hand_computed() -> None:
    # Ranks {8, 6} = 14 and {1, 2} = 3, gap 11. Candidate gaps |11 - 2d|: 8<->1 -> 3,
    # 8<->2 -> 1, 6<->1 -> 1, 6<->2 -> 3; the first best (8<->2) wins: ranks {2, 6} = 8 and
    # {1, 8} = 9, gap 1, and no swap with 0 < d < 1 exists, so it stops.
    assert plan_swaps([8, 6, 1, 2], [0, 0, 1, 1], 2, 10, "hill-climb") == [Swap(0, 3)]


def test_minmax_uses_middle_rank_when_hill_climb_is_stuck() -> None:
    # Ranks {12, 12} = 24, {10, 11} = 21, {0, 18} = 18. Max-vs-min swaps move 12 or -6: no
    # gap shrinks, hill-climbing stops. Swapping a 12 with the 10 of the middle rank gives
    # 22 / 23 / 18, a lower max.
    load, placement = [12, 12, 10, 11, 0, 18], [0, 0, 1, 1, 2, 2]
    assert plan_swaps(load, placement, 3, 10, "hill-climb") == []
    swaps = plan_swaps(load, placement, 3, 10, "minmax", tolerance=0.0)
    assert swaps
    assert rank_loads(load, apply_swaps(placement, swaps), 3).max() < 24


@pytest.mark.parametrize("method", METHODS)
def test_already_balanced_is_left_alone(method: str) -> None:
    assert plan_swaps([5] * 16, [e // 4 for e in range(16)], 4, None, method) == []


@pytest.mark.parametrize("method", METHODS)
def test_one_expert_hotter_than_mean(method: str) -> None:
    # Expert 0 alone is 100 > mean rank load 39; the best placement pairs it with a 1: 101.
    load = [100, 50, 1, 1, 1, 1, 1, 1]
    placement = [0, 0, 1, 1, 2, 2, 3, 3]
    after = apply_swaps(placement, plan_swaps(load, placement, 4, None, method))
    assert rank_loads(load, after, 4).max() == 101 == slot_lower_bound(load, 4)


@pytest.mark.parametrize("method", METHODS)
def test_one_expert_per_rank_cannot_improve(method: str) -> None:
    # E == R: a rank's load is its single expert's load; no swap lowers the max.
    assert plan_swaps([9, 1, 4, 7], [0, 1, 2, 3], 4, None, method) == []


def test_zipf_target_s1_e256_r32() -> None:
    # The benchmark's headline case (benchmarks/bench_balance.py): Zipf s=1.0, 256 experts,
    # 32 ranks, contiguous start placement, ranking shuffled across experts.
    rng = np.random.default_rng(0)
    e, r = 256, 32
    p = rng.permutation(np.arange(1, e + 1) ** -1.0)
    load = rng.multinomial(4096 * 8 * 16, p / p.sum())
    placement = [x // (e // r) for x in range(e)]
    ours = apply_swaps(placement, plan_swaps(load, placement, r))
    full = greedy_repack(load, placement, r)
    assert rank_loads(load, ours, r).max() <= 1.05 * lower_bound(load, r)
    assert count_moves(placement, ours) <= count_moves(placement, full) / 2


def test_greedy_repack_is_valid_and_not_worse_than_lpt_bound() -> None:
    rng = np.random.default_rng(1)
    load = rng.integers(0, 1000, 48)
    placement = [x // 6 for x in range(48)]
    q = greedy_repack(load, placement, 8)
    as_placement(q, 8, 48)
    # LPT's classical guarantee for identical machines: makespan <= 4/3 of the optimum.
    assert rank_loads(load, q, 8).max() <= 4 / 3 * slot_lower_bound(load, 8) + load.max()


@pytest.mark.parametrize(
    ("load", "placement", "n_ranks", "match"),
    [
        ([1, 2, 3], [0, 0, 1, 1], 2, "4 entries but load has 3"),
        ([1, -2, 3, 4], [0, 0, 1, 1], 2, "negative"),
        ([1, 2, 3, 4], [0, 0, 0, 1], 2, "rank 0 hosts 3 experts"),
        ([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 2, 2], 4, "cannot be split evenly"),
        ([1, 2, 3, 4], [0, 0, 1, 2], 2, r"placement\[3\] = 2 is not a rank"),
        ([1, 2, 3, 4], [0, 0, 1, 1], 0, "n_ranks must be a positive int"),
    ],
)
def test_bad_inputs_raise(load: list, placement: list, n_ranks: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_swaps(load, placement, n_ranks)


def test_bad_method_swaps_and_budget_raise() -> None:
    with pytest.raises(ValueError, match="unknown method 'best'; valid: minmax"):
        plan_swaps([1, 2], [0, 1], 2, method="best")
    with pytest.raises(ValueError, match="max_swaps must be an int >= 0"):
        plan_swaps([1, 2], [0, 1], 2, max_swaps=-1)
    with pytest.raises(ValueError, match="both on rank 0"):
        apply_swaps([0, 0, 1, 1], [Swap(0, 1)])
    with pytest.raises(ValueError, match="outside"):
        apply_swaps([0, 0, 1, 1], [Swap(0, 9)])
    with pytest.raises(ValueError, match="two different experts"):
        Swap(3, 3)


def test_apply_swaps_keeps_input_kind() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    out = apply_swaps(t, [Swap(1, 2)])
    assert out.dtype == torch.int32 and out.tolist() == [0, 1, 0, 1] and t.tolist() == [0, 0, 1, 1]
    arr = np.array([0, 0, 1, 1])
    assert apply_swaps(arr, [Swap(0, 3)]).tolist() == [1, 0, 1, 0]
