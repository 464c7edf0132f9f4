"""`python -m tuner plan`: search, explain infeasible requests, write the plan and launch files.

A request that cannot be served ends in `PlanError` with a message that says what would work:
a GPU count that does not fill nodes names the two nearest usable counts; a model that does
not fit names the smallest GPU count (doubling) at which its leanest layout fits, and the
memory that layout would need on the requested count. With redundant expert slots
(`PlanRequest.redundant`, fixed by the user: the planner cannot see the routing load that
decides it) that fit only without them, it says how much memory the extra slots need, how
much the leanest layout leaves them, and the largest r that fits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from model import ModelConfig
from tuner.layout import (
    DEFAULT_ASSUMPTIONS,
    PUBLISHED_PRECISION,
    ZERO_LEVELS,
    Assumptions,
    PrecisionPolicy,
    check_zero_levels,
    precision_policy,
)
from tuner.platform import Platform
from tuner.search import Candidate, Evaluator, SearchResult, exhaustive, optuna_search
from tuner.space import OVERLAP_CHOICES, SearchSpace, check_gpu_count, check_overlap_modes

__all__ = ["PlanError", "PlanRequest", "PlanOutput", "leanest_memory", "run_plan"]


class PlanError(ValueError):
    """A planning request that cannot be served; the message says what would."""


SEARCHES = ("auto", "tpe", "exhaustive")  # PlanRequest.search


@dataclass(frozen=True)
class PlanRequest:
    model: str
    platform: str
    n_gpus: int
    seq_len: int
    global_batch: int
    trials: int = 300
    seed: int = 0
    storage: str | None = None  # e.g. sqlite:///study.db; None = in memory
    zero: tuple[int, ...] = ZERO_LEVELS  # ZeRO levels searched
    redundant: int = 0  # redundant expert slots per EP rank and MoE layer (fixed, not searched)
    a2a_overlap: tuple[str, ...] = OVERLAP_CHOICES  # all-to-all overlap modes searched
    # "tpe": the seeded Optuna study of `trials` trials; "exhaustive": every point, by branch
    # and bound (the optimum of the model, at the cost of one pass over the space); "auto":
    # exhaustive with the closed-form all-to-all model (its bound prunes), tpe with netsim
    # (every evaluation simulates the exchange's flows: a pass over the space is too long)
    search: str = "auto"

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ValueError(f"--search {self.search!r}; valid: {', '.join(SEARCHES)}")
        check_zero_levels(self.zero)
        check_overlap_modes(self.a2a_overlap, what="--a2a-overlap")
        if isinstance(self.redundant, bool) or not isinstance(self.redundant, int) \
                or self.redundant < 0:
            raise ValueError(f"--redundant {self.redundant!r}: redundant expert slots per EP "
                             f"rank must be an int >= 0 (0 = one slot per expert)")


@dataclass
class PlanOutput:
    result: SearchResult
    space: SearchSpace
    plan_path: Path | None = None
    sbatch_path: Path | None = None
    plot_path: Path | None = None
    launch: list[str] | None = None


def leanest_memory(cfg: ModelConfig, platform: Platform, n_gpus: int, global_batch: int,
                   seq_len: int, precision: PrecisionPolicy = PUBLISHED_PRECISION,
                   assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
                   zero: tuple[int, ...] = ZERO_LEVELS, redundant: int = 0,
                   a2a_overlap: tuple[str, ...] = OVERLAP_CHOICES
                   ) -> tuple[float, dict] | None:
    """Smallest peak memory of any structurally valid layout with the memory-leanest choices
    (full recompute, one sequence per micro-batch, 1F1B, the ZeRO level of `zero` that needs
    least, the lower one on a tie; the leanest overlap mode of `a2a_overlap` the layout
    allows: none, then layer (the same memory), then fb, which refuses full recompute and
    takes selective, else none) and `redundant` slots, and that layout's point."""
    space = SearchSpace.default(cfg, platform, n_gpus, global_batch, seq_len, mbs=(1,), zero=zero,
                                redundant=redundant, a2a_overlap=a2a_overlap)
    ev = Evaluator(space, cfg, platform, precision, assumptions)
    best: tuple[float, dict] | None = None
    for pp in space.choices["pp"]:
        for ep in space.choices["ep"]:
            for z in space.choices["zero"]:  # ascending: a tie keeps the lower level
                c, pt = _leanest_point(ev, {"pp": pp, "ep": ep, "mbs": 1, "schedule": "1f1b",
                                            "alltoall": "flat", "placement": "local", "zero": z})
                if c is not None and c.peak_memory is not None \
                        and (best is None or c.peak_memory < best[0]):
                    best = (c.peak_memory, pt)
    return best


