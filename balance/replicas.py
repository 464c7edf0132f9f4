"""Placement with redundant expert slots: hot experts get several replicas, each taking an even
share of its tokens, so that one expert's load can be split across ranks (swaps cannot).

A placement with redundancy is a slot map ``slot2expert [R * S]``: slot ``s`` lives on rank
``s // S`` and hosts logical expert ``slot2expert[s]``; every expert has at least one slot. An
expert with ``c`` replicas sends ``load / c`` to each. The rank load is the sum over its slots.

:func:`plan_replicas` (pure, deterministic, numpy) returns a new slot map that minimises the
maximum rank load, with as few slot changes from ``current`` as the tolerance allows, in the
spirit of :func:`balance.plan_swaps`'s ``minmax``:

1. Candidates.
   - *repack* (four of them): replica counts by greedy apportionment (spare slots go to the
     expert with the largest per-replica load while that exceeds a stop level, 1, 0.75, 0.5 or
     0 times the mean rank load, at most one replica per rank; the rest become copies of the
     lightest experts), then the replicas, heaviest
     first, go to the lightest rank with a free slot that does not host that expert yet
     (DeepSeek's EPLB packs the same way), then a local search of slot exchanges between the
     most-loaded rank and every other rank.
   - *incremental* (with ``current``): from the current map, repeatedly turn one redundant slot
     (a replica of an expert with >= 2) into one more replica of the expert whose replicas are
     heaviest on the most-loaded rank, while that lowers the maximum; each step is one slot
     change.
   - *no-replication baseline*: the best single-copy placement found by ``plan_swaps`` (minmax)
     from the identity, its spare slots filled by the incremental rule. So the result is never
     worse than what the swap planner reaches without replication.
2. Each full repack is relabelled (ranks matched to the current ranks they overlap most,
   experts kept in the slot index they had) to keep slots in place.
3. Among candidates within ``tolerance`` of the best maximum (and within ``max_moves`` slot
   changes when given), the one with the fewest changes wins.

Shape legend: E logical experts, R ranks, S slots per rank (S = E / R + r redundant).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from balance.placement import apply_swaps, as_load
from balance.planner import plan_swaps

__all__ = ["plan_replicas", "replica_loads", "replica_counts", "slot_changes", "check_slot_map"]


def check_slot_map(slot2expert: Any, n_experts: int, n_ranks: int, slots_per_rank: int,
                   what: str = "placement") -> np.ndarray:
    """`slot2expert` as int64 [R * S], or ValueError naming what is wrong: its length, an id
    out of range, a missing expert, or one expert twice on a rank."""
    m = np.asarray(slot2expert.tolist() if hasattr(slot2expert, "tolist") else slot2expert,
                   dtype=np.int64).reshape(-1)
    if m.size != n_ranks * slots_per_rank:
        raise ValueError(f"{what} has {m.size} slots; expected {n_ranks} ranks x "
                         f"{slots_per_rank} slots = {n_ranks * slots_per_rank}")
    bad = m[(m < 0) | (m >= n_experts)]
    if bad.size:
        raise ValueError(f"{what} names expert {int(bad[0])}; valid ids are 0..{n_experts - 1}")
    missing = np.setdiff1d(np.arange(n_experts), m)
    if missing.size:
        raise ValueError(f"{what} misses expert(s) {missing[:8].tolist()}: every expert needs "
                         f"at least one slot")
    per_rank = m.reshape(n_ranks, slots_per_rank)
    if slots_per_rank <= n_experts:
        for r, row in enumerate(per_rank):
            vals, counts = np.unique(row, return_counts=True)
            if (counts > 1).any():
                raise ValueError(f"{what} names expert {int(vals[counts > 1][0])} twice on "
                                 f"rank {r}; a rank hosts at most one replica of an expert")
    return m


def replica_counts(slot2expert: np.ndarray, n_experts: int) -> np.ndarray:
    return np.bincount(slot2expert, minlength=n_experts)


def replica_loads(load: Any, slot2expert: Any, n_ranks: int) -> np.ndarray:
    """Load of each rank [R] when every expert's load is shared evenly by its replicas."""
    w = as_load(load)
    m = np.asarray(slot2expert, dtype=np.int64)
    per_slot = w[m] / replica_counts(m, w.size)[m]
    return per_slot.reshape(n_ranks, -1).sum(axis=1)


def slot_changes(before: Any, after: Any) -> int:
    """Slots whose expert differs (each is a copy of one expert's weights and state)."""
    return int((np.asarray(before) != np.asarray(after)).sum())


