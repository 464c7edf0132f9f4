"""Planner search: constraints, TPE against exhaustive enumeration, SQLite resume."""

from __future__ import annotations

import dataclasses

import pytest

from model import presets
from tuner import load_platform
from tuner.search import Evaluator, exhaustive, optuna_search
from tuner.space import SearchSpace, check_gpu_count


@pytest.fixture(scope="module")
def small():
    """Mixtral-8x7B on 64 Frontier GCDs, a reduced space of 768 points (exhaustive: 670
    model calls)."""
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    sp = SearchSpace.default(cfg, pf, 64, 512, 4096, mbs=(1, 2))
    ch = dict(sp.choices, pp=(2, 4, 8, 16), schedule=("1f1b", "zb-h1", "interleaved-1f1b:2"),
              checkpointing=("none", "full"))
    return cfg, pf, dataclasses.replace(sp, choices=ch)


def test_constraints_by_hand(small):
    cfg, pf, sp = small
    base = {"pp": 4, "ep": 8, "mbs": 1, "schedule": "1f1b", "alltoall": "flat",
            "checkpointing": "none", "placement": "local"}
    assert sp.reject(base) is None
    plan = sp.to_plan(base)
    assert (plan.dp, plan.microbatches) == (2, 512 // (2 * 8 * 1))
    assert "does not divide 8 experts" in sp.reject(dict(base, ep=16))
    assert "exceeds 32 layers" in sp.reject(dict(base, pp=16, ep=2, schedule="interleaved-1f1b:4"))
    assert "does not divide global batch" in SearchSpace.default(cfg, pf, 64, 96, 4096).reject(
        dict(base, mbs=4))
    assert 64 not in sp.choices["ep"] and max(sp.choices["ep"]) == 8  # EP <= E and <= 32
    with pytest.raises(ValueError, match="use 8 or 16"):
        check_gpu_count(12, pf)


def test_tpe_within_5_percent_of_exhaustive_in_a_quarter(small):
    cfg, pf, sp = small
    ref = exhaustive(Evaluator(sp, cfg, pf))
    assert ref.trials == sp.size == 768
    budget = sp.size // 4
    ev = Evaluator(sp, cfg, pf)
    # 120 trials: seeds 0-7 all end within 5 % (at trials 50-109) with 139-165 model calls.
    got = optuna_search(ev, n_trials=120, seed=0)
    assert got.trials + got.skipped <= budget
    assert got.evaluations + got.memory_checks <= (ref.evaluations + ref.memory_checks) / 4
    assert got.best.step_time <= 1.05 * ref.best.step_time
    # The ranking is consistent with the model: re-estimating the best gives the same time.
    assert got.best.estimate.fits and got.best.estimate.step_time == got.best.step_time


def test_sqlite_study_resumes(small, tmp_path):
    cfg, pf, sp = small
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = optuna_search(Evaluator(sp, cfg, pf), n_trials=6, seed=1, storage=url, study_name="s")
    again = optuna_search(Evaluator(sp, cfg, pf), n_trials=10, seed=1, storage=url, study_name="s")
    assert (first.trials, again.trials) == (6, 10)
    assert again.best.step_time <= first.best.step_time
