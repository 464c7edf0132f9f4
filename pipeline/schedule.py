"""Pipeline schedules as data: `Action`s laid out on a unit-time timeline, one list per rank.

A schedule is `dict[rank, list[Action | None]]`: slot t of rank r is what r does during time
step t (`None` = idle). Every action takes one step. Sends and receives are *not* part of
the schedule; `pipeline.analysis.derive_transfers` derives them from the data dependencies:

    F(s, m) needs F(s-1, m)                     (activation of micro-batch m from stage s-1)
    B(s, m) needs F(s, m) and B(s+1, m)         (output gradient from stage s+1)
    W(s, m) needs B(s, m)                       (weight gradient, zero-bubble schedules only)

A dependency is satisfied only by an action in an *earlier* step, so a timeline read step by
step never waits on work that happens at the same time.

Stages: with `n_virtual` = v virtual stages per rank there are S = p * v stages and stage s
runs on rank s % p (the Megatron interleaved layout); without interleaving S = p, stage = rank.

Legend: p ranks, m micro-batches, v virtual stages per rank, S = p * v stages.

Builders (all pure, deterministic):
    gpipe             all forwards, then all backwards
    1f1b              p - r - 1 warm-up forwards on rank r, then one forward / one backward
    interleaved-1f1b  Megatron's interleaved 1F1B over v chunks per rank (m % p == 0)
    zb-h1             1F1B with the backward split into B (input grad) and W (weight grad);
                      rank r defers W by r micro-batches so W fills the cool-down bubble
    forward_only      (not a training schedule: `forward_only`, not `build`) every stage's
                      forwards and no backward, for evaluation; stage s on rank s % p

Paired schedules (`build_fb`, --comm.a2a_overlap=fb): a slot may hold a `Pair(b, f)`, a B
and an F of the same rank that run together in that step (the runtime interleaves them on a
`comm.collectives.overlap.Baton`, so one's compute hides the other's expert exchanges). Each
member's dependencies must lie in earlier steps, like any action's; the passes of
`pipeline.analysis` read a pair as its two actions at the same step (`members`). `build_fb`
pairs each B with the F that follows it in the rank's order (on the last stage B(k) with
F(k + 1): B(k) needs F(k) itself). For 1F1B it first deepens rank r's warm-up from
p - r - 1 to 2(p - r - 1) forwards (interleaved-1F1B's warm-up has that depth already):
with 1F1B's own warm-up a pair on one rank waits for the previous pair of its neighbour, so
the pipeline would run one pair at a time; with the deeper one the paired schedule's makespan
equals 1F1B's at unit costs F=1, B=2 (`tests/test_fb_overlap_pipeline.py`), and anything the
pairs hide is gained. The price: rank r holds up to 2(p - r) - 1 micro-batches' activations
instead of p - r.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Action", "FB_SCHEDULES", "KINDS", "Pair", "PairedSchedule", "Schedule", "Slot",
           "build", "build_fb", "forward_only", "members", "schedule_names", "stage2rank",
           "n_stages"]

KINDS = ("F", "B", "W")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: `kind` ("F", "B" or "W") of `stage` on `microbatch`; str -> "2F0"."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {KINDS}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"Action stage={self.stage}, microbatch={self.microbatch}: both must be >= 0"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


@dataclass(frozen=True, order=True)
class Pair:
    """A B and an F of one rank run together in one step (module docstring); str -> "1B0+1F2"."""

    b: Action
    f: Action

    def __post_init__(self) -> None:
        if not (isinstance(self.b, Action) and isinstance(self.f, Action)
                and self.b.kind == "B" and self.f.kind == "F"):
            raise ValueError(f"Pair({self.b!r}, {self.f!r}): a pair is a B action and an F action")

    def __str__(self) -> str:
        return f"{self.b}+{self.f}"


Schedule = dict[int, list[Action | None]]
Slot = Action | Pair | None
PairedSchedule = dict[int, list[Slot]]  # a Schedule whose slots may hold Pairs (build_fb)
AnySchedule = Mapping[int, Sequence[Slot]]  # what the passes read: either kind


def members(slot: Slot) -> tuple[Action, ...]:
    """The actions a slot runs: none, one, or a pair's B and F."""
    if slot is None:
        return ()
    if isinstance(slot, Pair):
        return (slot.b, slot.f)
    return (slot,)


def stage2rank(schedule: AnySchedule) -> dict[int, int]:
    """Which rank runs each stage, read from the schedule; a stage on two ranks is an error."""
    out: dict[int, int] = {}
    for rank, slots in schedule.items():
        for slot in slots:
            for a in members(slot):
                prev = out.setdefault(a.stage, rank)
                if prev != rank:
                    raise ValueError(f"stage {a.stage} appears on ranks {prev} and {rank} ({a})")
    return out


