"""balance: expert load monitor, swap planners and the expert migration executor.

Pure planning (:func:`plan_swaps`, :func:`apply_swaps`) is CPU-side and torch-free; only
:func:`migrate` and the optional all-reduce in :class:`Monitor` touch ``torch.distributed``.
"""

from __future__ import annotations

from balance.migrate import MigrationResult, migrate, permute_slots, placement_of
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
from balance.planner import METHODS, greedy_repack, plan_summary, plan_swaps

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
    "greedy_repack",
    "imbalance",
    "lower_bound",
    "migrate",
    "permute_slots",
    "placement_of",
    "plan_summary",
    "plan_swaps",
    "rank_loads",
    "slot_lower_bound",
    "swaps_between",
]
