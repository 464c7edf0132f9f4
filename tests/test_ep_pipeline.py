"""The chunked, overlapped MoE exchanges and the deduplicated dispatch against one process.

Every rank builds the same seeded MoE layer and every rank's input, so the reference (the
whole layer in plain torch on each rank's tokens, no communication) is computed locally; the
expert-parallel layer (EP = 4 over 2 declared nodes of 2 ranks) must give the same output, input
gradient, router and shared-expert gradients, and its expert slots' gradients must equal the
sum of the reference's over all ranks. In float64: the only differences are summation order
(chunks add their expert-weight gradients separately; dedup adds a token's experts per node,
then the nodes), far below 1e-10 relative; a misrouted row would be O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from comm import Topology, run_local
from comm.collectives.dedup import distinct_remote_pairs
from model import MoELayer, presets

pytestmark = pytest.mark.multiproc

WORLD = 4
CFG = presets.get("tiny").replace(d_model=16, n_routed_experts=8, top_k=4, moe_ffn_dim=12,
                                  shared_ffn_dim=8)
TOL = dict(rtol=1e-10, atol=1e-12)


def _layer(cfg, n_slots: int | None = None) -> MoELayer:
    torch.manual_seed(7)
    layer = MoELayer(cfg).double()
    if n_slots:
        # replicas: every expert once, experts 0, 5, 2, 7 once more (slots 8..11, rank 3)
        layer.resize_slots([*range(cfg.n_routed_experts), 0, 5, 2, 7][:n_slots])
        layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
        if layer.n_slots > cfg.n_routed_experts:  # replicas start as copies of their expert
            m = layer.slot_map()
            for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
                w.copy_(w[m])
    return layer


def _inputs(cfg, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(2, 6 + r, cfg.d_model, generator=g, dtype=torch.float64)
            for r in range(world)]


def _grads(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    y = layer(x)
    g = torch.Generator().manual_seed(int(x.shape[1]))
    (y * torch.randn(y.shape, generator=g, dtype=y.dtype)).sum().backward()
    ex = layer.experts
    return (y.detach(), x.grad, layer.router.weight.grad.clone(),
            layer.shared_experts.w1.weight.grad.clone(),
            ex.w1.grad.clone(), ex.w2.grad.clone(), ex.w3.grad.clone())


def _worker(rank: int, world: int, group, algorithm: str, overlap: str, chunks: int,
            spread: bool, n_slots: int, permute_slots: bool) -> dict:
    from comm.ep import EPDispatcher
    from trainer.distributed.parallel import shard_layer

    torch.set_default_dtype(torch.float64)
    # two nodes of two ranks; "spread" interleaves them (node = rank % 2)
    topo = Topology.uniform(2, 2) if not spread else Topology(
        rank2node=(0, 1, 0, 1), rank2local=(0, 0, 1, 1), rank2domain=(0,) * 4,
        rank2group=(0,) * 4, rank2nic=(0, 0, 1, 1))
    ref = _layer(CFG, n_slots)
    ep = _layer(CFG, n_slots)
    if permute_slots:  # a migration: experts moved to other slots (and ranks)
        perm = torch.tensor([3, 6, 0, 7, 1, 4, 2, 5])  # expert e -> slot perm[e]
        slots = torch.empty_like(perm)
        slots[perm] = torch.arange(8)
        for lay in (ref, ep):
            lay.set_slots(slots)
            with torch.no_grad():
                for name in ("w1", "w2", "w3"):
                    w = getattr(lay.experts, name)
                    w[perm] = w[:8].clone()
    xs = _inputs(CFG, world)
    refs = [_grads(ref, x) for x in xs]
    disp = EPDispatcher(group, world, ep.n_slots, algorithm, topo, None, overlap, chunks)
    shard_layer(ep, disp, rank)
    El, lo = disp.local, rank * disp.local
    got = _grads(ep, xs[rank])
    want = refs[rank]
    for i, name in enumerate(("y", "dx", "router", "shared")):
        torch.testing.assert_close(got[i], want[i], **TOL, msg=name)
    for i, name in enumerate(("w1", "w2", "w3")):
        summed = sum(r[4 + i] for r in refs)[lo:lo + El]
        torch.testing.assert_close(got[4 + i], summed, **TOL, msg=name)
    # the rows that crossed nodes, against an independent count of this rank's routing
    with torch.no_grad():
        idx, _, _ = ref.router.route(xs[rank])
        slots = ref.expert2slot[idx] if not ref.replicated else None
    sent = disp.take_stats()
    out = {"remote_rows": sent.remote_rows, "flat_remote_rows": sent.flat_remote_rows}
    if slots is not None:
        out["distinct"] = distinct_remote_pairs(slots, El, topo, rank)
        node = topo.rank2node
        out["pairs"] = sum(1 for q in slots.flatten().tolist() if node[q // El] != node[rank])
    dist.barrier(group)
    return out


SLOW = pytest.mark.slow  # ~9 s each on 2 loaded cores; one flat and one dedup case stay fast
CASES = [
    # algorithm, overlap, chunks, spread, slots, migrated
    pytest.param("flat", "layer", 1, False, 0, False, marks=SLOW),
    pytest.param("flat", "layer", 3, False, 0, False),
    pytest.param("halo", "layer", 2, False, 0, False, marks=SLOW),
    pytest.param("dedup", "none", 1, False, 0, False, marks=SLOW),
    pytest.param("dedup", "layer", 3, True, 0, True),
    pytest.param("dedup", "layer", 2, False, 12, False, marks=SLOW),
]


@pytest.mark.parametrize("algorithm,overlap,chunks,spread,n_slots,migrated", CASES,
                         ids=["-".join(map(str, c.values)) for c in CASES])
def test_pipeline_equals_one_process(algorithm, overlap, chunks, spread, n_slots, migrated):
    outs = run_local(_worker, WORLD, algorithm, overlap, chunks, spread, n_slots, migrated,
                     timeout_s=240)
    for o in outs:
        if "pairs" in o:
            assert o["flat_remote_rows"] == o["pairs"]
            want = o["distinct"] if algorithm == "dedup" else o["pairs"]
            assert o["remote_rows"] == want, o
    if algorithm == "dedup":  # top-4 over 2 nodes: many tokens have 2+ experts on a node
        assert sum(o["remote_rows"] for o in outs) < sum(o["flat_remote_rows"] for o in outs)
