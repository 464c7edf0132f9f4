"""balance: expert load monitor, swap planners and the expert migration executor.

Pure planning (:func:`plan_swaps`, :func:`apply_swaps`) is CPU-side and torch-free; only
:func:`migrate` and the optional all-reduce in :class:`Monitor` touch ``torch.distributed``.

Wiring in a trainer (per EP group; ``expert2slot[l]`` is layer l's ``[E]`` map that the
dispatcher uses, ``w1[l], w2[l], w3[l]`` that layer's ``[S, ...]`` expert weights)::

    mon = Monitor(n_layers, E, ep_size, MigrationPolicy(...), group=ep_group)
    ...every step:
    mon.record(counts_LE)                       # logical-expert token counts of this step
    e2r = [placement_of(m, ep_size) for m in expert2slot]
    for layer, swaps in mon.plan(step, e2r).items():
        res = migrate(swaps, expert2slot[layer],
                      expert_state_tensors([w1[layer], w2[layer], w3[layer]], optimizer),
                      ep_group)
        expert2slot[layer] = res.expert2slot    # save it in checkpoints with mon.state_dict()
"""

from __future__ import annotations

from balance.migrate import (
    MigrationResult,
    expert_state_tensors,
    migrate,
    permute_slots,
    placement_of,
)
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
    "MigrationResult",
    "Monitor",
    "Swap",
    "apply_swaps",
    "as_load",
    "as_placement",
    "count_moves",
    "expert_state_tensors",
    "greedy_repack",
    "imbalance",
    "lower_bound",
    "migrate",
    "move_slots",
    "permute_slots",
    "placement_of",
    "plan_slot_moves",
    "plan_swaps",
    "plan_swaps_within",
    "rank_loads",
    "slot_lower_bound",
    "swaps_between",
]