def _apportion(w: np.ndarray, n_slots: int, n_ranks: int, stop: float) -> np.ndarray:
    """Replica counts: one each; then spare slots go to the largest per-replica load while it
    exceeds `stop` (at most n_ranks replicas of an expert), the rest to the lightest experts
    (cheap filler copies that add little to any rank)."""
    E = w.size
    c = np.ones(E, dtype=np.int64)
    spare = n_slots - E
    heap = [(-w[e], e) for e in range(E)]
    heapq.heapify(heap)
    while spare > 0 and heap and -heap[0][0] > stop:
        _, e = heapq.heappop(heap)
        c[e] += 1
        spare -= 1
        if c[e] < n_ranks:
            heapq.heappush(heap, (-w[e] / c[e], e))
    light = sorted(range(E), key=lambda e: (w[e] / c[e], e))
    while spare > 0:  # filler: lightest per-replica first, round robin, n_ranks copies at most
        placed = False
        for e in light:
            if spare and c[e] < n_ranks:
                c[e] += 1
                spare -= 1
                placed = True
        if not placed:  # every expert on every rank (S > E): forced duplicates
            for i in range(spare):
                c[light[i % E]] += 1
            spare = 0
    return c


def _pack(w: np.ndarray, counts: np.ndarray, n_ranks: int, S: int) -> np.ndarray:
    """Replicas heaviest first to the lightest rank with a free slot not hosting the expert."""
    items = sorted(((w[e] / counts[e], e) for e in range(w.size) for _ in range(counts[e])),
                   key=lambda t: (-t[0], t[1]))
    loads = np.zeros(n_ranks)
    rows: list[list[int]] = [[] for _ in range(n_ranks)]
    for x, e in items:
        free = [r for r in range(n_ranks) if len(rows[r]) < S]
        fresh = [r for r in free if e not in rows[r]] or free
        r = min(fresh, key=lambda q: (loads[q], q))
        rows[r].append(e)
        loads[r] += x
    return _repair(np.array([e for row in rows for e in row], dtype=np.int64), n_ranks, S)


def _repair(m: np.ndarray, n_ranks: int, S: int) -> np.ndarray:
    """Greedy packing can corner an expert onto a rank that already hosts it: exchange such a
    slot with one on another rank where neither side then holds a duplicate."""
    grid = m.reshape(n_ranks, S).copy()
    if S > len(set(m.tolist())):
        return m  # more slots per rank than experts: duplicates are unavoidable
    for r in range(n_ranks):
        for i in range(S):
            e = grid[r, i]
            if (grid[r] == e).sum() < 2:
                continue
            for q in range(n_ranks):
                j = next((j for j in range(S) if grid[q, j] not in grid[r] and e not in grid[q]),
                         None)
                if q != r and j is not None:
                    grid[r, i], grid[q, j] = grid[q, j], e
                    break
    return grid.reshape(-1)


def _local_search(w: np.ndarray, m: np.ndarray, n_ranks: int, S: int, iters: int) -> np.ndarray:
    """Exchange two slots (most-loaded rank <-> any rank) while that lowers the max of the two
    ranks below the current maximum; replica counts stay fixed. Vectorised over slot pairs."""
    m = m.copy()
    per = w[m] / replica_counts(m, w.size)[m]
    hosts = np.zeros((n_ranks, w.size), dtype=bool)  # hosts[r, e]: rank r holds expert e
    hosts[np.repeat(np.arange(n_ranks), S), m] = True
    for _ in range(iters):
        grid, pgrid = m.reshape(n_ranks, S), per.reshape(n_ranks, S)
        loads = pgrid.sum(axis=1)
        h = int(np.argmax(loads))
        best = None
        for r in range(n_ranks):
            if r == h:
                continue
            d = pgrid[h][:, None] - pgrid[r][None, :]  # [S_h, S_r]: load moved from h to r
            ok = (d > 0) & ~hosts[h][grid[r]][None, :] & ~hosts[r][grid[h]][:, None]
            if not ok.any():
                continue
            new_max = np.where(ok, np.maximum(loads[h] - d, loads[r] + d), np.inf)
            ih, jr = np.unravel_index(int(np.argmin(new_max)), new_max.shape)
            if new_max[ih, jr] < loads[h] - 1e-12 and (best is None or new_max[ih, jr] < best[0]):
                best = (float(new_max[ih, jr]), r, int(ih), int(jr))
        if best is None:
            break
        _, r, i, j = best
        hi, rj = h * S + i, r * S + j
        hosts[h, m[hi]], hosts[r, m[rj]] = False, False
        m[hi], m[rj] = m[rj], m[hi]
        hosts[h, m[hi]], hosts[r, m[rj]] = True, True
        per[hi], per[rj] = per[rj], per[hi]
    return m


