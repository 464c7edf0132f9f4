"""Expert migration as slot-map changes: swaps become a new slot map, which the one placement
executor (:func:`balance.move_slots`) carries out, weights and optimizer moments included.

A layer's placement is its slot map ``slot2expert [R * S]``: global slot ``g`` is row ``g % S``
of rank ``g // S``'s per-slot tensors (``w [S, ...]``, its ``.grad``, Adam ``exp_avg`` and
``exp_avg_sq``, ...) and holds logical expert ``slot2expert[g]`` (:mod:`balance.replicas`; with
redundant slots an expert holds several). The swap planners (:func:`balance.plan_swaps`) work
on ``expert2rank [E]`` (:func:`expert_ranks` of the map) and return :class:`balance.Swap`s;
:func:`swap_slots` turns them into the new map (each swap exchanges two experts' slots, an
expert in several swaps ends in its final slot, so its rows travel once), and
``move_slots(old, new, expert_state_tensors(params, optim), group, R)`` moves the rows.

Shape legend: E logical experts of one layer, R ranks in the EP group, S slots per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from balance.placement import Swap

__all__ = ["expert_ranks", "expert_state_tensors", "swap_slots"]


def _slot_map(slot2expert: Any, n_ranks: int) -> tuple[list[int], int]:
    m = np.asarray(slot2expert.tolist() if hasattr(slot2expert, "tolist") else slot2expert)
    if m.ndim != 1 or m.size == 0 or m.dtype.kind not in "iu":
        raise ValueError(f"slot2expert must be a non-empty 1-D sequence of expert ids, got "
                         f"{m.dtype} of shape {list(m.shape)}")
    if not isinstance(n_ranks, int | np.integer) or n_ranks < 1 or m.size % n_ranks:
        raise ValueError(f"{m.size} slots cannot be split evenly over n_ranks={n_ranks!r}")
    return [int(v) for v in m.tolist()], m.size // n_ranks


def expert_ranks(slot2expert: Any, n_ranks: int) -> list[int]:
    """``expert2rank [E]`` (what the swap planners take): the rank of each expert's first
    slot. E = the highest id + 1; every expert 0..E-1 must hold a slot."""
    m, S = _slot_map(slot2expert, n_ranks)
    E = max(m) + 1
    first: dict[int, int] = {}
    for g, e in enumerate(m):
        first.setdefault(e, g)
    if len(first) != E or min(m) < 0:
        missing = sorted(set(range(E)) - set(first))
        raise ValueError(f"slot2expert misses expert(s) {missing[:8]} (or names a negative id)")
    return [first[e] // S for e in range(E)]


def swap_slots(slot2expert: Any, swaps: Sequence[Swap], n_ranks: int) -> list[int]:
    """The slot map after ``swaps`` (in order; each exchanges the slots of its two experts,
    which must hold one slot each, on different ranks); pure, no communication."""
    new, S = _slot_map(slot2expert, n_ranks)
    slot_of = {e: g for g, e in enumerate(new)}
    counts = np.bincount(np.asarray(new), minlength=max(new) + 1)
    for i, s in enumerate(swaps):
        if not isinstance(s, Swap):
            raise ValueError(f"swaps[{i}] is not a balance.Swap: {s!r}")
        a, b = s.expert_a, s.expert_b
        if a not in slot_of or b not in slot_of:
            raise ValueError(f"swap #{i} {s} names an expert that holds no slot "
                             f"(experts 0..{counts.size - 1})")
        if counts[a] != 1 or counts[b] != 1:
            raise ValueError(f"swap #{i} {s}: an expert with replicas cannot be swapped "
                             f"(replica counts {int(counts[a])}, {int(counts[b])})")
        ga, gb = slot_of[a], slot_of[b]
        if ga // S == gb // S:
            raise ValueError(f"swap #{i} {s}: both experts are on rank {ga // S}; a swap must "
                             "join experts on different ranks")
        new[ga], new[gb] = b, a
        slot_of[a], slot_of[b] = gb, ga
    return new


def expert_state_tensors(
    params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
) -> list[torch.Tensor | None]:
    """Per-slot tensors of expert parameters: each param, its ``.grad``, its optimizer state.

    ``params`` are this rank's expert parameters, each ``[S, ...]`` (e.g. the w1/w2/w3 of one
    layer). For each, in order: the parameter, its grad (None if not allocated) and every
    state tensor of ``optimizer`` with the parameter's shape, sorted by state key (Adam:
    ``exp_avg``, ``exp_avg_sq``); scalars such as Adam's ``step`` are shared by all slots and
    stay. Ranks with identical models and optimizers get identical list structures, which
    :func:`balance.move_slots` relies on.
    """
    out: list[torch.Tensor | None] = []
    for p in params:
        out += [_local(p), _local(p.grad)]
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key in sorted(state, key=str):
            v = state[key]
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                out.append(_local(v))
    return out


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's local shard (ZeRO-3 shards expert stacks on a dim > 0, so the shard keeps
    every slot row: moving its rows moves this rank's columns of each expert), else t."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