def _leanest_point(ev: Evaluator, base: dict) -> tuple[Candidate | None, dict]:
    """The first structurally valid point of `base` with the leanest overlap mode and
    recompute: modes in `OVERLAP_CHOICES` order (none and layer hold the same activations,
    fb more), recompute full, then selective, then none."""
    pt = base
    for mode in ev.space.choices["a2a_overlap"]:
        for ckpt in ("full", "selective", "none"):
            pt = {**base, "checkpointing": ckpt, "a2a_overlap": mode}
            if ev.space.reject(pt) is None:
                return ev(pt), pt
    return None, pt


def _explain_no_fit(cfg: ModelConfig, platform: Platform, req: PlanRequest,
                    precision: PrecisionPolicy = PUBLISHED_PRECISION,
                    assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> str:
    lean = leanest_memory(cfg, platform, req.n_gpus, req.global_batch, req.seq_len, precision,
                          assumptions, zero=req.zero, redundant=req.redundant,
                          a2a_overlap=req.a2a_overlap)
    usable = platform.usable_hbm / 1e9
    if req.redundant and lean is not None:
        msg = _explain_redundant(cfg, platform, req, lean, precision, assumptions)
        if msg:
            return msg
    if lean is None and 0 not in req.zero and leanest_memory(
            cfg, platform, req.n_gpus, req.global_batch, req.seq_len, precision, assumptions,
            zero=(0,), a2a_overlap=req.a2a_overlap) is not None:
        return (f"no layout of {req.n_gpus} GPUs can use ZeRO levels {list(req.zero)}: ZeRO > 0 "
                f"needs a replica group of > 1 rank (DP x EP > 1); add 0 to --zero")
    if lean is None and "none" not in req.a2a_overlap and leanest_memory(
            cfg, platform, req.n_gpus, req.global_batch, req.seq_len, precision, assumptions,
            zero=req.zero, a2a_overlap=("none",)) is not None:
        return (f"no layout of {req.n_gpus} GPUs can run --a2a-overlap "
                f"{','.join(req.a2a_overlap)}: overlap needs an all-to-all (EP > 1), and fb "
                f"what train.py asks of it (trainer.layout.fb_problems: micro-batches, "
                f"schedule, recompute); add none to --a2a-overlap")
    if lean is None:
        return (f"no layout of {req.n_gpus} GPUs satisfies the structural constraints for "
                f"{cfg.name} with global batch {req.global_batch}: choose a global batch that is a "
                f"multiple of {req.n_gpus} (so every data shard gets whole sequences)")
    msg = (f"{cfg.name} does not fit on {req.n_gpus} x {platform.name} GPUs: its leanest layout "
           f"(pp={lean[1]['pp']}, ep={lean[1]['ep']}, ZeRO-{lean[1]['zero']}, "
           f"{lean[1]['checkpointing']} recompute, 1 "
           f"sequence per micro-batch) "
           f"needs {lean[0] / 1e9:.1f} GB per GPU, usable HBM is {usable:.1f} GB")
    n = req.n_gpus
    for _ in range(12):
        n *= 2
        try:
            check_gpu_count(n, platform)
            got = leanest_memory(cfg, platform, n, max(req.global_batch, n), req.seq_len,
                                 precision, assumptions, zero=req.zero, redundant=req.redundant,
                                 a2a_overlap=req.a2a_overlap)
        except ValueError:
            continue
        if got is not None and got[0] <= platform.usable_hbm:
            return msg + (f". It would fit on {n} GPUs (pp={got[1]['pp']}, ep={got[1]['ep']}, "
                          f"ZeRO-{got[1]['zero']}: {got[0] / 1e9:.1f} GB)")
    return msg + ". No GPU count up to 4096x the request fits: reduce seq_len or the model"


def _explain_redundant(cfg: ModelConfig, platform: Platform, req: PlanRequest,
                       lean: tuple[float, dict], precision: PrecisionPolicy,
                       assumptions: Assumptions) -> str:
    """When the model fits without its redundant slots but not with them: what they need on
    the leanest layout with them, what that layout leaves free, and the largest r that fits;
    "" when the model does not fit even without them."""
    from tuner.estimate import stage_memory

    args = (cfg, platform, req.n_gpus, req.global_batch, req.seq_len, precision, assumptions)
    if (base := leanest_memory(*args, zero=req.zero, a2a_overlap=req.a2a_overlap)) is None \
            or base[0] > platform.usable_hbm:
        return ""
    space = SearchSpace.default(cfg, platform, req.n_gpus, req.global_batch, req.seq_len,
                                mbs=(1,), zero=req.zero, redundant=req.redundant,
                                a2a_overlap=req.a2a_overlap)
    plan = space.to_plan(lean[1])
    with_r = stage_memory(cfg, plan, platform, precision, assumptions)
    without = max(s.total for s in stage_memory(cfg, plan.replace(redundant=0), platform,
                                                precision, assumptions))
    peak = max(with_r, key=lambda s: s.total)
    # r = lo fits, r = hi does not: bisect (the leanest memory grows with r)
    (lo, fit), hi = (0, base), req.redundant
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = leanest_memory(*args, zero=req.zero, redundant=mid, a2a_overlap=req.a2a_overlap)
        (lo, fit), hi = ((mid, got), hi) if got is not None and got[0] <= platform.usable_hbm \
            else ((lo, fit), mid)
    p, q = lean[1], fit[1]
    usable = platform.usable_hbm
    left = (f"available: {_gb(usable - without)} of the {_gb(usable)} usable HBM beside the rest "
            f"of that layout ({_gb(without)})" if without <= usable else
            f"available: none, that layout needs {_gb(without)} even without them (usable HBM "
            f"{_gb(usable)}; only EP degrees that host {req.redundant} slots qualify)")
    return (f"--redundant {req.redundant}: the {req.redundant} redundant expert slots per MoE "
            f"layer need {_gb(peak.redundant_bytes)} per GPU (weights, gradients and optimizer "
            f"state at ZeRO-{p['zero']}) on the leanest layout that hosts them (pp={p['pp']}, "
            f"ep={p['ep']}, {p['checkpointing']} recompute, 1 sequence per micro-batch: "
            f"{_gb(lean[0])} with "
            f"them); {left}; at most --redundant {lo} fits on {req.n_gpus} x {platform.name} "
            f"GPUs (valid: 0..{lo}; its leanest layout: pp={q['pp']}, ep={q['ep']}, "
            f"ZeRO-{q['zero']}, {_gb(fit[0])})")


def _point(pt: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in pt.items())


def _gb(nbytes: float) -> str:
    """Bytes as GB with three significant digits (planning spans MB-sized toys to TB)."""
    return f"{nbytes / 1e9:.3g} GB"


def run_plan(cfg: ModelConfig, platform: Platform, req: PlanRequest, out_dir: Path | None,
             precision: PrecisionPolicy | None = None,
             assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> PlanOutput:
    """Search the layouts of `req`; write plan, sbatch script and plot under `out_dir`.

    `precision`: None (default) = what train.py holds and sends on the platform's backend
    (`tuner.layout.precision_policy("trainer", backend)`). The plan file is the fastest
    layout train.py runs (`SearchResult.best_runnable`); a faster one it cannot run yet stays
    in the ranking (`SearchResult.best`), and the command line reports both."""
    if precision is None:
        precision = precision_policy("trainer", platform.backend)
    from tuner.report import launch_lines, plan_toml, plot_frontier, sbatch_script

    search = req.search
    if search == "auto":
        search = "exhaustive" if assumptions.alltoall_model == "closed-form" else "tpe"
    if search == "exhaustive" and req.storage:
        raise PlanError(f"--storage {req.storage!r} resumes a TPE study; the search here is "
                        f"exhaustive (--search {req.search}): add --search tpe, or drop "
                        f"--storage")
    try:
        check_gpu_count(req.n_gpus, platform)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if req.global_batch < 1 or req.seq_len < 1:
        raise PlanError(f"global batch {req.global_batch} and seq {req.seq_len} must be >= 1")
    if req.seq_len > cfg.max_seq_len:
        raise PlanError(f"seq {req.seq_len} exceeds {cfg.name}'s max_seq_len {cfg.max_seq_len}")
    try:
        space = SearchSpace.default(cfg, platform, req.n_gpus, req.global_batch, req.seq_len,
                                    zero=req.zero, redundant=req.redundant,
                                    a2a_overlap=req.a2a_overlap)
    except ValueError as e:
        raise PlanError(str(e)) from None
    # The leanest layout decides "cannot fit at all" before any trial runs.
    lean = leanest_memory(cfg, platform, req.n_gpus, req.global_batch, req.seq_len,
                          precision, assumptions, zero=req.zero, redundant=req.redundant,
                          a2a_overlap=req.a2a_overlap)
    if lean is None or lean[0] > platform.usable_hbm:
        raise PlanError(_explain_no_fit(cfg, platform, req, precision, assumptions))
    # Branch and bound skips full evaluations of points that cannot beat the best found.
    ev = Evaluator(space, cfg, platform, precision, assumptions,
                   prune=assumptions.alltoall_model == "closed-form")
    name = f"{cfg.name}|{platform.name}|{req.n_gpus}|s{req.seq_len}|b{req.global_batch}"
    if search == "exhaustive":
        print(f"tuner plan: every one of the {space.size} points of the space (branch and "
              f"bound; --search tpe samples {req.trials} of them instead) ...", flush=True)
        t0 = time.perf_counter()

        def progress(done: int, best: float) -> None:
            got = f"best so far {best:.4g} s per step" if math.isfinite(best) else \
                "no layout fits yet"
            print(f"  {done} of {space.size} points ({100 * done / space.size:.0f} %), {got}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)

        result = exhaustive(ev, progress, every=max(1000, space.size // 10))
    else:
        # The leanest layout goes first, so a study always holds at least one feasible layout.
        result = optuna_search(ev, req.trials, seed=req.seed, storage=req.storage,
                               study_name=name, enqueue=[lean[1]])
    if result.best is None:
        raise PlanError(_explain_no_fit(cfg, platform, req, precision, assumptions))
    if result.best_runnable is None:
        b = result.best
        raise PlanError(
            f"no layout train.py runs fits among the {len(result.ranked)} feasible ones found; "
            f"the best ({_point(b.point)}: {b.step_time:.3g} s per step) needs what the trainer "
            f"lacks: {'; '.join(b.not_runnable)}")
    out = PlanOutput(result, space)
    if out_dir is None:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{cfg.name}-{platform.name}-{req.n_gpus}"
    best = result.best_runnable.estimate  # never a layout train.py cannot run
    assert best is not None
    request = {"model": cfg.name, "platform": platform.name, "gpus": req.n_gpus,
               "seq_len": req.seq_len, "global_batch": req.global_batch, "trials": result.trials}
    out.plan_path = out_dir / f"{stem}.toml"
    hf = req.model if (Path(req.model) / "config.json").is_file() else ""
    out.plan_path.write_text(plan_toml(best, cfg.name, request, hf_path=hf))
    out.launch = launch_lines(out.plan_path, req.n_gpus, platform)
    if platform.launcher == "slurm":
        out.sbatch_path = out_dir / f"{stem}.sbatch"
        out.sbatch_path.write_text(sbatch_script(out.plan_path, req.n_gpus, platform, f"piper-{stem}"))
        out.launch.append(f"sbatch {out.sbatch_path}")
    out.plot_path = plot_frontier(result.ranked, platform.usable_hbm, out_dir / f"{stem}.png",
                                  f"{cfg.name} on {req.n_gpus} x {platform.name}")
    return out
