"""Migration (swaps as slot-map changes, `swap_slots`, carried out by the one placement
executor `move_slots`) on real gloo process groups against a single-process permutation of
full tensors.

The reference keeps the textbook map, ``expert2slot [E]``, and swaps its entries; the slot map
the trainer uses is its inverse. Every rank builds the same full ``[E, ...]`` tensors from a
seed and keeps its ``[S, ...]`` slice; after a migration its slice must equal the matching rows
of the full tensor permuted in one process (``full_new[new_slot[e]] = full[old_slot[e]]``),
bit for bit. The Adam case
moves the weight, grad and moments bit for bit too, then continues training after the move and
compares with an unmigrated single-process run (to fp32 rounding: other tensor shapes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from balance import (
    MigrationPolicy,
    Monitor,
    Swap,
    expert_ranks,
    expert_state_tensors,
    move_slots,
    plan_swaps,
    swap_slots,
)
from comm import run_local


def _reference_map(old: list[int], swaps: list[Swap]) -> list[int]:
    new = list(old)
    for s in swaps:
        new[s.expert_a], new[s.expert_b] = new[s.expert_b], new[s.expert_a]
    return new


def _inverse(perm: list[int]) -> list[int]:
    """expert2slot <-> slot2expert (a permutation's inverse)."""
    out = [0] * len(perm)
    for i, v in enumerate(perm):
        out[v] = i
    return out


def _migrate(swaps: list[Swap], e2s: list[int], tensors: list, group, n: int) -> tuple:
    """The trainer's path: swaps -> new slot map -> move_slots. Returns (new expert2slot,
    move_slots' result)."""
    old_map = _inverse(e2s)
    new_map = swap_slots(old_map, swaps, n)
    res = move_slots(old_map, new_map, tensors, group, n, n_experts=len(e2s))
    return _inverse(new_map), res


def _permute_full(full: torch.Tensor, old: list[int], new: list[int]) -> torch.Tensor:
    out = torch.empty_like(full)
    for o, n in zip(old, new, strict=True):
        out[n] = full[o]
    return out


def _check_plans(rank: int, world: int, group: object, members: list[int]) -> None:
    """Several plans in sequence on ``group`` (``members`` = its global ranks)."""
    me = members.index(rank)
    n = len(members)
    e = 4 * n
    slots = e // n
    gen = torch.Generator().manual_seed(0)
    fulls = [
        torch.randn(e, 3, 5, generator=gen),  # a weight
        torch.randn(e, 7, generator=gen).to(torch.float64),  # another dtype
        torch.randint(0, 100, (e,), generator=gen),  # 1-D, int64
    ]
    local = [f[me * slots : (me + 1) * slots].clone() for f in fulls]
    e2s = torch.randperm(e, generator=gen)
    load = torch.rand(e, generator=gen) * 100

    def chain(place: list[int]) -> list[Swap]:
        # Expert 0 moves twice but lands once; with 2 ranks the pair swaps back (no net move).
        b = next(x for x in range(e) if place[x] != place[0])
        c = next((x for x in range(e) if place[x] not in (place[0], place[b])), b)
        return [Swap(0, b), Swap(0, c)] if c != b else [Swap(0, b), Swap(0, b)]

    planners = [
        lambda place: plan_swaps(load, place, n, None, "greedy-repack"),
        chain,
        lambda place: plan_swaps(load, place, n, 3, "minmax"),
        lambda place: [],
    ]
    e2s = e2s.tolist()
    for planner in planners:
        plan = planner(expert_ranks(_inverse(e2s), n))
        assert expert_ranks(_inverse(e2s), n) == [s // slots for s in e2s]
        old = e2s
        ref_new = _reference_map(old, plan)
        tensors = [local[0], None, local[1], local[2]]
        new_e2s, res = _migrate(plan, e2s, tensors, group, n)
        assert new_e2s == ref_new
        fulls = [_permute_full(f, old, ref_new) for f in fulls]
        for t, f in zip(local, fulls, strict=True):
            assert torch.equal(t, f[me * slots : (me + 1) * slots])
        row_bytes = sum(f[0].numel() * f.element_size() for f in fulls)
        out_rows = sum(
            1 for o, m in zip(old, ref_new, strict=True) if o // slots == me != m // slots
        )
        assert res["bytes_sent"] == out_rows * row_bytes
        assert res["moved_slots"] == sum(o != m for o, m in zip(old, ref_new, strict=True))
        e2s = new_e2s


def _check_adam(rank: int, world: int) -> None:
    """Weights, grads and Adam moments travel together: training continues identically."""
    e, d, slots = 4 * world, 6, 4
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(e, d, generator=gen)
    grads = [torch.randn(e, d, generator=gen) for _ in range(3)]
    ref = torch.nn.Parameter(w0.clone())  # single process, logical order, never migrated
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    e2s = torch.arange(e)
    p = torch.nn.Parameter(w0[rank * slots : (rank + 1) * slots].clone())
    opt = torch.optim.Adam([p], lr=0.1)

    def step(g_logical: torch.Tensor) -> None:
        ref.grad = g_logical.clone()
        ref_opt.step()
        # This rank's slot s holds the logical expert whose slot is rank*slots + s.
        slot2expert = torch.empty(e, dtype=torch.long)
        slot2expert[e2s] = torch.arange(e)
        p.grad = g_logical[slot2expert[rank * slots : (rank + 1) * slots]].clone()
        opt.step()

    step(grads[0])
    load = torch.arange(e, dtype=torch.float64) ** 2  # hot experts all on the last rank
    swaps = plan_swaps(load, expert_ranks(_inverse(e2s.tolist()), world), world, 3)
    assert swaps
    st = opt.state[p]
    tensors = expert_state_tensors([p], opt)
    assert len(tensors) == 4 and tensors[2] is st["exp_avg"] and tensors[3] is st["exp_avg_sq"]
    fulls = []  # every rank's weight, grad and moments before the move, gathered
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous())
        fulls.append(torch.cat(parts))
    old = e2s.tolist()
    e2s = torch.tensor(_migrate(swaps, e2s.tolist(), tensors, dist.group.WORLD, world)[0])
    for t, f in zip(tensors, fulls, strict=True):  # the move itself is a copy: bit for bit
        want = _permute_full(f, old, e2s.tolist())[rank * slots : (rank + 1) * slots]
        assert torch.equal(t.detach(), want)
    for g in grads[1:]:
        step(g)
    slot2expert = torch.empty(e, dtype=torch.long)
    slot2expert[e2s] = torch.arange(e)
    mine = slot2expert[rank * slots : (rank + 1) * slots]
    # The reference steps one [E, d] tensor, each rank an [S, d] slice: an element sits at
    # another offset, where CPU elementwise kernels may take their scalar tail path instead of
    # the vector body (FMA contraction can differ), so fp32 to a few ulp after 3 steps.
    torch.testing.assert_close(p.detach(), ref.detach()[mine], rtol=1e-6, atol=1e-6)
    # a running mean of squares: positive terms, no cancellation, so a relative bound
    torch.testing.assert_close(
        st["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"][mine], rtol=1e-5, atol=0
    )


def _check_monitor_group(rank: int, world: int) -> None:
    mon = Monitor(2, 8, 2, MigrationPolicy(window=2), group=dist.group.WORLD)
    for step in range(3):
        mon.record(torch.full((2, 8), float(rank + step)))
    # Sum over ranks of (rank + step) for the last 2 steps (1, 2).
    expect = sum(r + s for r in range(world) for s in (1, 2))
    assert torch.equal(
        torch.as_tensor(mon.load()), torch.full((2, 8), float(expect), dtype=torch.float64)
    )


def _body(rank: int, world: int, group: object) -> None:
    _check_plans(rank, world, group, list(range(world)))
    _check_adam(rank, world)
    _check_monitor_group(rank, world)
    # A subgroup that leaves rank 0 out: peers must be translated to global ranks.
    members = list(range(1, world))
    sub = dist.new_group(members)
    if rank in members:
        _check_plans(rank, world, sub, members)


@pytest.mark.multiproc
def test_migrate_matches_single_process_permutation() -> None:
    # One launch of 3 processes covers the world group (3 ranks, so chains cross three ranks)
    # and a 2-rank subgroup. run_local rendezvouses through a file and holds barriers around
    # the body, so no rank tears the group down while a slower one is still using it.
    run_local(_body, 3)


def test_swap_slots_and_errors() -> None:
    # slot map [1, 2, 3, 0] = expert2slot [3, 0, 1, 2]: expert 0 in slot 3 (rank 1), ...
    assert expert_ranks(torch.tensor([1, 2, 3, 0]), 2) == [1, 0, 0, 1]
    assert swap_slots([0, 1, 2, 3], [Swap(0, 2)], 2) == [2, 1, 0, 3]
    # a chain: expert 0 ends in its final slot, the others shift once
    assert swap_slots([0, 1, 2, 3], [Swap(0, 2), Swap(0, 1)], 2) == [2, 0, 1, 3]
    assert _inverse(swap_slots(_inverse([3, 0, 1, 2]), [Swap(1, 0)], 2)) == \
        _reference_map([3, 0, 1, 2], [Swap(1, 0)])
    with pytest.raises(ValueError, match="both experts are on rank 0"):
        swap_slots([0, 1, 2, 3], [Swap(0, 1)], 2)
    with pytest.raises(ValueError, match="replicas cannot be swapped"):
        swap_slots([0, 1, 1, 2], [Swap(1, 2)], 2)
    with pytest.raises(ValueError, match="misses expert"):
        expert_ranks([0, 1, 3, 3], 2)
    with pytest.raises(ValueError, match="cannot be split evenly over n_ranks=3"):
        expert_ranks([0, 1, 2, 3], 3)
