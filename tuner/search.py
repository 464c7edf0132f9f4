"""Search over layouts: exhaustive enumeration and a seeded Optuna TPE study.

Optuna only orchestrates (docs/architecture.md, "Conventions"): a trial's choices become a point
of `SearchSpace`; a structural constraint or the memory model rejects it before the time model
runs; otherwise the analytic `estimate` is the objective (predicted step time, minimised; MFU is
its reciprocal up to a constant for a fixed model and batch). Every trial records its prediction
in user attributes, so a study stored in SQLite is a readable log and resumes where it stopped.

Counters: `evaluations` are calls of the full step-time model (distinct points),
`memory_checks` calls of the memory model, `bound_checks` calls of the cheap step-time lower
bound, `trials` all proposals including rejected and repeated ones.

Pruning (`Evaluator(prune=True)`, branch and bound): once a feasible point has been
evaluated, a new memory-feasible point first gets `tuner.estimate.step_time_lower_bound`
(compute, all-to-all bandwidth term, bubble and optimizer; no latencies, P2P or DP sync);
when that bound is already >= the best step time found among layouts train.py runs, the point
cannot win and its full evaluation is skipped (a layout train.py cannot run yet is evaluated
and ranked all the same, `Candidate.not_runnable` saying what is missing; `SearchResult.best`
is the fastest overall, `best_runnable` the one to launch). The ranking is unchanged at its top: a pruned point is slower than
the incumbent. Only for the closed-form all-to-all model, where the bound is proven.
With the all-to-all overlapped (a2a_overlap layer or fb) the bound counts no all-to-all
time at all: the exposed part the step pays (`tuner.costs.a2a_exposed`) is >= 0, and
nothing else the bound keeps (compute, bubble, optimizer) depends on the overlap mode, so it
stays below the step of every point; a point without overlap keeps its all-to-all term,
which overlap cannot remove from it. `tests/test_tuner_search.py` checks the pruned search
against exhaustive enumeration with overlap in the space.

Each point is priced with the chunks its plan file runs (`Evaluator.point_assumptions`,
`tuner.space.overlap_chunks`), not `Assumptions.a2a_chunks`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import optuna

from model import ModelConfig
from tuner.estimate import Estimate, estimate, stage_memory, step_time_lower_bound
from tuner.layout import PUBLISHED_PRECISION, Assumptions, PrecisionPolicy, not_runnable
from tuner.platform import Platform
from tuner.space import Point, SearchSpace, overlap_chunks

__all__ = ["Candidate", "Evaluator", "SearchResult", "exhaustive", "neighbours", "optuna_search"]

_PENALTY = 1e30  # objective of a rejected trial; TPE also sees the constraint value


@dataclass
class Candidate:
    point: Point
    rejected: str | None = None
    peak_memory: float | None = None
    estimate: Estimate | None = None
    lower_bound: float | None = None  # step-time lower bound, when the point was pruned
    not_runnable: list[str] = field(default_factory=list)  # what train.py lacks to run it

    @property
    def step_time(self) -> float:
        return self.estimate.step_time if self.estimate else math.inf

    @property
    def runnable(self) -> bool:
        return not self.not_runnable


@dataclass
class Evaluator:
    """Constraint checks and the model for one request, with a cache and counters."""

    space: SearchSpace
    cfg: ModelConfig
    platform: Platform
    precision: PrecisionPolicy = PUBLISHED_PRECISION
    assumptions: Assumptions = field(default_factory=Assumptions)
    evaluations: int = 0
    memory_checks: int = 0
    prune: bool = False
    bound_checks: int = 0
    incumbent: float = math.inf  # best full step time of a runnable layout evaluated so far
    cache: dict[tuple, Candidate] = field(default_factory=dict)
    _asm: dict[int, Assumptions] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.prune and self.assumptions.alltoall_model != "closed-form":
            raise ValueError("prune=True needs alltoall_model='closed-form' (the lower bound is "
                             f"proven for it only), got {self.assumptions.alltoall_model!r}")

    def point_assumptions(self, overlap: str) -> Assumptions:
        """The assumptions a point with a2a_overlap `overlap` is priced with: this
        evaluator's, with the chunks the plan file will run (`tuner.space.overlap_chunks`:
        2 for layer and fb) in place of `Assumptions.a2a_chunks`, so what is priced is what
        is launched."""
        chunks = overlap_chunks(overlap)
        if not chunks or chunks == self.assumptions.a2a_chunks:
            return self.assumptions
        if chunks not in self._asm:
            self._asm[chunks] = dataclasses.replace(self.assumptions, a2a_chunks=chunks)
        return self._asm[chunks]

    def __call__(self, pt: Point) -> Candidate:
        key = self.space.key(pt)
        if key in self.cache:
            return self.cache[key]
        c = Candidate(dict(pt))
        c.rejected = self.space.reject(pt)
        if c.rejected is None:
            plan = self.space.to_plan(pt)
            asm = self.point_assumptions(plan.a2a_overlap)
            mem = stage_memory(self.cfg, plan, self.platform, self.precision, asm)
            self.memory_checks += 1
            peak = max(mem, key=lambda s: s.total)
            c.peak_memory = peak.total
            if c.peak_memory > self.platform.usable_hbm:
                c.rejected = (f"peak memory {c.peak_memory / 1e9:.1f} GB > usable "
                              f"{self.platform.usable_hbm / 1e9:.1f} GB")
                if plan.redundant:
                    c.rejected += (f" ({peak.redundant_bytes / 1e9:.1f} GB of it the "
                                   f"{plan.redundant} redundant expert slots per MoE layer)")
            else:
                if self.prune and self.incumbent < math.inf:
                    lb = step_time_lower_bound(self.cfg, plan, self.platform, self.precision,
                                               asm, stages=mem)
                    self.bound_checks += 1
                    if lb >= self.incumbent:
                        c.lower_bound = lb
                        c.rejected = (f"bound: step time >= {lb:.3g} s, not better than the best "
                                      f"found {self.incumbent:.3g} s")
                        self.cache[key] = c
                        return c
                c.estimate = estimate(self.cfg, plan, self.platform, self.precision, asm)
                self.evaluations += 1
                c.not_runnable = not_runnable(plan)
                if c.runnable:  # pruning against the runnable best keeps it and the overall one
                    self.incumbent = min(self.incumbent, c.estimate.step_time)
        self.cache[key] = c
        return c


@dataclass
class SearchResult:
    ranked: list[Candidate]  # feasible, best (shortest step) first
    trials: int
    evaluations: int
    memory_checks: int
    rejected: dict[str, int]  # reason kind (structure, memory, bound) -> count
    study_name: str = ""
    bound_checks: int = 0
    history: list[float] = field(default_factory=list)  # best step time after each proposal
    skipped: int = 0  # neighbours rejected by a structural constraint before becoming trials
    study: optuna.Study | None = None  # the Optuna study (None for exhaustive enumeration)

    @property
    def best(self) -> Candidate | None:
        """The fastest feasible layout, whether train.py runs it or not."""
        return self.ranked[0] if self.ranked else None

    @property
    def best_runnable(self) -> Candidate | None:
        """The fastest feasible layout train.py runs: the plan to launch."""
        return next((c for c in self.ranked if c.runnable), None)


def _result(ev: Evaluator, cands: list[Candidate], trials: int, name: str = "") -> SearchResult:
    feasible = {ev.space.key(c.point): c for c in cands if c.estimate is not None}
    # Ties (ZeRO-2 with M > 1 micro-batches holds and moves what ZeRO-1 does) go to the lower
    # ZeRO level: the same step for less machinery.
    ranked = sorted(feasible.values(), key=lambda c: (c.step_time, c.point.get("zero", 0)))
    rejected: dict[str, int] = {}
    for c in cands:
        if c.rejected:
            kind = "memory" if c.rejected.startswith("peak memory") else \
                "bound" if c.rejected.startswith("bound") else "structure"
            rejected[kind] = rejected.get(kind, 0) + 1
    history, best = [], math.inf
    for c in cands:
        best = min(best, c.step_time)
        history.append(best)
    return SearchResult(ranked, trials, ev.evaluations, ev.memory_checks, rejected, name,
                        ev.bound_checks, history)


def exhaustive(ev: Evaluator, progress: Callable[[int, float], None] | None = None,
               every: int = 10000) -> SearchResult:
    """Evaluate every point of the space (the reference the planner is judged against).
    `progress(points done, best step time so far)` is called every `every` points."""
    if every < 1:
        raise ValueError(f"every={every} must be >= 1")
    cands, best = [], math.inf
    for i, pt in enumerate(ev.space.points(), 1):
        c = ev(pt)
        cands.append(c)
        best = min(best, c.step_time)
        if progress is not None and i % every == 0:
            progress(i, best)
    return _result(ev, cands, len(cands))


# Degrees and sizes are ordered: as integer indexes into their sorted choices TPE's Parzen
# estimators carry what one value taught to its neighbours (pp=16 good -> try pp=8, 32), which
# unordered categoricals cannot; on the tests' Mixtral space this halves the trials needed.
# ZeRO levels are ordered too (each shards more state than the one before).
ORDINAL = ("pp", "ep", "mbs", "zero")


def _from_params(space: SearchSpace, params: dict) -> Point:
    return {n: space.choices[n][params[n]] if n in ORDINAL else params[n] for n in space.choices}


def _to_params(space: SearchSpace, pt: Point) -> dict:
    return {n: space.choices[n].index(pt[n]) if n in ORDINAL else pt[n] for n in space.choices}


def _storage(url: str | None) -> optuna.storages.BaseStorage | None:
    """SQLite in WAL mode without fsync (a crash of the OS, not of Python, may lose the last
    trials; the study stays readable): a trial makes ~10 small writes, and a
    synchronous commit each costs tens of ms on a shared disk (60 trials took 40 s)."""
    if url is None or not url.startswith("sqlite:"):
        return url
    import sqlalchemy

    st = optuna.storages.RDBStorage(url)

    @sqlalchemy.event.listens_for(st.engine, "connect")
    def _pragmas(conn, _record) -> None:  # noqa: ANN001 - DBAPI objects
        cur = conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=OFF")
        cur.close()

    st.engine.dispose()  # connections opened during set-up reconnect with the pragmas
    return st


def optuna_search(ev: Evaluator, n_trials: int, seed: int = 0, storage: str | None = None,
                  study_name: str = "tuner", multivariate: bool = True,
                  enqueue: list[Point] | None = None, polish: float = 0.6) -> SearchResult:
    """Run (or resume) a study until it holds `n_trials` trials; return its ranking.

    The first (1 - polish) of the trials are TPE's. The rest polish its findings by best-first
    local search: the best evaluated point not yet expanded has its one-step neighbours
    (`neighbours`) enqueued as trials, and so on. TPE alone stalls a few % off the optimum
    when reaching it takes two coupled moves (pp 16 -> 8 *and* ep 2 -> 8); the neighbour
    walk crosses such ridges through the second-best points. Neighbours that fail a
    structural constraint are skipped before a trial is made (counted in `skipped`).
    polish=0.6: over 5-8 seeds on DeepSeek-V3 / 1024 GCDs and the tests' Mixtral space it
    reached the optimum sooner than 0.3 (median trial 176 vs 258) and kept TPE's global
    exploration that pure local search (0.8+) gives up.
    Points in `enqueue` are tried first (when the study is new)."""
    if not 0.0 <= polish < 1.0:
        raise ValueError(f"polish={polish} must be in [0, 1)")
    if n_trials < 1:
        raise ValueError(f"n_trials={n_trials} must be >= 1")
    optuna.logging.set_verbosity(logging.WARNING)

    # multivariate + group TPE models the joint choice (pp, ep, mbs interact through DP, M
    # and memory): on DeepSeek-V3 / 1024 GCDs it reaches the exhaustive optimum in fewer
    # trials than independent (univariate) choices (benchmarks/bench_tuner.py).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(
            seed=seed, multivariate=multivariate, group=multivariate, n_startup_trials=20,
        )
    study = optuna.create_study(study_name=study_name, storage=_storage(storage), sampler=sampler,
                                direction="minimize", load_if_exists=True)
    cands: list[Candidate] = []

    def objective(trial: optuna.Trial) -> float:
        pt = _from_params(ev.space, {
            n: trial.suggest_int(n, 0, len(ch) - 1) if n in ORDINAL else trial.suggest_categorical(n, list(ch))
            for n, ch in ev.space.choices.items()})
        c = ev(pt)
        cands.append(c)
        if c.estimate is None:
            if c.lower_bound is not None:  # feasible but pruned: no better than the incumbent
                assert c.peak_memory is not None  # pruned points passed the memory check
                trial.set_constraint("memory", c.peak_memory / ev.platform.usable_hbm - 1)
                trial.set_user_attr("prediction", {"pruned": c.rejected,
                                                   "step_time_lower_bound_s": c.lower_bound})
                return c.lower_bound
            # TPE ranks infeasible trials by their summed violation.
            if c.peak_memory is None:
                trial.set_constraint("structure", 1.0)
                trial.set_user_attr("prediction", {"rejected": c.rejected})
            else:
                trial.set_constraint("memory", c.peak_memory / ev.platform.usable_hbm - 1)
                trial.set_user_attr("prediction", {"rejected": c.rejected,
                                                   "peak_memory_gb": c.peak_memory / 1e9})
            return _PENALTY
        e = c.estimate
        trial.set_constraint("memory", e.peak_memory / ev.platform.usable_hbm - 1)
        # One attribute per trial: every attribute is a database write with SQLite storage.
        trial.set_user_attr("prediction", {
            "peak_memory_gb": e.peak_memory / 1e9, "mfu": e.mfu,
            "tflops_per_gpu": e.tflops_per_gpu, **{f"{k}_s": float(v) for k, v in e.time.items()},
            **({"not_runnable_because": c.not_runnable} if c.not_runnable else {}),
        })
        return e.step_time

    done = len(study.trials)
    if not done:
        for pt in enqueue or []:
            study.enqueue_trial(_to_params(ev.space, pt))
    # Earlier trials of a resumed study count: re-evaluate their points (cheap) so the
    # ranking covers the whole study.
    for t in study.trials:
        if t.state == optuna.trial.TrialState.COMPLETE and set(t.params) == set(ev.space.choices):
            cands.append(ev(_from_params(ev.space, t.params)))
    explore = n_trials - int(n_trials * polish)
    if done < explore:
        study.optimize(objective, n_trials=explore - done)
    expanded: set[tuple] = set()
    skipped = 0
    while len(study.trials) < n_trials:
        # Feasible points by step time, then memory-rejected ones by peak memory: with no
        # feasible point yet the walk moves towards layouts that fit.
        ranked = sorted((c for c in ev.cache.values() if c.peak_memory is not None),
                        key=lambda c: (c.estimate is None, c.step_time if c.estimate else c.peak_memory))
        nxt = next((c for c in ranked if ev.space.key(c.point) not in expanded), None)
        if nxt is None:
            break
        expanded.add(ev.space.key(nxt.point))
        fresh = [p for p in neighbours(ev.space, nxt.point) if ev.space.key(p) not in ev.cache]
        valid = [p for p in fresh if ev.space.reject(p) is None]
        skipped += len(fresh) - len(valid)
        valid = valid[: n_trials - len(study.trials)]
        for p in valid:
            study.enqueue_trial(_to_params(ev.space, p))
        if valid:
            study.optimize(objective, n_trials=len(valid))
    if len(study.trials) < n_trials:  # nothing left to polish: back to TPE
        study.optimize(objective, n_trials=n_trials - len(study.trials))
    res = _result(ev, cands, len(study.trials), study_name)
    res.skipped = skipped
    res.study = study
    return res


def neighbours(space: SearchSpace, pt: Point) -> list[Point]:
    """Points one step away: an ordinal choice moved to the next smaller or larger value, or
    a categorical choice set to any other value; a step onto a variant the space keeps once
    (pp = 1, ep = 1) lands on the kept one (`SearchSpace.canonical`), so such a move is not
    lost to the rejection of the variant."""
    out: list[Point] = []
    seen = {space.key(pt)}
    for n, ch in space.choices.items():
        i = ch.index(pt[n])
        alts = [ch[j] for j in (i - 1, i + 1) if 0 <= j < len(ch)] if n in ORDINAL else \
            [v for v in ch if v != pt[n]]
        for v in alts:
            q = space.canonical(dict(pt, **{n: v}))
            if space.key(q) not in seen:
                seen.add(space.key(q))
                out.append(q)
    return out
