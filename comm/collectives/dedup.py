"""Deduplicated MoE dispatch: a token crosses to a remote node once, whatever its experts there.

Flat sends one row per (token, expert slot); a token with k experts on one remote node crosses
the network k times. Here, with R ranks on N nodes (`Topology`, group ranks) and E_l slots per
rank (slot q lives on rank q // E_l as its local slot q % E_l):

    X1 (inter-node hop)  source s sends each distinct (token t, node m) pair once, to
                         relay(s, m) (HALO's rail-aligned relay, `comm.topology.relay.relay_table`;
                         s itself for its own node), grouped by relay rank, in token order.
                         The row carries x_t, the token's k routing weights, zero for the
                         choices off node m, and its k int32 slots (-1 off node m) bit for bit
                         in `meta_columns` last columns: one row, one exchange per item.
    X2 (fan-out)         relay p copies each item to the ranks of its node holding its slots:
                         rows for rank r ordered by (source, local slot, token), so r knows
                         the blocks it gets from the counts alone. X2 never leaves a node.
    experts              r regroups the rows slot-major (`block_order`) for the grouped GEMM.
    X2^T (combine)       expert outputs go back to the relay, which weights them and sums
                         the rows of each item: one row per (token, node).
    X1^T                 the item rows go back to the source, which adds a token's items.

Exact against flat up to summation order: y_t = sum over nodes of (sum over the node's
experts of w y), where flat adds the k terms in one sum. Backward: every step is a gather,
an index_add or an exchange, and autograd mirrors them (the weights' gradients ride back
through X1's weight columns).

X1, X2 and their mirrors are point-to-point exchanges with the peers that have rows
(`p2p_start`; plan algorithm "p2p"), not collectives over the EP group.

`plan_dedup` settles every chunk's splits in one small exchange of ints before any row moves
(per destination: the counts for its slots, the items it relays from this rank, and, for the
rank that relays this source on its node, this source's rows for each rank of that node).
`distinct_remote_pairs` is the independent count the tests check the plan's rows against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

from comm.collectives.alltoall import AllToAllPlan
from comm.collectives.flat import _split_device, exchange_ints
from comm.topology import Topology
from comm.topology.relay import relay_table

__all__ = ["DedupChunk", "block_order", "dedup_byte_ratio", "distinct_remote_pairs", "fanout",
           "meta_columns", "p2p_start", "plan_dedup", "source_items"]

_TAG_P2P = 46  # gloo matches point-to-point ops on (peer, tag); HALO uses 41-45 and 1000+


@dataclass(frozen=True)
class DedupChunk:
    """One chunk's exchanges as seen from this rank (all splits host ints)."""

    x1: AllToAllPlan  # source -> relay: items (one row per distinct (token, node))
    x2: AllToAllPlan  # relay -> expert rank, inside the node: one row per (token, slot)
    recv_SE: list[list[int]]  # rows source s routes to my local slot j
    arrival: list[tuple[int, int]]  # X2's output blocks in arrival order: (local slot, rows)
    remote_items: int  # X1 rows this rank sends off its node
    remote_pairs: int  # rows flat would send off its node (one per (token, slot))


