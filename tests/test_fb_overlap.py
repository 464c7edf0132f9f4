"""--comm.a2a_overlap=fb: micro-batches paired on a `Baton` give the plain loop's gradients,
and every rank issues one and the same sequence of collectives.

Processes (default tier, ~5 s): EP = 2 on gloo, float64. Every rank builds the same seeded
two-MoE-layer model (shared experts included) and feeds its own 3 micro-batches; a dense
parameter's post-accumulate hook all-reduces its gradient over a second group, as the DP
bucket hooks do (a collective launched from the backward). Against the plain loop over the
same EP layers (`overlap=layer`, one chunk: the same ops on the same shapes in the same
order), the fb loop's gradients are equal exactly; against the unpipelined path (`none`:
dispatch / combine, other ops around the same GEMMs) within 1e-12 relative. The recorded
collectives (name, group, row counts) are identical on both ranks and in two runs, and they
interleave the two parties (forward exchanges of micro-batch j between backward exchanges of
j - 1), so the test fails if the baton never hands over.

Processes-free: `Baton` itself (hand-overs at switch points only, exceptions) and the
trainer's refusals of fb where it cannot run.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from comm import run_local
from comm.collectives.overlap import Baton
from model import MoELayer, presets

WORLD, M = 2, 3
CFG = presets.get("tiny").replace(d_model=16, n_routed_experts=4, top_k=2, moe_ffn_dim=12,
                                  shared_ffn_dim=8)


class _Net(torch.nn.Module):
    """Linear -> MoE -> tanh -> MoE -> sum of squares: two exchanges per MoE layer each way."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = torch.nn.Linear(CFG.d_model, CFG.d_model)
        self.moe = torch.nn.ModuleList([MoELayer(CFG), MoELayer(CFG)])
        self.double()
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.moe[0](self.inp(x))
        return (self.moe[1](torch.tanh(h)) ** 2).mean()


def _shard(net: _Net, group, overlap: str, rank: int) -> None:
    from comm.ep import EPDispatcher
    from trainer.distributed.parallel import shard_layer

    for layer in net.moe:
        shard_layer(layer, EPDispatcher(group, WORLD, layer.n_slots, "flat", None, None, overlap, 1),
                    rank)


def _record(trace: list[tuple]) -> list:
    """Wrap the collectives the step issues (blocking or async) to append to `trace`."""
    saved = []
    for name in ("all_to_all_single", "all_reduce"):
        real = getattr(dist, name)

        def wrapper(*args, real=real, name=name, group=None, **kw):
            rows = tuple(args[0].shape[:1]) if args and isinstance(args[0], torch.Tensor) else ()
            trace.append((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD)),
                          rows, threading.current_thread().name))
            return real(*args, group=group, **kw)
        saved.append((name, real))
        setattr(dist, name, wrapper)
    return saved


def _run(rank: int, overlap: str, fb: bool, dp) -> tuple[list[torch.Tensor], list[tuple], int]:
    net = _Net()
    _shard(net, dist.group.WORLD, overlap, rank)
    # the DP hook: a gradient all-reduce launched from the backward, on its own group
    works = []
    net.inp.weight.register_post_accumulate_grad_hook(
        lambda p: works.append(dist.all_reduce(p.grad.clone(), group=dp, async_op=True)))
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(2, 5 + j, CFG.d_model, generator=g, dtype=torch.float64) for j in range(M)]
    trace: list[tuple] = []
    saved = _record(trace)
    baton = Baton()
    try:
        if fb:
            for layer in net.moe:
                layer.dispatcher.baton = baton
            baton.microbatches(M, lambda j: net(xs[j]), lambda loss: (loss / M).backward())
        else:
            for j in range(M):
                (net(xs[j]) / M).backward()
    finally:
        for name, real in saved:
            setattr(dist, name, real)
    for w in works:
        w.wait()
    grads = [p.grad.clone() for p in net.parameters()]
    return grads, trace, baton.switches


def _worker(rank: int, world: int, group) -> dict:
    torch.set_default_dtype(torch.float64)
    dp = dist.new_group([0, 1])
    out = {}
    for key, overlap, fb in [("none", "none", False), ("layer", "layer", False),
                             ("fb", "fb", True), ("fb2", "fb", True)]:
        grads, trace, switches = _run(rank, overlap, fb, dp)
        out[key] = {"grads": grads, "trace": trace, "switches": switches}
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_local(_worker, WORLD, timeout_s=120)


