"""Replica placement executor: change an EP group's slot map, moving expert rows with it.

A slot map ``slot2expert [R * S]`` (see :mod:`balance.replicas`) says which logical expert each
global slot holds; slot ``g`` is row ``g % S`` of rank ``g // S``'s per-slot tensors (a layer's
``w1, w3, w2`` and their AdamW ``exp_avg`` / ``exp_avg_sq``). Replicas of an expert hold identical
rows, so when the map changes from ``old`` to ``new`` every changed slot ``d`` only needs a copy
of *some* slot that held ``new[d]`` before; nothing has to travel for unchanged slots.

Source rule (:func:`plan_slot_moves`, pure): changed slots are taken in increasing order. If the
destination's own rank held ``new[d]`` in ``old``, the lowest such slot is the source (a local
copy, no communication). Otherwise the source is the holder of ``new[d]`` whose rank has sent
the fewest remote rows so far in this plan, ties broken by the lowest slot; this spreads the
sends of a hot expert with several replicas over its holders instead of piling them on the
first. The rule is a function of the two maps only, so every rank derives the same plan.

Execution (:func:`move_slots`): every rank reads all its source rows (local copies and outgoing
rows) before writing any destination, since a slot can be both. Outgoing rows of all tensors
are packed into one byte buffer ``[rows, row_bytes]`` (each tensor's row viewed as bytes, side
by side), ordered by destination rank then destination slot; a receiver expects rows from each
source rank in the same order. One ``dist.all_to_all_single`` with split sizes taken from the
plan (identical on every rank, so no size exchange) carries them; the receiver unpacks each
tensor's byte columns into its rows. Index tensors are built before the exchange, and nothing
reads device data on the host while it is pending, so on NCCL the copy stays stream-ordered.
When no slot needs a remote source the collective is skipped on every rank alike.

Shape legend: E logical experts of one layer, R ranks in the EP group, S slots per rank
(``E / R + r`` with ``r`` redundant slots).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from balance.replicas import check_slot_map

__all__ = ["move_slots", "plan_slot_moves"]


def _as_map(m: Any, what: str) -> np.ndarray:
    a = np.asarray(m.tolist() if hasattr(m, "tolist") else m)
    if a.ndim != 1 or a.size == 0 or not (a.dtype.kind in "iu" or a.dtype == object):
        raise ValueError(f"{what} must be a non-empty 1-D sequence of expert ids, got "
                         f"{a.dtype} of shape {list(a.shape)}")
    return a.astype(np.int64)


def _check_maps(old_map: Any, new_map: Any, n_ranks: int,
                n_experts: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Both maps as int64 [R * S] and S, or ValueError naming what is wrong."""
    if not isinstance(n_ranks, int | np.integer) or n_ranks < 1:
        raise ValueError(f"n_ranks={n_ranks!r} must be an integer >= 1")
    old, new = _as_map(old_map, "old_map"), _as_map(new_map, "new_map")
    if old.size != new.size:
        raise ValueError(f"old_map has {old.size} slots and new_map {new.size}; a placement "
                         f"change keeps the number of slots")
    if old.size % n_ranks:
        raise ValueError(f"{old.size} slots cannot be split evenly over n_ranks={n_ranks}")
    S = old.size // n_ranks
    # Without n_experts the ids present say how many experts there are (ids 0..max); an expert
    # missing from one map is then caught unless it is the highest id and missing from both.
    E = int(max(old.max(), new.max())) + 1 if n_experts is None else n_experts
    old = check_slot_map(old, E, n_ranks, S, "old_map")
    new = check_slot_map(new, E, n_ranks, S, "new_map")
    return old, new, S


