"""balance.move_slots / plan_slot_moves: changing a slot map with replicas moves the right rows.

Reference: one process holds the global tensors ``[R * S, ...]`` rebuilt row by row from a map,
each row taken from its expert's original data (``ref[g] = data[slot2expert[g]]``). Every rank
starts from its slice of the reference for the old map; after ``move_slots`` its slice must
equal the reference for the new map, bit for bit, for every tensor (bf16 weights as an
``nn.Parameter``, fp32 AdamW-like moments, float64, bool and int64 tensors, a 1-D one). Maps
come from ``plan_replicas`` on Zipf loads whose hot experts change from one plan to the next,
and from rotating a map by one rank (every slot changes and no source is local).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given
from hypothesis import strategies as st

from balance import move_slots, plan_slot_moves
from balance.replicas import plan_replicas
from comm import run_local


def expert_data(E: int, seed: int) -> list[torch.Tensor]:
    """Per-expert original rows of each tensor kind, [E, ...]."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(E, 3, 4, generator=g).to(torch.bfloat16),  # w1 (bf16 weight)
        torch.randn(E, 4, 3, generator=g).to(torch.bfloat16),  # w2
        torch.rand(E, 3, generator=g) < 0.5,  # bool, 3 bytes a row: later segments need padding
        torch.randn(E, 3, 4, generator=g),  # exp_avg (fp32)
        torch.rand(E, 3, 4, generator=g),  # exp_avg_sq (fp32, >= 0)
        torch.randn(E, 5, generator=g, dtype=torch.float64),
        torch.randint(0, 1 << 40, (E,), generator=g),  # 1-D int64
    ]


def reference(data: list[torch.Tensor], slot2expert) -> list[torch.Tensor]:
    """Global [R * S, ...] tensors for a map, one row per slot from its expert's data."""
    out = []
    for x in data:
        full = torch.empty((len(slot2expert), *x.shape[1:]), dtype=x.dtype)
        for g, e in enumerate(slot2expert):
            full[g] = x[int(e)]
        out.append(full)
    return out


def zipf_maps(E: int, R: int, r: int, seed: int, n_plans: int) -> list[np.ndarray]:
    """A first plan, re-plans as the hot experts change (Zipf s=1.0 over a fresh random
    expert order each time), and the last map rotated by one rank."""
    rng = np.random.default_rng(seed)
    S = E // R + r
    base = 1.0 / np.arange(1, E + 1)
    maps = [plan_replicas(base[rng.permutation(E)], R, S)]
    for _ in range(n_plans):
        maps.append(plan_replicas(base[rng.permutation(E)], R, S, current=maps[-1]))
    maps.append(np.roll(maps[-1], S))
    return maps


def changed_without_local_source(old, new, R: int, S: int, rank: int) -> int:
    """Rows rank `rank` must receive: its changed slots whose expert it did not hold."""
    mine = range(rank * S, (rank + 1) * S)
    held = {int(old[g]) for g in mine}
    return sum(1 for g in mine if old[g] != new[g] and int(new[g]) not in held)


