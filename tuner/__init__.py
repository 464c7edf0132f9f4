"""tuner: analytic resource model, platform descriptions, micro-benchmarks, Optuna planner.

Public API: `Platform`, `load_platform`, `platform_names`, `ParallelPlan`, `PrecisionPolicy`,
`Assumptions`, `estimate` -> `Estimate` (with per-stage `StageMemory`), `stage_memory`.
Command line: `python -m tuner plan | reproduce-paper | measure` (see `tuner.cli`).
"""

from __future__ import annotations

from tuner.estimate import Estimate, StageMemory, estimate, stage_memory
from tuner.layout import Assumptions, ParallelPlan, PrecisionPolicy
from tuner.platform import Platform, load_platform, platform_names

__all__ = [
    "Assumptions",
    "Estimate",
    "ParallelPlan",
    "Platform",
    "PrecisionPolicy",
    "StageMemory",
    "estimate",
    "load_platform",
    "platform_names",
    "stage_memory",
]