def _plan(old: np.ndarray, new: np.ndarray, n_ranks: int, S: int) -> list[tuple[int, int]]:
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old.tolist()):
        holders.setdefault(e, []).append(s)  # ascending slots
    sent = [0] * n_ranks
    moves = []
    for d in np.flatnonzero(old != new).tolist():
        cands = holders[int(new[d])]
        local = [s for s in cands if s // S == d // S]
        if local:
            src = local[0]
        else:
            src = min(cands, key=lambda s: (sent[s // S], s))
            sent[src // S] += 1
        moves.append((d, src))
    return moves


def plan_slot_moves(old_map: Any, new_map: Any, n_ranks: int,
                    n_experts: int | None = None) -> list[tuple[int, int]]:
    """``[(dst_slot, src_slot), ...]`` for every slot whose expert changes, by increasing
    ``dst_slot``: row ``dst_slot`` becomes a copy of row ``src_slot`` (global slots, read from
    the placement before the move). Sources follow the module docstring's rule: same rank
    first, else the holder rank with the fewest rows sent so far, ties by lowest slot.

    ``old_map``, ``new_map``: ``[R * S]`` slot -> expert maps; ``n_experts``: E (default:
    the highest id in either map + 1). ValueError for different lengths, a length not divisible
    by ``n_ranks``, or a map that misses an expert or names one twice on a rank."""
    old, new, S = _check_maps(old_map, new_map, n_ranks, n_experts)
    return _plan(old, new, n_ranks, S)


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def move_slots(old_map: Any, new_map: Any, tensors: Sequence[torch.Tensor | None], group: Any,
               n_ranks: int, *, n_experts: int | None = None) -> dict[str, float | int]:
    """Change this rank's per-slot ``tensors`` from placement ``old_map`` to ``new_map``.

    Args:
        old_map, new_map: ``[R * S]`` slot -> expert maps, identical on every rank of
            ``group`` (e.g. the layer's ``slot_map()`` and :func:`balance.plan_replicas`'s
            result); validated before any communication.
        tensors: this rank's per-slot tensors, each with dim 0 == S (weights, grads, optimizer
            moments; any dtypes and devices), changed in place; ``None`` entries are skipped.
            Every rank of the group must pass the same structure (shapes and dtypes).
        group: the EP process group; ``None`` for a single process (then ``n_ranks`` == 1).
        n_ranks: R, the size of ``group``.
        n_experts: E (default: highest id in either map + 1).

    Returns:
        ``{"moved_slots": slots changed group-wide, "remote_rows": rows this rank received,
        "bytes_sent": bytes this rank sent, "seconds": wall time of this rank's part}``.
    """
    t0 = time.perf_counter()
    old, new, S = _check_maps(old_map, new_map, n_ranks, n_experts)
    if _group_size(group) != n_ranks:
        raise ValueError(f"n_ranks={n_ranks} but the group has {_group_size(group)} ranks"
                         + ("; group=None means one process" if group is None else ""))
    live = []
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.ndim == 0 or t.shape[0] != S:
            raise ValueError(f"tensors[{i}] has shape {list(t.shape)}; dim 0 must be the {S} "
                             f"local slots ({old.size} slots over {n_ranks} ranks)")
        live.append(t)
    rank = 0 if group is None else dist.get_rank(group)
    moves = _plan(old, new, n_ranks, S)
    lo, hi = rank * S, (rank + 1) * S

    local_dst = [d - lo for d, s in moves if lo <= d < hi and lo <= s < hi]
    local_src = [s - lo for d, s in moves if lo <= d < hi and lo <= s < hi]
    # Remote rows, in plan order (ascending dst slot, hence grouped by destination rank) on the
    # sender; the receiver lists its incoming rows by source rank, then dst slot: same order.
    out_src = [s - lo for d, s in moves if lo <= s < hi and not lo <= d < hi]
    in_pairs = sorted((s // S, d) for d, s in moves if lo <= d < hi and not lo <= s < hi)
    in_dst = [d - lo for _, d in in_pairs]
    send_splits = [0] * n_ranks
    recv_splits = [0] * n_ranks
    any_remote = False
    for d, s in moves:
        if d // S != s // S:
            any_remote = True
            if s // S == rank:
                send_splits[d // S] += 1
            if d // S == rank:
                recv_splits[s // S] += 1

    # Byte width of one row of each tensor; a row is viewed as uint8 so that tensors of every
    # dtype travel in one buffer.
    row_bytes = [t[0].numel() * t.element_size() for t in live]
    B = sum(row_bytes)
    if any_remote and group is not None and dist.get_backend(group) == "nccl":
        comm_dev = torch.device("cuda", torch.cuda.current_device())
    else:
        comm_dev = torch.device("cpu")

    def idx(rows: list[int], dev: torch.device) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=dev)

    def as_bytes(rows: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [n, row bytes] uint8
        return rows.reshape(rows.shape[0], -1).contiguous().view(torch.uint8)

    devs = {t.device for t in live}
    # All index tensors first: building one on a GPU later would wait for the exchange.
    loc_src = {dv: idx(local_src, dv) for dv in devs} if local_src else {}
    loc_dst = {dv: idx(local_dst, dv) for dv in devs} if local_dst else {}
    snd = {dv: idx(out_src, dv) for dv in devs} if out_src else {}
    rcv = {dv: idx(in_dst, dv) for dv in devs} if in_dst else {}
    with torch.no_grad():
        # Read every source before writing any destination (a slot can be both).
        local_bufs = [t.index_select(0, loc_src[t.device]) for t in live] if local_src else []
        n_in = len(in_dst)
        n_in = n_in if B else 0  # no tensors (all None): nothing to carry, on every rank
        if any_remote and B:
            if out_src:
                send = torch.cat([as_bytes(t.index_select(0, snd[t.device])).to(comm_dev)
                                  for t in live], dim=1)
            else:
                send = torch.empty((0, B), dtype=torch.uint8, device=comm_dev)
            recv = torch.empty((n_in, B), dtype=torch.uint8, device=comm_dev)
            dist.all_to_all_single(recv, send, output_split_sizes=recv_splits,
                                   input_split_sizes=send_splits, group=group)
        if local_src:
            for t, buf in zip(live, local_bufs, strict=True):
                t.index_copy_(0, loc_dst[t.device], buf)
        if n_in:
            off = 0
            for t, nb in zip(live, row_bytes, strict=True):
                rows = recv[:, off:off + nb].to(t.device).contiguous().view(t.dtype)
                t.index_copy_(0, rcv[t.device], rows.view(n_in, *t.shape[1:]))
                off += nb
    for dv in devs:
        if dv.type == "cuda":
            torch.cuda.synchronize(dv)  # only so that "seconds" covers the work
    return {
        "moved_slots": len(moves),
        "remote_rows": n_in,
        "bytes_sent": len(out_src) * B,
        "seconds": time.perf_counter() - t0,
    }