def n_stages(schedule: AnySchedule) -> int:
    """Number of stages S (the highest stage index + 1)."""
    return max((a.stage for slots in schedule.values() for s in slots for a in members(s)),
               default=-1) + 1


def dependencies(a: Action, n_stage: int) -> list[Action]:
    """The actions `a` needs to have finished first (see the module docstring)."""
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.kind == "B":
        deps = [Action(a.stage, "F", a.microbatch)]
        if a.stage < n_stage - 1:
            deps.append(Action(a.stage + 1, "B", a.microbatch))
        return deps
    return [Action(a.stage, "B", a.microbatch)]


def _place(orders: Mapping[int, Sequence[Action | Pair]], n_stage: int) -> PairedSchedule:
    """Lay per-rank orders onto the unit timeline, each action (or pair) at its earliest
    step."""
    done: dict[Action, int] = {}
    out: PairedSchedule = {r: [] for r in orders}
    pos = dict.fromkeys(orders, 0)
    total = sum(len(o) for o in orders.values())
    placed_n = 0
    t = 0
    while placed_n < total:
        placed = []
        for r, order in orders.items():
            if pos[r] < len(order):
                a = order[pos[r]]
                if all(done.get(d, t) < t for m in members(a) for d in dependencies(m, n_stage)):
                    placed.append((r, a))
                    continue
            out[r].append(None)
        if not placed:
            stuck = [str(o[pos[r]]) for r, o in orders.items() if pos[r] < len(o)]
            raise RuntimeError(f"schedule order deadlocks at step {t}; blocked: {stuck}")
        for r, a in placed:
            out[r].append(a)
            for m in members(a):
                done[m] = t
            pos[r] += 1
            placed_n += 1
        t += 1
    return out


def _plain(sched: PairedSchedule) -> Schedule:
    """A schedule placed from orders without pairs, typed as such."""
    out: Schedule = {}
    for r, slots in sched.items():
        assert not any(isinstance(a, Pair) for a in slots)
        out[r] = [a for a in slots if not isinstance(a, Pair)]
    return out


def _check_common(n_ranks: int, n_microbatches: int) -> None:
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"n_ranks={n_ranks!r} is invalid; need an int >= 1")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches!r} is invalid; need an int >= 1")


def _gpipe(p: int, m: int) -> Schedule:
    orders = {
        r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
        for r in range(p)
    }
    return _plain(_place(orders, p))


def _one_f_one_b_orders(p: int, m: int, deep: bool = False) -> dict[int, list[Action]]:
    orders = {}
    for r in range(p):
        # Rank r runs p - r - 1 forwards before its first backward can arrive; afterwards
        # every backward frees the activations the next forward needs (peak p - r). `deep`:
        # 2(p - r - 1) warm-up forwards, what the paired schedule needs (module docstring).
        warm = min(2 * (p - r - 1) if deep else p - r - 1, m)
        o = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            o += [Action(r, "F", warm + i), Action(r, "B", i)]
        o += [Action(r, "B", i) for i in range(m - warm, m)]
        orders[r] = o
    return orders


def _one_f_one_b(p: int, m: int) -> Schedule:
    return _plain(_place(_one_f_one_b_orders(p, m), p))


def _interleaved(p: int, m: int, v: int) -> Schedule:
    return _plain(_place(_interleaved_orders(p, m, v), p * v))


def _interleaved_orders(p: int, m: int, v: int) -> dict[int, list[Action]]:
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"n_virtual={v!r} is invalid; need an int >= 1")
    if m % p:
        valid = [k * p for k in range(1, 4)]
        raise ValueError(
            f"interleaved-1f1b needs n_microbatches divisible by n_ranks: "
            f"n_microbatches={m}, n_ranks={p}; valid n_microbatches: {valid}, ..."
        )
    total = m * v

    def nth(k: int, forward: bool, r: int) -> Action:
        # Micro-batches go through the chunks in groups of p: chunk 0 for mbs 0..p-1, chunk 1
        # for the same p, ...; backwards walk the chunks in reverse.
        group, within = divmod(k, p * v)
        chunk = within // p if forward else v - 1 - within // p
        mb = group * p + within % p
        return Action(chunk * p + r, "F" if forward else "B", mb)

    orders = {}
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        o = [nth(k, True, r) for k in range(warm)]
        for i in range(total - warm):
            o += [nth(warm + i, True, r), nth(i, False, r)]
        o += [nth(k, False, r) for k in range(total - warm, total)]
        orders[r] = o
    return orders


def _zb_h1_order(r: int, p: int, m: int) -> list[Action]:
    """Rank r's ZB-H1 order: 1F1B's F/B sequence, with W(i) right after B(i + r)."""
    warm = min(p - r - 1, m)
    fwd = [Action(r, "F", i) for i in range(m)]
    # The F/B interleaving of 1F1B: `warm` forwards, then (F, B) pairs, then the last B's.
    fb = fwd[:warm]
    for i in range(m - warm):
        fb += [fwd[warm + i], Action(r, "B", i)]
    fb += [Action(r, "B", i) for i in range(m - warm, m)]
    order = []
    n_w = 0
    for a in fb:
        order.append(a)
        if a.kind == "B" and a.microbatch + 1 - n_w > r:
            order.append(Action(r, "W", n_w))
            n_w += 1
    return order + [Action(r, "W", i) for i in range(n_w, m)]


