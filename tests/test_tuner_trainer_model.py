"""The CPU trainer's memory model and the planner's branch and bound.

References are independent of the formulas under test: element counts worked out by hand
for the tiny preset, and what a real forward/backward of `model.MoETransformer` with AdamW
saves and holds, measured by `trainer.observe.memory`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import MoETransformer, presets
from trainer.observe.memory import SavedTensorMeter, state_bytes
from tuner import Assumptions, ParallelPlan, estimate, load_platform, stage_memory
from tuner.counts import layer_counts
from tuner.estimate import step_time_lower_bound
from tuner.layout import FP32_TRAINER_PRECISION
from tuner.search import Evaluator, exhaustive, optuna_search
from tuner.space import SearchSpace

TRAINER = Assumptions(activation_set="trainer")


def test_trainer_activation_set_by_hand():
    # tiny: D=128, H=4, G=2, hd=32, E=8, k=2, F=256, norm_topk_prob
    lc = layer_counts(presets.get("tiny"), 0, 1, 256, True)
    assert lc.act_trainer["attention"] == 3 * 128 + 1 + 2 * 4 * 32 + 2 * 2 * 32 + 4  # 773
    assert lc.act_trainer["router"] == 3 * 128 + 1 + 8 + 3 * 2 + 1  # 400
    assert lc.act_trainer["dispatch"] == 2 * 128 + 5 * 2  # 266
    assert lc.act_trainer["experts"] == 2 * (128 + 4 * 256)  # 2304
    with pytest.raises(ValueError, match="derived for GQA"):
        stage_memory(presets.get("deepseek-v3"),  # MLA
                     ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=1, seq_len=64),
                     load_platform("frontier"), FP32_TRAINER_PRECISION, TRAINER)
    with pytest.raises(ValueError, match="activation_set='bogus'; valid: published, trainer"):
        Assumptions(activation_set="bogus")


@pytest.mark.parametrize("batch,seq,ckpt", [(2, 64, "none"), (3, 128, "none"),
                                            (2, 64, "selective"), (2, 64, "full")])
@pytest.mark.integration
def test_trainer_memory_matches_a_real_step(batch, seq, ckpt):
    """One process, fp32, AdamW: predicted state equals the held bytes up to AdamW's 0-dim
    step counters; predicted activations equal the saved bytes within 0.1 % (left out: the
    per-sequence aux-loss statistics). The recompute working set is real memory the model
    adds, but torch's checkpoint saves it under its own hooks, unseen by the meter."""
    from model.checkpointing import set_checkpointing

    cfg = presets.get("tiny")
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    set_checkpointing(model, ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    meter = SavedTensorMeter(model)
    with meter:
        ce, aux = model(tokens, tokens)
    (ce + aux).backward()
    opt.step()
    n_tensors = len(list(model.parameters()))
    plan = ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=batch, seq_len=seq,
                        checkpointing=ckpt)
    st = stage_memory(cfg, plan, load_platform("frontier"), FP32_TRAINER_PRECISION, TRAINER)[0]
    assert st.weights + st.grads + st.optimizer + 4 * n_tensors == state_bytes(model, opt)
    seen = st.activations - st.act_by_part.get("recompute", 0.0)
    assert seen == pytest.approx(meter.peak, rel=1e-3)


@pytest.mark.integration
def test_recompute_rebuilds_what_the_checkpoint_dropped():
    """The recompute's working set ("recompute", one layer of one micro-batch) is what the
    checkpoint dropped of a layer: measured as the saved bytes of a real step without
    checkpointing less those with it, per layer (the tiny preset's four layers are alike).
    Before, a whole layer's set was counted for "selective" too, 1.8x the FFN intermediates
    it drops (the README recipe planned with selective on an Intel Xeon, 2026-12-08)."""
    from model.checkpointing import set_checkpointing

    cfg, batch, seq = presets.get("tiny"), 2, 64
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    peak = {}
    for ckpt in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        set_checkpointing(model, ckpt)
        meter = SavedTensorMeter(model)
        with meter:
            ce, aux = model(tokens, tokens)
        (ce + aux).backward()
        peak[ckpt] = meter.peak
    for ckpt in ("selective", "full"):
        plan = ParallelPlan(pp=1, ep=1, dp=1, microbatches=1, global_batch=batch, seq_len=seq,
                            checkpointing=ckpt)
        st = stage_memory(cfg, plan, load_platform("frontier"), FP32_TRAINER_PRECISION, TRAINER)[0]
        dropped = (peak["none"] - peak[ckpt]) / cfg.n_layers
        # "full" also drops each layer's rotary tables (2 s hd, counted per layer apart)
        rope = 2 * seq * cfg.qk_head_dim * 4 if ckpt == "full" else 0
        assert st.act_by_part["recompute"] == pytest.approx(dropped - rope, rel=1e-3), ckpt
    assert peak["none"] - peak["selective"] < 0.6 * (peak["none"] - peak["full"])


