"""Elastic restarts: an attempt with another world size than its checkpoint re-plans the layout.

Under torchrun's elastic agent (`--nnodes=MIN:MAX --rdzv-backend c10d`) a lost node ends the
attempt and the survivors start a new one with fewer ranks; a node that comes back makes the
agents restart once more with more. `resolve()` runs in train.py before `prepare()` and decides
which layout this attempt trains with (`--train.resume` must name a checkpoint source):

    checkpoint world == this world   the configured layout, or the checkpoint's own layout when
                                     that one was re-planned (an attempt after a re-plan keeps
                                     it instead of planning again)
    world differs, --train.replan=off  the configured layout if it fits this world (today's
                                     behaviour); else a ConfigError naming both worlds and why
    world differs, --train.replan=auto the configured layout when this is the world it was
                                     configured for (the node came back), else rank 0 asks the
                                     planner (`Planner`, train.py passes `tuner.replan`) for the
                                     same model, sequence and global batch on this world, takes
                                     the fastest layout the trainer accepts, and broadcasts it

The chosen layout replaces the run config's layout fields (`LAYOUT_FIELDS`); the global batch
never changes (the planner keeps it; only micro-batches / gradient accumulation move). What
carries across is the checkpoint's: weights and AdamW state by logical key under any
PP/EP/DP/ZeRO (trainer/checkpoint.py), the step (so the LR schedule and the data order, both
functions of the step and the global batch, continue where they stopped: no window is read
twice or skipped), the migration monitor's window, and the expert placement, re-balanced from
the recorded load when the EP size changed (`remap_placement`). Rank 0 logs what changed and
why, and appends the decision to `<out_dir>/elastic.jsonl`.
"""

from __future__ import annotations

import copy
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .checkpoint import CheckpointError, find_latest, read_meta
from .common import log
from .config import ConfigError, RunConfig, apply_dict
from .setup import (
    REPLAN_MODES,
    build_model_config,
    check_elastic,
    layout_problem,
    replan_platform,
)

__all__ = ["REPLAN_MODES", "LAYOUT_FIELDS", "Planner", "Decision", "decide",
           "resolve", "layout_problem", "with_layout", "remap_placement", "LoadRecord",
           "checkpoint_world"]

# the run config fields a layout consists of (what a plan file's [run.*] sets, plus tp/sp)
LAYOUT_FIELDS: dict[str, tuple[str, ...]] = {
    "parallel": ("pp", "ep", "dp", "tp", "sp", "schedule", "microbatches", "n_virtual",
                 "layer_split", "ep_placement", "zero"),
    "comm": ("alltoall", "a2a_overlap", "a2a_chunks"),  # the planner searches the overlap too
    "train": ("checkpointing",),
}
class Proposal(Protocol):
    """One layout the planner proposes (`tuner.replan.Proposal`)."""

    sections: dict[str, dict[str, Any]]
    step_time_s: float
    peak_memory_gb: float
    platform: str


class Planner(Protocol):
    """`tuner.replan.runnable_layouts`: runnable layouts of n_gpus, fastest first."""

    def __call__(self, mcfg: Any, platform: str, n_gpus: int, seq_len: int, global_batch: int,
                 redundant: int = 0, trials: int = 100) -> Sequence[Proposal]: ...


def checkpoint_world(meta: dict[str, Any]) -> int:
    """Ranks of the run that wrote a checkpoint (world = pp x dp x ep; tp folds into dp x ep)."""
    m = meta.get("mesh") or {}
    return int(m.get("pp", 1)) * int(m.get("dp", 1)) * int(m.get("ep", 1))


