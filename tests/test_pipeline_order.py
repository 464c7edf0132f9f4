"""One global issue order for pipeline P2P and the collectives stages run inside their actions.

NCCL runs a communicator's operations on one stream in issue order, and a receive does not
finish before the peer's matching send runs, so ranks deadlock when their issue orders cannot
be merged into one: rank A issues X then Y while rank B issues Y' then X', with X matched by
X' and Y by Y'. The checker below states this directly. Operations that complete together
(a collective: its k-th call on a communicator on every member; P2P: a batch, joined with
every batch holding a matching send or receive) become one node; each rank's issue order
adds edges; a global order exists iff the graph has no cycle.

Checked on traces recorded from real gloo runs of `PipelineRuntime` (PP=2 x EP=2, four
processes, a flat `comm.all_to_all` over the EP group inside every stage, M=8, the repo's
four schedules), and, without processes, on the post order the runtime derives for more
layouts. The checker is shown to fail on the first runtime's order (receives of step t
posted before the action, sends after it, a host sync between them): a cycle at pp=2, M=8
for 1F1B and interleaved 1F1B, which have steps where the two ranks send to each other.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import comm
import pipeline
from comm import run_local
from pipeline.analysis import comm_plan, derive_transfers

SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("interleaved-1f1b", {"n_virtual": 2}), ("zb-h1", {})]
M, MB, D, VOCAB, CLASSES = 8, 4, 8, 11, 5

# A trace entry: ("p2p", comm, ((kind, src, dst, tag), ...)) | ("coll", comm, name)
#                | ("wait", tag) (a receive consumed) | ("sync", why) (the host blocks on the device)


def merged_order_cycle(traces: dict[int, list[tuple]]) -> list | None:
    """None if the ranks' issue orders merge into one global order, else the nodes of a
    cycle. Raises AssertionError on traces that do not even match (an unmatched P2P op, or
    members calling different collectives as the k-th on a communicator)."""
    parent: dict = {}

    def find(n):
        parent.setdefault(n, n)
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    program: dict[int, list] = {}
    sends, recvs, calls = {}, {}, {}
    for rank, trace in traces.items():
        count: dict = {}
        nodes = []
        for i, entry in enumerate(trace):
            if entry[0] == "coll":
                _, key, name = entry
                k = count.get(key, 0)
                count[key] = k + 1
                node = ("coll", key, k)
                calls.setdefault(node, {})[rank] = name
            elif entry[0] == "p2p":
                _, key, ops = entry
                node = ("p2p", rank, i)
                for kind, src, dst, tag in ops:
                    (sends if kind == "send" else recvs)[(key, src, dst, tag)] = node
            else:
                continue
            find(node)
            nodes.append(node)
        program[rank] = nodes
    for node, names in calls.items():
        members = node[1]
        assert sorted(names) == sorted(members), f"{node}: called by {sorted(names)}, members {members}"
        assert len(set(names.values())) == 1, f"{node}: members call different collectives {names}"
    assert sorted(sends) == sorted(recvs), (
        f"unmatched P2P: sends {sorted(set(sends) - set(recvs))}, recvs {sorted(set(recvs) - set(sends))}")
    for op, node in sends.items():
        a, b = find(node), find(recvs[op])
        parent[a] = b
    succ: dict = {find(n): set() for n in parent}
    indeg = dict.fromkeys(succ, 0)
    for nodes in program.values():
        for a, b in zip(nodes, nodes[1:], strict=False):
            a, b = find(a), find(b)
            if a != b and b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
    ready = [n for n, d in indeg.items() if d == 0]
    done = 0
    while ready:
        n = ready.pop()
        done += 1
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if done == len(succ):
        return None
    return sorted((n for n, d in indeg.items() if d > 0), key=str)


def sync_violations(trace: list[tuple]) -> list[str]:
    """Host syncs issued while a posted receive had not been consumed yet."""
    outstanding, bad = set(), []
    for entry in trace:
        if entry[0] == "p2p":
            outstanding |= {op[3] for op in entry[2] if op[0] == "recv"}
        elif entry[0] == "wait":
            outstanding.discard(entry[1])
        elif entry[0] == "sync" and outstanding:
            bad.append(f"sync {entry[1]!r} with receives {sorted(outstanding)} outstanding")
    return bad


def planned_traces(schedule: dict, old: bool) -> dict[int, list[tuple]]:
    """Each rank's P2P issue order as the runtime derives it from `comm_plan` (`old`: the
    first runtime's order). Every transfer's tag is its index in `derive_transfers`."""
    tag = {x: i for i, x in enumerate(derive_transfers(schedule))}
    out = {}
    for rank, slots in schedule.items():
        at: dict[int, list] = {}
        for kind, peer, x in comm_plan(schedule, rank):
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            at.setdefault(x.step, []).append((kind, src, dst, tag[x]))
        consumes = {x.consumer: tag[x] for _, _, x in comm_plan(schedule, rank)}
        trace: list[tuple] = []
        for t, a in enumerate(slots):
            recv = tuple(op for op in at.get(t, []) if op[0] == "recv")
            send = tuple(op for op in at.get(t, []) if op[0] == "send")
            if old and recv:
                trace.append(("p2p", "pp", recv))
            if a in consumes:
                trace.append(("wait", consumes[a]))
            if old:
                trace.append(("sync", f"after step {t}"))
                if send:
                    trace.append(("p2p", "pp", send))
            elif recv or send:
                trace.append(("p2p", "pp", recv + send))
        out[rank] = trace
    return out


def _both_send(schedule: dict) -> int:
    """Steps at which two ranks send to each other."""
    pairs = {(x.step, x.src, x.dst) for x in derive_transfers(schedule) if not x.is_local}
    return len({t for t, s, d in pairs if (t, d, s) in pairs})


# -- process-free: the derived order, and the checker on the old one ------------------------

@pytest.mark.parametrize("name,kw", SCHEDULES, ids=[n for n, _ in SCHEDULES])
@pytest.mark.parametrize("pp,m", [(2, 8), (2, 4), (4, 8), (3, 6)])
def test_derived_order_merges(name: str, kw: dict, pp: int, m: int) -> None:
    sched = pipeline.build(name, pp, m, **kw)
    traces = planned_traces(sched, old=False)
    assert merged_order_cycle(traces) is None
    assert all(not sync_violations(t) for t in traces.values())


@pytest.mark.parametrize("name,kw", [("1f1b", {}), ("interleaved-1f1b", {"n_virtual": 2})])
def test_checker_fails_on_the_old_order(name: str, kw: dict) -> None:
    """The first runtime's order at pp=2, M=8 has a cycle (both schedules have steps where
    the two ranks send to each other: 6 for 1F1B, 18 for interleaved with v=2), and host
    syncs with receives outstanding."""
    sched = pipeline.build(name, 2, M, **kw)
    assert _both_send(sched) > 0
    traces = planned_traces(sched, old=True)
    cycle = merged_order_cycle(traces)
    assert cycle is not None and len(cycle) >= 2
    assert any(sync_violations(t) for t in traces.values())


def test_checker_catches_crossed_collectives() -> None:
    """Two communicators, two ranks, opposite orders: a cycle; the same order: none."""
    a, b = ("coll", (0, 1), "all_reduce"), ("coll", (0, 1, 2), "all_to_all_single")
    c = ("coll", (2,), "x")
    assert merged_order_cycle({0: [a, b], 1: [a, b], 2: [b, c]}) is None
    assert merged_order_cycle({0: [a, b], 1: [b, a], 2: [b]}) is not None


# -- recorded from real gloo runs: PP=2 x EP=2 ------------------------------------------------

class _Block(nn.Module):
    """Linear -> flat all-to-all over the EP group (equal halves) -> tanh -> Linear: the EP
    exchange and, in the backward, its mirror run inside every pipeline action."""

    def __init__(self, ep_group: dist.ProcessGroup, first: bool, last: bool) -> None:
        super().__init__()
        self.ep_group = ep_group
        self.embed = nn.Embedding(VOCAB, D) if first else None
        self.inp = nn.Linear(D, D)
        self.out = nn.Linear(D, CLASSES if last else D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.embed(x) if self.embed is not None else x)
        y, _ = comm.all_to_all(h, [MB // 2, MB // 2], self.ep_group, algorithm="flat")
        return self.out(torch.tanh(y))


def _key(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))


def _record(trace: list[tuple]) -> list:
    """Patch torch.distributed's entry points used inside a step to append to `trace`."""
    me = dist.get_rank()
    saved = []

    def coll(name):
        real = getattr(dist, name)

        def wrapper(*args, group=None, **kw):
            trace.append(("coll", _key(group), name))
            return real(*args, group=group, **kw)
        saved.append((name, real))
        setattr(dist, name, wrapper)

    for name in ("all_to_all_single", "all_reduce"):
        coll(name)
    real_batch = dist.batch_isend_irecv

    def batch(ops):
        rows = tuple(("send", me, o.peer, o.tag) if o.op is dist.isend else
                     ("recv", o.peer, me, o.tag) for o in ops)
        trace.append(("p2p", _key(ops[0].group), rows))
        return real_batch(ops)
    saved.append(("batch_isend_irecv", real_batch))
    dist.batch_isend_irecv = batch
    return saved


