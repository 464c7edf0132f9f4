"""comm.all_to_all(algorithm="flat") against all_to_all_single and a one-process reference.

Every rank rebuilds every other rank's input from a seed, so the expected output and gradient
are computed locally in plain torch (no communication) and the collective must match exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm import all_to_all, run_local
from comm.collectives.flat import reference_all_to_all

pytestmark = pytest.mark.multiproc

WORLD = 4


def _matrix(case: str, world: int, seed: int) -> list[list[int]]:
    """S[s][d]: rows rank s sends to rank d for one named split pattern."""
    g = torch.Generator().manual_seed(seed)
    S = torch.randint(0, 5, (world, world), generator=g)
    if case == "zeros":
        S[S < 2] = 0
    elif case == "silent_sender":  # rank 1 sends nothing at all
        S[1, :] = 0
    elif case == "deaf_receiver":  # rank 2 receives nothing at all
        S[:, 2] = 0
    elif case == "all_empty":
        S.zero_()
    elif case == "self_only":
        S = torch.diag(torch.arange(1, world + 1))
    return S.tolist()


def _inputs(S: list[list[int]], width: int, seed: int) -> list[torch.Tensor]:
    """x_s [sum(S[s]), width, 2] for every rank s, identical on every process."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(sum(row), width, 2, generator=g, dtype=torch.float64) for row in S]


def reference(xs: list[torch.Tensor], S: list[list[int]], me: int) -> torch.Tensor:
    return reference_all_to_all(xs, S)[me]


CASES = ["random", "zeros", "silent_sender", "deaf_receiver", "all_empty", "self_only"]


def _flat_worker(rank: int, world: int, group: dist.ProcessGroup) -> list[str]:
    checked = []
    for i, case in enumerate(CASES):
        S = _matrix(case, world, seed=10 + i)
        xs = _inputs(S, width=3, seed=100 + i)
        ST = [[S[d][s] for d in range(world)] for s in range(world)]
        weights = _inputs(ST, width=3, seed=200 + i)  # weights[r] is shaped like y_r
        for form in ("list", "tensor", "known_out"):
            x = xs[rank].clone().requires_grad_(True)
            splits = S[rank] if form == "list" else torch.tensor(S[rank])
            out = [S[s][rank] for s in range(world)] if form == "known_out" else None
            y, out_splits = all_to_all(x, splits, group, "flat", out_splits=out)
            assert out_splits == [S[s][rank] for s in range(world)], (case, out_splits)
            assert torch.equal(y, reference(xs, S, rank)), case
            # Vendor collective on the same input: equal bit for bit.
            y_vendor = torch.empty_like(y)
            dist.all_to_all_single(y_vendor, xs[rank], out_splits, S[rank], group=group)
            assert torch.equal(y, y_vendor), case
            # loss = sum_r <y_r, w_r>; d loss / d x_s rows for d are w_d's rows from s.
            (y * weights[rank]).sum().backward()
            grad_ref = reference(weights, ST, rank)  # the mirrored exchange
            assert torch.equal(x.grad, grad_ref), case
            checked.append(f"{case}/{form}")
    # Bad input is rejected on every rank before any communication.
    for bad, match in (([1, 2], "entries"), ([-1, 0, 0, 0], ">= 0"), ([9, 0, 0, 0], "sum")):
        try:
            all_to_all(torch.zeros(3, 2), bad, group, "flat")
        except ValueError as e:
            assert match in str(e), str(e)
        else:
            raise AssertionError(f"accepted bad splits {bad}")
    return checked


def test_flat_matches_vendor_and_reference() -> None:
    results = run_local(_flat_worker, WORLD)
    assert all(len(r) == 3 * len(CASES) for r in results)
