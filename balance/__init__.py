"""balance: expert load monitor, swap and replica planners, and the one placement executor.

A layer's placement is one slot map ``slot2expert [R * S]`` (slot g on rank g // S holds
logical expert slot2expert[g]; with redundant slots an expert holds several). Pure planning
(:func:`plan_swaps`, :func:`apply_swaps` on ``expert2rank``, :func:`plan_replicas` on slot
maps) is CPU-side and torch-free; swaps become a new slot map (:func:`swap_slots`); only
:func:`move_slots` (the executor of every placement change) and the optional all-reduce in
:class:`Monitor` touch ``torch.distributed``.

Wiring in a trainer (per EP group; ``slot2expert[l]`` is layer l's map, ``w1[l], w2[l], w3[l]``
that layer's ``[S, ...]`` expert weights)::

    mon = Monitor(n_layers, E, ep_size, MigrationPolicy(...), group=ep_group)
    ...every step:
    mon.record(counts_LE)                       # logical-expert token counts of this step
    e2r = [expert_ranks(m, ep_size) for m in slot2expert]
    for layer, swaps in mon.plan(step, e2r).items():
        new = swap_slots(slot2expert[layer], swaps, ep_size)
        move_slots(slot2expert[layer], new,
                   expert_state_tensors([w1[layer], w2[layer], w3[layer]], optimizer),
                   ep_group, ep_size)
        slot2expert[layer] = new                # save it in checkpoints with mon.state_dict()
"""

from __future__ import annotations

from balance.migrate import expert_ranks, expert_state_tensors, swap_slots
from balance.monitor import MigrationPolicy, Monitor
from balance.placement import (
    Swap,
    apply_swaps,
    as_load,
    as_placement,
    count_moves,
    imbalance,
    lower_bound,
    rank_loads,
    slot_lower_bound,
    swaps_between,
)
from balance.planner import METHODS, greedy_repack, plan_swaps, plan_swaps_within
from balance.replica_move import move_slots, plan_slot_moves

__all__ = [
    "METHODS",
    "MigrationPolicy",
    "Monitor",
    "Swap",
    "apply_swaps",
    "as_load",
    "as_placement",
    "count_moves",
    "expert_ranks",
    "expert_state_tensors",
    "greedy_repack",
    "imbalance",
    "lower_bound",
    "move_slots",
    "plan_slot_moves",
    "plan_swaps",
    "plan_swaps_within",
    "rank_loads",
    "slot_lower_bound",
    "swap_slots",
    "swaps_between",
]
