"""Event-driven flow-level simulation: traffic with phases and dependencies on a Network.

Shape legend: F flows, C classes, R ranks, P phases.

Life of a flow:
    waiting  until its phase's dependencies are met (see `sync` below),
    released at time t: starts moving bytes at t + message_overhead (the per-message
             software / injection cost),
    active   moves bytes at its max-min fair rate, recomputed whenever the set of active
             flows changes (a flow starts or its bytes are out),
    tail     its last byte is out; it completes after the route's propagation latency
             (sum of link latencies, fraction-weighted over multipath routes), and not
             before its rank has posted all its messages of the phase (message_gap each),
    done     counts towards the dependencies of later phases.
`sync="rank"` is what the HALO executor does: rank s starts its phase-p sends once every
dependency-phase flow *to* s has completed (phase III waits for the rows s relays).
`sync="phase"` waits for the whole dependency phase (a global barrier).

Flows with identical segments, size, phase (and, where dependencies need it, the source or
destination rank) are aggregated into classes: they start together, get the same rate and
finish together, so the simulation is exact on classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from comm.netsim.fairshare import max_min_rates
from comm.netsim.network import Network

__all__ = ["SimResult", "Traffic", "simulate"]

_WAIT, _SCHED, _ACTIVE, _TAIL, _DONE = range(5)


@dataclass(frozen=True)
class Traffic:
    """Flows between ranks: src/dst [F] rank ids, nbytes [F], phase [F] index into phases.

    deps[p] lists the phases phase p waits for (HALO: I=(), II=(), III=(II,)).
    mult [F] (optional): flow f stands for mult[f] identical flows; remote [F] (optional):
    route f between two nodes even if its GPUs share one; rank_mult [R] (optional): rank r
    stands for rank_mult[r] real ranks (all three used by `comm.netsim.lumped`).
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    phase: np.ndarray
    phases: tuple[str, ...] = ("all",)
    deps: tuple[tuple[int, ...], ...] = ((),)
    mult: np.ndarray | None = None
    remote: np.ndarray | None = None
    rank_mult: np.ndarray | None = None  # [R] real ranks each (lumped) rank stands for

    def __post_init__(self) -> None:
        F = len(np.asarray(self.src))
        m = np.ones(F) if self.mult is None else np.asarray(self.mult, dtype=np.float64)
        object.__setattr__(self, "mult", m)
        r = np.zeros(F, bool) if self.remote is None else np.asarray(self.remote, dtype=bool)
        object.__setattr__(self, "remote", r)
        for name in ("src", "dst", "phase"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        object.__setattr__(self, "nbytes", np.asarray(self.nbytes, dtype=np.float64))
        F = len(self.src)
        shapes = {n: getattr(self, n).shape
                  for n in ("src", "dst", "nbytes", "phase", "mult", "remote")}
        if any(s != (F,) for s in shapes.values()):
            raise ValueError(f"traffic arrays must all be 1-d of length {F}, got {shapes}")
        P = len(self.phases)
        if len(self.deps) != P:
            raise ValueError(f"deps has {len(self.deps)} entries for {P} phases {self.phases}")
        bad = [(p, q) for p, ds in enumerate(self.deps) for q in ds if not 0 <= q < P or q == p]
        if bad:
            raise ValueError(f"deps {self.deps} name invalid phases {bad}; valid 0..{P - 1}")
        if _has_cycle(self.deps):
            raise ValueError(f"deps {self.deps} of phases {self.phases} form a cycle")
        if F and (self.phase.min() < 0 or self.phase.max() >= P):
            raise ValueError(f"phase ids must be in 0..{P - 1}, got {np.unique(self.phase)}")
        if F and (self.nbytes.min() < 0 or min(self.src.min(), self.dst.min()) < 0):
            raise ValueError("nbytes and rank ids must be >= 0")
        if F and m.min() < 0:
            raise ValueError(f"mult must be >= 0, got min {m.min()}")

    @property
    def num_ranks(self) -> int:
        return int(max(self.src.max(), self.dst.max())) + 1 if len(self.src) else 0


def _has_cycle(deps: tuple[tuple[int, ...], ...]) -> bool:
    """Whether the phase dependency graph has a cycle (its phases would wait forever)."""
    state = [0] * len(deps)  # 0 new, 1 on the stack, 2 finished

    def visit(p: int) -> bool:
        state[p] = 1
        for q in deps[p]:
            if state[q] == 1 or (state[q] == 0 and visit(q)):
                return True
        state[p] = 2
        return False

    return any(state[p] == 0 and visit(p) for p in range(len(deps)))


@dataclass
class SimResult:
    """Completion time of the whole traffic and of each phase (seconds), plus statistics."""

    time: float
    phase_end: dict[str, float]
    flow_end: np.ndarray  # float [F]: completion of every flow (0 for skipped flows)
    flows: int
    classes: int
    events: int
    rounds: int
    stats: dict[str, float] = field(default_factory=dict)


def _classes(net: Network, tr: Traffic, gsrc: np.ndarray, gdst: np.ndarray, keep: np.ndarray,
             key_src: np.ndarray, key_dst: np.ndarray, n_msgs: np.ndarray):
    """Aggregate the kept flows into classes; returns per-class arrays and flow -> class."""
    assert tr.mult is not None and tr.remote is not None, "Traffic.__post_init__ fills them"
    routes = net.route(gsrc[keep], gdst[keep], tr.remote[keep])
    k_src = np.where(key_src[tr.phase[keep]], tr.src[keep], -1)
    k_dst = np.where(key_dst[tr.phase[keep]], tr.dst[keep], -1)
    key = np.column_stack([routes.segs, tr.nbytes[keep].view(np.int64), tr.phase[keep],
                           k_src, k_dst, n_msgs])
    # One int64 key per row would be faster, but rows are wide; lexsort keeps it exact.
    order = np.lexsort(key.T[::-1])
    sk = key[order]
    new = np.ones(len(sk), dtype=bool)
    new[1:] = np.any(sk[1:] != sk[:-1], axis=1)
    cls_sorted = np.cumsum(new) - 1
    flow2class = np.empty(len(sk), dtype=np.int64)
    flow2class[order] = cls_sorted
    first = order[new]
    mult = np.bincount(flow2class, weights=tr.mult[keep])
    return routes, first, mult, flow2class


def _release(status: np.ndarray, t_act: np.ndarray, t_rel: np.ndarray, now: float,
             overhead: float, pending: np.ndarray, c_phase: np.ndarray, c_rel: np.ndarray,
             deps: tuple[tuple[int, ...], ...]) -> None:
    """Release (at `now`) every waiting class whose dependency counters reached zero."""
    waiting = np.flatnonzero(status == _WAIT)
    if not waiting.size:
        return
    ready = np.ones(waiting.size, dtype=bool)
    for p in np.unique(c_phase[waiting]):
        sel = c_phase[waiting] == p
        for q in deps[p]:
            ready[sel] &= pending[q, c_rel[waiting[sel]]] <= 0.5
    rel = waiting[ready]
    status[rel] = _SCHED
    t_rel[rel] = now
    t_act[rel] = now + overhead


def simulate(
    net: Network,
    traffic: Traffic,
    rank2gpu: np.ndarray,
    message_overhead: float = 0.0,
    message_gap: float = 0.0,
    sync: str = "rank",
    max_events: int = 1_000_000,
) -> SimResult:
    """Simulate `traffic` with rank r on GPU rank2gpu[r]; self and zero-byte flows are skipped.

    message_overhead: seconds from release to the first byte of every message (in parallel).
    message_gap: seconds a rank spends per message it posts, serially (LogGP's g): the flows
    of rank s in phase p complete no earlier than release + n_msgs(s, p) * message_gap.
    """
    if sync not in ("rank", "phase"):
        raise ValueError(f"sync must be 'rank' or 'phase', got {sync!r}")
    if message_overhead < 0 or message_gap < 0:
        raise ValueError(f"message_overhead and message_gap must be >= 0 s, got "
                         f"{message_overhead}, {message_gap}")
    rank2gpu = np.asarray(rank2gpu, dtype=np.int64)
    tr = traffic
    assert tr.mult is not None and tr.remote is not None, "Traffic.__post_init__ fills them"
    R, P = len(rank2gpu), len(tr.phases)
    if tr.num_ranks > R:
        raise ValueError(f"traffic uses ranks up to {tr.num_ranks - 1} but rank2gpu has {R}")
    if len(np.unique(rank2gpu)) != R:
        raise ValueError("rank2gpu must map ranks to distinct GPUs")
    gsrc, gdst = rank2gpu[tr.src], rank2gpu[tr.dst]
    keep = ((gsrc != gdst) | tr.remote) & (tr.nbytes > 0) & (tr.mult > 0)
    is_dep = np.zeros(P, dtype=bool)
    for ds in tr.deps:
        is_dep[list(ds)] = True
    has_deps = np.array([bool(ds) for ds in tr.deps])
    rank_sync = sync == "rank"
    # Messages each rank posts per phase (the serial message_gap term).
    pr = tr.phase[keep] * R + tr.src[keep]
    per_rank = np.ones(R) if tr.rank_mult is None else np.asarray(tr.rank_mult, float)
    n_msgs = np.bincount(pr, weights=tr.mult[keep], minlength=P * R)[pr] / \
        per_rank[tr.src[keep]]
    n_msgs = np.rint(n_msgs).astype(np.int64)
    routes, first, mult, flow2class = _classes(
        net, tr, gsrc, gdst, keep, has_deps & rank_sync, is_dep & rank_sync, n_msgs)
    kidx = np.flatnonzero(keep)[first]  # a representative original flow of every class
    C = len(first)
    segs = routes.segs[first]
    latency = routes.flow_latency()[first]
    c_phase, c_src, c_dst = tr.phase[kidx], tr.src[kidx], tr.dst[kidx]
    remaining = tr.nbytes[kidx].copy()
    min_busy = message_gap * n_msgs[first]  # after release, before the class may complete
    # Dependency counters: flows not yet done per (phase, receiving rank) or per phase.
    cols = R if rank_sync else 1
    c_col = c_dst if rank_sync else np.zeros(C, dtype=np.int64)
    c_rel = c_src if rank_sync else np.zeros(C, dtype=np.int64)
    pending = np.zeros((P, cols))
    np.add.at(pending, (c_phase, c_col), mult)

    status = np.full(C, _WAIT)
    t_act = np.full(C, np.inf)
    t_done = np.full(C, np.inf)
    t_rel = np.zeros(C)  # release time of every class
    c_end = np.zeros(C)
    rate = np.zeros(C)
    start = ~has_deps[c_phase]
    status[start] = _SCHED
    t_act[start] = message_overhead
    # A rank that receives nothing in a dependency phase may start at once.
    _release(status, t_act, t_rel, 0.0, message_overhead, pending, c_phase, c_rel, tr.deps)
    t, events, rounds, dirty = 0.0, 0, 0, True
    active = np.zeros(0, dtype=np.int64)
    n_done = 0
    while n_done < C:
        events += 1
        if events > max_events:
            raise RuntimeError(f"more than max_events={max_events} events; raise the limit")
        if dirty:
            active = np.flatnonzero(status == _ACTIVE)
            r, k = max_min_rates(segs[active], mult[active], routes.seg_ptr, routes.seg_link,
                                 routes.seg_frac, net.capacity)
            rate[active] = r
            rounds += k
            dirty = False
        with np.errstate(divide="ignore"):
            fin = t + remaining[active] / rate[active]
        t_next = min(fin.min(initial=np.inf), t_act.min(initial=np.inf),
                     t_done.min(initial=np.inf))
        if not np.isfinite(t_next):
            raise RuntimeError(f"simulation stalled at t={t} s with {C - n_done} classes "
                               "left: a flow crosses no link of positive capacity")
        dt = t_next - t
        if np.isfinite(dt) and dt > 0:
            remaining[active] -= np.where(np.isinf(rate[active]), remaining[active],
                                          rate[active] * dt)
        t = t_next
        tol = 1e-12 * max(t, 1e-9)
        # Bytes out -> tail.
        out = active[fin <= t + tol]
        if out.size:
            remaining[out] = 0.0
            status[out] = _TAIL
            t_done[out] = np.maximum(t, t_rel[out] + min_busy[out]) + latency[out]
            dirty = True
        # Tails over -> done; release the classes whose dependencies are now met.
        over = np.flatnonzero(t_done <= t + tol)
        if over.size:
            status[over] = _DONE
            t_done[over] = np.inf
            c_end[over] = t
            n_done += over.size
            np.subtract.at(pending, (c_phase[over], c_col[over]), mult[over])
            _release(status, t_act, t_rel, t, message_overhead, pending, c_phase, c_rel,
                     tr.deps)
        # Scheduled -> active.
        go = np.flatnonzero(t_act <= t + tol)
        if go.size:
            status[go] = _ACTIVE
            t_act[go] = np.inf
            dirty = True
    flow_end = np.zeros(len(tr.src))
    flow_end[np.flatnonzero(keep)] = c_end[flow2class]
    phase_end = {name: float(flow_end[tr.phase == p].max(initial=0.0))
                 for p, name in enumerate(tr.phases)}
    return SimResult(
        time=float(c_end.max(initial=0.0)), phase_end=phase_end, flow_end=flow_end,
        flows=int(keep.sum()), classes=C, events=events, rounds=rounds,
        stats={"bytes": float(tr.nbytes[keep].sum())},
    )
