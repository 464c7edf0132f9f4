"""Execute a HALO plan over torch.distributed point-to-point ops, with autograd.

Per call (see `comm.collectives.halo_plan` for the layout algebra), on gloo:
    batch 1: receives of phases I, II and III, then sends of phase II, then sends of phase I
    local copies x -> y while batch 1 is in flight
    for each phase II receive (smallest first, the plan's order): wait for it, then send its rows
        to the other ranks of the node (phase III, stage -> y) and copy the relay's own;
        the relay hop of early sources overlaps the arrival of later ones
    wait for everything, scatter multi-segment receives into y.
On NCCL (one Work per batch) phase III is a second batch after all of phase II.
Every phase posts all of its receives before any of its sends: gloo's TCP transport
serialises the two directions of a rank pair when a rank sends to a peer before it has
posted the receive from that peer. Ops go through `batch_isend_irecv`, which NCCL runs as one
group (no ordering deadlock between ranks); on gloo they are posted in list order straight
on the ProcessGroup (`_Poster`). Tags keep the phases
(and on gloo the sources of phase III) apart; NCCL ignores tags but matches in posting
order, which every rank shares.
The backward runs the plan of the transposed split matrix on the output gradient.
`halo_gather_ints` brings the split rows ahead of a call in the same two levels (node,
then the rank with the same local index on every other node).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from comm.collectives.halo_plan import Message, RankPlan, Segment, SplitPlans
from comm.topology import Topology

__all__ = [
    "HaloAllToAll", "halo_all_to_all", "halo_exchange", "halo_gather_array", "halo_gather_ints",
    "PIPELINE_ON_GLOO",
]

_TAG_INTRA, _TAG_INTER, _TAG_RELAY = 41, 42, 43
_TAG_GATHER_NODE, _TAG_GATHER_RAIL = 44, 45
_TAG_RELAY_BASE = 1000  # + original source rank: phase III on gloo
# The order of phase III on gloo: True = pipelined (its receives posted with phases I/II, each
# source forwarded as soon as it is in); False = NCCL's order, a second batch after phase II, so
# a gloo run checks the order NCCL runs (tests/test_comm_halo.py sets it in its workers).
PIPELINE_ON_GLOO = True


@dataclass
class _Recv:
    message: Message
    buffer: torch.Tensor  # the landing tensor (a view of the target or a temporary)
    scatter: bool  # True when rows must be copied into the target's segments afterwards


def _pack(buf: torch.Tensor, m: Message) -> torch.Tensor:
    if len(m.segments) == 1:
        start, n = m.segments[0]
        return buf.narrow(0, start, n)
    return torch.cat([buf.narrow(0, start, n) for start, n in m.segments])


def _post_recv(target: torch.Tensor, m: Message) -> _Recv:
    if len(m.segments) == 1:
        start, n = m.segments[0]
        return _Recv(m, target.narrow(0, start, n), False)
    return _Recv(m, target.new_empty((m.rows, *target.shape[1:])), True)


class _Poster:
    """Posts one batch of point-to-point ops: receives first, then sends, in list order.

    gloo: straight on the ProcessGroup (group ranks, one Work per op). `dist.isend` /
    `batch_isend_irecv` do the same after ~10 Python-level checks and group lookups per op,
    which cost more CPU than a small exchange itself when 16 ranks share 2 cores. Other
    backends go through `batch_isend_irecv` (NCCL runs it as one group) with global ranks.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.gloo = dist.get_backend(group) == dist.Backend.GLOO  # raises before init
        pg = dist.group.WORLD if group is None else group
        if pg is None:  # torch types WORLD as optional: None before init_process_group
            raise RuntimeError("HALO needs torch.distributed initialised (init_process_group)")
        self.pg: dist.ProcessGroup = pg
        self.ranks = None if self.gloo or group is None or group is dist.group.WORLD \
            else dist.get_process_group_ranks(group)

    def run(
        self, recvs: list[_Recv], sends: list[tuple[torch.Tensor, int]], tag: list[int]
    ) -> list[dist.Work]:
        """Post receives then sends; `tag` gives one tag per op in that order."""
        send_tags = tag[len(recvs):]
        if self.gloo:
            works = [self.pg.recv([r.buffer], r.message.peer, t)
                     for r, t in zip(recvs, tag, strict=False)]
            works += [self.pg.send([buf], peer, t)
                      for (buf, peer), t in zip(sends, send_tags, strict=True)]
            return works
        ranks = self.ranks
        ops = [
            dist.P2POp(dist.irecv, r.buffer, r.message.peer if ranks is None
                       else ranks[r.message.peer], self.group, t)
            for r, t in zip(recvs, tag, strict=False)
        ]
        ops += [
            dist.P2POp(dist.isend, buf, peer if ranks is None else ranks[peer], self.group, t)
            for (buf, peer), t in zip(sends, send_tags, strict=True)
        ]
        return dist.batch_isend_irecv(ops) if ops else []