def test_recompute_is_never_priced_faster_than_keeping_the_activations():
    """A recompute adds work: over the tiny preset's space on a measured CPU platform (where
    the activations' memory traffic is priced) no recompute mode is cheaper than none. Before,
    the traffic was priced over the kept activations only, and the search picked selective
    recompute for speed (the README recipe on 2026-12-08; measured 1.17x none's step)."""
    cfg, pf = presets.get("tiny"), load_platform("local")
    asm = Assumptions(activation_set="trainer", activation_traffic_passes=4.0)
    sp = SearchSpace.default(cfg, pf, 4, 16, 256)
    n = 0
    for pt in sp.points():
        if sp.reject(pt) is None and pt["checkpointing"] == "none":
            plan = sp.to_plan(pt)
            t0 = estimate(cfg, plan, pf, FP32_TRAINER_PRECISION, asm).step_time
            for ckpt in ("selective", "full"):
                t = estimate(cfg, dataclasses.replace(plan, checkpointing=ckpt), pf,
                             FP32_TRAINER_PRECISION, asm).step_time
                assert t > t0, (plan, ckpt)
            n += 1
    assert n > 50


def test_full_recompute_reruns_the_forward_half_of_the_ep_path():
    """Full recompute re-runs an EP layer's dispatch and combine (2 more of its 4 exchanges)
    and with them the forward's half of the EP path's measured fixed cost: the all-to-all
    part, exchanges and fixed cost together, is 1.5x none's (pp1-ep2 on the frozen
    2-process CPU platform, whose `ep_layer_overhead` is 5.0 ms). Priced once before, full
    recompute with EP ran 1.36-1.53x none's step against 1.22x priced (2026-12-08)."""
    from conftest import CPU_W2

    cfg, pf = presets.get("tiny"), load_platform(CPU_W2)
    assert pf.ep_layer_overhead > 0
    asm = Assumptions(activation_set="trainer", activation_traffic_passes=4.0)
    plan = ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=16, seq_len=256)
    e0, e1 = (estimate(cfg, dataclasses.replace(plan, checkpointing=c), pf,
                       FP32_TRAINER_PRECISION, asm) for c in ("none", "full"))
    assert e1.time["alltoall"] == pytest.approx(1.5 * e0.time["alltoall"], rel=1e-9)
    assert e1.time["alltoall"] - e0.time["alltoall"] >= 0.5 * pf.ep_layer_overhead * cfg.n_layers


def test_lower_bound_never_exceeds_the_estimate():
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    sp = SearchSpace.default(cfg, pf, 64, 512, 4096, mbs=(1, 2))
    n = 0
    for pt in sp.points():
        if sp.reject(pt) is None and n < 300:
            plan = sp.to_plan(pt)
            assert step_time_lower_bound(cfg, plan, pf) <= estimate(cfg, plan, pf).step_time
            n += 1
    assert n == 300
    # A measured CPU platform (per-layer overhead, GEMM efficiency by width) and the trainer's
    # memory-traffic term: the bound leaves the traffic out, so it still holds.
    cfg, pf = presets.get("tiny"), load_platform("local")
    asm = Assumptions(activation_set="trainer", activation_traffic_passes=4.0)
    sp = SearchSpace.default(cfg, pf, 4, 16, 256)
    for pt in sp.points():
        if sp.reject(pt) is None:
            plan = sp.to_plan(pt)
            lb = step_time_lower_bound(cfg, plan, pf, FP32_TRAINER_PRECISION, asm)
            assert lb <= estimate(cfg, plan, pf, FP32_TRAINER_PRECISION, asm).step_time
    with pytest.raises(ValueError, match="closed-form"):
        step_time_lower_bound(cfg, sp.to_plan(next(iter(sp.points()))), pf,
                              assumptions=Assumptions(alltoall_model="netsim"))