def layout_of(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The layout fields of a run config dict (`RunConfig.to_dict()`, a checkpoint's "run")."""
    return {s: {f: run[s][f] for f in fs if f in run.get(s, {})} for s, fs in LAYOUT_FIELDS.items()}


def _checkpoint_layout(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The layout a checkpoint was written under, with the degrees its mesh really had."""
    lay = layout_of(meta["run"])
    for k, v in (meta.get("mesh") or {}).items():
        lay["parallel"][k] = v
    return lay


def with_layout(cfg: RunConfig, sections: dict[str, dict[str, Any]]) -> RunConfig:
    """A copy of `cfg` with its layout fields replaced: those `sections` names, the defaults for
    the rest (a layer split or TP degree of the old layout does not fit a new one)."""
    new = copy.deepcopy(cfg)
    fresh = RunConfig()
    for s, fs in LAYOUT_FIELDS.items():
        for f in fs:
            setattr(getattr(new, s), f, getattr(getattr(fresh, s), f))
    sections = {s: {f: v for f, v in body.items() if s in LAYOUT_FIELDS and f in LAYOUT_FIELDS[s]
                    or (s, f) == ("balance", "redundant")} for s, body in sections.items()}
    apply_dict(new, sections, "the re-planned layout")
    return new


def _describe(lay: dict[str, dict[str, Any]]) -> str:
    p = lay["parallel"]
    return (f"pp={p['pp']} x dp={p['dp'] or 'auto'} x ep={p['ep']}"
            + (f" x tp={p['tp']}" if p.get("tp", 1) > 1 else ""))


def _changes(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict:
    """{"section.field": [before, after]} of the layout fields that differ."""
    out = {}
    for s, fs in LAYOUT_FIELDS.items():
        for f in fs:
            a, b = before.get(s, {}).get(f), after.get(s, {}).get(f)
            if a != b:
                out[f"{s}.{f}"] = [a, b]
    return out


@dataclass
class Decision:
    """What `decide` found: `kind` none | keep-replanned | configured | replan | refuse."""

    kind: str
    checkpoint: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    ckpt_world: int = 0
    reason: str = ""


def _resume_path(cfg: RunConfig) -> Path | None:
    t = cfg.train
    if not t.resume:
        return None
    if t.resume in ("latest", "auto"):
        return find_latest(Path(t.out_dir) / "checkpoints")
    return Path(t.resume)


def decide(cfg: RunConfig, mcfg: Any, world: int) -> Decision:
    """Which layout this attempt needs (reads the checkpoint's meta.json only; no collective)."""
    path = _resume_path(cfg)
    if path is None or not (path / "meta.json").is_file():
        # no complete checkpoint yet (e.g. a node lost while the first one was written): with
        # auto, a start that the configured layout cannot hold is planned for this world
        problem = layout_problem(cfg, mcfg, world) \
            if cfg.train.replan == "auto" and cfg.train.resume == "auto" else ""
        if problem:
            return Decision("replan", None, {}, 0,
                            f"no complete checkpoint yet and the configured layout does not fit "
                            f"this attempt's {world} ranks ({problem})")
        return Decision("none")  # prepare() names a missing or incomplete checkpoint
    try:
        meta = read_meta(path)
    except CheckpointError:
        return Decision("none")
    w0 = checkpoint_world(meta)
    el = meta.get("elastic") or {}
    d = Decision("none", path, meta, w0)
    problem = layout_problem(cfg, mcfg, world)
    if w0 == world:
        if cfg.train.replan == "auto" and el.get("replanned") and "run" in meta:
            d.kind, d.reason = "keep-replanned", (f"checkpoint {path.name} was written by {w0} "
                                                  f"ranks under a re-planned layout")
        return d
    why = (f"checkpoint {path} was written by {w0} rank{'s' if w0 > 1 else ''} "
           f"({_describe(_checkpoint_layout(meta)) if 'run' in meta else 'layout unknown'}), "
           f"this attempt has {world}")
    if cfg.train.replan == "off":
        if problem:
            d.kind, d.reason = "refuse", (
                f"{why}, and the configured layout does not fit {world} ranks: {problem}. "
                f"--train.replan=off keeps the configured layout; pass --train.replan=auto to "
                f"re-plan for {world} ranks (or relaunch on {w0})")
        else:
            d.reason = why
        return d
    if not problem and int(el.get("configured_world", -1)) == world:
        d.kind, d.reason = "configured", (f"{why}: the world the configured layout was set up "
                                          f"for, so it returns to that layout")
        return d
    d.kind, d.reason = "replan", why
    return d


def resolve(cfg: RunConfig, world: int, rank: int, planner: Planner,
            init_pg: Callable[[], None]) -> tuple[RunConfig, dict[str, Any]]:
    """The run config this attempt trains with and the elastic record its checkpoints carry
    (`{"configured_world", "replanned"}`). Collective only when it re-plans (then it calls
    `init_pg()` first: rank 0 plans, every rank receives the layout or the same error)."""
    check_elastic(cfg)  # the option checks live with prepare()'s (trainer/setup.py)
    hf = None
    if cfg.model.hf_path:
        from model.hf_checkpoint import HFCheckpoint

        hf = HFCheckpoint(cfg.model.hf_path)
    mcfg = build_model_config(cfg, hf)
    d = decide(cfg, mcfg, world)
    el = d.meta.get("elastic") or {}
    # the world the configured layout is meant for: carried from checkpoint to checkpoint (a
    # checkpoint without the record was written by the configured layout itself)
    first = d.ckpt_world if d.checkpoint is not None else world
    if d.kind == "replan" and d.checkpoint is None:
        first = 0  # started re-planned: the configured layout's world is not known
    record = {"configured_world": int(el.get("configured_world", first)), "replanned": False}
    if d.kind == "refuse":
        raise ConfigError(d.reason)
    if d.kind == "none":
        if d.checkpoint is not None and d.ckpt_world != world:
            log(f"elastic: {d.reason}; the configured layout fits (--train.replan=off)", rank)
        return cfg, record
    before = _checkpoint_layout(d.meta) if "run" in d.meta else layout_of(cfg.to_dict())
    extra: dict[str, Any] = {}
    if d.kind == "keep-replanned":
        new = with_layout(cfg, d.meta["run"])
        record["replanned"] = True
    elif d.kind == "configured":
        new = cfg
    else:
        t0 = time.perf_counter()
        if world > 1:
            init_pg()
        payload: list[Any] = [None]
        if rank == 0:
            try:
                sections, prop = _replan(cfg, mcfg, world, planner)
                payload[0] = ("ok", sections, {"platform": prop.platform,
                                               "predicted_step_time_s": prop.step_time_s,
                                               "predicted_peak_memory_gb": prop.peak_memory_gb})
            except ValueError as e:
                payload[0] = ("error", f"--train.replan=auto: {d.reason}; no layout of "
                                       f"{world} ranks: {e}", {})
        if world > 1 and _distributed():  # every rank takes rank 0's layout (or its error)
            _broadcast(payload)
        status, sections, extra = payload[0]
        if status == "error":
            raise ConfigError(sections)
        new = with_layout(cfg, sections)
        record["replanned"] = True
        extra = dict(extra, plan_s=round(time.perf_counter() - t0, 3))
    after = layout_of(new.to_dict())
    changed = _changes(before, after)
    what = ", ".join(f"{k.split('.')[1]} {a}->{b}" for k, (a, b) in changed.items()) or \
        "nothing"
    how = {"keep-replanned": "keeping the checkpoint's re-planned layout",
           "configured": "back to the configured layout",
           "replan": f"re-planned with the planner (platform {replan_platform(cfg)}, "
                     f"{cfg.train.replan_trials} trials)"}[d.kind]
    log(f"elastic: {d.reason}; {how}: {_describe(before)} -> {_describe(after)} ({what}); "
        f"global batch {new.train.global_batch} and seq {new.train.seq_len} kept"
        + (f"; predicted {extra['predicted_step_time_s']:.3g} s/step, "
           f"{extra['predicted_peak_memory_gb']:.3g} GB per rank" if "platform" in extra else ""),
        rank)
    if rank == 0:
        out = Path(cfg.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        row = {"event": d.kind, "time": time.time(), "step": int(d.meta.get("step", 0)),
               "checkpoint": str(d.checkpoint), "world_before": d.ckpt_world,
               "world_after": world, "before": before, "after": after, "changed": changed,
               **extra}
        with open(out / "elastic.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return new, record


def _replan(cfg: RunConfig, mcfg: Any, world: int, planner: Planner):
    """The fastest planned layout the trainer accepts: (sections, proposal)."""
    t = cfg.train
    props = planner(mcfg, replan_platform(cfg), world, t.seq_len, t.global_batch,
                    redundant=cfg.balance.redundant, trials=t.replan_trials)
    problems = []
    for prop in props:
        trial = with_layout(cfg, prop.sections)
        problem = layout_problem(trial, mcfg, world)
        if not problem:
            return prop.sections, prop
        problems.append(f"{_describe(layout_of(trial.to_dict()))}: {problem}")
    raise ValueError(f"the planner's {len(props)} runnable layouts all break a trainer rule "
                     f"with this run's options, e.g. {'; '.join(problems[:3])}")


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _broadcast(payload: list[Any]) -> None:
    import torch.distributed as dist

    dev = None
    if dist.get_backend() == "nccl":  # NCCL moves the pickled object through a device tensor
        import os

        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    dist.broadcast_object_list(payload, src=0, device=dev)


# -- expert placement across a change of EP size -------------------------------------------------
class LoadRecord:
    """Tokens per logical expert of each MoE layer this rank holds, summed over the last
    `window` steps (the stage's data shards already summed: `StepStats.expert_counts`); what
    checkpoints store as the recorded load a new EP size is re-balanced from."""

    def __init__(self, window: int):
        self.steps: deque[list[np.ndarray]] = deque(maxlen=max(1, window))

    def add(self, counts: Sequence[torch.Tensor]) -> None:
        if counts:
            self.steps.append([c.detach().cpu().to(torch.float64).numpy() for c in counts])

    def by_layer(self, names: Sequence[str]) -> dict[str, list[float]]:
        if not self.steps:
            return {}
        total = np.sum(np.stack([np.stack(s) for s in self.steps]), axis=0)
        return {n: total[i].tolist() for i, n in enumerate(names)}


def remap_placement(meta: dict[str, Any], layers: dict[str, Any], ep: int
                    ) -> dict[str, Any]:
    """{layer name: placement for this run's EP size} of this rank's MoE `layers` when the
    checkpoint's EP size differs: the recorded load (`layer_state[name]["load"]`) re-balanced
    over `ep` ranks, `balance.greedy_repack` (every rank E/ep experts, the groups relabelled to
    keep experts where the saved map had them) or, with redundant slots, `plan_replicas`.
    Layers without a recorded load keep the saved map ({} entries are left out)."""
    from balance import greedy_repack
    from balance.replicas import plan_replicas

    saved_ep = int((meta.get("mesh") or {}).get("ep", 1))
    if saved_ep == ep:
        return {}
    state = meta.get("layer_state") or {}
    placement = meta.get("placement") or {}
    out: dict[str, Any] = {}
    for name, layer in layers.items():
        load = (state.get(name) or {}).get("load")
        E = layer.num_experts
        if load is None or len(load) != E or not any(load):
            continue
        w = np.asarray(load, dtype=np.float64)
        if layer.replicated:
            S = layer.n_slots // ep
            out[name] = {"slots": [int(e) for e in plan_replicas(w, ep, S)]}
            continue
        saved = placement.get(name)
        e2s = np.asarray(saved if isinstance(saved, list) and len(saved) == E else range(E))
        El = E // ep
        e2r = np.asarray(greedy_repack(w, e2s // El, ep))
        new = np.empty(E, dtype=np.int64)
        for q in range(ep):  # rank q's experts fill its slots in their saved order
            mine = sorted(np.flatnonzero(e2r == q).tolist(), key=lambda e: e2s[e])
            for j, e in enumerate(mine):
                new[e] = q * El + j
        out[name] = new.tolist()
    return out
