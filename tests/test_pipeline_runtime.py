"""PipelineRuntime on 2 and 4 gloo processes against the same model run in one process.

The model is an embedding -> 7 tanh MLP blocks -> classifier stack, split unevenly (the
embedding and one extra block on stage 0, the head on the last stage) into p * v stages.
Every stage adds an auxiliary term 0.01 * mean(y^2) through `aux_fn`, so the hook path is
exercised by every schedule. The reference is one plain forward/backward of the whole model
over the whole batch in the parent process; with equal micro-batches and mean-reduced losses
the pipeline's 1/M-scaled micro-batch gradients must sum to the same thing.

Tolerance (fp32): rtol 1e-5, atol 1e-6. The pipeline accumulates M micro-batch gradients
where the reference reduces one batch, so sums run in a different order; observed gaps are
~1e-7 relative, two orders below the bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pipeline
from comm import run_local

pytestmark = pytest.mark.multiproc

VOCAB, D, CLASSES, MB, M, BLOCKS = 11, 16, 5, 3, 4, 7
AUX = 0.01
SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("interleaved-1f1b", {"n_virtual": 2}), ("zb-h1", {})]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Embedding(VOCAB, D)]
    layers += [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(BLOCKS)]
    layers.append(nn.Linear(D, CLASSES))
    return nn.Sequential(*layers)


def _split(n_stages: int) -> list[list[int]]:
    """Layer indices per stage: stage 0 gets the embedding plus one block more than the
    rest (an uneven split), the last stage ends with the head."""
    n = len(_model())
    bounds = [0] + [2 + (n - 2) * (s + 1) // n_stages for s in range(n_stages - 1)] + [n]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]


def _data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, VOCAB, (MB,), generator=g) for _ in range(M)]
    ys = [torch.randint(0, CLASSES, (MB,), generator=g) for _ in range(M)]
    return xs, ys


def _aux(stage: int, module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    return AUX * y.pow(2).mean()


def _run(name: str, kw: dict, rank: int, world: int, group: dist.ProcessGroup | None) -> dict:
    xs, ys = _data()
    sched = pipeline.build(name, world, M, **kw)
    model = _model()
    split = _split(pipeline.n_stages(sched))
    mine = {s: nn.Sequential(*[model[i] for i in split[s]])
            for s, r in pipeline.stage2rank(sched).items() if r == rank}
    rt = pipeline.PipelineRuntime(sched, mine, F.cross_entropy, act_shape=(MB, D),
                                  aux_fn=_aux, group=group)
    losses = rt.step(xs, ys)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # A second step must reproduce the losses: no state leaks from one step to the next.
    model.zero_grad()
    again = rt.step(xs, ys)
    return {"losses": losses, "again": again, "grads": grads, "spans": rt.gather_spans(),
            "aux": rt.last_aux}


def _evaluate(v: int, rank: int, world: int) -> dict:
    """The forward-only schedule (evaluation) on the same runtime: losses, and whether any
    parameter got a gradient or any graph was kept."""
    xs, ys = _data()
    sched = pipeline.forward_only(world, M, v)
    model = _model()
    split = _split(pipeline.n_stages(sched))
    mine = {s: nn.Sequential(*[model[i] for i in split[s]])
            for s, r in pipeline.stage2rank(sched).items() if r == rank}
    rt = pipeline.PipelineRuntime(sched, mine, F.cross_entropy, act_shape=(MB, D), group=None)
    losses = rt.step(xs, ys)
    return {"losses": losses, "grad_fn": [x.grad_fn is not None for x in losses or []],
            "grads": [n for n, p in model.named_parameters() if p.grad is not None]}


def _bad_inputs(rank: int, world: int) -> list[str]:
    """Messages of the ValueErrors a misconfigured runtime raises (checked in the parent)."""
    sched = pipeline.build("1f1b", world, M)
    stage = {rank: nn.Linear(D, D)}
    attempts = [
        lambda: pipeline.PipelineRuntime(sched, {rank + 1: nn.Linear(D, D)}, F.mse_loss, (MB, D)),
        lambda: pipeline.PipelineRuntime(pipeline.build("1f1b", world + 1, M), stage,
                                         F.mse_loss, (MB, D)),
    ]
    mixed = {rank: nn.Linear(D, D), rank + world: nn.Linear(D, D)}  # interleaved, v=2
    mixed[rank].boundary_dtype = torch.bfloat16  # e.g. one autocast Stage, one plain
    attempts.append(lambda: pipeline.PipelineRuntime(
        pipeline.build("interleaved-1f1b", world, M, n_virtual=2), mixed, F.mse_loss, (MB, D)))
    if rank in (0, world - 1):  # the ranks that own inputs / targets check their counts
        attempts.append(lambda: pipeline.PipelineRuntime(sched, stage, F.mse_loss, (MB, D)).step(
            [torch.zeros(MB, D)] * (M - 1), [torch.zeros(MB, D)] * (M - 1)))
    msgs = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as e:
            msgs.append(str(e))
        else:
            msgs.append("no error")
    return msgs


def _worker(rank: int, world: int, group: dist.ProcessGroup) -> dict[str, dict]:
    out = {name: _run(name, kw, rank, world, None) for name, kw in SCHEDULES}
    # Every stage on one rank (p = 1, 3 virtual stages): the hand-offs stay in memory.
    # new_group is collective, so every rank creates every singleton group.
    singles = [dist.new_group([r]) for r in range(world)]
    out["local"] = _run("interleaved-1f1b", {"n_virtual": 3}, 0, 1, singles[rank])
    out["bad"] = _bad_inputs(rank, world)
    out["eval"] = _evaluate(1, rank, world)
    out["eval_v2"] = _evaluate(2, rank, world)
    return out


def _reference(n_stages: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One process, whole batch: CE mean + the aux term of every stage output, plain
    autograd. Returns the per-micro-batch CE losses and every parameter's gradient."""
    model = _model()
    xs, ys = _data()
    with torch.no_grad():
        mb_losses = [F.cross_entropy(model(xm), ym) for xm, ym in zip(xs, ys, strict=True)]
    layer_out = {}
    h = torch.cat(xs)
    for i, layer in enumerate(model):
        h = layer(h)
        layer_out[i] = h
    # Equal micro-batch sizes make the mean of per-micro-batch means the full-batch mean.
    aux = sum(AUX * layer_out[layers[-1]].pow(2).mean() for layers in _split(n_stages))
    (F.cross_entropy(h, torch.cat(ys)) + aux).backward()
    return mb_losses, {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp4"])
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_local(_worker, world, timeout_s=240)


@pytest.mark.parametrize("name", [n for n, _ in SCHEDULES])
def test_matches_single_process(runs: tuple[int, list[dict]], name: str) -> None:
    world, results = runs
    kw = dict(SCHEDULES)[name]
    n_stage = pipeline.n_stages(pipeline.build(name, world, M, **kw))
    ref_losses, ref_grads = _reference(n_stage)
    last = pipeline.stage2rank(pipeline.build(name, world, M, **kw))[n_stage - 1]
    for rank, res in enumerate(results):
        r = res[name]
        if rank == last:
            torch.testing.assert_close(torch.stack(r["losses"]), torch.stack(ref_losses),
                                       rtol=1e-5, atol=1e-6)
            assert [float(v) for v in r["again"]] == [float(v) for v in r["losses"]]
        else:
            assert r["losses"] is None
    merged = {}
    for res in results:
        for n, g in res[name]["grads"].items():
            assert n not in merged, f"parameter {n} has gradients on two ranks"
            merged[n] = g
    assert sorted(merged) == sorted(ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(merged[n], g, rtol=1e-5, atol=1e-6, msg=f"grad of {n}")


@pytest.mark.parametrize("name", [n for n, _ in SCHEDULES])
def test_spans_follow_schedule(runs: tuple[int, list[dict]], name: str) -> None:
    """Measured spans: each rank ran exactly its schedule's actions, in order, and no
    action started before the ones it depends on had ended."""
    world, results = runs
    sched = pipeline.build(name, world, M, **dict(SCHEDULES)[name])
    spans = results[0][name]["spans"]
    for rank in range(world):
        got = [s.action for s in sorted(spans, key=lambda s: s.start) if s.rank == rank]
        assert got == [a for a in sched[rank] if a is not None]
    end = {s.action: s.end for s in spans}
    n_stage = pipeline.n_stages(sched)
    for s in spans:
        for d in pipeline.schedule.dependencies(s.action, n_stage):
            assert end[d] <= s.start, f"{s.action} started before {d} ended"
    measured = pipeline.bubble_from_spans(spans, world)
    assert 0.0 <= measured < 1.0


def test_all_stages_on_one_rank(runs: tuple[int, list[dict]]) -> None:
    """p = 1 with 3 virtual stages: activations and gradients hand off in memory."""
    _, results = runs
    ref_losses, ref_grads = _reference(3)
    for res in results:
        r = res["local"]
        torch.testing.assert_close(torch.stack(r["losses"]), torch.stack(ref_losses),
                                   rtol=1e-5, atol=1e-6)
        for n, g in ref_grads.items():
            torch.testing.assert_close(r["grads"][n], g, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("key, v", [("eval", 1), ("eval_v2", 2)])
def test_forward_only_schedule_evaluates(runs: tuple[int, list[dict]], key: str, v: int) -> None:
    """Evaluation on the training executor: the last stage's losses equal the whole model's
    forward per micro-batch bit for bit (the same ops on the same shapes in the same order;
    the hand-offs copy tensors exactly), no graph, no gradient anywhere."""
    world, results = runs
    ref_losses, _ = _reference(world * v)
    last = (world * v - 1) % world
    for rank, res in enumerate(results):
        r = res[key]
        assert r["grads"] == []
        if rank == last:
            assert torch.equal(torch.stack(r["losses"]), torch.stack(ref_losses))
            assert r["grad_fn"] == [False] * M
        else:
            assert r["losses"] is None


def test_bad_inputs_raise_clear_errors(runs: tuple[int, list[dict]]) -> None:
    world, results = runs
    for rank, res in enumerate(results):
        wrong_stage, wrong_world, mixed_dtypes, *wrong_count = res["bad"]
        assert f"got modules for stages [{rank + 1}]" in wrong_stage
        assert f"runs stages [{rank}] here" in wrong_stage
        assert f"schedule has {world + 1} ranks but the PP group has {world}" in wrong_world
        assert "different boundary dtypes" in mixed_dtypes and "bfloat16" in mixed_dtypes
        if rank in (0, world - 1):
            assert f"needs {M}" in wrong_count[0] and f"got {M - 1}" in wrong_count[0]
