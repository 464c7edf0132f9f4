"""Layouts for a running job that lost (or regained) GPUs: the planner, asked by train.py.

`trainer.elastic` decides when an attempt must re-plan (its world size differs from the
checkpoint's) and applies the answer; it cannot import the planner (the trainer sits below the
tuner in the import graph), so train.py hands it `runnable_layouts`, which runs the same search
as `python -m tuner plan` for the same model, sequence length and global batch on the GPUs the
attempt has, and returns every layout train.py runs, fastest first, as the `[run.*]` sections
a plan file would hold (`tuner.report.run_sections`). The global batch is a constraint of the
search space (M = global batch / (dp x micro-batch size)), so every layout keeps it and changes
only the micro-batches / gradient accumulation; a request no layout serves ends in
`tuner.planner.PlanError` naming why (e.g. a global batch the new data shards cannot split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model import ModelConfig

__all__ = ["Proposal", "runnable_layouts"]


@dataclass(frozen=True)
class Proposal:
    """One planned layout: the run config sections to apply and what the planner predicts."""

    sections: dict[str, dict[str, Any]]  # {"parallel": {...}, "comm": {...}, "train": {...}}
    step_time_s: float
    peak_memory_gb: float
    platform: str  # the platform's name


def runnable_layouts(mcfg: ModelConfig, platform: str, n_gpus: int, seq_len: int,
                     global_batch: int, redundant: int = 0, trials: int = 100,
                     seed: int = 0) -> list[Proposal]:
    """The runnable layouts of `n_gpus` GPUs of `platform` (a name under configs/platforms or a
    TOML path), fastest first; a PlanError (ValueError) names why there is none."""
    import optuna

    from tuner.planner import PlanRequest, run_plan
    from tuner.platform import load_platform
    from tuner.report import run_sections

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial otherwise
    plat = load_platform(platform)
    req = PlanRequest(model=mcfg.name, platform=plat.name, n_gpus=n_gpus, seq_len=seq_len,
                      global_batch=global_batch, trials=trials, seed=seed, redundant=redundant,
                      search="tpe")  # a resize waits on it: seconds, not a pass over the space
    out = run_plan(mcfg, plat, req, None)
    props = []
    for c in out.result.ranked:
        if not c.runnable or c.estimate is None:
            continue
        e = c.estimate
        props.append(Proposal(run_sections(e.plan, mcfg.n_layers), float(e.step_time),
                              float(e.peak_memory) / 1e9, plat.name))
    return props