@pytest.mark.integration
def test_branch_and_bound_keeps_the_optimum_with_fewer_evaluations():
    """With the all-to-all overlap modes in the space (the bound counts no all-to-all for an
    overlapped point) the pruned enumeration keeps the exhaustive optimum, an overlapped one
    here (layer; one sequence per micro-batch keeps the space at 6912 points)."""
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    sp = SearchSpace.default(cfg, pf, 64, 512, 4096, mbs=(1,))
    assert sp.choices["a2a_overlap"] == ("none", "layer", "fb")
    sp = dataclasses.replace(sp, choices=dict(sp.choices, pp=(2, 4, 8, 16),
                                              schedule=("1f1b", "zb-h1", "interleaved-1f1b:2"),
                                              checkpointing=("none", "full")))
    ref = exhaustive(Evaluator(sp, cfg, pf))
    # Exhaustive with pruning visits every point, so it must find the same optimum.
    pruned = exhaustive(Evaluator(sp, cfg, pf, prune=True))
    assert pruned.best.step_time == ref.best.step_time
    assert pruned.best.point == ref.best.point and ref.best.point["a2a_overlap"] != "none"
    assert pruned.evaluations < ref.evaluations and pruned.rejected["bound"] > 0
    assert pruned.evaluations + pruned.rejected["bound"] == ref.evaluations
    got = optuna_search(Evaluator(sp, cfg, pf, prune=True), n_trials=120, seed=0)
    assert got.best.step_time <= 1.05 * ref.best.step_time
    assert got.evaluations < ref.evaluations
    with pytest.raises(ValueError, match="prune=True needs alltoall_model='closed-form'"):
        Evaluator(sp, cfg, pf, assumptions=Assumptions(alltoall_model="netsim"), prune=True)


def _state_worker(rank: int, world: int, _group, levels: list[int], seq: int) -> dict:
    """One real step of the tiny preset under each ZeRO level on a DP group of `world` ranks
    (trainer/distributed/grad_sync.py + trainer/distributed/zero.py, as the trainer drives them): the bytes
    `trainer.observe.memory.state_bytes` counts after the optimizer step, and how many parameter
    tensors hold AdamW state (each adds a 4-byte step counter the planner leaves out)."""
    from trainer.distributed.grad_sync import GradSync
    from trainer.distributed.mesh import Mesh
    from trainer.distributed.zero import build_optimizer

    mesh = Mesh.plan(world, rank, pp=1, ep=1).build_groups()
    cfg = presets.get("tiny")
    out = {}
    for z in levels:
        torch.manual_seed(0)
        model = MoETransformer(cfg)
        sync = GradSync(model, mesh, zero=z)
        opt = build_optimizer(model, sync, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)
        tokens = torch.randint(0, cfg.vocab_size, (1, seq),
                               generator=torch.Generator().manual_seed(rank))
        sync.start_step(1)
        ce, aux = model(tokens, tokens)
        (ce + aux).backward()
        sync.finish()
        opt.step()
        with_state = sum(1 for p in model.parameters() if opt.state.get(p))
        out[z] = (state_bytes(model, opt), with_state)
    return out


