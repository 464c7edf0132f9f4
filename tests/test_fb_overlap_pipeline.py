"""Paired pipeline schedules (`pipeline.build_fb`, --comm.a2a_overlap=fb) as data, and run.

Process-free: for 1F1B and interleaved 1F1B over several (p, m, v) the paired schedule passes
`pipeline.validate` (coverage, every member's dependencies in earlier steps, matched P2P,
no deadlock), has pairs on every rank once m allows, and at unit costs F=1, B=2 takes the
plain schedule's makespan (the pairs add no bubble; what they hide is extra).

Processes (PP=2 x EP=2, gloo, float64): stages holding MoE layers whose EP dispatchers run
the fb pipeline. The paired schedule's gradients equal the plain schedule's exactly (the same
ops on the same shapes, each stage's backwards in the same micro-batch order; the plain run
uses the same dispatcher path, overlap `layer` with one chunk); the recorded collectives and
P2P batches of all ranks merge into one global order (tests/test_pipeline_order.py's
checker), the EP peers issue the same sequence, the same in a second step, and the baton
handed over.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_pipeline_order import _record, merged_order_cycle

import pipeline
from comm import run_local
from model import MoELayer, presets
from pipeline.schedule import Pair, build_fb

CASES = [("1f1b", {}), ("interleaved-1f1b", {"n_virtual": 2}),
         ("interleaved-1f1b", {"n_virtual": 3})]


@pytest.mark.parametrize("name,kw", CASES, ids=["1f1b", "interleaved-v2", "interleaved-v3"])
@pytest.mark.parametrize("p,m", [(1, 4), (2, 2), (2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_paired_schedule_is_valid_and_costs_no_bubble(name, kw, p, m) -> None:
    plain = pipeline.build(name, p, m, **kw)
    fb = build_fb(name, p, m, **kw)
    pipeline.validate(fb)
    pairs = {r: sum(isinstance(s, Pair) for s in slots) for r, slots in fb.items()}
    assert pairs[p - 1] >= 1  # the last rank pairs B(k) with F(k + 1)
    for slots in fb.values():
        for s in slots:
            if isinstance(s, Pair):
                assert (s.b.stage, s.b.microbatch) != (s.f.stage, s.f.microbatch)
    costs = {"F": 1.0, "B": 2.0}
    end = max(sp.end for sp in pipeline.simulate(plain, costs))
    assert max(sp.end for sp in pipeline.simulate(fb, costs)) == end
    # same transfers, only at other steps
    key = lambda x: (x.producer, x.consumer)  # noqa: E731
    assert sorted(map(key, pipeline.derive_transfers(fb))) == \
        sorted(map(key, pipeline.derive_transfers(plain)))


def test_paired_schedule_refuses_other_schedules() -> None:
    with pytest.raises(ValueError, match="no paired"):
        build_fb("zb-h1", 2, 4)
    with pytest.raises(ValueError, match="divisible"):
        build_fb("interleaved-1f1b", 2, 3)


# -- run: PP=2 x EP=2 ------------------------------------------------------------------------

M, MB, S, D = 4, 2, 3, 16
CFG = presets.get("tiny").replace(d_model=D, n_routed_experts=4, top_k=2, moe_ffn_dim=12,
                                  shared_ffn_dim=8)


class _Stage(torch.nn.Module):
    """Linear -> MoE (EP over 2 ranks) -> tanh: two exchanges each way per micro-batch."""

    def __init__(self, seed: int, ep_group, ep_rank: int, overlap: str) -> None:
        from comm.ep import EPDispatcher
        from trainer.distributed.parallel import shard_layer

        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(D, D)
        self.moe = MoELayer(CFG)
        self.double()
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)
        shard_layer(self.moe, EPDispatcher(ep_group, 2, self.moe.n_slots, "flat", None, None,
                                           overlap, 1), ep_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.moe(self.inp(x)))


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).mean()


def _worker(rank: int, world: int, group) -> dict:
    torch.set_default_dtype(torch.float64)
    pp_idx, ep_idx = divmod(rank, 2)  # EP groups {0,1} {2,3}: same pipeline position
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ep, pp = ep_groups[pp_idx], pp_groups[ep_idx]
    g = torch.Generator().manual_seed(10 + ep_idx)
    xs = [torch.randn(MB, S, D, generator=g) for _ in range(M)]
    ys = [torch.randn(MB, S, D, generator=g) for _ in range(M)]
    out = {}
    for name, kw in [("1f1b", {}), ("interleaved-1f1b", {"n_virtual": 2})]:
        for fb in (False, True):
            sched = build_fb(name, 2, M, **kw) if fb else pipeline.build(name, 2, M, **kw)
            stages = {s: _Stage(100 + s, ep, ep_idx, "fb" if fb else "layer")
                      for s, r in pipeline.stage2rank(sched).items() if r == pp_idx}
            rt = pipeline.PipelineRuntime(sched, stages, _loss, (MB, S, D), group=pp,
                                          dtype=torch.float64)
            trace: list[tuple] = []
            saved = _record(trace)
            try:
                first = len(trace)
                rt.step(xs, ys)
                one = trace[first:]
                rt.step(xs, ys)
                two = trace[first + len(one):]
            finally:
                for attr, real in saved:
                    setattr(dist, attr, real)
            grads = {f"{s}.{n}": p.grad.clone() for s, m in stages.items()
                     for n, p in m.named_parameters()}
            out[(name, fb)] = {"trace": one, "trace2": two, "grads": grads,
                               "switches": rt.baton.switches if rt.baton else 0}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_local(_worker, 4, timeout_s=240)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b"])
def test_paired_runtime_equals_plain_and_keeps_one_order(ranks, name) -> None:
    for r in ranks:
        plain, fb = r[(name, False)], r[(name, True)]
        assert plain["grads"].keys() == fb["grads"].keys()
        # two steps of accumulated gradients; exact: both run the layer pipeline's ops on the
        # same shapes, and pairing keeps every rank's backwards (the accumulation) in order
        for k in plain["grads"]:
            assert torch.equal(fb["grads"][k], plain["grads"][k]), k
        assert fb["switches"] > 0
        # the second step repeats the first, less the runtime's one-time PP all-reduce
        assert fb["trace"][0] == ("coll", fb["trace"][0][1], "all_reduce")
        assert fb["trace"][1:] == fb["trace2"]
    traces = {i: r[(name, True)]["trace"] for i, r in enumerate(ranks)}
    assert merged_order_cycle(traces) is None
    for a, b in ((0, 1), (2, 3)):  # EP peers: one sequence of EP collectives
        ea = [e for e in traces[a] if e[0] == "coll" and e[1] == (a, b)]
        eb = [e for e in traces[b] if e[0] == "coll" and e[1] == (a, b)]
        assert ea == eb and len(ea) >= 4 * M
