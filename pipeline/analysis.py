"""Passes over a schedule: derived transfers, validation, simulation, bubble and memory.

Everything here is pure Python over `Schedule` data (see `pipeline.schedule`); nothing touches
torch. A slot holding a `Pair` (`pipeline.build_fb`) counts as its two actions at that step;
simulated, a pair takes its members' summed cost (their compute runs one at a time: what the
pair hides is exchange time, which these costs do not hold) and gives one span each, B first. The runtime executes exactly the transfers and post order that `comm_plan` returns, so
`validate` checking those is checking what runs.

Legend: p ranks, S stages, m micro-batches, t time step (slot index).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pipeline.schedule import (
    Action,
    AnySchedule,
    Pair,
    Slot,
    dependencies,
    members,
    n_stages,
    stage2rank,
)

__all__ = [
    "Span",
    "Transfer",
    "Costs",
    "derive_transfers",
    "comm_plan",
    "validate",
    "is_forward_only",
    "simulate",
    "timeline_spans",
    "bubble_fraction",
    "bubble_from_spans",
    "peak_inflight",
    "peak_activation_bytes",
]

Costs = Mapping[str, float] | Callable[[Action], float]


@dataclass(frozen=True)
class Transfer:
    """A tensor `producer` (on `src`) hands to `consumer` (on `dst`): the activation after an
    F, or the input gradient after a B. `step` is the producer's slot; `src == dst` means the
    two stages share a rank and nothing crosses the network."""

    src: int
    dst: int
    producer: Action
    consumer: Action
    step: int

    @property
    def is_local(self) -> bool:
        return self.src == self.dst


@dataclass(frozen=True)
class Span:
    """`action` ran on `rank` from `start` to `end` (time steps, seconds, or cost units). A
    pair the runtime measured gives its B the first half of its time and its F the second
    (their compute interleaves; only the sum is measured)."""

    rank: int
    action: Action
    start: float
    end: float


def _steps(schedule: AnySchedule) -> dict[Action, tuple[int, int]]:
    """Action -> (rank, step); duplicates are left to `validate` to report."""
    out: dict[Action, tuple[int, int]] = {}
    for rank, slots in schedule.items():
        for t, slot in enumerate(slots):
            for a in members(slot):
                out.setdefault(a, (rank, t))
    return out


def derive_transfers(schedule: AnySchedule) -> list[Transfer]:
    """Every stage-to-stage hand-off the schedule implies, ordered by (step, producer)."""
    s2r = stage2rank(schedule)
    last = n_stages(schedule) - 1
    out = []
    for rank, slots in schedule.items():
        for t, a in ((t, a) for t, slot in enumerate(slots) for a in members(slot)):
            if a.kind == "F" and a.stage < last:
                c = Action(a.stage + 1, "F", a.microbatch)
            elif a.kind == "B" and a.stage > 0:
                c = Action(a.stage - 1, "B", a.microbatch)
            else:
                continue
            if c.stage not in s2r:
                raise ValueError(f"{a} on rank {rank} feeds stage {c.stage}, which no rank runs")
            out.append(Transfer(rank, s2r[c.stage], a, c, t))
    out.sort(key=lambda x: (x.step, x.producer))
    return out


def comm_plan(schedule: AnySchedule, rank: int) -> list[tuple[str, int, Transfer]]:
    """The point-to-point operations of `rank` in the order the runtime posts them:
    `("send" | "recv", peer, transfer)`. Both ends of a rank pair list their common
    transfers in the same (step, producer) order, which is what makes tag-free matching
    deterministic."""
    ops = []
    for x in derive_transfers(schedule):
        if x.is_local:
            continue
        if x.src == rank:
            ops.append(("send", x.dst, x))
        elif x.dst == rank:
            ops.append(("recv", x.src, x))
    return ops


def _check_structure(schedule: AnySchedule) -> None:
    if not isinstance(schedule, dict) or not schedule:
        raise ValueError(f"a schedule is a non-empty dict rank -> list of actions, got {schedule!r}")
    if sorted(schedule) != list(range(len(schedule))):
        raise ValueError(f"schedule ranks must be 0..{len(schedule) - 1}, got {sorted(schedule)}")
    for rank, slots in schedule.items():
        for t, a in enumerate(slots):
            if a is not None and not isinstance(a, Action | Pair):
                raise ValueError(f"rank {rank} step {t}: {a!r} is neither an Action, a Pair "
                                 f"nor None")


def _check_coverage(schedule: AnySchedule) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for rank, slots in schedule.items():
        for t, a in ((t, a) for t, slot in enumerate(slots) for a in members(slot)):
            if a in seen:
                r0, t0 = seen[a]
                raise ValueError(
                    f"{a} runs twice: rank {r0} step {t0} and rank {rank} step {t}"
                )
            seen[a] = (rank, t)
    n_stage = n_stages(schedule)
    m = max(a.microbatch for a in seen) + 1
    s2r = stage2rank(schedule)
    forward = is_forward_only(schedule)
    for s in range(n_stage):
        if s not in s2r:
            raise ValueError(f"stage {s} has no actions (stages run 0..{n_stage - 1})")
        split = any(Action(s, "W", i) in seen for i in range(m))
        kinds = ("F",) if forward else ("F", "B", "W") if split else ("F", "B")
        for i in range(m):
            for kind in kinds:
                if Action(s, kind, i) not in seen:
                    why = " (stage splits its backward into B and W)" if kind == "W" else ""
                    raise ValueError(
                        f"{Action(s, kind, i)} is missing on rank {s2r[s]}: every stage runs "
                        f"each of micro-batches 0..{m - 1} once{why}"
                    )


def is_forward_only(schedule: AnySchedule) -> bool:
    """Whether `schedule` has forwards only (evaluation: `pipeline.schedule.forward_only`)."""
    return all(a.kind == "F" for slots in schedule.values() for s in slots for a in members(s))


def _check_dependencies(schedule: AnySchedule) -> None:
    where = _steps(schedule)
    n_stage = n_stages(schedule)
    for a, (rank, t) in where.items():
        for d in dependencies(a, n_stage):
            rd, td = where[d]
            if td >= t:
                raise ValueError(
                    f"{a} on rank {rank} at step {t} needs {d} (rank {rd}), which runs at step "
                    f"{td}; a dependency must run in an earlier step"
                )


def _check_comm(schedule: AnySchedule) -> None:
    plans = {r: comm_plan(schedule, r) for r in schedule}
    where = _steps(schedule)
    for r, ops in plans.items():
        for op, _, x in ops:
            if op == "recv" and where[x.consumer][1] <= x.step:
                raise ValueError(f"{x.consumer} on rank {r} uses {x.producer} before it is sent")
    for a in schedule:
        for b in schedule:
            sends = [x for op, peer, x in plans[a] if op == "send" and peer == b]
            recvs = [x for op, peer, x in plans[b] if op == "recv" and peer == a]
            if sends != recvs:
                raise ValueError(
                    f"sends rank {a} -> {b} {[str(x.producer) for x in sends]} do not match "
                    f"receives {[str(x.producer) for x in recvs]}"
                )


def validate(schedule: AnySchedule) -> None:
    """Raise ValueError naming the first offending action unless `schedule` is runnable:
    every stage on one rank; F and B (and W, if the stage has any) exactly once per stage and
    micro-batch (F only in a forward-only schedule: no B or W anywhere); each dependency in
    an earlier step (a pair's members too: they may not depend on each other); sends match
    receives pair by pair; and executing each rank's actions in order (ignoring steps)
    cannot deadlock."""
    _check_structure(schedule)
    if not any(members(a) for slots in schedule.values() for a in slots):
        raise ValueError("schedule has no actions")
    stage2rank(schedule)
    _check_coverage(schedule)
    _check_dependencies(schedule)
    _check_comm(schedule)
    simulate(schedule)


def _cost_fn(costs: Costs | None) -> Callable[[Action], float]:
    if costs is None:
        return lambda a: 1.0
    if callable(costs):
        return costs
    missing = {"F", "B"} - set(costs)
    if missing:
        raise ValueError(f"costs {dict(costs)} lack kinds {sorted(missing)}; give F, B (and W)")

    def by_kind(a: Action) -> float:
        if a.kind not in costs:
            raise ValueError(f"costs {dict(costs)} have no entry for kind {a.kind!r} ({a})")
        return float(costs[a.kind])

    return by_kind


def simulate(schedule: AnySchedule, costs: Costs | None = None, transfer: float = 0.0
             ) -> list[Span]:
    """Replay each rank's actions in order with per-action `costs` (unit by default): an
    action starts when its rank is free and its dependencies have ended, plus `transfer`
    (the time a point-to-point hand-over takes) for a dependency that ran on another rank.
    Raises ValueError naming the blocked actions if the orders deadlock."""
    if not transfer >= 0:
        raise ValueError(f"transfer={transfer} must be >= 0 (seconds, or unit steps)")
    cost = _cost_fn(costs)
    rank_of = stage2rank(schedule)
    orders = {r: [a for a in slots if a is not None] for r, slots in schedule.items()}
    n_stage = n_stages(schedule)
    end: dict[Action, float] = {}
    free = dict.fromkeys(orders, 0.0)
    pos = dict.fromkeys(orders, 0)
    spans = []
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, order in orders.items():
            while pos[r] < len(order):
                acts = members(order[pos[r]])
                deps = [d for a in acts for d in dependencies(a, n_stage)]
                if not all(d in end for d in deps):
                    break
                start = max([free[r]] + [end[d] + (transfer if rank_of[d.stage] != r else 0.0)
                                         for d in deps])
                for a in acts:
                    c = cost(a)
                    if c < 0:
                        raise ValueError(f"cost of {a} is {c}; costs must be >= 0")
                    spans.append(Span(r, a, start, start + c))
                    start += c
                for a in acts:  # a pair's outputs leave when the pair ends
                    end[a] = start
                free[r] = start
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = {r: str(o[pos[r]]) for r, o in orders.items() if pos[r] < len(o)}
            raise ValueError(f"schedule deadlocks: each rank's next action waits: {blocked}")
    return spans


def timeline_spans(schedule: AnySchedule, costs: Costs | None = None) -> list[Span]:
    """Spans of the planned timeline: slot t -> [t, t+1) as laid out (a pair: its B in the
    first half, its F in the second), or simulated times when `costs` are given."""
    if costs is not None:
        return simulate(schedule, costs)
    out = []
    for r, slots in schedule.items():
        for t, slot in enumerate(slots):
            acts = members(slot)
            for i, a in enumerate(acts):
                out.append(Span(r, a, t + i / len(acts), t + (i + 1) / len(acts)))
    return out


def bubble_from_spans(spans: Iterable[Span], n_ranks: int) -> float:
    """Idle share of `n_ranks` x (last end - first start), given the busy spans."""
    spans = list(spans)
    if not spans:
        raise ValueError("no spans to measure a bubble from")
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    if t1 <= t0:
        return 0.0
    busy = sum(s.end - s.start for s in spans)
    return 1.0 - busy / (n_ranks * (t1 - t0))


def bubble_fraction(schedule: AnySchedule, costs: Costs | None = None, transfer: float = 0.0) -> float:
    """Idle share of the timeline. Without `costs` or `transfer`: idle slots / (ranks x
    steps) of the unit-time layout as given ((p-1)/(m+p-1) for GPipe and 1F1B). With `costs`
    (per kind, e.g. {"F": 1.0, "B": 2.0, "W": 1.0}, or a function of the Action) and/or a
    point-to-point `transfer` time (see `simulate`): the simulated timeline's idle share."""
    if costs is None and not transfer:
        length = max(len(s) for s in schedule.values())
        if length == 0:
            raise ValueError("empty schedule has no timeline")
        idle = sum(length - sum(a is not None for a in s) for s in schedule.values())
        return idle / (length * len(schedule))
    return bubble_from_spans(simulate(schedule, costs, transfer), len(schedule))


def _walk(slots: Sequence[Slot]) -> list[Action]:
    """A rank's actions in memory order: a pair's F before its B (both are alive while the
    pair runs)."""
    return [a for slot in slots for a in reversed(members(slot))]


def _split_stages(schedule: AnySchedule) -> set[int]:
    return {a.stage for slots in schedule.values() for s in slots for a in members(s)
            if a.kind == "W"}


def peak_inflight(schedule: AnySchedule) -> dict[int, int]:
    """Per rank, the most (stage, micro-batch) pairs whose activations are alive at once:
    F done and B (W for stages that split their backward) not yet. With interleaving each
    pair holds one virtual stage's activations."""
    split = _split_stages(schedule)
    out = {}
    for rank, slots in schedule.items():
        alive: set[tuple[int, int]] = set()
        peak = 0
        for a in _walk(slots):
            key = (a.stage, a.microbatch)
            if a.kind == "F":
                alive.add(key)
            elif a.kind == "W" or a.stage not in split:
                alive.discard(key)
            peak = max(peak, len(alive))
        out[rank] = peak
    return out



def peak_activation_bytes(
    schedule: AnySchedule, bytes_per_stage: Mapping[int, float]
) -> dict[int, float]:
    """Per rank, the peak of saved-activation bytes alive at once when one micro-batch
    through stage s keeps `bytes_per_stage[s]` alive (the same walk as `peak_inflight`,
    weighted; equal to peak_inflight x bytes when every stage of a rank weighs the same)."""
    split = _split_stages(schedule)
    missing = sorted(set(stage2rank(schedule)) - set(bytes_per_stage))
    if missing:
        raise ValueError(f"bytes_per_stage lacks stages {missing}")
    out = {}
    for rank, slots in schedule.items():
        live = peak = 0.0
        alive: set[tuple[int, int]] = set()
        for a in _walk(slots):
            key = (a.stage, a.microbatch)
            if a.kind == "F":
                alive.add(key)
                live += bytes_per_stage[a.stage]
            elif (a.kind == "W" or a.stage not in split) and key in alive:
                alive.discard(key)
                live -= bytes_per_stage[a.stage]
            peak = max(peak, live)
        out[rank] = peak
    return out
