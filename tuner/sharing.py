"""Pipeline schedule replay on shared cores (processor sharing), for CPU platforms.

On a GPU platform every rank owns its device: a rank waiting for its pipeline neighbour idles
a device nobody else can use, and the bubble costs its full length (`pipeline.bubble_fraction`).
On a CPU node with more processes than cores (`Platform.cores_per_node`,
`threads_per_process`), the OS shares the cores among the processes that are runnable: a rank
blocked on a receive or a collective takes no core, and the busy ones get its share.

`shared_makespan` replays a schedule (`pipeline.build`) under that rule:

- pipeline rank r stands for `procs[r]` processes of the node (its stage's DP x EP ranks),
  all doing the same action at the same time;
- an action of cost c (seconds at the rate every process gets while *all* the node's
  processes compute: how `tuner measure` measures a CPU platform) is `cpu_share` x c of work
  on the cores and (1 - `cpu_share`) x c of waiting (the action's all-to-alls and P2P
  hand-overs, priced by their measured times) that takes no core, the two finely
  interleaved (an MoE stage exchanges twice per layer and pass): a rank computes the part
  w / s of its w / s + v seconds, and the computing processes are counted by those shares
  (`spread_speed`); `tuner.estimate` counts
  the EP path's measured fixed cost (`Platform.ep_layer_overhead`) as work: measured with
  every process computing, it is mostly waiting for partner processes to get a core, and
  shrinks like compute when fewer compute;
- at any moment, with k processes doing work, each gets min(threads, cores / k) cores, so its
  work runs min(threads, cores / k) / min(threads, cores / N) times as fast as at the
  measured rate (N = every process of the node);
- an action starts when its rank is free and its dependencies (`pipeline.schedule`) have
  ended, plus `transfer` for one that ran on another rank.

With every rank computing the whole time the replay is the plain sum of costs; it differs only
where some ranks wait. Worked by hand (tests/test_tuner_sharing.py): a 2-stage GPipe over 2
micro-batches, F = 1, B = 2, 2 processes per stage on 2 cores (1 thread each) ends at 6, the
busy work of one rank (on dedicated devices: 9). Approximations: the OS's time slices are
taken as fluid shares, and so are an action's waits (spread evenly through it).

Where the waits lie matters where ranks run in lock-step. Until 2026-12-07 the replay put
each action's waiting after its work (`waits="after"`, kept for comparison); GPipe's stages
then waited at the same moments, leaving cores idle, and the replay priced a GPipe step 6 %
above 1F1B's for PP 2 x EP 2 on 4 processes (cpu_share 0.86), where ten records measured the
two within 1 % of each other on average (`benchmarks/repredict_tuner_records.py`: the GPipe
row's bias +12.5 % with the waits after, +5.7 % spread; docs/planner.md, "Shared cores").

Checked against a real pipeline (`tuner.measure`'s pipeline probe: 1F1B, 2 stages of 2
processes on 2 cores, each action timed with all processes computing, then replayed here),
the replay is optimistic: the pipelined step ran 1.02-1.22x the replay on this project's VM
(2026-12-06; 1.12-1.27x with the P2P hand-overs left out). Its processes took 2-8 % more
CPU time for the same actions than in lock-step, and the cores idled 2-6 % of the step;
neither is in the rule above. `shared_replay` also returns the replay's contended seconds
(more processes computing than the cores hold); `tuner measure` puts the measured excess on
them (`Platform.shared_pipeline_factor` = 1 + excess / contended), and `tuner.estimate`
scales a plan's contended seconds by it. Until 2026-12-07 the factor was the whole step's
ratio and scaled the whole replay, also where the stages never compute at once: the README
recipe's plan (PP 2 x DP 2, one micro-batch, the two processes of one stage on the two
cores) was priced +8.7 % slow on average over eight records, -1.4 % with the excess on the
contended part (docs/planner.md, "Shared cores").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from pipeline import Action, Schedule
from pipeline.schedule import dependencies, n_stages, stage2rank

__all__ = ["WAITS", "Replay", "core_speed", "exchange_tail_saving", "shared_imbalance",
           "shared_makespan", "shared_replay", "spread_speed"]

_EPS = 1e-12


def core_speed(busy: int, total: int, cores: int, threads: int) -> float:
    """Speed of a computing process when `busy` of the node's `total` processes compute,
    relative to all `total` computing: min(threads, cores / busy) / min(threads, cores / total)."""
    for name, v in (("busy", busy), ("total", total), ("cores", cores), ("threads", threads)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"core_speed: {name}={v!r} must be an int >= 1")
    if busy > total:
        raise ValueError(f"core_speed: busy={busy} exceeds total={total} processes")
    return _rate(busy, total, cores, threads)


def _rate(busy: float, total: int, cores: int, threads: int) -> float:
    """`core_speed` for a count of computing processes that may be fractional (> 0); no
    computing process at all: the speed of the first one to start, one alone."""
    cores_each = cores / busy if busy > _EPS else cores
    return min(threads, cores_each) / min(threads, cores / total)


def shared_imbalance(imbalance: float, group: int, procs: int, cores: int,
                     threads: int) -> float:
    """The routing imbalance an expert phase shows on shared cores: when it ends, in units of
    the mean rank's work at the all-busy rate (the rate `tuner measure` measures), with
    `procs` processes on `cores` cores (`threads` each). Each EP group of `group` ranks on
    the host (all `procs` of them when the group spans more) has one rank at `imbalance` x
    the mean and the rest sharing what is left evenly; a rank that finishes gives its core
    share to the others (fluid processor sharing, as `shared_makespan`). On dedicated cores
    (procs x threads <= cores) this is `imbalance` itself."""
    for name, v in (("group", group), ("procs", procs), ("cores", cores), ("threads", threads)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"shared_imbalance: {name}={v!r} must be an int >= 1")
    if not 1.0 <= imbalance <= max(group, 1):
        raise ValueError(f"shared_imbalance: imbalance={imbalance} must be in [1, {group}] "
                         f"(max / mean over {group} ranks)")
    if procs * threads <= cores or group == 1 or imbalance == 1.0:
        return imbalance
    g = min(group, procs)
    rest = (group - imbalance) / (group - 1)
    loads = ([imbalance] + [rest] * (g - 1)) * (procs // g) + [rest] * (procs % g)
    base = min(threads, cores / procs)  # each process's speed with all of them busy
    t, left = 0.0, sorted(loads)
    done = 0.0  # work each remaining process has finished (they all run at one speed)
    while left:
        speed = min(threads, cores / len(left)) / base
        dt = (left[0] - done) / speed
        t += dt
        done = left[0]
        left = [w for w in left if w > done + _EPS]
    return t


def exchange_tail_saving(work: float, tail: float, procs: int, waiting: int, cores: int,
                         threads: int) -> float:
    """Seconds a compute phase of `work` seconds (at the all-busy rate) saves when it follows
    an exchange whose busiest ranks wait `tail` seconds longer than the rest (fluid processor
    sharing on `cores` shared cores, `threads` per process, `procs` processes on the host).

    The exchange's busiest node (`waiting` of the processes: its ranks wait on its link) ends
    `tail` after the others. The others start `work` at once, faster than at the all-busy
    rate while the waiting ones take no core (speed s1 = `core_speed(procs - waiting, ...)`);
    when the waiting ones start, each side has its rest to do; all run at the all-busy rate
    until the others finish (they have less left), then the waiting ones alone (speed s2).
    The phase ends with the waiting ones at tail + r + (work - r) / s2, r = max(0, work -
    s1 tail) being what the others had left; the all-busy price ends it at tail + work, so
    the saving is (work - r) (1 - 1 / s2). On dedicated cores (s1 = s2 = 1), with no tail
    or with nobody else to run, it is 0."""
    for name, v in (("procs", procs), ("cores", cores), ("threads", threads)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"exchange_tail_saving: {name}={v!r} must be an int >= 1")
    if not isinstance(waiting, int) or not 1 <= waiting <= procs:
        raise ValueError(f"exchange_tail_saving: waiting={waiting!r} must be an int in "
                         f"[1, procs={procs}]")
    if work < 0 or tail < 0:
        raise ValueError(f"exchange_tail_saving: work={work} and tail={tail} must be >= 0")
    if waiting == procs or work == 0 or tail == 0:
        return 0.0
    s1 = core_speed(procs - waiting, procs, cores, threads)
    s2 = core_speed(waiting, procs, cores, threads)
    left = max(0.0, work - s1 * tail)
    return (work - left) * (1.0 - 1.0 / s2)


def _computing(active: list[tuple[int, float, float]], speed: float) -> float:
    """How many processes of `active` (processes, work left, wait left per rank) compute on
    average while their work runs at `speed` and their waits interleave with it
    (`spread_speed`): procs x w / (w + speed v) per rank with work left."""
    return sum(n * w / (w + speed * v) for n, w, v in active if w > _EPS)


def spread_speed(active: list[tuple[int, float, float]], total: int, cores: int,
                 threads: int) -> float:
    """The speed (`core_speed`'s unit) at which the computing parts of `active` actions run
    when each interleaves its work and its waits finely (WAITS "spread"): `active` holds
    (processes, work left, wait left) per rank. A rank that must do work w at speed s and
    wait v computes w / s of the w / s + v seconds both take, so it keeps
    procs x w / (w + s v) processes computing on average; the speed is the one that this
    average count of computing processes gives (`core_speed` with a fractional count): the
    fixed point of an increasing map, iterated from the all-computing speed (its smallest)."""
    s = _rate(float(sum(n for n, w, _ in active if w > _EPS)), total, cores, threads)
    for _ in range(200):
        nxt = _rate(_computing(active, s), total, cores, threads)
        if abs(nxt - s) <= 1e-12 * nxt:
            return nxt
        s = nxt
    return s


WAITS = ("spread", "after")


def shared_makespan(schedule: Schedule, cost: Callable[[Action], float] | Mapping[str, float],
                    procs: Mapping[int, int], cores: int, threads: int,
                    cpu_share: float = 1.0, transfer: float = 0.0,
                    waits: str = "spread") -> float:
    """End time of `schedule` replayed on `cores` shared cores (module docstring); the
    arguments as `shared_replay`'s."""
    return shared_replay(schedule, cost, procs, cores, threads, cpu_share, transfer,
                         waits).span


class Replay(NamedTuple):
    """`shared_replay`'s result: `span`, the replayed schedule's end time, and `contended`,
    the seconds of it during which the computing processes want more cores than the node
    has (more than cores / threads of them computing, fractional counts under WAITS
    "spread" as `spread_speed` counts them)."""

    span: float
    contended: float


def shared_replay(schedule: Schedule, cost: Callable[[Action], float] | Mapping[str, float],
                  procs: Mapping[int, int], cores: int, threads: int,
                  cpu_share: float = 1.0, transfer: float = 0.0,
                  waits: str = "spread") -> Replay:
    """`schedule` replayed on `cores` shared cores (module docstring): its end time and the
    part of it with the cores oversubscribed (`Replay`).

    `cost`: seconds per action at the all-busy rate (a function of the Action, or per kind
    {"F": .., "B": .., "W": ..}); `procs[r]`: processes pipeline rank r stands for;
    `threads`: intra-op threads per process; `cpu_share` in [0, 1]: the part of each action
    that computes; `transfer` >= 0: P2P hand-over between ranks (not in the costs).
    `waits`: where an action's waiting part lies: "spread" (the default) finely interleaved
    with its work (an MoE stage's exchanges: two per layer and pass), so the ranks' waits
    overlap the other ranks' work however the actions line up (`spread_speed`); "after" in
    one block after the work (the replay before 2026-12-07: ranks whose actions run in
    lock-step, as GPipe's stages do, then wait at the same moments and leave cores idle)."""
    if not 0.0 <= cpu_share <= 1.0:
        raise ValueError(f"cpu_share={cpu_share} must be in [0, 1]")
    if waits not in WAITS:
        raise ValueError(f"waits={waits!r}; valid: {', '.join(WAITS)}")
    if not transfer >= 0:
        raise ValueError(f"transfer={transfer} must be >= 0 seconds")
    if set(procs) != set(schedule):
        raise ValueError(f"procs has ranks {sorted(procs)}, the schedule {sorted(schedule)}")
    if any(not isinstance(n, int) or n < 1 for n in procs.values()):
        raise ValueError(f"procs={dict(procs)}: every rank needs an int >= 1 processes")
    if callable(cost):
        cost_of = cost
    else:
        table = dict(cost)
        kinds = {a.kind for s in schedule.values() for a in s if a is not None}
        if kinds - set(table):
            raise ValueError(f"cost {table} lacks kinds {sorted(kinds - set(table))}")
        cost_of = lambda a: float(table[a.kind])  # noqa: E731
    total = sum(procs.values())
    core_speed(total, total, cores, threads)  # validates cores and threads
    rank_of = stage2rank(schedule)
    S = n_stages(schedule)
    orders = {r: [a for a in slots if a is not None] for r, slots in schedule.items()}
    pos = dict.fromkeys(orders, 0)
    end: dict[Action, float] = {}
    # per rank: None (free) or [phase "cpu" | "wait", remaining work or seconds]
    doing: dict[int, list | None] = dict.fromkeys(orders, None)
    now = contended = 0.0
    while True:
        # start every action whose rank is free and whose inputs have arrived
        ready_at: dict[int, float] = {}
        for r, order in orders.items():
            if doing[r] is not None or pos[r] == len(order):
                continue
            a = order[pos[r]]
            deps = dependencies(a, S)
            if not all(d in end for d in deps):
                continue
            t = max([now] + [end[d] + (transfer if rank_of[d.stage] != r else 0.0) for d in deps])
            if t <= now + _EPS:
                c = cost_of(a)
                if c < 0:
                    raise ValueError(f"cost of {a} is {c}; costs must be >= 0")
                doing[r] = ["cpu", c * cpu_share, c * (1.0 - cpu_share)]
            else:
                ready_at[r] = t
        if all(pos[r] == len(o) for r, o in orders.items()):
            return Replay(now, contended)
        if waits == "spread":
            active = [(procs[r], d[1], d[2]) for r, d in doing.items() if d is not None]
            speed = spread_speed(active, total, cores, threads) if active else 0.0
            # each action ends when its work (at `speed`) and its waits are both done
            steps = [d[1] / speed + d[2] for d in doing.values() if d is not None]
            busy = _computing(active, speed)
        else:
            n_cpu = sum(procs[r] for r, d in doing.items() if d is not None and d[0] == "cpu")
            speed = core_speed(n_cpu, total, cores, threads) if n_cpu else 0.0
            busy = float(n_cpu)
            # the next event: a work or wait part ending
            steps = [d[1] / speed if d[0] == "cpu" else d[1]
                     for d in doing.values() if d is not None]
        steps += [t - now for t in ready_at.values()]  # or an input arriving
        if not steps:
            blocked = {r: str(o[pos[r]]) for r, o in orders.items() if pos[r] < len(o)}
            raise ValueError(f"schedule deadlocks: each rank's next action waits: {blocked}")
        dt = max(0.0, min(steps))
        now += dt
        if busy * threads > cores + _EPS:
            contended += dt
        for r, d in doing.items():
            if d is None:
                continue
            if waits == "spread":
                # the share of dt this rank's processes compute: both parts end together
                w, v = d[1], d[2]
                p = w / (w + speed * v) if w > _EPS else 0.0
                d[1], d[2] = max(0.0, w - dt * speed * p), max(0.0, v - dt * (1.0 - p))
                done = d[1] <= _EPS and d[2] <= _EPS
            else:
                d[1] -= dt * speed if d[0] == "cpu" else dt
                if d[1] <= _EPS and d[0] == "cpu":
                    d[0], d[1] = "wait", d[2]
                done = d[1] <= _EPS and d[0] == "wait"
            if done:
                end[orders[r][pos[r]]] = now
                pos[r] += 1
                doing[r] = None
