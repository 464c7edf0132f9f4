"""comm.collectives.dedup's index algebra against loops written from its definitions (one process).

The exchanges themselves are checked end to end in tests/test_ep_pipeline.py (multi-process,
against one process); here: which rows a source sends to which relay, how a relay fans them
out, how arriving blocks regroup, and the expected byte ratio against enumerating every
routing of a token.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from comm import Topology
from comm.collectives.dedup import (
    block_order,
    dedup_byte_ratio,
    distinct_remote_pairs,
    fanout,
    source_items,
)
from comm.topology.relay import relay_table


def _routing(T: int, K: int, n_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n_slots, generator=g)[:K] for _ in range(T)])


@pytest.mark.parametrize("nodes,gpn,rank", [(2, 2, 1), (3, 2, 4), (4, 1, 0)])
def test_source_items_one_row_per_token_and_node(nodes, gpn, rank):
    topo = Topology.uniform(nodes, gpn)
    El, K, T = 2, 3, 9
    slot = _routing(T, K, El * nodes * gpn, seed=nodes)
    tok, on, dest = source_items(slot, El, topo, rank)
    relay = relay_table(topo)[rank]
    want = []  # (relay rank, token, mask) from the definition
    for t in range(T):
        nodes_of = [topo.rank2node[int(q) // El] for q in slot[t]]
        for m in sorted(set(nodes_of)):
            want.append((relay[m], t, [n == m for n in nodes_of]))
    want.sort(key=lambda w: (w[0], w[1]))
    assert dest.tolist() == [w[0] for w in want]
    assert tok.tolist() == [w[1] for w in want]
    assert on.tolist() == [w[2] for w in want]
    remote = sum(1 for w in want if topo.rank2node[w[0]] != topo.rank2node[rank])
    assert distinct_remote_pairs(slot, El, topo, rank) == remote


def test_fanout_orders_by_destination_source_slot_item():
    El, R = 3, 4
    items_from = [2, 0, 3, 1]
    src_of = [0, 0, 2, 2, 2, 3]
    meta = torch.tensor([[4, -1, 9], [-1, 5, -1], [3, 11, -1], [-1, -1, 10], [5, 4, -1],
                         [9, -1, -1]])
    u, j = fanout(meta, items_from, El, R)
    pairs = [(i, c) for i in range(6) for c in range(3) if meta[i, c] >= 0]
    want = sorted(pairs, key=lambda p: (int(meta[p]) // El, src_of[p[0]], int(meta[p]) % El,
                                        p[0]))
    assert list(zip(u.tolist(), j.tolist(), strict=True)) == want


def test_block_order_groups_by_key_keeping_arrival_order():
    blocks = [(1, 2), (0, 1), (2, 0), (1, 1), (0, 2)]
    order, counts = block_order(blocks, torch.device("cpu"))
    rows = [k for k, n in blocks for _ in range(n)]  # key of each arriving row
    want = sorted(range(len(rows)), key=lambda i: (rows[i], i))
    assert order.tolist() == want and counts.tolist() == [3, 3, 0]


@pytest.mark.parametrize("nodes,k,E", [(2, 2, 8), (2, 4, 8), (4, 3, 8), (3, 1, 6)])
def test_byte_ratio_against_every_routing(nodes, k, E):
    D, elt = 16, 4
    per = E // nodes
    distinct = copies = 0
    subsets = list(itertools.combinations(range(E), k))
    for s in subsets:  # a token on node 0 choosing the experts s (uniform over subsets)
        ns = [e // per for e in s]
        distinct += len(set(ns) - {0})
        copies += sum(1 for n in ns if n != 0)
    want = (distinct * ((D + k) * elt + 4 * k)) / (copies * D * elt)
    assert dedup_byte_ratio(nodes, k, E, D, elt) == pytest.approx(want, rel=1e-12)
    assert dedup_byte_ratio(1, k, E, D, elt) == 1.0
    with pytest.raises(ValueError, match="divisible"):
        dedup_byte_ratio(3, 2, 8, D, elt)
    assert math.isfinite(want)


def test_byte_ratio_bound_to_nodes():
    """Every token's experts on M of N nodes (uniformly chosen, own node included): M (N - 1)
    / N remote nodes at most, against k (N - 1) / N remote copies."""
    D, elt, k = 64, 4, 4
    wide = ((D + k) * elt + 4 * k) / (D * elt)
    assert dedup_byte_ratio(2, k, 8, D, elt, node_limit=1) == pytest.approx(1 / k * wide)
    wide8 = ((D + 8) * elt + 4 * 8) / (D * elt)  # top-8 rows carry 8 weights and slots
    assert dedup_byte_ratio(8, 8, 256, D, elt, node_limit=4) == pytest.approx(4 / 8 * wide8)
    # a bound above what uniform routing reaches changes nothing
    assert dedup_byte_ratio(2, k, 8, D, elt, node_limit=2) == dedup_byte_ratio(2, k, 8, D, elt)