def source_items(slot_TK: torch.Tensor, local: int, topo: Topology, rank: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The items of X1 on the source: (item_tok [I], item_on [I, k] bool: the choices on the
    item's node, item_dest [I] relay rank), grouped by relay rank ascending, tokens ascending
    inside a relay's block."""
    dev = slot_TK.device
    rank2node = torch.tensor(topo.rank2node, dtype=torch.int64, device=dev)
    node_TK = rank2node[slot_TK // local]
    T = slot_TK.shape[0]
    on_TN = torch.zeros(T, topo.num_nodes, dtype=torch.bool, device=dev)
    on_TN.scatter_(1, node_TK, True)
    tok, node = on_TN.nonzero(as_tuple=True)  # token-major
    relay_N = torch.tensor(relay_table(topo)[rank], dtype=torch.int64, device=dev)
    dest = relay_N[node]
    perm = torch.argsort(dest, stable=True)
    tok, node, dest = tok[perm], node[perm], dest[perm]
    return tok, node_TK[tok] == node[:, None], dest


def fanout(meta_IK: torch.Tensor, items_from: list[int], local: int, world: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """At a relay, from the slots of the items it received (meta [I, k], -1 where a choice is
    not on this node; items grouped by source in `items_from` blocks): the (item, choice)
    pairs to send on, ordered by (destination rank, source, local slot, item)."""
    dev = meta_IK.device
    src = torch.repeat_interleave(torch.arange(world, device=dev),
                                  torch.tensor(items_from, dtype=torch.int64, device=dev))
    u, j = (meta_IK >= 0).nonzero(as_tuple=True)
    slot = meta_IK[u, j].to(torch.int64)
    key = ((slot // local) * world + src[u]) * local + slot % local
    perm = torch.argsort(key, stable=True)
    return u[perm], j[perm]


def block_order(blocks: list[tuple[int, int]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts) regrouping rows that arrive in `blocks` (key, rows) key-major, blocks
    of one key in arrival order: x_grouped = x.index_select(0, order); counts[key] rows."""
    keys = torch.tensor([k for k, _ in blocks], dtype=torch.int64)
    lens = torch.tensor([n for _, n in blocks], dtype=torch.int64)
    row_key = torch.repeat_interleave(keys, lens)
    order = torch.argsort(row_key, stable=True)
    n_keys = int(keys.max()) + 1 if keys.numel() else 0
    counts = torch.bincount(row_key, minlength=n_keys)
    return order.to(device), counts


def plan_dedup(counts_cQ: list[list[int]], items_cR: list[list[int]], local: int,
               topo: Topology, group: dist.ProcessGroup | None, device: torch.device
               ) -> list[DedupChunk]:
    """Every chunk's X1 / X2 plans from one exchange of ints (module docstring).

    counts_cQ[i][q]: chunk i's rows for slot q (this rank's tokens); items_cR[i][d]: its X1
    items for rank d (nonzero only at its relays)."""
    R, rank = topo.world_size, dist.get_rank(group)
    node2ranks = [topo.node_ranks(m) for m in range(topo.num_nodes)]
    G = max(len(r) for r in node2ranks)
    relay = relay_table(topo)
    me_node = topo.rank2node[rank]
    stride = local + 1 + G
    c = len(counts_cQ)
    values: list[int] = []
    for d in range(R):
        n_d = topo.rank2node[d]
        for i in range(c):
            cq = counts_cQ[i]
            values += cq[d * local:(d + 1) * local]
            values.append(items_cR[i][d])
            if relay[rank][n_d] == d:
                tot = [sum(cq[r * local:(r + 1) * local]) for r in node2ranks[n_d]]
                values += tot + [0] * (G - len(tot))
            else:
                values += [0] * G
    got = exchange_ints(values, group, _split_device(device, group))
    mates = node2ranks[me_node]
    out = []
    for i in range(c):
        rec = [got[(s * c + i) * stride:(s * c + i + 1) * stride] for s in range(R)]
        recv_SE = [r[:local] for r in rec]
        x1 = AllToAllPlan(tuple(items_cR[i]), tuple(r[local] for r in rec), "p2p")
        x2_in = [0] * R
        for s in range(R):
            if relay[s][me_node] == rank:
                for g, r in enumerate(mates):
                    x2_in[r] += rec[s][local + 1 + g]
        x2_out = [0] * R
        arrival: list[tuple[int, int]] = []
        for p in sorted(mates):  # X2's output comes grouped by source rank, ascending
            for s in range(R):
                if relay[s][me_node] == p:
                    x2_out[p] += sum(recv_SE[s])
                    arrival += [(j, recv_SE[s][j]) for j in range(local)]
        x2 = AllToAllPlan(tuple(x2_in), tuple(x2_out), "p2p")
        cq = counts_cQ[i]
        remote_pairs = sum(sum(cq[r * local:(r + 1) * local]) for r in range(R)
                           if topo.rank2node[r] != me_node)
        remote_items = sum(items_cR[i][d] for d in range(R) if topo.rank2node[d] != me_node)
        out.append(DedupChunk(x1, x2, recv_SE, arrival, remote_items, remote_pairs))
    return out


class _Posted:
    """The point-to-point ops of one `p2p_start`; `wait()` waits each exactly once (a gloo
    Work waited twice blocks for a new message)."""

    __slots__ = ("works",)

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait()


def p2p_start(x: torch.Tensor, plan: AllToAllPlan, group: dist.ProcessGroup | None
              ) -> tuple[torch.Tensor, _Posted]:
    """`all_to_all_single` of the rows of x per `plan`'s splits (rows grouped by destination
    in, by source out), posted as point-to-point ops with only the peers that have rows:
    receives first, then sends (gloo's TCP pairs serialise the two directions when a send
    goes out before its peer posted the receive), the rank's own rows copied locally. Returns
    (y, posted); y is complete once `posted.wait()` returned.

    Why not the collective: X1 and X2 of the deduplicated dispatch have few peers (a source
    sends to one relay per node, a relay fans out to its own node only), and gloo's
    all_to_all_single exchanges a header with every rank of the group, empty entries
    included, so each call waited on every rank of every node. Every rank posts its exchanges
    in the same program order (the pipeline's fixed schedule), so the k-th message of a pair
    on this tag matches the k-th receive: the same order rule as for collectives, per pair.
    gloo posts straight on the ProcessGroup (group ranks; `dist.isend` adds per-op Python
    checks); other backends use `batch_isend_irecv` (one NCCL group, global ranks), which
    the caller's stream waits for in `wait()` as for an async collective."""
    pg = dist.group.WORLD if group is None else group
    assert pg is not None, "torch.distributed is initialised (the plan exchange ran)"
    rank = dist.get_rank(group)
    x = x.contiguous()
    y = x.new_empty((sum(plan.out_splits), *x.shape[1:]))
    x_off = list(accumulate(plan.in_splits, initial=0))
    y_off = list(accumulate(plan.out_splits, initial=0))
    recvs = [(y.narrow(0, y_off[s], n), s) for s, n in enumerate(plan.out_splits)
             if n and s != rank]
    sends = [(x.narrow(0, x_off[d], n), d) for d, n in enumerate(plan.in_splits)
             if n and d != rank]
    if dist.get_backend(group) == dist.Backend.GLOO:
        works = [pg.recv([buf], s, _TAG_P2P) for buf, s in recvs]
        works += [pg.send([buf], d, _TAG_P2P) for buf, d in sends]
    else:
        ranks = None if group is None or group is dist.group.WORLD \
            else dist.get_process_group_ranks(group)
        ops = [dist.P2POp(dist.irecv, buf, s if ranks is None else ranks[s], group, _TAG_P2P)
               for buf, s in recvs]
        ops += [dist.P2POp(dist.isend, buf, d if ranks is None else ranks[d], group, _TAG_P2P)
                for buf, d in sends]
        works = dist.batch_isend_irecv(ops) if ops else []
    n = plan.in_splits[rank]
    if n:
        y.narrow(0, y_off[rank], n).copy_(x.narrow(0, x_off[rank], n))
    return y, _Posted(works)


def meta_columns(top_k: int, dtype: torch.dtype) -> int:
    """Columns of an X1 row (dtype `dtype`) that carry the item's k int32 slots, bit for bit
    (`torch.Tensor.view(dtype)`), padded to whole columns: k for 4-byte rows, 2k for 2-byte
    rows, ceil(k / 2) for 8-byte rows."""
    elt = torch.empty(0, dtype=dtype).element_size()
    return -(-4 * top_k // elt)


def distinct_remote_pairs(slot_TK: torch.Tensor, local: int, topo: Topology, rank: int) -> int:
    """Distinct (token, remote node) pairs of this rank's routing: what a deduplicated
    dispatch sends off the node, counted directly (a Python set, for tests)."""
    node = topo.rank2node
    me = node[rank]
    pairs = {(t, node[int(q) // local]) for t, row in enumerate(slot_TK.tolist()) for q in row}
    return sum(1 for _, m in pairs if m != me)


# `--comm.alltoall=auto` (trainer.build.resolve_a2a) and the planner's "auto"
# (tuner.comms.alltoall_time) run dedup at most at this expected inter-node byte ratio: dedup
# adds HALO's relay hop inside the node, which cost HALO 1.01-1.17x flat's time on the emulator
# and in the netsim projection, so it must save more than that share. Measured on the 2x2
# emulator at 200 Mbit/s (docs/alltoall.md): at top-4 (ratio 0.52) dedup took 0.83x flat's
# step, at top-2 (ratio 0.79) 0.995x, and with the layer pipeline 1.08x flat's: the bound lies
# between the two
DEDUP_AUTO_MAX_RATIO = 0.7


def dedup_byte_ratio(nodes: int, top_k: int, n_experts: int, row_numel: int,
                     elt_bytes: int, node_limit: int = 0) -> float:
    """Expected inter-node bytes of the dedup dispatch over flat's, routing uniform over
    `nodes` nodes holding n_experts / nodes experts each: a token's distinct remote nodes
    (exact for k distinct experts) against its k (nodes - 1) / nodes remote copies, each dedup
    row wider by the k weights and the k int32 slots. 1.0 on one node. `node_limit` = M > 0:
    every token's experts lie on at most M nodes (routing bound to nodes), counted as M nodes
    (an upper bound on the distinct ones)."""
    if nodes <= 1:
        return 1.0
    if n_experts % nodes or not 1 <= top_k <= n_experts:
        raise ValueError(f"{n_experts} experts over {nodes} nodes at top-{top_k}: need the "
                         f"experts divisible by the nodes and 1 <= top_k <= experts")
    # P(no expert of a given node among the k) = C(E - E/n, k) / C(E, k)
    none = math.comb(n_experts - n_experts // nodes, top_k) / math.comb(n_experts, top_k)
    distinct_remote = (nodes - 1) * (1.0 - none)
    if node_limit:
        distinct_remote = min(distinct_remote, min(node_limit, nodes) * (nodes - 1) / nodes)
    copies_remote = top_k * (nodes - 1) / nodes
    wide = (row_numel + top_k) * elt_bytes + 4 * top_k
    return distinct_remote * wide / (copies_remote * row_numel * elt_bytes)