def _incremental(w: np.ndarray, m: np.ndarray, n_ranks: int, S: int, budget: int) -> np.ndarray:
    """Turn redundant slots into replicas of the hottest expert on the most-loaded rank, one
    slot change at a time, while the maximum rank load goes down."""
    m = m.copy()
    for _ in range(budget):
        loads = replica_loads(w, m, n_ranks)
        cur = loads.max()
        h = int(np.argmax(loads))
        c = replica_counts(m, w.size)
        hot = max(set(m[h * S:(h + 1) * S].tolist()), key=lambda e: (w[e] / c[e], -e))
        best = None
        for s in range(m.size):
            e_old = m[s]
            if c[e_old] < 2 or e_old == hot or hot in m[(s // S) * S:(s // S + 1) * S]:
                continue
            trial = m.copy()
            trial[s] = hot
            mx = replica_loads(w, trial, n_ranks).max()
            if mx < cur - 1e-12 and (best is None or mx < best[0]):
                best = (mx, s)
        if best is None:
            break
        m[best[1]] = hot
    return m


def _relabel(m: np.ndarray, current: np.ndarray, n_ranks: int, S: int) -> np.ndarray:
    """Permute ranks (greedy matching on shared experts) and slots within a rank so that as
    many slots as possible keep their current expert; loads are unchanged."""
    new, cur = m.reshape(n_ranks, S), current.reshape(n_ranks, S)
    overlap = np.array([[len(set(new[a]) & set(cur[b])) for b in range(n_ranks)]
                        for a in range(n_ranks)])
    order = sorted(((overlap[a, b], a, b) for a in range(n_ranks) for b in range(n_ranks)),
                   key=lambda t: (-t[0], t[1], t[2]))
    target, used_a, used_b = {}, set(), set()
    for _, a, b in order:
        if a not in used_a and b not in used_b:
            target[a] = b
            used_a.add(a)
            used_b.add(b)
    out = np.empty_like(new)
    for a, b in target.items():
        row, keep = list(new[a]), [None] * S
        for i in range(S):  # an expert already in slot i of rank b stays there
            if cur[b, i] in row:
                keep[i] = cur[b, i]
                row.remove(cur[b, i])
        for i in range(S):
            if keep[i] is None:
                keep[i] = row.pop(0)
        out[b] = keep
    return out.reshape(-1)


def plan_replicas(load: Any, n_ranks: int, slots_per_rank: int, current: Any = None,
                  max_moves: int | None = None, tolerance: float = 0.01,
                  search_iters: int = 200) -> np.ndarray:
    """New slot map [n_ranks * slots_per_rank] for per-expert `load` (see the module docstring).

    `current`: the slot map in use (None: no preference); `max_moves`: at most that many slot
    changes from `current`; `tolerance`: plans whose maximum rank load is within this fraction
    of the best found count as equal, and the one with the fewest changes is returned."""
    w = as_load(load)
    E = w.size
    if n_ranks < 1 or slots_per_rank < 1:
        raise ValueError(f"n_ranks={n_ranks} and slots_per_rank={slots_per_rank} must be >= 1")
    if n_ranks * slots_per_rank < E:
        raise ValueError(f"{n_ranks} ranks x {slots_per_rank} slots = "
                         f"{n_ranks * slots_per_rank} slots cannot host {E} experts; need "
                         f"slots_per_rank >= {-(-E // n_ranks)}")
    if max_moves is not None and max_moves < 0:
        raise ValueError(f"max_moves={max_moves} must be >= 0 or None")
    if not tolerance >= 0:
        raise ValueError(f"tolerance={tolerance} must be >= 0")
    R, S = n_ranks, slots_per_rank
    cur = None if current is None else check_slot_map(current, E, R, S, "current")
    candidates: list[np.ndarray] = []
    mean = w.sum() / R
    for stop in (mean, 0.75 * mean, 0.5 * mean, 0.0):  # how far to split hot experts
        packed = _pack(w, _apportion(w, R * S, R, stop), R, S)
        candidates.append(_local_search(w, packed, R, S, search_iters))
    if E % R == 0:  # the best single-copy placement the swap planner finds, plus replicas
        ident = np.repeat(np.arange(R), E // R)
        e2r = np.asarray(apply_swaps(ident, plan_swaps(w, ident, R, max_swaps=4 * E)))
        base = np.empty(R * S, dtype=np.int64)
        fill = np.argsort(-w, kind="stable")  # spare slots start as replicas of hot experts
        for r in range(R):
            own = np.flatnonzero(e2r == r).tolist()
            extra = [int(e) for e in fill if e not in own][: S - len(own)]
            extra += [int(fill[i % E]) for i in range(S - len(own) - len(extra))]  # S > E
            base[r * S:(r + 1) * S] = own + extra
        candidates.append(_incremental(w, base, R, S, R * S))
    if cur is not None:
        candidates = [_relabel(c, cur, R, S) for c in candidates]
        budget = R * S if max_moves is None else max_moves
        candidates.append(_incremental(w, cur, R, S, budget))
        candidates.append(cur.copy())
    scored = [(replica_loads(w, c, R).max(), 0 if cur is None else slot_changes(cur, c), i, c)
              for i, c in enumerate(candidates)]
    if max_moves is not None and cur is not None:
        scored = [t for t in scored if t[1] <= max_moves]
    best = min(t[0] for t in scored)
    ok = [t for t in scored if t[0] <= best * (1 + tolerance) + 1e-12]
    return min(ok, key=lambda t: (t[1], t[0], t[2]))[3].copy()
