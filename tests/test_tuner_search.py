"""Planner search: constraints, TPE against exhaustive enumeration, SQLite resume, the
all-to-all overlap modes and branch and bound with them."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import CPU_W4

from model import presets
from trainer.layout import AUTO_OVERLAP_CHUNKS, fb_problems
from tuner import ParallelPlan, load_platform
from tuner.estimate import estimate, fb_inflight, stage_memory, step_time_lower_bound
from tuner.layout import CPU_TRAFFIC_PASSES, ZERO_LEVELS, Assumptions, precision_policy
from tuner.search import Evaluator, exhaustive, optuna_search
from tuner.space import OVERLAP_CHOICES, SearchSpace, check_gpu_count, overlap_chunks


@pytest.fixture(scope="module")
def small():
    """Mixtral-8x7B on 64 Frontier GCDs, a reduced space of 2304 points (768 layouts x ZeRO
    0/1/2, the all-to-all not overlapped; exhaustive: 2234 model calls). The overlap modes
    are searched in `test_pruned_search_with_overlap_equals_exhaustive`."""
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    sp = SearchSpace.default(cfg, pf, 64, 512, 4096, mbs=(1, 2), zero=(0, 1, 2),
                             a2a_overlap=("none",))
    ch = dict(sp.choices, pp=(2, 4, 8, 16), schedule=("1f1b", "zb-h1", "interleaved-1f1b:2"),
              checkpointing=("none", "full"), alltoall=("flat", "halo"))
    return cfg, pf, dataclasses.replace(sp, choices=ch)


def test_constraints_by_hand(small):
    cfg, pf, sp = small
    base = {"pp": 4, "ep": 8, "mbs": 1, "schedule": "1f1b", "alltoall": "flat",
            "checkpointing": "none", "placement": "local", "zero": 0}
    assert sp.reject(base) is None
    plan = sp.to_plan(base)
    assert (plan.dp, plan.microbatches) == (2, 512 // (2 * 8 * 1))
    assert "does not divide 8 experts" in sp.reject(dict(base, ep=16))
    assert "exceed the model's 32 layers" in sp.reject(
        dict(base, pp=16, ep=2, schedule="interleaved-1f1b:4"))
    assert "does not divide global batch" in SearchSpace.default(cfg, pf, 64, 96, 4096).reject(
        dict(base, mbs=4))
    assert 64 not in sp.choices["ep"] and max(sp.choices["ep"]) == 8  # EP <= E and <= 32
    with pytest.raises(ValueError, match="use 8 or 16"):
        check_gpu_count(12, pf)


def test_tpe_within_5_percent_of_exhaustive_in_a_quarter(small):
    cfg, pf, sp = small
    ref = exhaustive(Evaluator(sp, cfg, pf))
    assert ref.trials == sp.size == 2304
    budget = sp.size // 4
    ev = Evaluator(sp, cfg, pf)
    # 120 trials: seeds 0-5 all reach the optimum with 153-166 model calls (ZeRO included).
    got = optuna_search(ev, n_trials=120, seed=0)
    assert got.trials + got.skipped <= budget
    assert got.evaluations + got.memory_checks <= (ref.evaluations + ref.memory_checks) / 4
    assert got.best.step_time <= 1.05 * ref.best.step_time
    # The ranking is consistent with the model: re-estimating the best gives the same time.
    assert got.best.estimate.fits and got.best.estimate.step_time == got.best.step_time


@pytest.mark.integration
def test_sqlite_study_resumes(small, tmp_path):
    cfg, pf, sp = small
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first = optuna_search(Evaluator(sp, cfg, pf), n_trials=6, seed=1, storage=url, study_name="s")
    again = optuna_search(Evaluator(sp, cfg, pf), n_trials=10, seed=1, storage=url, study_name="s")
    assert (first.trials, again.trials) == (6, 10)
    assert again.best.step_time <= first.best.step_time


@pytest.mark.integration
def test_search_includes_zero_and_never_shards_a_single_copy():
    """Tiny on 4 CPU processes: PP 4 leaves DP x EP = 1, where ZeRO would shard over one
    rank; the space rejects it, so neither exhaustive nor TPE ranks such a point."""
    cfg, pf = presets.get("tiny"), load_platform("local")
    sp = SearchSpace.default(cfg, pf, 4, 16, 256, mbs=(1, 4))
    assert sp.choices["zero"] == ZERO_LEVELS  # every level the planner prices
    pt = {"pp": 4, "ep": 1, "mbs": 1, "schedule": "1f1b", "alltoall": "flat",
          "checkpointing": "none", "placement": "local", "zero": 1}
    assert sp.reject(pt) == ("zero=1 needs a replica group of > 1 rank; dp=1 x ep=1 holds one "
                             "copy of each parameter")
    assert sp.reject(dict(pt, zero=0)) is None
    assert sp.reject(dict(pt, pp=2, ep=2)) is None  # dp=1, but EP ranks share non-expert state
    ref = exhaustive(Evaluator(sp, cfg, pf))
    zeros = {c.point["zero"] for c in ref.ranked}
    assert zeros == set(ZERO_LEVELS)
    single = [c for c in ref.ranked if c.estimate.plan.dp * c.estimate.plan.ep == 1]
    assert single and all(c.point["zero"] == 0 for c in single)
    got = optuna_search(Evaluator(sp, cfg, pf), n_trials=40, seed=0)
    assert all(c.point["zero"] == 0 for c in got.ranked
               if c.estimate.plan.dp * c.estimate.plan.ep == 1)
    assert got.best.estimate.plan.zero == got.best.point["zero"]


def test_zero_lets_a_model_fit_where_replicated_state_does_not():
    """DeepSeek-V3 on 256 GCDs: its leanest layout (PP 32 x EP 8, DP 1) needs 58.9 GB with
    replicated state, over Frontier's usable 57.6; sharding the non-expert state over the 8
    EP ranks brings it under."""
    from tuner.planner import leanest_memory

    cfg, pf = presets.get("deepseek-v3"), load_platform("frontier")
    rep = leanest_memory(cfg, pf, 256, 512, 4096, zero=(0,))
    zero = leanest_memory(cfg, pf, 256, 512, 4096)
    assert rep[0] > pf.usable_hbm >= zero[0]
    assert zero[1]["zero"] > 0 and rep[1]["zero"] == 0
    with pytest.raises(ValueError, match="zero=5: the ZeRO level must be"):
        SearchSpace.default(cfg, pf, 256, 512, 4096, zero=(0, 5))


def test_redundant_is_fixed_and_limits_ep():
    """Mixtral (E = 8) on 64 GCDs with r = 6: only EP degrees with E - E/EP >= 6 (EP 4, 8)
    host the slots; every point carries r = 6; a layout the slots push past the usable HBM is
    rejected saying how much of its memory they take (4 layers x 6 slots x 176 M params x
    16 B at PP 8 x EP 8, DP 1)."""
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    sp = SearchSpace.default(cfg, pf, 64, 512, 4096, redundant=6)
    assert sp.choices["ep"] == (4, 8)
    pt = {"pp": 8, "ep": 8, "mbs": 1, "schedule": "1f1b", "alltoall": "flat",
          "checkpointing": "full", "placement": "local", "zero": 1}
    assert sp.to_plan(pt).redundant == 6
    assert "redundant=6 exceeds the 4 experts an EP rank does not hold (E=8, ep=2)" in \
        sp.reject(dict(pt, ep=2))
    c = Evaluator(sp, cfg, pf)(pt)
    slots = 4 * 6 * cfg.expert_params() * 16
    assert c.rejected.startswith("peak memory")
    assert f"({slots / 1e9:.1f} GB of it the 6 redundant expert slots per MoE layer)" in c.rejected
    assert Evaluator(dataclasses.replace(sp, redundant=0), cfg, pf)(pt).rejected is None
    with pytest.raises(ValueError, match=r"--redundant 8: an EP rank does not hold more than "
                                         r"E - E/ep = 7 .*valid: 0\.\.7"):
        SearchSpace.default(cfg, pf, 64, 512, 4096, redundant=8)


def _overlap_space():
    """Mixtral-8x7B on 64 Frontier GCDs, a few layouts with every overlap mode."""
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    return cfg, pf, SearchSpace.default(cfg, pf, 64, 512, 4096, mbs=(1,), zero=(0, 1))


def test_overlap_is_a_dimension_with_the_trainers_rules():
    """a2a_overlap none / layer / fb is searched; EP = 1 keeps only none (no exchange); the
    fb points train.py refuses are rejected with `trainer.layout.fb_problems`' own words; a
    fb point's memory holds the paired schedule's in-flight micro-batches; layer and fb are
    priced with the chunks the plan file runs (2)."""
    cfg, pf, sp = _overlap_space()
    assert sp.choices["a2a_overlap"] == OVERLAP_CHOICES == ("none", "layer", "fb")
    base = {"pp": 4, "ep": 8, "mbs": 1, "schedule": "1f1b", "alltoall": "flat",
            "checkpointing": "selective", "placement": "local", "zero": 1, "a2a_overlap": "fb"}
    assert sp.reject(base) is None
    plan = sp.to_plan(base)
    assert (plan.a2a_overlap, plan.microbatches) == ("fb", 32)
    assert sp.reject(dict(base, ep=1, a2a_overlap="layer")) == \
        "ep=1 has no all-to-all to overlap: a2a_overlap layer runs as none"
    assert sp.reject(dict(base, ep=1, a2a_overlap="none")) is None
    for change in ({"checkpointing": "full"}, {"schedule": "gpipe"}, {"schedule": "zb-h1"}):
        pt = dict(base, **change)
        why = fb_problems(32, 4, pt["schedule"], pt["checkpointing"])
        assert len(why) == 1 and sp.reject(pt) == f"a2a_overlap fb with {why[0]}"
        assert sp.reject(dict(pt, a2a_overlap="layer")) is None  # layer has no such rule
    one = SearchSpace.default(cfg, pf, 64, 16, 4096, mbs=(1,))  # 16 sequences: M = 1
    assert one.to_plan(dict(base, a2a_overlap="none")).microbatches == 1
    assert one.reject(base) == \
        f"a2a_overlap fb with {fb_problems(1, 4, '1f1b', 'selective')[0]}"
    # pp = 1 runs 1f1b (gradient accumulation): fb pairs whatever M >= 2 there
    assert sp.reject(dict(base, pp=1)) is None

    ev = Evaluator(sp, cfg, pf)
    fb, layer, none = (ev(dict(base, a2a_overlap=m)) for m in ("fb", "layer", "none"))
    assert fb.peak_memory == max(s.total for s in stage_memory(cfg, plan, pf))
    assert fb.peak_memory > layer.peak_memory == none.peak_memory
    # 1F1B rank r holds 2(p - r) micro-batches' activations under fb, p - r without
    paired, plain = (stage_memory(cfg, p, pf)[0].act_by_part["experts"]
                     for p in (plan, plan.replace(a2a_overlap="none")))
    assert paired / plain == fb_inflight("1f1b", 4, 32, 1)[0] / 4 == 2
    for c in (fb, layer):
        asm = Assumptions(a2a_chunks=overlap_chunks(c.point["a2a_overlap"]))
        assert overlap_chunks(c.point["a2a_overlap"]) == AUTO_OVERLAP_CHUNKS == 2
        assert c.step_time == estimate(cfg, sp.to_plan(c.point), pf, assumptions=asm).step_time
    assert fb.estimate.time["alltoall"] < none.estimate.time["alltoall"]

    assert SearchSpace.default(cfg, pf, 64, 512, 4096, a2a_overlap=("fb", "none")
                               ).choices["a2a_overlap"] == ("none", "fb")
    with pytest.raises(ValueError, match=r"a2a_overlap='auto' is not searched: it runs none, "
                                         r"layer or fb"):
        SearchSpace.default(cfg, pf, 64, 512, 4096, a2a_overlap=("auto",))
    with pytest.raises(ValueError, match=r"a2a_overlap='lyer': the all-to-all overlap must be "
                                         r"one of none \(every exchange exposed\), layer "):
        SearchSpace.default(cfg, pf, 64, 512, 4096, a2a_overlap=("none", "lyer"))
    with pytest.raises(ValueError, match="no overlap mode given"):
        SearchSpace.default(cfg, pf, 64, 512, 4096, a2a_overlap=())


# (model, platform, GPUs, global batch, narrowed choices, the overlap mode of the optimum):
# the all-to-all inside one 8-GPU node (Mixtral, EP 8: the layer pipeline wins), across two
# DGX nodes (Qwen3-30B-A3B, EP 16: fb with dedup wins), and the CPU platform of this machine
# (tiny on 4 processes sharing 2 cores: the bound's shared-core branch; no overlap wins; the
# platform recorded with the validation rows, which stays put: on it the bound prunes 2 of
# 567 points, on configs/platforms/local.toml as re-measured 2026-12-06 none).
PRUNE_CASES = {
    "mixtral-frontier-64": ("mixtral-8x7b", "frontier", 64, 512,
                            dict(pp=(2, 4, 8), schedule=("1f1b", "zb-h1", "interleaved-1f1b:2"),
                                 alltoall=("flat", "halo"), zero=(1,)), "layer"),
    "qwen3-dgx-h100-32": ("qwen3-30b-a3b", "dgx-h100", 32, 256,
                          dict(pp=(1, 2, 4), ep=(2, 8, 16),
                               schedule=("1f1b", "zb-h1", "interleaved-1f1b:2"),
                               alltoall=("flat", "dedup"), checkpointing=("none", "full"),
                               placement=("local",), zero=(1,)), "fb"),
    "tiny-local-4": ("tiny", str(CPU_W4), 4, 16,
                     dict(zero=(0, 1)), None),
}


@pytest.mark.parametrize("case", sorted(PRUNE_CASES))
def test_pruned_search_with_overlap_equals_exhaustive(case):
    """Branch and bound with the overlap modes in the space: the lower bound stays below the
    step of every feasible point (overlapped ones included), and the pruned enumeration
    returns the exhaustive optimum (overall and the runnable one) with fewer evaluations."""
    model, platform, n, b, narrow, wins = PRUNE_CASES[case]
    cfg, pf = presets.get(model), load_platform(platform)
    prec = precision_policy("trainer", pf.backend)
    cpu = pf.backend == "gloo"
    asm = Assumptions(activation_set="trainer" if cpu else "published",
                      activation_traffic_passes=CPU_TRAFFIC_PASSES if cpu else 0.0)
    sp = SearchSpace.default(cfg, pf, n, b, 256 if cpu else 4096, mbs=(1,))
    sp = dataclasses.replace(sp, choices=dict(sp.choices, **narrow))
    ev = Evaluator(sp, cfg, pf, prec, asm)
    ref = exhaustive(ev)
    modes = {c.point["a2a_overlap"] for c in ref.ranked}
    assert modes == ({"none", "layer", "fb"} if sp.choices["ep"] != (1,) else {"none"})
    for c in ref.ranked:
        plan, a = sp.to_plan(c.point), ev.point_assumptions(c.point["a2a_overlap"])
        assert step_time_lower_bound(cfg, plan, pf, prec, a) <= c.step_time, c.point
    pruned = exhaustive(Evaluator(sp, cfg, pf, prec, asm, prune=True))
    assert pruned.best.point == ref.best.point
    assert pruned.best.step_time == ref.best.step_time
    assert pruned.best_runnable.point == ref.best_runnable.point
    bounded = pruned.rejected.get("bound", 0)
    if not platform.endswith(".toml"):
        # the platform files: the bound prunes points. A measured local platform may not: on
        # d4ad3ee's (the frozen copy) no lower bound passes the optimum (0.4222 s against
        # 0.4249 s), on 8f08b2e's two did; the equalities above hold either way.
        assert bounded > 0
    assert pruned.evaluations + bounded == ref.evaluations
    assert ref.best.point["a2a_overlap"] == (wins or "none")


def test_the_neighbour_walk_steps_onto_the_kept_variant():
    """pp = 1 keeps 1f1b only and ep = 1 the flat, local, not overlapped exchange: a step onto
    another variant lands on the kept one (`SearchSpace.canonical`), so leaving a zb-h1 or an
    overlapped point towards pp = 1 or ep = 1 is one step. Without it, TPE's 100 trials on
    tiny / 4 CPU processes stalled 16 % off the optimum (pp 2 ep 2 zb-h1 layer, 0.355 s
    against pp 1 ep 2 layer, 0.306 s) for seeds 0 and 3. On the frozen 4-process platform
    (tests/data/cpu_platform_w4.toml), not configs/platforms/local.toml, which every
    re-measurement changes: on the one of 2026-12-07 12:36 UTC seed 0's 100 trials ended 7 %
    off the optimum (pp 1 ep 2, 0.469 s, against pp 2 ep 1, 0.437 s)."""
    from tuner.planner import leanest_memory
    from tuner.search import neighbours

    cfg, pf = presets.get("tiny"), load_platform(str(CPU_W4))
    prec = precision_policy("trainer", pf.backend)
    asm = Assumptions(activation_set="trainer", activation_traffic_passes=CPU_TRAFFIC_PASSES,
                      zero_sharding="per-parameter")
    sp = SearchSpace.default(cfg, pf, 4, 16, 256)
    pt = {"pp": 2, "ep": 2, "mbs": 4, "schedule": "zb-h1", "alltoall": "halo",
          "checkpointing": "none", "placement": "spread", "zero": 2, "a2a_overlap": "layer"}
    near = neighbours(sp, pt)
    assert dict(pt, pp=1, schedule="1f1b") in near and dict(pt, pp=1) not in near
    assert dict(pt, ep=1, alltoall="flat", placement="local", a2a_overlap="none") in near
    assert all(q != pt for q in near) and len({sp.key(q) for q in near}) == len(near)
    assert sp.canonical(pt) is pt
    narrow = dataclasses.replace(sp, choices=dict(sp.choices, alltoall=("halo",)))
    assert narrow.canonical(dict(pt, ep=1))["alltoall"] == "halo"  # flat is not a choice
    ref = exhaustive(Evaluator(sp, cfg, pf, prec, asm, prune=True))
    lean = leanest_memory(cfg, pf, 4, 16, 256, prec, asm)
    assert lean is not None
    for seed in (0, 3):
        got = optuna_search(Evaluator(sp, cfg, pf, prec, asm, prune=True), n_trials=100,
                            seed=seed, enqueue=[lean[1]])
        assert got.best.step_time == ref.best.step_time, (seed, got.best.point, ref.best.point)


def test_fb_pairing_layer_holds_one_layer_more_than_the_plain_schedule():
    """Assumptions.fb_pairing "layer" (Megatron-Core's combined 1F1B, interleaved layer by
    layer): the plain schedule's activations plus one layer's; "trainer" (the default) keeps
    this trainer's paired schedule, whole micro-batches (`fb_inflight`)."""
    cfg = presets.get("qwen3-30b-a3b")  # every layer the same MoE layer
    pf = load_platform("dgx-h100")
    pol = precision_policy("megatron", "nccl")
    base = ParallelPlan(pp=1, ep=16, dp=1, microbatches=64, global_batch=1024, seq_len=4096)
    plain = stage_memory(cfg, base, pf, pol, Assumptions())[0].act_by_part
    layer = stage_memory(cfg, base.replace(a2a_overlap="fb"), pf, pol,
                         Assumptions(fb_pairing="layer"))[0].act_by_part
    trainer = stage_memory(cfg, base.replace(a2a_overlap="fb"), pf, pol, Assumptions())[0]
    # the 48 layers' parts of the plain schedule (one micro-batch in flight at PP 1), and the
    # parts outside the layers (logits) unchanged
    per_layer = {p: v / cfg.n_layers for p, v in plain.items() if p != "logits"}
    assert set(layer) == set(plain) | {"fb_pair_layer"}
    assert layer["fb_pair_layer"] == pytest.approx(sum(per_layer.values()), rel=1e-12)
    assert {p: v for p, v in layer.items() if p != "fb_pair_layer"} == plain
    # the trainer's pairs hold two whole micro-batches at PP 1 (fb_inflight)
    assert fb_inflight("1f1b", 1, 64, 1) == (2,)
    assert trainer.act_by_part["experts"] == pytest.approx(2 * plain["experts"], rel=1e-12)
    with pytest.raises(ValueError, match="fb_pairing='both'; valid: trainer, layer"):
        Assumptions(fb_pairing="both")