def check_moves(rank: int, world: int, group, members: list[int], E: int, r: int,
                seed: int, maps=None) -> list[tuple[int, int]]:
    """Run the map sequence on `group` (global ranks `members`); returns per step this rank's
    (remote_rows, bytes_sent)."""
    if rank not in members:
        return []
    R, me = len(members), members.index(rank)
    maps = zipf_maps(E, R, r, seed, 3) if maps is None else maps
    S = len(maps[0]) // R
    data = expert_data(E, seed)
    rows = slice(me * S, (me + 1) * S)
    local = [f[rows].clone() for f in reference(data, maps[0])]
    local[0] = torch.nn.Parameter(local[0])  # a real parameter, written under no_grad
    row_bytes = sum(x[0].numel() * x.element_size() for x in data)
    stats = []
    for old, new in zip(maps[:-1], maps[1:], strict=True):
        tensors = [local[0], None, *local[1:]]  # None: a grad not allocated yet
        res = move_slots(old, new, tensors, group, R)
        for t, f in zip(local, reference(data, new), strict=True):
            assert torch.equal(t.detach(), f[rows])
        assert res["moved_slots"] == int((np.asarray(old) != np.asarray(new)).sum())
        assert res["remote_rows"] == changed_without_local_source(old, new, R, S, me)
        assert res["bytes_sent"] % row_bytes == 0
        stats.append((res["remote_rows"], res["bytes_sent"] // row_bytes))
    return stats


def check_sends_match_receives(stats: list[list[tuple[int, int]]]) -> None:
    stats = [s for s in stats if s]
    for step in zip(*stats, strict=True):
        assert sum(rcv for rcv, _ in step) == sum(snd for _, snd in step)
    assert sum(rcv for s in stats for rcv, _ in s) > 0  # the exchange really ran


# -- pure planning ---------------------------------------------------------------------------


@st.composite
def map_pairs(draw):
    R = draw(st.integers(1, 4))
    S0 = draw(st.integers(1, 3))
    r = draw(st.integers(0, 2))
    E, S = R * S0, S0 + r
    maps = []
    for _ in range(2):
        fill = [draw(st.integers(0, E - 1)) for _ in range(R * S - E)]
        order = draw(st.permutations(list(range(E)) + fill))
        grid: list[list[int]] = [[] for _ in range(R)]
        for e in order:  # spread replicas over ranks not hosting them yet
            free = [q for q in range(R) if len(grid[q]) < S and (e not in grid[q] or S > E)]
            assume(free)
            grid[draw(st.sampled_from(free))].append(e)
        maps.append([e for row in grid for e in row])
    return maps[0], maps[1], R, S


@given(map_pairs())
def test_plan_properties(case) -> None:
    old, new, R, S = case
    moves = plan_slot_moves(old, new, R)
    assert [d for d, _ in moves] == [g for g in range(len(old)) if old[g] != new[g]]
    for d, s in moves:
        assert old[s] == new[d]  # the source held the expert before the move
        if new[d] in old[(d // S) * S:(d // S + 1) * S]:
            assert s // S == d // S  # a copy on the same rank is preferred
    assert plan_slot_moves(np.array(old), torch.tensor(new), R) == moves  # deterministic
    # Applying the plan to the old map, sources read first, gives the new map.
    after = list(old)
    for d, s in moves:
        after[d] = old[s]
    assert after == list(new)


# A hand case of the source rule (R=4, S=2, E=6): expert 0 lives on ranks 1 and 2 and ranks 0
# and 3 both need it; slot 0 is also the source of expert 1 and slot 6 of expert 5.
HAND_OLD = [1, 2, 0, 3, 0, 4, 5, 2]
HAND_NEW = [0, 2, 1, 3, 0, 4, 0, 5]


def test_plan_hand_case() -> None:
    # slot 0 <- 0: holders slots 2 (rank 1) and 4 (rank 2), none sent yet: lowest slot, 2.
    # slot 2 <- 1: only slot 0. slot 6 <- 0: rank 1 has sent one row, rank 2 none: slot 4.
    # slot 7 <- 5: slot 6 is on the same rank: a local copy (read before slot 6 is written).
    assert plan_slot_moves(HAND_OLD, HAND_NEW, 4) == [(0, 2), (2, 0), (6, 4), (7, 6)]
    assert plan_slot_moves(HAND_OLD, HAND_OLD, 4) == []


def test_bad_inputs_named_before_any_work() -> None:
    old = [0, 1, 2, 0, 3, 1]  # R=2, S=3, E=4
    with pytest.raises(ValueError, match="old_map has 6 slots and new_map 4"):
        plan_slot_moves(old, [0, 1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"new_map misses expert\(s\) \[1\]"):
        plan_slot_moves(old, [0, 3, 2, 0, 3, 2], 2)
    with pytest.raises(ValueError, match="new_map names expert 2 twice on rank 1"):
        plan_slot_moves(old, [0, 1, 3, 2, 3, 2], 2)
    with pytest.raises(ValueError, match="old_map names expert 0 twice on rank 0"):
        plan_slot_moves([0, 0, 2, 1, 3, 1], old, 2)
    with pytest.raises(ValueError, match="cannot be split evenly over n_ranks=4"):
        plan_slot_moves(old, old, 4)
    with pytest.raises(ValueError, match="new_map names expert 5; valid ids are 0..3"):
        plan_slot_moves(old, [0, 1, 2, 5, 3, 1], 2, n_experts=4)
    with pytest.raises(ValueError, match="must be a non-empty 1-D sequence"):
        plan_slot_moves([0.0, 1.0], [0.0, 1.0], 1)
    t = torch.arange(6.0).view(6, 1)
    before = t.clone()
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape \[5, 1\]; dim 0 must be the "
                                         r"6 local slots"):
        move_slots(old, [1, 0, 2, 0, 3, 1], [t, torch.zeros(5, 1)], None, 1)
    with pytest.raises(ValueError, match="n_ranks=2 but the group has 1 ranks; group=None"):
        move_slots(old, old, [t[:3]], None, 2)
    with pytest.raises(ValueError, match="new_map misses expert"):
        move_slots(old, [0, 3, 2, 0, 3, 2], [t], None, 1)
    assert torch.equal(t, before)  # nothing was written


# -- execution -------------------------------------------------------------------------------


def test_one_process_matches_reference() -> None:
    # R=1: every move is a local copy; S > E here, so one rank may hold an expert twice.
    E = 6
    maps = zipf_maps(E, 1, 2, seed=3, n_plans=3)
    maps.append(np.array([5, 4, 3, 2, 1, 0, 5, 5]))  # sources and destinations overlap
    stats = check_moves(0, 1, None, [0], E, 2, seed=3, maps=maps)
    assert all(s == (0, 0) for s in stats)


@pytest.mark.multiproc
def test_two_ranks_gloo_matches_reference() -> None:
    stats = run_local(check_moves, 2, [0, 1], 8, 1, 0)
    check_sends_match_receives(stats)


def four_rank_cases(rank: int, world: int, group) -> list[list[tuple[int, int]]]:
    out = [check_moves(rank, world, group, list(range(world)), 16, r, seed)
           for r, seed in ((1, 1), (2, 2))]
    # The hand case: local copy, remote rows balanced over expert 0's two holders.
    out.append(check_moves(rank, world, group, list(range(world)), 6, 0, 0,
                           maps=[np.array(HAND_OLD), np.array(HAND_NEW)]))
    # A 3-rank subgroup without rank 0: group ranks differ from global ranks.
    sub = dist.new_group([1, 2, 3])
    out.append(check_moves(rank, world, sub, [1, 2, 3], 9, 1, 4))
    return out


@pytest.mark.slow
@pytest.mark.multiproc
def test_four_ranks_gloo_matches_reference() -> None:
    per_rank = run_local(four_rank_cases, 4)
    for case in zip(*per_rank, strict=True):
        check_sends_match_receives(list(case))
    # Hand case, (received, sent) rows per rank: expert 0's two holders (ranks 1, 2) send one
    # row each; rank 3's second change is a local copy.
    assert [s[2] for s in per_rank] == [[(1, 1)], [(1, 1)], [(0, 1)], [(1, 0)]]
