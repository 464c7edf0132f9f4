"""tuner.sharing: the pipeline replay on shared cores, against timelines worked by hand, the
dedicated-device simulator (pipeline.simulate), and its use in tuner.estimate (CPU platforms
only; GPU platforms unchanged)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import CPU_W4

from model import presets
from pipeline import build, simulate
from tuner import Assumptions, ParallelPlan, estimate, load_platform
from tuner.estimate import step_time_lower_bound
from tuner.layout import FP32_TRAINER_PRECISION
from tuner.measure import write_platform_toml
from tuner.platform import Platform
from tuner.sharing import (
    core_speed,
    exchange_tail_saving,
    shared_makespan,
    shared_replay,
    spread_speed,
)

FB = {"F": 1.0, "B": 2.0}


def test_gpipe_two_stages_two_ranks_per_core_by_hand() -> None:
    # GPipe, 2 stages x 2 micro-batches, F = 1, B = 2 (seconds at the rate of a process while
    # all 4 compute: half a core each); 2 processes per stage on 2 cores, 1 thread each. A
    # stage computing alone has a core per process: twice the rate. By hand:
    #   [0, 0.5]  s0 F0 alone (1 / 2)
    #   [0.5, 1.5] s0 F1 and s1 F0 together (rate 1)
    #   [1.5, 2]  s1 F1 alone;  [2, 3] s1 B1 alone (2 / 2)
    #   [3, 5]    s0 B1 and s1 B0 together;  [5, 6] s0 B0 alone
    # = 6, one rank's busy work; on dedicated devices (m + p - 1)(F + B) = 9.
    sched = build("gpipe", 2, 2)
    assert shared_makespan(sched, FB, {0: 2, 1: 2}, cores=2, threads=1) == pytest.approx(6.0)
    assert shared_makespan(sched, FB, {0: 1, 1: 1}, cores=2, threads=1) == pytest.approx(9.0)
    # contended (4 processes computing on 2 cores): [0.5, 1.5] and [3, 5]; with a core per
    # process never
    got = shared_replay(sched, FB, {0: 2, 1: 2}, cores=2, threads=1)
    assert (got.span, got.contended) == (pytest.approx(6.0), pytest.approx(3.0))
    assert shared_replay(sched, FB, {0: 1, 1: 1}, cores=2, threads=1).contended == 0.0
    # one micro-batch: one stage computes at a time, never contended
    one = shared_replay(build("1f1b", 2, 1), FB, {0: 2, 1: 2}, cores=2, threads=1)
    assert (one.span, one.contended) == (pytest.approx(3.0), 0.0)


def test_waiting_part_takes_no_core_by_hand() -> None:
    # One micro-batch through 2 stages: F0 s0, F0 s1, B0 s1, B0 s0, one stage at a time. Half
    # of each action computes (at twice the all-busy rate: the stage is alone), half waits
    # (not sped up): F = 0.5 / 2 + 0.5 = 0.75, B = 1 / 2 + 1 = 1.5; 2 x 0.75 + 2 x 1.5 = 4.5.
    sched = build("gpipe", 2, 1)
    got = shared_makespan(sched, FB, {0: 2, 1: 2}, cores=2, threads=1, cpu_share=0.5)
    assert got == pytest.approx(4.5)


def test_spread_waits_overlap_other_ranks_work_by_hand() -> None:
    # GPipe 2 stages x 2 micro-batches, F = 1, B = 2, half of each action waiting; one process
    # per stage on one core (the all-busy rate: half a core each). Waits spread through the
    # action: a rank computing alone at twice the rate computes 1/3 of its time, so two such
    # ranks (2/3 of a process computing on average) never contend: every action takes
    # work / 2 + wait. F: 0.25 + 0.5 = 0.75, B: 0.5 + 1 = 1.5, along the critical path
    # F0 s0, F1 s0 (beside F0 s1), F1 s1, B1 s1, B1 s0 (beside B0 s1), B0 s0:
    # 3 x 0.75 + 3 x 1.5 = 6.75. With the waits after the work, the two ranks computing
    # together share the core (rate 1) and then wait together: the F pair takes 0.5 + 0.5,
    # the B pair 1 + 1: 0.75 + 1 + 0.75 + 1.5 + 2 + 1.5 = 7.5.
    sched = build("gpipe", 2, 2)
    spread = shared_makespan(sched, FB, {0: 1, 1: 1}, cores=1, threads=1, cpu_share=0.5)
    after = shared_makespan(sched, FB, {0: 1, 1: 1}, cores=1, threads=1, cpu_share=0.5,
                            waits="after")
    assert (spread, after) == (pytest.approx(6.75), pytest.approx(7.5))


def test_spread_speed_fixed_point_by_hand() -> None:
    # two ranks of 2 processes on 2 cores (all-busy rate: half a core each), each with work
    # 0.8 and wait 0.2 left: at speed s a rank computes 0.8 / (0.8 + 0.2 s) of the time, so
    # 3.2 / (0.8 + 0.2 s) processes compute on average; above 2 of them each gets 2 / busy
    # cores, speed 4 / busy = (0.8 + 0.2 s) / 0.8, whose fixed point is s = 4 / 3 (3 busy)
    assert spread_speed([(2, 0.8, 0.2), (2, 0.8, 0.2)], 4, 2, 1) == pytest.approx(4 / 3)
    # nothing waits: every process computes, the all-busy rate (1); one rank alone: 2
    assert spread_speed([(2, 1.0, 0.0), (2, 1.0, 0.0)], 4, 2, 1) == pytest.approx(1.0)
    assert spread_speed([(2, 1.0, 0.0)], 4, 2, 1) == pytest.approx(2.0)


@pytest.mark.parametrize("name,m,kw", [("1f1b", 4, {}), ("gpipe", 3, {}), ("zb-h1", 6, {}),
                                       ("interleaved-1f1b", 6, {"n_virtual": 2})])
def test_enough_cores_is_the_dedicated_simulator(name, m, kw) -> None:
    # as many cores as processes x threads: nobody gains from a waiting rank, so the replay is
    # pipeline.simulate's makespan (an independent event loop), transfers included
    sched = build(name, 3, m, **kw)
    costs = {"F": 1.0, "B": 2.0, "W": 1.0}
    want = max(s.end for s in simulate(sched, costs, transfer=0.25))
    got = shared_makespan(sched, costs, dict.fromkeys(sched, 2), cores=12, threads=2,
                          transfer=0.25)
    assert got == pytest.approx(want)


def test_core_speed() -> None:
    assert core_speed(2, 4, cores=2, threads=1) == pytest.approx(2.0)  # 1 core vs 1/2
    assert core_speed(1, 4, cores=2, threads=1) == pytest.approx(2.0)  # 1 thread: 1 core max
    assert core_speed(2, 4, cores=4, threads=2) == pytest.approx(2.0)
    assert core_speed(3, 4, cores=8, threads=2) == pytest.approx(1.0)  # never short of cores


def test_bad_inputs_are_named() -> None:
    sched = build("1f1b", 2, 2)
    with pytest.raises(ValueError, match="cpu_share=1.5"):
        shared_makespan(sched, FB, {0: 1, 1: 1}, 2, 1, cpu_share=1.5)
    with pytest.raises(ValueError, match="waits='before'; valid: spread, after"):
        shared_makespan(sched, FB, {0: 1, 1: 1}, 2, 1, waits="before")
    with pytest.raises(ValueError, match=r"procs has ranks \[0\]"):
        shared_makespan(sched, FB, {0: 1}, 2, 1)
    with pytest.raises(ValueError, match="cores=0"):
        shared_makespan(sched, FB, {0: 1, 1: 1}, 0, 1)
    with pytest.raises(ValueError, match="lacks kinds"):
        shared_makespan(build("zb-h1", 2, 2), FB, {0: 1, 1: 1}, 2, 1)
    frontier = load_platform("frontier")
    with pytest.raises(ValueError, match="give both"):
        dataclasses.replace(frontier, cores_per_node=2)
    with pytest.raises(ValueError, match="threads_per_process=-1"):
        dataclasses.replace(frontier, cores_per_node=2, threads_per_process=-1)


def _cpu(**kw) -> Platform:
    """The recorded 4-process platform of this machine (frozen in tests/data), as written."""
    return dataclasses.replace(load_platform(CPU_W4), **kw)


PP_DP = ParallelPlan(pp=2, ep=1, dp=2, microbatches=2, global_batch=16, seq_len=256)
ASM = Assumptions(activation_set="trainer", activation_traffic_passes=4.0)


def test_estimate_uses_it_on_shared_cores_only(tmp_path) -> None:
    cfg = presets.get("tiny")
    pf = _cpu(shared_pipeline_factor=1.0)  # the replay as is (the factor: the test below)
    assert pf.shares_cores(4) and (pf.cores_per_node, pf.threads_per_process) == (2, 1)
    back = load_platform(write_platform_toml(pf, tmp_path / "p.toml", {}))
    assert (back.cores_per_node, back.threads_per_process) == (2, 1)
    off = dataclasses.replace(ASM, shared_cores=False)
    on = estimate(cfg, PP_DP, pf, FP32_TRAINER_PRECISION, ASM)
    ded = estimate(cfg, PP_DP, pf, FP32_TRAINER_PRECISION, off)
    # 2 stages of 2 processes on 2 cores: one stage always computes, so the dedicated bubble
    # ((p - 1) / (m + p - 1) = 1/3 of the pipeline time) is almost all hidden
    assert ded.time["bubble"] > 0.3 * (ded.step_time - ded.time["dp_sync"])
    assert 0 <= on.time["bubble"] < 0.05 * ded.time["bubble"]
    assert on.step_time < ded.step_time
    assert step_time_lower_bound(cfg, PP_DP, pf, FP32_TRAINER_PRECISION, ASM) <= on.step_time
    # the same platform with a core per process, or without its cores stated: the dedicated
    # bubble, exactly
    for p2 in (_cpu(cores_per_node=4), _cpu(cores_per_node=0, threads_per_process=0)):
        assert not p2.shares_cores(4)
        assert estimate(cfg, PP_DP, p2, FP32_TRAINER_PRECISION, ASM).step_time == ded.step_time


def test_measured_pipeline_factor_scales_the_contended_replay_only(tmp_path) -> None:
    # the replayed pipeline's contended part (more processes computing than cores) is scaled
    # by the platform's measured factor; the rest of the replay is not, nor the rest of the
    # step (DP sync, optimizer, the step's syncs), nor a plan without a pipeline, nor one on
    # dedicated cores
    cfg = presets.get("tiny")
    one, slow, slower = (_cpu(shared_pipeline_factor=f) for f in (1.0, 1.25, 1.5))
    assert load_platform(write_platform_toml(slow, tmp_path / "p.toml", {})) \
        .shared_pipeline_factor == 1.25
    e1, e2, e3 = (estimate(cfg, PP_DP, p, FP32_TRAINER_PRECISION, ASM)
                  for p in (one, slow, slower))
    pipe1 = sum(v for k, v in e1.time.items()
                if k not in ("dp_sync", "optimizer", "grad_post", "step_syncs"))
    # linear in the factor's excess, and on a 2-micro-batch 1F1B (2 stages of 2 processes
    # on 2 cores: the first forward and the last backward run alone, unscaled) only a part
    # of the pipeline is scaled
    extra = e2.step_time - e1.step_time
    assert e3.step_time - e1.step_time == pytest.approx(2 * extra, rel=1e-9)
    assert 0.1 * 0.25 * pipe1 < extra < 0.9 * 0.25 * pipe1
    assert e2.time["bubble"] - e1.time["bubble"] == pytest.approx(extra, rel=1e-9)
    assert step_time_lower_bound(cfg, PP_DP, slow, FP32_TRAINER_PRECISION, ASM) <= e2.step_time
    # one micro-batch: the stages never compute at once, the factor changes nothing
    m1 = PP_DP.replace(microbatches=1)
    assert estimate(cfg, m1, slow, FP32_TRAINER_PRECISION, ASM).step_time == \
        estimate(cfg, m1, one, FP32_TRAINER_PRECISION, ASM).step_time
    flat = PP_DP.replace(pp=1, dp=4, microbatches=1)
    ded = dataclasses.replace(ASM, shared_cores=False)
    for plan, asm in ((flat, ASM), (PP_DP, ded)):
        assert estimate(cfg, plan, slow, FP32_TRAINER_PRECISION, asm).step_time == \
            estimate(cfg, plan, one, FP32_TRAINER_PRECISION, asm).step_time
    # a factor below 1 keeps the lower bound below the estimate
    fast = _cpu(shared_pipeline_factor=0.8)
    assert step_time_lower_bound(cfg, PP_DP, fast, FP32_TRAINER_PRECISION, ASM) <= \
        estimate(cfg, PP_DP, fast, FP32_TRAINER_PRECISION, ASM).step_time
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="shared_pipeline_factor"):
            _cpu(shared_pipeline_factor=bad)


def test_ep_fixed_cost_shares_the_cores_like_compute() -> None:
    # the EP path's measured fixed cost (ep_layer_overhead: the dispatcher's work and the
    # waits for partner processes to be scheduled, measured with every process computing)
    # is core time in the replay, not a coreless wait: on the tiny preset (every layer MoE)
    # booking x per MoE layer there or as the per-layer overhead (compute) gives the same
    # step; a coreless wait would hide it behind the other stage's work in 1F1B and stretch
    # GPipe (measured on this VM: GPipe 1.05x 1F1B's step, such a replay 1.14x)
    cfg = presets.get("tiny")
    assert all(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    base = _cpu(shared_pipeline_factor=1.0)
    x = 0.012
    as_ep = dataclasses.replace(base, ep_layer_overhead=x)
    as_layer = dataclasses.replace(base, ep_layer_overhead=0.0,
                                   layer_overhead=base.layer_overhead + x)
    for sched in ("1f1b", "gpipe"):
        plan = ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=16, seq_len=256,
                            schedule=sched)
        a, b = (estimate(cfg, plan, p, FP32_TRAINER_PRECISION, ASM) for p in (as_ep, as_layer))
        assert a.time["alltoall"] > b.time["alltoall"] + 2 * 4 * x * 0.99  # booked apart
        assert a.step_time == pytest.approx(b.step_time, rel=1e-9), sched


@pytest.mark.parametrize("name", ["frontier", "dgx-h100", "h200-node"])
def test_gpu_platforms_unchanged(name) -> None:
    # one device per rank (no cores stated): the term never applies, bit for bit
    cfg = presets.get("tiny")
    pf = load_platform(name)
    assert pf.cores_per_node == 0 and not pf.shares_cores(pf.gpus_per_node)
    for plan in (ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=16, seq_len=256),
                 ParallelPlan(pp=4, ep=1, dp=2, microbatches=8, global_batch=32, seq_len=256,
                              schedule="zb-h1")):
        a = estimate(cfg, plan, pf, assumptions=Assumptions(shared_cores=True))
        b = estimate(cfg, plan, pf, assumptions=Assumptions(shared_cores=False))
        assert a.step_time == b.step_time and a.time == b.time


def _tail_by_steps(work: float, tail: float, procs: int, waiting: int, cores: int,
                   threads: int, dt: float = 1e-4) -> float:
    """The saving of `exchange_tail_saving` by brute force: time steps of dt, every process
    with work left runs at `core_speed` of how many have work left; procs - waiting start
    at 0, the waiting ones at `tail`; the phase ends when the waiting ones are done."""
    left = [work] * (procs - waiting) + [work] * waiting
    start = [0.0] * (procs - waiting) + [tail] * waiting
    t = 0.0
    while any(w > 1e-12 for w in left[procs - waiting:]):
        active = [i for i in range(procs) if start[i] <= t + 1e-12 and left[i] > 1e-12]
        if active:
            v = core_speed(len(active), procs, cores, threads)
            for i in active:
                left[i] -= v * dt
        t += dt
    return tail + work - t  # the all-busy price ends the phase at tail + work


def test_exchange_tail_saving_by_hand() -> None:
    # 4 processes on 2 cores, 2 waiting: the others run at 2x during the tail, the waiting
    # ones at 2x once the others are done
    assert exchange_tail_saving(1.0, 0.3, 4, 2, 2, 1) == pytest.approx(0.3)  # r = 0.4
    assert exchange_tail_saving(1.0, 1.0, 4, 2, 2, 1) == pytest.approx(0.5)  # others done
    assert exchange_tail_saving(1.0, 0.3, 4, 2, 4, 1) == 0.0  # a core each: nothing to gain
    assert exchange_tail_saving(1.0, 0.0, 4, 2, 2, 1) == 0.0
    assert exchange_tail_saving(1.0, 0.3, 4, 4, 2, 1) == 0.0  # everybody waits
    for bad in ({"work": -1.0}, {"tail": -0.1}, {"waiting": 0}, {"waiting": 5}, {"cores": 0}):
        kw = {"work": 1.0, "tail": 0.3, "procs": 4, "waiting": 2, "cores": 2, "threads": 1,
              **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            exchange_tail_saving(**kw)


@pytest.mark.parametrize("procs,waiting,cores,threads,work,tail", [
    (4, 2, 2, 1, 0.8, 0.25), (4, 1, 2, 1, 0.5, 0.4), (8, 2, 2, 1, 0.6, 0.1),
    (8, 2, 2, 1, 0.3, 0.5), (8, 3, 4, 1, 0.7, 0.2), (6, 2, 4, 2, 0.5, 0.15),
    (4, 3, 2, 1, 0.4, 0.3)])
def test_exchange_tail_saving_equals_a_time_stepped_replay(procs, waiting, cores, threads,
                                                           work, tail) -> None:
    got = exchange_tail_saving(work, tail, procs, waiting, cores, threads)
    assert got == pytest.approx(_tail_by_steps(work, tail, procs, waiting, cores, threads),
                                abs=2e-3)


def _emulated(nodes: int = 2, mbit: float = 200.0) -> Platform:
    from tuner.measure import emulator_platform
    return emulator_platform(_cpu(), nodes, 2, mbit)


def test_tail_saving_in_the_estimate_on_an_emulated_cluster_only(monkeypatch) -> None:
    """The estimate's compute drops by the layers' tail savings where the EP group's nodes
    share the host's cores, and only there; the lower bound stays below the estimate."""
    import importlib

    te = importlib.import_module("tuner.estimate")
    cfg = dataclasses.replace(presets.get("tiny"), n_routed_experts=16, top_k=4)
    plans = [ParallelPlan(pp=1, ep=4, dp=1, microbatches=m, global_batch=16, seq_len=256,
                          alltoall=a, a2a_overlap=o)
             for a in ("flat", "halo", "dedup") for o, m in (("none", 1), ("layer", 1),
                                                             ("fb", 2))]
    asm = dataclasses.replace(ASM, routing_imbalance=1.7, exchange_imbalance=1.27,
                              zero_sharding="per-parameter")
    pf = _emulated()
    assert pf.host_nodes == 2
    for plan in plans:
        on = estimate(cfg, plan, pf, FP32_TRAINER_PRECISION, asm)
        calls: list[float] = []
        real = te.tail_saving

        def spy(*a, _calls=calls, _real=real, **k):
            _calls.append(_real(*a, **k))
            return 0.0
        monkeypatch.setattr(te, "tail_saving", spy)
        off = estimate(cfg, plan, pf, FP32_TRAINER_PRECISION, asm)
        monkeypatch.setattr(te, "tail_saving", real)
        assert len(calls) == cfg.n_layers  # every MoE layer, priced once per micro-batch
        saved = plan.microbatches * sum(calls)
        assert saved > 0
        assert off.time["compute"] - on.time["compute"] == pytest.approx(saved, rel=1e-9)
        assert on.step_time == pytest.approx(off.step_time - saved, rel=1e-9)
        lb = step_time_lower_bound(cfg, plan, pf, FP32_TRAINER_PRECISION, asm)
        assert lb <= on.step_time * (1 + 1e-12)
    # balanced links (no tail), one node's host, or a GPU file: no saving
    ep = te.place_groups(plans[0], pf.gpus_per_node, asm.attention)[0]["ep"]
    parts = {"experts": 0.1, "attn": 0.1}
    assert te.tail_saving(1.0, parts, 0.0, plans[0], pf, ep, asm) > 0
    assert te.tail_saving(1.0, parts, 0.0, plans[0], pf, ep,
                          dataclasses.replace(asm, exchange_imbalance=1.0)) == 0.0
    assert te.tail_saving(1.0, parts, 0.0, plans[0], pf, ep,
                          dataclasses.replace(asm, shared_cores=False)) == 0.0
    assert 0.0 < te.tail_bound_factor(plans[0], pf, ep, asm) < 1.0
    solo = dataclasses.replace(pf, host_nodes=1)
    ep = te.place_groups(plans[0], solo.gpus_per_node, asm.attention)[0]["ep"]
    assert te.tail_saving(1.0, {"experts": 0.1, "attn": 0.1}, 0.0, plans[0], solo, ep,
                          asm) == 0.0
    assert te.tail_bound_factor(plans[0], solo, ep, asm) == 1.0
    gpu = load_platform("dgx-h100")
    ep = te.place_groups(plans[0], gpu.gpus_per_node, asm.attention)[0]["ep"]
    assert te.tail_saving(1.0, {"experts": 0.1, "attn": 0.1}, 0.0, plans[0], gpu, ep,
                          asm) == 0.0


