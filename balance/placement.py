"""Expert placements, swaps and the load arithmetic every planner shares.

A placement maps each logical expert to the EP rank that hosts it (``expert2rank [E]``).
Every rank owns the same number of physical slots, ``S = E / R``, because each rank's expert
weights are one ``[S, ...]`` tensor; a migration therefore never changes how many experts a
rank holds, only which ones. The unit of change is a :class:`Swap`: two logical experts on
different ranks exchange their physical slots.

Shape legend: E logical experts, R ranks (the EP group), S = E / R slots per rank.
``load_E`` is the token count (or any non-negative cost) of each logical expert; the load of
a rank is the sum over its experts, and ``imbalance = max rank load / mean rank load``.

Everything here is pure and CPU-side (numpy float64 / int64); inputs may be lists, numpy
arrays or torch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "Swap",
    "apply_swaps",
    "as_load",
    "as_placement",
    "count_moves",
    "imbalance",
    "lower_bound",
    "rank_loads",
    "slot_lower_bound",
    "swaps_between",
]


@dataclass(frozen=True)
class Swap:
    """Exchange the physical slots of two logical experts hosted on different ranks."""

    expert_a: int
    expert_b: int

    def __post_init__(self) -> None:
        if self.expert_a == self.expert_b:
            raise ValueError(f"a swap needs two different experts, got {self.expert_a} twice")
        if self.expert_a < 0 or self.expert_b < 0:
            raise ValueError(f"expert ids must be >= 0, got ({self.expert_a}, {self.expert_b})")

    def __str__(self) -> str:
        return f"{self.expert_a}<->{self.expert_b}"


def _to_numpy(x: Any) -> np.ndarray:
    # torch tensors (possibly on a GPU) go through .tolist() so this module does not import
    # torch; placements are small (E <= a few hundred per layer).
    if hasattr(x, "detach") and hasattr(x, "tolist"):
        x = x.detach().cpu().tolist()
    return np.asarray(x)


def as_load(load: Any) -> np.ndarray:
    """``load_E`` as a float64 array; raises ValueError on a bad shape or negative entries."""
    arr = _to_numpy(load).astype(np.float64, copy=True)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"load must be a non-empty 1-D sequence [E], got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"load[{bad}] = {arr[bad]} is not finite")
    if np.any(arr < 0):
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"load[{bad}] = {arr[bad]} is negative; loads must be >= 0")
    return arr


def as_placement(placement: Any, n_ranks: int, n_experts: int | None = None) -> np.ndarray:
    """``expert2rank [E]`` as an int64 array, validated.

    Valid means: 1-D, length ``n_experts`` when given, every entry in ``[0, n_ranks)``, and
    every rank hosting exactly ``E / n_ranks`` experts.
    """
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int | np.integer) or n_ranks < 1:
        raise ValueError(f"n_ranks must be a positive int, got {n_ranks!r}")
    arr = _to_numpy(placement)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"placement must be a non-empty 1-D sequence [E], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"placement entries must be integer ranks, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    n = arr.size
    if n_experts is not None and n != n_experts:
        raise ValueError(f"placement has {n} entries but load has {n_experts} experts")
    if n % n_ranks != 0:
        valid = [r for r in range(1, n + 1) if n % r == 0]
        raise ValueError(f"{n} experts cannot be split evenly over {n_ranks} ranks; valid: {valid}")
    bad = np.flatnonzero((arr < 0) | (arr >= n_ranks))
    if bad.size:
        e = int(bad[0])
        raise ValueError(f"placement[{e}] = {arr[e]} is not a rank in [0, {n_ranks})")
    counts = np.bincount(arr, minlength=n_ranks)
    slots = n // n_ranks
    if np.any(counts != slots):
        r = int(np.flatnonzero(counts != slots)[0])
        raise ValueError(
            f"rank {r} hosts {counts[r]} experts; every rank must host E/R = {n}/{n_ranks} = "
            f"{slots} (slot counts per rank: {counts.tolist()})"
        )
    return arr


def rank_loads(load: Any, placement: Any, n_ranks: int) -> np.ndarray:
    """``[R]`` summed load of each rank under ``placement``."""
    w = as_load(load)
    p = as_placement(placement, n_ranks, w.size)
    return np.bincount(p, weights=w, minlength=n_ranks)


def imbalance(load: Any, placement: Any, n_ranks: int) -> float:
    """max rank load / mean rank load; 1.0 when every load is zero (nothing to balance)."""
    rl = rank_loads(load, placement, n_ranks)
    mean = rl.mean()
    return float(rl.max() / mean) if mean > 0 else 1.0


def lower_bound(load: Any, n_ranks: int) -> float:
    """No placement can have a max rank load below max(mean rank load, hottest expert)."""
    w = as_load(load)
    return float(max(w.sum() / n_ranks, w.max()))


def slot_lower_bound(load: Any, n_ranks: int) -> float:
    """A tighter bound that also counts slots: every rank hosts exactly S = E/R experts.

    By pigeonhole, among the (j-1)R + 1 hottest experts some rank hosts j; that rank carries at
    least the j lightest of those plus the S - j lightest experts overall (disjoint from them
    since (j-1)R + 1 <= E - S + j). The bound is the max over j = 1..S and the mean rank load.
    For j = 1 it is the hottest expert plus the S - 1 coldest, which matters for mild skew
    (Zipf s=0.5, E=256, R=32: the hottest expert alone is ~1.05x the mean, this bound ~1.4x).
    """
    w = as_load(load)
    if w.size % n_ranks != 0:
        raise ValueError(f"{w.size} experts cannot be split evenly over {n_ranks} ranks")
    slots = w.size // n_ranks
    v = np.sort(w)[::-1]
    csum = np.concatenate([[0.0], np.cumsum(v)])
    best = w.sum() / n_ranks
    for j in range(1, slots + 1):
        n_j = (j - 1) * n_ranks + 1
        top = csum[n_j] - csum[n_j - j]
        cold = csum[w.size] - csum[w.size - (slots - j)]
        best = max(best, top + cold)
    return float(best)


def _check_swap(swap: Any, n_experts: int) -> tuple[int, int]:
    if not isinstance(swap, Swap):
        raise ValueError(f"expected a balance.Swap, got {swap!r}")
    a, b = swap.expert_a, swap.expert_b
    if a >= n_experts or b >= n_experts:
        raise ValueError(f"swap {swap} names an expert outside [0, {n_experts})")
    return a, b


def apply_swaps(placement: Any, swaps: Sequence[Swap]) -> Any:
    """Return a new placement with ``swaps`` applied in order (the input is not modified).

    The result has the input's kind: list in, list out; numpy in, numpy out; a torch tensor
    in, a tensor of the same dtype and device out. Each swap must join experts that sit on
    different ranks at the moment it is applied.
    """
    arr = _to_numpy(placement).astype(np.int64, copy=True)
    if arr.ndim != 1:
        raise ValueError(f"placement must be 1-D [E], got shape {arr.shape}")
    for i, s in enumerate(swaps):
        a, b = _check_swap(s, arr.size)
        if arr[a] == arr[b]:
            raise ValueError(
                f"swap #{i} {s}: experts {a} and {b} are both on rank {arr[a]}; "
                "a swap must join experts on different ranks"
            )
        arr[a], arr[b] = arr[b], arr[a]
    if hasattr(placement, "detach") and hasattr(placement, "new_tensor"):
        return placement.new_tensor(arr.tolist())
    if isinstance(placement, np.ndarray):
        return arr.astype(placement.dtype)
    return arr.tolist()


def count_moves(before: Any, after: Any) -> int:
    """Number of experts whose rank differs between two placements (what must be copied)."""
    a, b = _to_numpy(before), _to_numpy(after)
    if a.shape != b.shape:
        raise ValueError(f"placements differ in length: {a.shape} vs {b.shape}")
    return int(np.count_nonzero(a != b))


def swaps_between(before: Any, after: Any, n_ranks: int) -> list[Swap]:
    """Swaps that turn ``before`` into ``after`` (same slot counts), one per moved expert at most.

    Each swap puts at least one expert on its target rank; when the expert it displaces wants
    to go exactly where the first one came from, both land at once (a 2-cycle), which is
    preferred so full re-placements are expressed with few swaps.
    """
    cur = as_placement(before, n_ranks).copy()
    tgt = as_placement(after, n_ranks, cur.size)
    swaps: list[Swap] = []
    for a in range(cur.size):
        if cur[a] == tgt[a]:
            continue
        src, dst = cur[a], tgt[a]
        # Misplaced experts on the destination rank; one exists because slot counts match.
        cand = np.flatnonzero((cur == dst) & (tgt != dst))
        pair = cand[tgt[cand] == src]
        b = int(pair[0] if pair.size else cand[0])
        swaps.append(Swap(a, b))
        cur[a], cur[b] = dst, src
    assert np.array_equal(cur, tgt)
    return swaps