@pytest.mark.multiproc
def test_planner_state_bytes_equal_the_trainers_meter_per_zero_level():
    """DP=2, tiny, one micro-batch: the largest per-rank state the trainer holds (weights,
    gradients, AdamW moments: `trainer.observe.memory.state_bytes`, less the 4-byte step counters)
    equals the planner's state bytes for ZeRO 0, 1 and 2 under the trainer's precision
    (`FP32_TRAINER_PRECISION`) and its per-parameter ownership. The planner's per-part
    greedy maxima (dense over the stage group, experts over DP) are an upper bound when
    they fall on different ranks; for tiny both fall on rank 0 (the larger tensors go first,
    ties to the lower rank), so the comparison is exact."""
    from comm import run_local

    levels, seq = [0, 1, 2], 32
    got = run_local(_state_worker, 2, levels, seq)
    cfg, pf = presets.get("tiny"), load_platform("frontier")
    for z in levels:
        plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=2, seq_len=seq,
                            zero=z)
        st = stage_memory(cfg, plan, pf, FP32_TRAINER_PRECISION,
                          Assumptions(zero_sharding="per-parameter"))[0]
        measured = max(r[z][0] - 4 * r[z][1] for r in got)
        assert st.weights + st.grads + st.optimizer == measured, (z, got)
    # sharding really happened: ZeRO-1 holds less than ZeRO-0, ZeRO-2 less than ZeRO-1
    m = [max(r[z][0] for r in got) for z in levels]
    assert m[0] > m[1] > m[2]


def _dtype_state_worker(rank: int, world: int, _group, configs: list[tuple[int, str]],
                        seq: int) -> dict:
    """One real step of the tiny preset per (ZeRO level, param dtype) on DP=`world`, set up as
    train.py does (trainer/distributed/precision.py's bf16 weights + fp32 masters; FSDP2 for ZeRO-3):
    `trainer.observe.memory.state_bytes` after the step, less the 0-dim step counters the planner
    leaves out."""
    from trainer.distributed.grad_sync import GradSync
    from trainer.distributed.mesh import Mesh
    from trainer.distributed.parallel import parallelize
    from trainer.distributed.precision import Precision, to_working_dtype
    from trainer.distributed.zero import build_optimizer
    from trainer.distributed.zero3 import Zero3Sync, shard_model

    torch.set_num_threads(1)
    mesh = Mesh.plan(world, rank, pp=1, ep=1).build_groups()
    cfg = presets.get("tiny")
    out = {}
    for zero, pdt in configs:
        dt = torch.bfloat16 if pdt == "bf16" else torch.float32
        with torch.device("meta"):
            model = MoETransformer(cfg)
        parallelize(model, mesh, alltoall="flat")
        model.materialize(torch.device("cpu"), seed=0)
        fp32: dict = {}
        if zero == 3:
            shard_model(model, mesh, Precision(dt, dt, torch.float32), "cpu")
            sync = Zero3Sync(model, mesh)
        else:
            fp32 = to_working_dtype(model, dt)
            sync = GradSync(model, mesh, zero=zero)
        opt = build_optimizer(model, sync, 1e-3, (0.9, 0.95), 1e-8, 0.1, fp32)
        del fp32
        tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1),
                               generator=torch.Generator().manual_seed(rank))
        sync.start_step(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=pdt == "bf16"):
            logits = model(tokens[:, :-1])
        ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               tokens[:, 1:].reshape(-1))
        (ce + model.aux_loss()).backward()
        sync.finish()
        opt.step()
        counters = sum(v.numel() * v.element_size() for s in opt.state.values()
                       for v in s.values() if isinstance(v, torch.Tensor) and v.dim() == 0)
        out[f"{zero}-{pdt}"] = state_bytes(model, opt) - counters
    return out


