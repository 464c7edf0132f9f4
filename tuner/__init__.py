"""tuner: analytic resource model, platform descriptions, micro-benchmarks, Optuna planner.

Public API: `Platform`, `load_platform`, `platform_names`, `ParallelPlan` (degrees, schedule,
micro-batches, all-to-all and its overlap, checkpointing, EP placement, `zero` level 0/1/2
and `redundant` expert slots per EP rank), `PrecisionPolicy`, `Assumptions` (incl. `zero_sharding`,
`zero2_grad_sync`), `estimate` -> `Estimate` (with per-stage `StageMemory`), `stage_memory`;
search: `SearchSpace`, `Evaluator`, `exhaustive`, `optuna_search` -> `SearchResult`;
planning: `PlanRequest`, `run_plan`, `PlanError`; `tuner.launch` runs a plan for real on this
machine (CPU processes) and reads back its measured step time and memory.
Command line: `python -m tuner plan | reproduce-paper | measure` (see `tuner.cli`).
"""

from __future__ import annotations

from tuner.estimate import Estimate, StageMemory, estimate, stage_memory
from tuner.layout import Assumptions, ParallelPlan, PrecisionPolicy
from tuner.planner import PlanError, PlanRequest, run_plan
from tuner.platform import Platform, load_platform, platform_names
from tuner.search import Evaluator, SearchResult, exhaustive, optuna_search
from tuner.space import SearchSpace

__all__ = [
    "Assumptions",
    "Estimate",
    "Evaluator",
    "ParallelPlan",
    "PlanError",
    "PlanRequest",
    "Platform",
    "PrecisionPolicy",
    "SearchResult",
    "SearchSpace",
    "StageMemory",
    "estimate",
    "exhaustive",
    "load_platform",
    "optuna_search",
    "platform_names",
    "run_plan",
    "stage_memory",
]