def _zb_h1(p: int, m: int) -> Schedule:
    """1F1B order with B and W split; rank r runs W(i) only after B(i + r).

    Lagging the weight gradients by r micro-batches lets the input gradients race down the
    pipeline in the cool-down while the deferred W's fill what 1F1B leaves idle: with unit F,
    B and W the makespan is 3m + p - 1 (the ZB-H1 optimum; 1F1B with split backward takes
    3m + 2(p - 1)) and every rank holds at most p micro-batches, 1F1B's stage-0 peak.
    """
    return _plain(_place({r: _zb_h1_order(r, p, m) for r in range(p)}, p))


_BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved,
    "zb-h1": _zb_h1,
}


def forward_only(n_ranks: int, n_microbatches: int = 1, n_virtual: int = 1) -> Schedule:
    """Evaluation: only forwards, no backward. Rank r runs its stages r, r + p, ... (the
    interleaved layout; one stage per rank with n_virtual = 1), each micro-batch through
    one stage after another; `PipelineRuntime` runs it without autograd. Not one of
    `schedule_names()` (those train)."""
    _check_common(n_ranks, n_microbatches)
    if not isinstance(n_virtual, int) or n_virtual < 1:
        raise ValueError(f"n_virtual={n_virtual!r} is invalid; need an int >= 1")
    p, m, v = n_ranks, n_microbatches, n_virtual
    sched = _plain(_place({r: [Action(c * p + r, "F", i) for c in range(v) for i in range(m)]
                           for r in range(p)}, p * v))
    length = max(len(s) for s in sched.values())
    return {r: s + [None] * (length - len(s)) for r, s in sched.items()}


def schedule_names() -> list[str]:
    """Names accepted by `build`."""
    return list(_BUILDERS)


def build(name: str, n_ranks: int, n_microbatches: int, **kw: int) -> Schedule:
    """Build schedule `name` for `n_ranks` pipeline ranks and `n_microbatches` micro-batches.

    Keyword arguments: `n_virtual` (virtual stages per rank) for `interleaved-1f1b`
    (default 2). Returns `{rank: [Action | None, ...]}` with all lists of equal length.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; valid: {schedule_names()}")
    _check_common(n_ranks, n_microbatches)
    allowed = {"n_virtual"} if name == "interleaved-1f1b" else set()
    extra = set(kw) - allowed
    if extra:
        raise ValueError(
            f"schedule {name!r} got unexpected options {sorted(extra)}; valid: {sorted(allowed)}"
        )
    if name == "interleaved-1f1b":
        sched = _interleaved(n_ranks, n_microbatches, kw.get("n_virtual", 2))
    else:
        sched = _BUILDERS[name](n_ranks, n_microbatches)
    length = max(len(s) for s in sched.values())
    return {r: s + [None] * (length - len(s)) for r, s in sched.items()}


FB_SCHEDULES = ("1f1b", "interleaved-1f1b")  # what `build_fb` pairs


def _pair_up(order: list[Action]) -> list[Action | Pair]:
    """Each B with the F right after it in the rank's order (module docstring)."""
    out: list[Action | Pair] = []
    i = 0
    while i < len(order):
        a = order[i]
        if a.kind == "B" and i + 1 < len(order) and order[i + 1].kind == "F":
            out.append(Pair(a, order[i + 1]))
            i += 2
        else:
            out.append(a)
            i += 1
    return out


def build_fb(name: str, n_ranks: int, n_microbatches: int, **kw: int) -> PairedSchedule:
    """Schedule `name` with its steady state's B / F pairs fused (module docstring), for
    --comm.a2a_overlap=fb: "1f1b" (with the deeper warm-up) or "interleaved-1f1b"
    (`n_virtual`, default 2). All lists of equal length, like `build`'s."""
    if name not in FB_SCHEDULES:
        raise ValueError(f"schedule {name!r} has no paired (fb) form; valid: {list(FB_SCHEDULES)}")
    build(name, n_ranks, n_microbatches, **kw)  # the same argument checks
    p, m = n_ranks, n_microbatches
    if name == "1f1b":
        orders, n_stage = _one_f_one_b_orders(p, m, deep=True), p
    else:
        v = kw.get("n_virtual", 2)
        orders, n_stage = _interleaved_orders(p, m, v), p * v
    sched = _place({r: _pair_up(o) for r, o in orders.items()}, n_stage)
    length = max(len(s) for s in sched.values())
    return {r: s + [None] * (length - len(s)) for r, s in sched.items()}