def _order_worker(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    pp_idx, ep_idx = divmod(rank, 2)  # EP groups {0,1} {2,3}: same pipeline position
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, pp = ep_groups[pp_idx], pp_groups[ep_idx]
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randint(0, VOCAB, (MB,), generator=g) for _ in range(M)]
    ys = [torch.randint(0, CLASSES, (MB,), generator=g) for _ in range(M)]
    out = {}
    for name, kw in SCHEDULES:
        sched = pipeline.build(name, 2, M, **kw)
        S = pipeline.n_stages(sched)
        torch.manual_seed(0)
        stages = {s: _Block(ep, s == 0, s == S - 1)
                  for s, r in pipeline.stage2rank(sched).items() if r == pp_idx}
        rt = pipeline.PipelineRuntime(sched, stages, F.cross_entropy, (MB, D), group=pp)
        trace: list[tuple] = []
        violations: list[str] = []
        take, host_sync = rt._take, rt._host_sync

        def taking(consumer, take=take, rt=rt, trace=trace):
            tags = [rt._tag[x] for x in rt._tag if x.consumer == consumer and not x.is_local]
            trace.extend(("wait", t) for t in tags if consumer in rt._pending)
            return take(consumer)

        def syncing(why, rt=rt, trace=trace, violations=violations, host_sync=host_sync):
            if rt._pending or rt._inbox:  # a receive posted and not consumed
                violations.append(f"{why}: receives for {sorted(map(str, rt._pending))}")
            trace.append(("sync", why))
            host_sync(why)

        rt._take, rt._host_sync = taking, syncing
        saved = _record(trace)
        try:
            losses = [rt.step(xs, ys) for _ in range(2)]
        finally:
            for attr, real in saved:
                setattr(dist, attr, real)
        out[name] = {"trace": trace, "violations": violations, "losses": losses}
    return out


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    return run_local(_order_worker, 4, timeout_s=240)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [n for n, _ in SCHEDULES])
def test_recorded_order_is_global(recorded: list[dict], name: str) -> None:
    traces = {r: res[name]["trace"] for r, res in enumerate(recorded)}
    for r, t in traces.items():
        assert any(e[0] == "coll" and e[2] == "all_to_all_single" for e in t), f"rank {r}: no EP exchange"
        assert any(e[0] == "p2p" for e in t), f"rank {r}: no P2P"
        assert [e for e in t if e[0] == "sync"], f"rank {r}: the sync point was never called"
        assert recorded[r][name]["violations"] == []
        assert sync_violations(t) == []
    assert merged_order_cycle(traces) is None
    for r, res in enumerate(recorded):
        losses = res[name]["losses"]
        if r // 2 == 1:  # the last stage's ranks: two equal steps of finite losses
            assert all(torch.isfinite(torch.stack(step)).all() for step in losses)
            assert [float(v) for v in losses[0]] == [float(v) for v in losses[1]]
        else:
            assert losses == [None, None]