@pytest.mark.multiproc
def test_fb_gradients_equal_plain_loop(ranks: list[dict]) -> None:
    for r in ranks:
        for got, same, plain in zip(r["fb"]["grads"], r["layer"]["grads"], r["none"]["grads"],
                                    strict=True):
            assert torch.equal(got, same)  # the same ops on the same shapes in the same order
            torch.testing.assert_close(got, plain, rtol=1e-12, atol=1e-14)


@pytest.mark.multiproc
def test_fb_collective_order_is_one_and_deterministic(ranks: list[dict]) -> None:
    seqs = [[e[:2] for e in r["fb"]["trace"]] for r in ranks]
    assert seqs[0] == seqs[1]  # one order on both ranks: name and group of every call
    for r in ranks:
        assert r["fb"]["trace"] == r["fb2"]["trace"]  # and the same in a second run
        assert r["fb"]["switches"] > 0
        threads = [e[3] for e in r["fb"]["trace"]]
        # both parties issue collectives, interleaved: some helper-thread call comes between
        # two calls of the calling thread (the plain loop issues everything from one thread)
        first = threads.index("fb-baton")
        assert "MainThread" in threads[first:] and "MainThread" in threads[:first]
        assert {e[3] for e in r["layer"]["trace"]} == {"MainThread"}
        # the DP hook's all-reduces are in the sequence, on their own group
        assert sum(e[0] == "all_reduce" for e in r["fb"]["trace"]) == M
        # same collectives as the plain loop, only reordered
        assert sorted(e[:3] for e in r["fb"]["trace"]) == sorted(e[:3] for e in r["layer"]["trace"])


def test_baton_hands_over_at_switches_only() -> None:
    baton = Baton()
    log: list[str] = []

    def party(name: str, n: int):
        def run() -> str:
            for i in range(n):
                log.append(f"{name}{i}")
                baton.switch()
            return name
        return run

    assert baton.pair(party("b", 3), party("f", 5)) == ("b", "f")
    # b runs until its switch, then f until its switch, ...; once b ended f runs on alone
    assert log == ["b0", "f0", "b1", "f1", "b2", "f2", "f3", "f4"]
    baton.switch()  # outside a pair: a no-op


def test_baton_raises_after_both_ended() -> None:
    baton = Baton()
    done = []

    def bad() -> None:
        baton.switch()
        raise ValueError("boom")

    def good() -> int:
        baton.switch()
        baton.switch()
        done.append(1)
        return 1

    with pytest.raises(ValueError, match="boom"):
        baton.pair(bad, good)
    assert done == [1]
    assert baton.pair(lambda: 1, lambda: 2) == (1, 2)  # reusable afterwards


def test_baton_keeps_grad_mode() -> None:
    baton = Baton()
    with torch.no_grad():
        got = baton.pair(torch.is_grad_enabled, torch.is_grad_enabled)
    assert got == (False, False)
    assert baton.pair(torch.is_grad_enabled, torch.is_grad_enabled) == (True, True)


@pytest.mark.parametrize("args,match", [
    (["--parallel.microbatches=1"], "microbatches=1"),
    (["--parallel.microbatches=4", "--train.checkpointing=full"], "checkpointing='full'"),
])
def test_trainer_refuses_fb_where_it_cannot_run(args, match) -> None:
    from trainer.config import parse_args
    from trainer.setup import check_fb

    cfg = parse_args(["--comm.a2a_overlap=fb", *args])
    with pytest.raises(ValueError, match=match):
        check_fb(cfg, 1)


def test_trainer_refuses_fb_with_unpaired_schedules() -> None:
    from trainer.config import parse_args
    from trainer.setup import check_fb

    for sched in ("gpipe", "zb-h1"):
        cfg = parse_args(["--comm.a2a_overlap=fb", "--parallel.microbatches=4",
                          f"--parallel.schedule={sched}"])
        with pytest.raises(ValueError, match=f"schedule='{sched}'.*1f1b, interleaved-1f1b"):
            check_fb(cfg, 2)
        check_fb(cfg, 1)  # the schedule is unused with pp = 1
