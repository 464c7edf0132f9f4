"""`--comm.a2a_overlap=auto`: one rule (`trainer.layout.auto_overlap`) for the trainer's
`trainer.build.resolve_a2a` and the planner's price of a plan with a2a_overlap "auto"
(`tuner.estimate.resolve_overlap`); fb's memory in the planner (`fb_inflight`)."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_W4

from comm.topology import Topology
from model import presets
from trainer.build import resolve_a2a
from trainer.config import ConfigError, parse_args
from trainer.layout import Layout, auto_overlap, fb_problems
from trainer.setup import check_fb
from tuner import estimate, load_platform
from tuner.estimate import fb_inflight, fb_memory, resolve_overlap, stage_memory
from tuner.fb_memory import fb_memory_of_run
from tuner.layout import PUBLISHED_PRECISION, Assumptions, ParallelPlan, trainer_precision

GB = 1e9


def test_rule_by_hand():
    fits = {"fb_peak": 1 * GB, "budget": 2 * GB}
    # inside one node, or under tensor parallel: nothing to hide / not built
    assert auto_overlap(1, microbatches=4, **fits)[:2] == ("none", 1)
    mode, chunks, why = auto_overlap(2, tp=2, microbatches=4, **fits)
    assert (mode, chunks) == ("none", 1) and "tensor parallel (tp=2)" in why
    # across nodes: fb / 2 with >= 2 micro-batches and the memory known to fit
    mode, chunks, why = auto_overlap(2, microbatches=2, fb_extra=0.25 * GB, **fits)
    assert (mode, chunks) == ("fb", 2), why
    assert "EP group on 2 nodes, 2 micro-batches" in why and "+0.25 GB" in why
    assert "budget 2 GB" in why
    # one micro-batch: layer / 2, and why not fb
    mode, chunks, why = auto_overlap(2, microbatches=1, **fits)
    assert (mode, chunks) == ("layer", 2) and "parallel.microbatches=1" in why
    # the memory: not known, or not fitting
    assert auto_overlap(2, microbatches=4)[:2] == ("layer", 2)
    assert "not known to fit" in auto_overlap(2, microbatches=4, fb_peak=1 * GB)[2]
    mode, _, why = auto_overlap(2, microbatches=4, fb_peak=3 * GB, budget=2 * GB)
    assert mode == "layer" and "not fb: a rank's predicted peak with fb 3 GB" in why
    # what the trainer refuses under fb, auto does not pick
    assert auto_overlap(2, microbatches=4, pp=2, schedule="gpipe", **fits)[0] == "layer"
    assert auto_overlap(2, microbatches=4, pp=2, schedule="zb-h1", **fits)[0] == "layer"
    assert auto_overlap(2, microbatches=4, pp=2, schedule="1f1b", **fits)[0] == "fb"
    assert auto_overlap(2, microbatches=4, pp=2, schedule="interleaved-1f1b", **fits)[0] == "fb"
    assert auto_overlap(2, microbatches=4, pp=1, schedule="gpipe", **fits)[0] == "fb"  # unused
    assert auto_overlap(2, microbatches=4, recompute="full", **fits)[0] == "layer"
    assert auto_overlap(2, microbatches=4, recompute="selective", **fits)[0] == "fb"


@pytest.mark.parametrize("args,needle", [
    (["--parallel.microbatches=1"], "comm.a2a_overlap=fb with parallel.microbatches=1"),
    (["--parallel.microbatches=4", "--parallel.schedule=gpipe"],
     "comm.a2a_overlap=fb with parallel.schedule='gpipe' (pp=2) is not built"),
    (["--parallel.microbatches=4", "--train.checkpointing=full"],
     "comm.a2a_overlap=fb with train.checkpointing='full' is not built"),
])
def test_check_fb_refuses_what_fb_problems_names(args, needle):
    """The trainer's refusal of an explicit fb and auto's reason not to pick it are one list."""
    cfg = parse_args(["--comm.a2a_overlap=fb", *args])
    with pytest.raises(ConfigError) as e:
        check_fb(cfg, 2)
    assert needle in str(e.value)
    par = cfg.parallel
    assert len(fb_problems(par.microbatches, 2, par.schedule, cfg.train.checkpointing)) == 1
    check_fb(parse_args(["--comm.a2a_overlap=fb", "--parallel.microbatches=2"]), 2)


def test_fb_memory_holds_the_paired_micro_batches():
    """The planner's memory of fb: pp = 1 holds two micro-batches' activations (the plain
    loop one), 1F1B at pp = 2 four and two on ranks 0 and 1 (plain: two and one)."""
    cfg = presets.get("tiny")
    asm, pb = Assumptions(activation_set="trainer"), trainer_precision("gloo")
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=4, global_batch=8, seq_len=64)
    layer = stage_memory(cfg, plan.replace(a2a_overlap="layer"), None, pb, asm)[0]
    fb = stage_memory(cfg, plan.replace(a2a_overlap="fb"), None, pb, asm)[0]
    assert fb.activations == pytest.approx(2 * layer.activations, rel=1e-12)
    assert fb.weights == layer.weights and fb.buffers == layer.buffers
    peak, extra = fb_memory(cfg, plan, pb, asm)
    assert (peak, extra) == (fb.total, pytest.approx(layer.activations, rel=1e-12))
    pp2 = ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=8, seq_len=64)
    plain2 = stage_memory(cfg, pp2, None, pb, asm)
    fb2 = stage_memory(cfg, pp2.replace(a2a_overlap="fb"), None, pb, asm)
    for r, (k_fb, k_plain) in enumerate(((4, 2), (2, 1))):  # in flight, rank 0 and rank 1
        per_mb = plain2[r].act_by_part["experts"] / k_plain
        assert fb2[r].act_by_part["experts"] == pytest.approx(k_fb * per_mb, rel=1e-12)
    assert fb_inflight("1f1b", 1, 4, 1) == (2,)
    assert fb_inflight("gpipe", 1, 4, 1) == (2,)  # pp = 1: the trainer's paired loop
    assert fb_inflight("1f1b", 2, 8, 1) == (4, 2)
    assert fb_inflight("1f1b", 2, 1000, 1) == (4, 2)  # flat beyond the warm-up
    # no exchange (ep = 1) or nothing paired (M = 1): the plain schedule's count
    one = plan.replace(ep=1, a2a_overlap="fb")
    assert stage_memory(cfg, one, None, assumptions=asm)[0].activations == pytest.approx(
        stage_memory(cfg, one.replace(a2a_overlap="none"), None, assumptions=asm)[0].activations)


GPUS = 2  # per node, in the trainer's topology and the planner's platform


def _platform(hbm_bytes: float, base: str = "local"):
    return dataclasses.replace(load_platform(base), gpus_per_node=GPUS, nics_per_node=1,
                               hbm_bytes=hbm_bytes)


# a recorded CPU platform (benchmarks/bench_tuner_validate.py's 4-process one, frozen in
# tests/data), not this machine's freshly measured `local`, whose overlap-vs-none verdict
# moves with each measurement
RECORDED_W4 = str(CPU_W4)


GRID = list(itertools.product((1, 2), (1, 2, 4), (1, 2), (1, 2), ("none", "full"),
                              ("fits", "too small")))


@pytest.mark.parametrize("nodes,M,tp,pp,recompute,memory", GRID)
def test_trainer_and_planner_agree(monkeypatch, nodes, M, tp, pp, recompute, memory):
    """On a grid of EP spans, micro-batches, TP, PP, recompute and memory the trainer's
    resolve_a2a (with the planner's memory of the run, as train.py passes it, and a budget
    set to the platform's usable memory) runs what the planner prices a plan with
    a2a_overlap "auto" as: the same mode and chunks."""
    import trainer.build

    cfg_m = presets.get("tiny")
    ep = nodes * GPUS
    world = pp * ep
    plan = ParallelPlan(pp=pp, ep=ep, dp=1, microbatches=M, global_batch=16, seq_len=64, tp=tp,
                        checkpointing=recompute, a2a_overlap="auto")
    precision = trainer_precision("gloo")
    asm = Assumptions(activation_set="trainer", zero_sharding="per-parameter")
    peak, _ = fb_memory(cfg_m, plan, precision, asm)
    pf = _platform(peak / 0.9 * (2 if memory == "fits" else 0.5))
    planned, asm_out, _ = resolve_overlap(cfg_m, plan, pf, precision, asm)
    want = (planned.a2a_overlap,
            asm_out.a2a_chunks if planned.a2a_overlap != "none" else 1)

    monkeypatch.setattr(trainer.build, "fb_budget", lambda: pf.usable_hbm)
    cfg = parse_args(["--comm.alltoall=flat", "--comm.a2a_overlap=auto",
                      f"--parallel.microbatches={M}", f"--parallel.pp={pp}",
                      f"--parallel.ep={ep}", f"--parallel.tp={tp}", "--train.global_batch=16",
                      "--train.seq_len=64", f"--train.checkpointing={recompute}",
                      "--parallel.schedule=1f1b"])
    layout = Layout(world, pp=pp, ep=ep, tp=tp)
    mesh = SimpleNamespace(ep=ep, tp=tp, pp=pp, rank=1, layout=layout)
    _, overlap, chunks = resolve_a2a(cfg, cfg_m, mesh, Topology.uniform(nodes, GPUS),
                                     fb_memory_of_run)
    assert (overlap, chunks) == want
    # and the rule's expected outcome on this grid
    if tp > 1 or nodes == 1:
        assert want == ("none", 1)
    elif M >= 2 and recompute == "none" and memory == "fits":
        assert want == ("fb", 2)
    else:
        assert want == ("layer", 2)


def test_trainer_logs_the_decision_and_why(capsys, monkeypatch):
    import trainer.build

    monkeypatch.setattr(trainer.build, "fb_budget", lambda: 8 * GB)
    cfg_m = presets.get("tiny")
    cfg = parse_args(["--comm.alltoall=flat", "--comm.a2a_overlap=auto",
                      "--parallel.microbatches=2", "--parallel.ep=4", "--train.global_batch=8"])
    mesh = SimpleNamespace(ep=4, tp=1, pp=1, rank=0, layout=Layout(4, ep=4))
    topo = Topology.uniform(2, GPUS)
    assert resolve_a2a(cfg, cfg_m, mesh, topo, lambda *a: (1 * GB, 0.5 * GB)) == \
        ("flat", "fb", 2)
    out = capsys.readouterr().out
    assert "comm.a2a_overlap=auto: fb (EP group on 2 nodes, 2 micro-batches, a rank's " \
           "predicted peak with fb 1 GB (+0.5 GB of activations), budget 8 GB)" in out
    assert "comm.a2a_chunks=auto: 2 (a2a_overlap=auto)" in out
    # without the planner's memory (no train.py): not known to fit, layer
    assert resolve_a2a(cfg, cfg_m, mesh, topo) == ("flat", "layer", 2)
    assert "comm.a2a_overlap=auto: layer (EP group on 2 nodes; not fb: its activation " \
           "memory is not known to fit)" in capsys.readouterr().out

    def unmodelled(*a):
        raise ValueError("no such layout")

    assert resolve_a2a(cfg, cfg_m, mesh, topo, unmodelled)[1] == "layer"
    assert "fb's memory not estimated (no such layout)" in capsys.readouterr().out
    # an explicit fb keeps its 1 chunk by default
    fb = parse_args(["--comm.alltoall=flat", "--comm.a2a_overlap=fb",
                     "--parallel.microbatches=2"])
    assert resolve_a2a(fb, cfg_m, mesh, topo) == ("flat", "fb", 1)


def test_estimate_prices_auto_as_the_mode_it_resolves_to():
    """`tuner.estimate` of a plan with a2a_overlap "auto" is the estimate of the plan with the
    mode and chunks auto resolves to (the rule's, unless it prices no faster than none, as
    the trial would find: then none), and says so in its notes. Both outcomes: the tiny model
    on a recorded CPU platform with every message's latency set to 5 ms (latency-bound:
    chunking pays each message's latency again and hides less than that; with the latencies
    as measured the verdict moves between measurements of the machine: none at 5d39c22's
    platform, layer and fb at 9b6555b's) and Qwen3-30B-A3B over two DGX H100 nodes."""
    slow = dataclasses.replace(_platform(64 * GB, RECORDED_W4), network_latency=5e-3,
                               intra_node_latency=5e-3)
    cases = [(presets.get("tiny"), slow, trainer_precision("gloo"),
              Assumptions(activation_set="trainer", zero_sharding="per-parameter"),
              dict(pp=1, ep=4, dp=1, global_batch=16, seq_len=64)),
             (presets.get("qwen3-30b-a3b"), load_platform("dgx-h100"),
              PUBLISHED_PRECISION, Assumptions(),
              dict(pp=1, ep=16, dp=1, global_batch=64, seq_len=4096))]
    seen = set()
    for cfg, pf, precision, asm, layout in cases:
        for M in (1, 4):
            plan = ParallelPlan(microbatches=M, a2a_overlap="auto", **layout)
            mode = resolve_overlap(cfg, plan, pf, precision, asm)[0].a2a_overlap  # the rule's
            assert mode == ("layer" if M == 1 else mode)
            e = estimate(cfg, plan, pf, precision, asm)
            asm2 = dataclasses.replace(asm, a2a_chunks=2)
            ruled, none = (estimate(cfg, plan.replace(a2a_overlap=m), pf, precision, asm2)
                           for m in (mode, "none"))
            want = mode if ruled.step_time < none.step_time else "none"
            seen.add(want == "none")
            same = estimate(cfg, plan.replace(a2a_overlap=want), pf, precision, asm2)
            assert e.plan.a2a_overlap == want and e.step_time == same.step_time
            assert e.peak_memory == same.peak_memory
            note = next(n for n in e.notes if n.startswith("a2a_overlap auto: "))
            if want == "none":
                assert f"the trial would keep none: {mode} prices" in note
                # the plain plan's estimate whole, with auto's note after the precision note
                why = resolve_overlap(cfg, plan, pf, precision, asm)[2]
                assert why in note
                assert dataclasses.replace(e, notes=()) == dataclasses.replace(same, notes=())
                at = next(i for i, n in enumerate(e.notes) if n.startswith("precision: ")) + 1
                assert e.notes[at] == note
                assert e.notes[:at] + e.notes[at + 1:] == same.notes
            else:
                assert note.startswith(f"a2a_overlap auto: {mode} / 2 chunks")
    assert seen == {True, False}  # both outcomes


def test_cli_estimate_takes_auto(capsys):
    import json

    from tuner.cli import main

    assert main(["estimate", "--model", "tiny", "--platform", "local", "--gpus", "8",
                 "--ep", "8", "--global-batch", "16", "--seq", "64", "--a2a-overlap", "auto",
                 "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # local: 4 processes a node, so EP 8 spans 2; M = 16 / 8 = 2 micro-batches: the rule
    # says fb; the trial's price (fb against none) keeps fb or falls back to none
    assert s["layout"]["a2a_overlap"] in ("fb", "none") and s["runnable"] is True
    assert main(["estimate", "--model", "tiny", "--platform", "local", "--gpus", "8",
                 "--ep", "8", "--global-batch", "16", "--seq", "64", "--a2a-overlap", "none",
                 "--json"]) == 0
    none = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step_time_s"]
    if s["layout"]["a2a_overlap"] == "none":  # fb / 2 priced no faster: none's estimate
        assert s["step_time_s"] == none
    else:
        assert s["step_time_s"] < none


def test_planner_reports_refused_fb_not_runnable():
    from tuner.layout import not_runnable

    base = ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=8, seq_len=64,
                        a2a_overlap="fb")
    assert not_runnable(base) == []
    assert not_runnable(base.replace(a2a_overlap="auto")) == []
    why = not_runnable(base.replace(schedule="gpipe", checkpointing="full"))
    assert why == ["a2a_overlap fb with parallel.schedule='gpipe' (pp=2) is not built; it runs "
                   "with 1f1b, interleaved-1f1b",
                   "a2a_overlap fb with train.checkpointing='full' is not built (the backward's "
                   "recomputed MoE forward would run beside the paired forward); use "
                   "train.checkpointing none or selective"], why
    assert "parallel.microbatches=1" in not_runnable(base.replace(microbatches=1))[0]


def test_trial_candidates_are_the_choices_auto_still_has():
    """The rules' choice first (it wins ties); dedup, auto's per-call flat / HALO and flat
    where alltoall is auto across nodes (dedup at top-k > 1); the rule's overlap against none
    only where a2a_overlap is auto and the rule overlaps; fixed choices are not re-opened."""
    from trainer.build import trial_candidates

    assert trial_candidates("auto", "auto", "dedup", "fb", 2, 2, 4) == [
        ("dedup", "fb", 2), ("dedup", "none", 1), ("auto", "fb", 2), ("auto", "none", 1),
        ("flat", "fb", 2), ("flat", "none", 1)]
    assert trial_candidates("auto", "none", "auto", "none", 1, 4, 4) == [
        ("auto", "none", 1), ("flat", "none", 1), ("dedup", "none", 1)]
    assert trial_candidates("auto", "none", "auto", "none", 1, 2, 1) == [
        ("auto", "none", 1), ("flat", "none", 1)]
    assert trial_candidates("auto", "none", "auto", "none", 1, 1, 4) == [("auto", "none", 1)]
    assert trial_candidates("flat", "auto", "flat", "layer", 4, 2, 4) == [
        ("flat", "layer", 4), ("flat", "none", 1)]
    assert trial_candidates("flat", "auto", "flat", "none", 1, 1, 4) == [("flat", "none", 1)]
    assert trial_candidates("dedup", "layer", "dedup", "layer", 3, 2, 4) == [
        ("dedup", "layer", 3)]


def test_step_trial_runs_each_candidate_and_keeps_the_fastest():
    """StepTrial: one uncounted step, then `rounds` rounds of every candidate, each set on
    every dispatcher for its step; the median per candidate decides, ties to the first
    listed; the pick stays set and the log line names every time."""
    from trainer.a2a_trial import StepTrial

    disps = [SimpleNamespace(algorithm="dedup", overlap="layer", chunks=2) for _ in range(3)]
    cands = [("dedup", "layer", 2), ("dedup", "none", 1), ("flat", "none", 1)]
    trial = StepTrial(disps, cands, 3, torch.device("cpu"))
    assert trial.steps == 1 + 3 * 3
    # step seconds by candidate: flat/none fastest by median though one round is slow
    secs = {None: 9.0, cands[0]: [1.0, 1.1, 0.9], cands[1]: [0.8, 0.8, 0.8],
            cands[2]: [0.5, 2.0, 0.6]}
    ran, msg = [], None
    for _ in range(trial.steps):
        trial.before_step()
        c = (disps[0].algorithm, disps[0].overlap, disps[0].chunks)
        assert all((d.algorithm, d.overlap, d.chunks) == c for d in disps)
        step = trial.plan[trial.i]
        ran.append(step)
        assert msg is None
        msg = trial.after_step(9.0 if step is None else secs[step].pop(0))
    assert ran == [None, *cands, *cands, *cands]
    assert trial.done and trial.picked == ("flat", "none", 1)
    assert all((d.algorithm, d.overlap, d.chunks) == ("flat", "none", 1) for d in disps)
    assert msg.startswith("comm.alltoall / a2a_overlap=auto: trial over 9 steps (3 rounds")
    assert "flat/none 0.600 s (1.00x), dedup/none 0.800 s (1.33x), dedup/layer/2 1.000 s " \
           "(1.67x); runs flat/none from here" in msg
    trial.before_step()  # after the trial: nothing changes, nothing is recorded
    assert trial.after_step(5.0) is None and trial.picked == ("flat", "none", 1)
    tie = StepTrial(disps, cands[:2], 1, torch.device("cpu"))
    for _ in range(tie.steps):
        tie.before_step()
        tie.after_step(1.0)
    assert tie.picked == cands[0]


def test_a_resumed_run_keeps_the_recorded_trial_pick_where_it_applies():
    """StepTrial.record -> checkpoint meta (JSON) -> resume_pick: the same candidates on the
    same mesh keep the pick (and say what the trial timed); other candidates, another mesh,
    no record or a damaged one try again, saying why."""
    import json

    from trainer.a2a_trial import StepTrial, resume_pick

    disps = [SimpleNamespace(algorithm="dedup", overlap="layer", chunks=2)]
    cands = [("dedup", "layer", 2), ("dedup", "none", 1), ("flat", "none", 1)]
    trial = StepTrial(disps, cands, 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before the trial decided"):
        trial.record({"world": 4}, 0)
    for secs in (9.0, 1.0, 0.7, 0.8):
        trial.before_step()
        trial.after_step(secs)
    mesh = {"world": 4, "pp": 1, "dp": 1, "ep": 4, "tp": 1, "ep_nodes": 2}
    rec = json.loads(json.dumps(trial.record(mesh, 4)))  # as meta.json carries it
    assert rec["picked"] == ["dedup", "none", 1] and rec["step"] == 4
    picked, why = resume_pick(rec, cands, dict(mesh))
    assert picked == ("dedup", "none", 1)
    assert why == ("comm.alltoall / a2a_overlap=auto: keeps dedup/none, the pick of the trial "
                   "recorded in the checkpoint (ended at step 4: dedup/none 0.700 s (1.00x), "
                   "flat/none 0.800 s (1.14x), dedup/layer/2 1.000 s (1.43x)); no new trial")
    assert resume_pick(None, cands, mesh) == (None, "the checkpoint records no trial")
    picked, why = resume_pick(rec, cands[:2], mesh)
    assert picked is None and "this run's choices are dedup/layer/2, dedup/none" in why
    picked, why = resume_pick(rec, cands, {**mesh, "ep_nodes": 4})
    assert picked is None and "'ep_nodes': 2" in why and "'ep_nodes': 4" in why
    picked, why = resume_pick({k: v for k, v in rec.items() if k != "seconds"}, cands, mesh)
    assert picked is None and "unreadable (KeyError" in why
    picked, why = resume_pick({**rec, "picked": ["halo", "none", 1]}, cands, mesh)
    assert picked is None and "timed" in why