@pytest.mark.multiproc
def test_planner_trainer_policy_equals_the_meter_per_zero_level_and_param_dtype():
    """DP=2, tiny: the planner's own account of the trainer (`precision_policy("trainer",
    "gloo", param_dtype)`; ZeRO-1/2 per-parameter owners, ZeRO-3 flat shards) against the
    trainer's meter after one real step, for ZeRO 0-3 x fp32/bf16 weights. fp32: exact (the
    same per-tensor arithmetic). bf16: the router weight stays fp32 (no master: 16 B where
    the policy counts 18), so the planner may exceed the meter by at most 2 B per router
    parameter per rank, and under per-parameter ZeRO-1/2 that narrower tensor can move the
    greedy owner by at most its own size either way: |planned - measured| <= 16 B x router
    parameters. ZeRO-3 leaves out the gathered layer (the meter reads after the step, when
    none is gathered)."""
    from comm import run_local
    from tuner.layout import precision_policy

    configs = [(z, d) for d in ("fp32", "bf16") for z in (0, 1, 2, 3)]
    seq = 32
    got = run_local(_dtype_state_worker, 2, configs, seq)
    cfg, pf = presets.get("tiny"), load_platform("frontier")
    router = sum(cfg.d_model * cfg.n_routed_experts for i in range(cfg.n_layers)
                 if cfg.is_moe_layer(i))
    for z, d in configs:
        plan = ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=2, seq_len=seq,
                            zero=z)
        asm = Assumptions(zero_sharding="flat" if z == 3 else "per-parameter")
        st = stage_memory(cfg, plan, pf, precision_policy("trainer", "gloo", param_dtype=d),
                          asm)[0]
        planned = st.state - st.state_by_part.get("zero3_gathered", 0.0)
        measured = max(r[f"{z}-{d}"] for r in got)
        if d == "fp32":
            assert planned == measured, (z, d, planned, measured)
        else:
            assert abs(planned - measured) <= 16 * router, (z, d, planned, measured, router)


def _bcast_bucket_worker(rank: int, world: int, _group, ep: int, caps: list[int]) -> dict:
    """The trainer's ZeRO-1 broadcast buckets of the tiny preset at EP = `ep` x DP = world /
    ep, set up as train.py does, per bucket cap: the elements in buckets of more than one
    parameter whose group has more than one rank (those `broadcast_params` packs or unpacks)."""
    from trainer.distributed.grad_sync import GradSync
    from trainer.distributed.mesh import Mesh
    from trainer.distributed.parallel import parallelize
    from trainer.distributed.tensor_parallel import local

    torch.set_num_threads(1)
    mesh = Mesh.plan(world, rank, pp=1, ep=ep).build_groups()
    with torch.device("meta"):
        model = MoETransformer(presets.get("tiny"))
    parallelize(model, mesh, alltoall="flat")
    model.materialize(torch.device("cpu"), seed=0)
    out = {}
    for cap in caps:
        sync = GradSync(model, mesh, zero=1, bucket_bytes=cap)
        out[cap] = (sum(local(p).numel() for b in sync.bcast if len(b.params) > 1
                        and sync.groups[b.kind] is not None for p in b.params),
                    sum(1 for b in sync.bcast if sync.groups[b.kind] is not None))
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world,ep", [(2, 1), (4, 2)])
def test_planner_bcast_copies_equal_the_trainers_buckets(world, ep):
    """The parameters the planner prices as packed / unpacked around ZeRO's weight broadcast
    (`StageMemory.bcast_copy_params`) and the broadcasts it counts (`bcast_calls`) equal
    what the trainer's own `GradSync` buckets hold and send on every rank: at its default
    25 MiB (every bucket several parameters), at 1 MiB (at EP = 1 each 1 MiB expert tensor
    fills a bucket alone: broadcast in place, not copied) and at 64 KiB (more buckets of
    one parameter)."""
    from comm import run_local

    caps = [25 << 20, 1 << 20, 64 << 10]
    got = run_local(_bcast_bucket_worker, world, ep, caps)
    cfg, pf = presets.get("tiny"), load_platform("frontier")
    plan = ParallelPlan(pp=1, ep=ep, dp=world // ep, microbatches=1, global_batch=8,
                        seq_len=32, zero=1)
    for cap in caps:
        asm = Assumptions(zero_sharding="per-parameter", grad_bucket_bytes=cap)
        st = stage_memory(cfg, plan, pf, FP32_TRAINER_PRECISION, asm)[0]
        assert {r[cap] for r in got} == {(st.bcast_copy_params, st.bcast_calls)}, (cap, got)
    n = [got[0][cap][0] for cap in caps]  # smaller buckets: more of them hold one parameter
    assert n[0] >= n[1] >= n[2] > 0 and n[0] > n[2]
    calls = [got[0][cap][1] for cap in caps]  # and there are more of them
    assert 0 < calls[0] < calls[1] < calls[2]