def test_overlap_hides_nothing_inside_one_cpu_node() -> None:
    """On a CPU platform an exchange inside one node is the processes' own loopback copies:
    layer / fb overlap expose all of it (share 1), so the planner never prefers overlap there
    (train.py's auto runs none inside a node); across emulated nodes, and on GPU files, the
    communication kernels' share applies."""
    import importlib

    te = importlib.import_module("tuner.estimate")
    cfg = dataclasses.replace(presets.get("tiny"), n_routed_experts=16, top_k=4)
    one = ParallelPlan(pp=1, ep=4, dp=1, microbatches=1, global_batch=16, seq_len=256)
    pf = _cpu()
    ep = te.place_groups(one, pf.gpus_per_node, ASM.attention)[0]["ep"]
    assert ep.nodes == 1 and te.overlap_share(pf, ep, ASM) == 1.0
    none = estimate(cfg, one, pf, FP32_TRAINER_PRECISION, ASM)
    layer = estimate(cfg, dataclasses.replace(one, a2a_overlap="layer"), pf,
                     FP32_TRAINER_PRECISION, dataclasses.replace(ASM, a2a_chunks=2))
    assert layer.time["alltoall"] >= none.time["alltoall"]  # chunks only add latencies
    emu = _emulated()
    ep2 = te.place_groups(one, emu.gpus_per_node, ASM.attention)[0]["ep"]
    assert ep2.nodes == 2 and te.overlap_share(emu, ep2, ASM) == ASM.overlap_compute_share
    gpu = load_platform("dgx-h100")
    epg = te.place_groups(one, gpu.gpus_per_node, ASM.attention)[0]["ep"]
    assert te.overlap_share(gpu, epg, ASM) == ASM.overlap_compute_share