def halo_exchange(
    x: torch.Tensor, plan: RankPlan, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Move the rows of x [plan.x_rows, ...] per `plan`; returns y [plan.y_rows, ...]."""
    if x.shape[0] != plan.x_rows:
        raise ValueError(f"x has {x.shape[0]} rows, the plan expects {plan.x_rows}")
    x = x.contiguous()
    trailing = x.shape[1:]
    y = x.new_empty((plan.y_rows, *trailing))
    stage = x.new_empty((plan.stage_rows, *trailing))
    # gloo gives one Work per op and matches on (peer, tag): the phase III receives (one
    # tag per original source) are posted up front with the others, and each source is
    # forwarded as soon as its phase II message is in. NCCL (one Work per batch, matching in
    # posting order) runs phase III as a second batch after phase II.
    poster = _Poster(group)
    pipelined = PIPELINE_ON_GLOO and poster.gloo

    intra = [_post_recv(y, m) for m in plan.intra_recvs]
    inter = [_post_recv(stage, m) for m in plan.inter_recvs]
    relay = [_post_recv(y, m) for m in plan.relay_recvs]
    sends = [(_pack(x, m), m.peer) for m in plan.inter_sends]
    sends += [(_pack(x, m), m.peer) for m in plan.intra_sends]
    first = intra + inter + (relay if pipelined else [])
    tags = [_TAG_INTRA] * len(intra) + [_TAG_INTER] * len(inter)
    tags += [_relay_tag(m) for m in plan.relay_recvs] if pipelined else []
    tags += [_TAG_INTER] * len(plan.inter_sends) + [_TAG_INTRA] * len(plan.intra_sends)
    works = poster.run(first, sends, tags)
    for (src, _), (dst, n) in plan.self_copies:
        y.narrow(0, dst, n).copy_(x.narrow(0, src, n))

    n_intra, n_inter = len(intra), len(inter)
    if pipelined:
        assert len(works) == len(first) + len(sends), "gloo returns one Work per op"
        by_source: dict[int, list[Message]] = {}
        for m in plan.relay_sends:
            by_source.setdefault(m.source, []).append(m)
        # The relay's own rows of each source: its phase II message holds them (messages
        # lie in the stage buffer in ascending source and offset order).
        landing = sorted((m.segments[0][0], m.peer) for m in plan.inter_recvs)
        starts = [start for start, _ in landing]
        copies: dict[int, list[tuple[Segment, Segment]]] = {}
        for (src, n), dst_seg in plan.stage_copies:
            source = landing[bisect.bisect_right(starts, src) - 1][1]
            copies.setdefault(source, []).append(((src, n), dst_seg))
        # A gloo Work must be waited exactly once (a second wait on a receive blocks for a
        # new message), so the awaited ones leave the pending list.
        pending = works[:n_intra] + works[n_intra + n_inter :]
        for r, w in zip(inter, works[n_intra : n_intra + n_inter], strict=True):
            w.wait()
            source = r.message.peer
            out = by_source.pop(source, [])
            pending += poster.run([], [(_pack(stage, m), m.peer) for m in out],
                                  [_relay_tag(m) for m in out])
            for (src, n), (dst, _) in copies.pop(source, []):
                y.narrow(0, dst, n).copy_(stage.narrow(0, src, n))
        works = pending
    else:
        for w in works:
            w.wait()
        relay_out = plan.relay_sends  # per peer ascending source, as the peer posts its receives
        works = poster.run(relay, [(_pack(stage, m), m.peer) for m in relay_out],
                           [_TAG_RELAY] * (len(relay) + len(relay_out)))
        for (src, n), (dst, _) in plan.stage_copies:
            y.narrow(0, dst, n).copy_(stage.narrow(0, src, n))
    for w in works:
        w.wait()
    for r in intra + relay:
        if r.scatter:
            offset = 0
            for start, n in r.message.segments:
                y.narrow(0, start, n).copy_(r.buffer.narrow(0, offset, n))
                offset += n
    return y


def halo_gather_ints(
    values: list[int],
    group: dist.ProcessGroup | None,
    topo: Topology,
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> list[int] | None:
    """Every rank's `values` (the same length everywhere), concatenated in rank order: an
    all-gather of ints in HALO's two levels. Step 1, each rank sends its values to the
    other ranks of its node; step 2, each rank sends its node's values to the rank with its
    local index on every other node. R = N x G ranks send (G - 1) + (N - 1) messages each
    instead of the R - 1 of an all-to-all (8 instead of 15 at 8 x 2, 134 instead of 1023
    at 128 x 8): the small exchange ahead of every HALO call. Returns None where that does
    not apply (one node, one rank per node, or nodes of unequal size): the caller exchanges
    the flat way.
    """
    out = halo_gather_array(np.asarray(values, dtype=np.int64), group, topo, device, dtype)
    return None if out is None else out.tolist()


def halo_gather_array(
    values: np.ndarray,
    group: dist.ProcessGroup | None,
    topo: Topology,
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> np.ndarray | None:
    """`halo_gather_ints` on a 1-D array, returning a read-only array [R * len(values)]
    (what `comm.all_to_all` reads the split matrix from without a Python int per entry).
    The buffer is a tensor torch allocated, seen from numpy (see `exchange_int_array`)."""
    world = dist.get_world_size(group)
    if topo.world_size != world:
        raise ValueError(f"topology describes {topo.world_size} ranks but the group has {world}")
    G, node_major = _gather_shape(topo)
    if not G:
        return None
    N, rank = topo.num_nodes, dist.get_rank(group)
    node, local, k = topo.rank2node[rank], topo.rank2local[rank], len(values)
    host = torch.empty((N, G, k), dtype=dtype)  # every bundle is written or received
    host.numpy()[node, local] = values
    buf = host if device.type == "cpu" else host.to(device)
    poster = _Poster(group)
    mates = [p for p in topo.node_ranks(node) if p != rank]
    rails = [topo.node_ranks(m)[local] for m in range(N) if m != node]
    for peers, landing, mine, tag in (
        (mates, lambda p: buf[node, topo.rank2local[p]], buf[node, local], _TAG_GATHER_NODE),
        (rails, lambda p: buf[topo.rank2node[p]], buf[node], _TAG_GATHER_RAIL),
    ):
        recvs = [_Recv(Message(p, ()), landing(p), False) for p in peers]
        for w in poster.run(recvs, [(mine, p) for p in peers], [tag] * (2 * len(peers))):
            w.wait()
    got = buf.numpy() if device.type == "cpu" else buf.cpu().numpy()
    # bundles are in rank order when the nodes hold consecutive ranks; else reorder
    out = got.reshape(-1) if node_major else \
        got[np.asarray(topo.rank2node), np.asarray(topo.rank2local)].reshape(-1)
    out.flags.writeable = False
    return out


def _gather_shape(topo: Topology) -> tuple[int, bool]:
    """(G, node-major) for `halo_gather_ints`, memoised on `topo` as `relay_table` is: G
    ranks on every node (0 where the two levels do not apply: one node, one rank per node or
    nodes of unequal size), and whether node m holds ranks m*G .. m*G + G - 1."""
    memo = topo.__dict__.get("_gather_shape")
    if memo is None:
        sizes = set(topo.ranks_per_node())
        G = max(sizes)
        usable = topo.num_nodes > 1 and G > 1 and len(sizes) == 1
        memo = (G if usable else 0, usable and all(
            topo.node_ranks(m) == tuple(range(m * G, (m + 1) * G))
            for m in range(topo.num_nodes)))
        object.__setattr__(topo, "_gather_shape", memo)
    return memo


def _relay_tag(m: Message) -> int:
    return _TAG_RELAY_BASE + m.source


class HaloAllToAll(torch.autograd.Function):
    """y = HALO(x; S); dx = HALO(dy; S^T): the mirrored exchange. Both rank plans come from
    one `SplitPlans`, which builds each at most once (and shares them with the reverse)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        splits: SplitPlans,
        rank: int,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.rank, ctx.group = splits, rank, group
        return halo_exchange(x, splits.rank_plan(rank), group)

    @staticmethod
    def backward(
        ctx: Any, grad_y: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        plan = ctx.splits.transposed().rank_plan(ctx.rank)
        return halo_exchange(grad_y, plan, ctx.group), None, None, None


def halo_all_to_all(
    x: torch.Tensor,
    S: Sequence[Sequence[int]] | SplitPlans,
    topo: Topology,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, list[int]]:
    """HALO all-to-all given the full split matrix S (identical on every rank), as lists or
    as a `SplitPlans` (which keeps the rank plans for the backward and the reverse)."""
    world = dist.get_world_size(group)
    if topo.world_size != world:
        raise ValueError(
            f"topology describes {topo.world_size} ranks but the group has {world}; pass "
            "topology.restrict(dist.get_process_group_ranks(group))"
        )
    splits = S if isinstance(S, SplitPlans) else SplitPlans(S, topo)
    if splits.topology is not topo and splits.topology != topo:
        raise ValueError("the SplitPlans was made for another topology than the one passed")
    rank = dist.get_rank(group)
    plan = splits.rank_plan(rank)
    return HaloAllToAll.apply(x, splits, rank, group), list(plan.out_splits)
