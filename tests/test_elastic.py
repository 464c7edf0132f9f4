"""Elastic restarts (trainer/elastic.py): an attempt of another world size re-plans its layout.

The reference of every training comparison is a one-process run resumed from the same
checkpoint: the same data (the order is a function of the step and the global batch), the
same LR schedule (a function of the step), the same weights and AdamW state. Tolerance rel
1e-5: fp32 on CPU, the re-planned layout sums gradients in another order (all-reduce over the
data shards instead of one batch; ~1e-7 relative per op) over <= 6 AdamW steps; measured
<= 1e-7 here. A routing flip would show far above that.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, run_train, stdlib_corpus, step_losses, train_ok

from balance import greedy_repack, rank_loads
from trainer import ConfigError, RunConfig, parse_args
from trainer.elastic import (
    LoadRecord,
    checkpoint_world,
    decide,
    layout_problem,
    remap_placement,
    resolve,
    with_layout,
)
from trainer.setup import build_model_config

SMALL = ["--config", str(ROOT / "configs" / "tiny.toml"), "--train.seq_len=32",
         "--train.global_batch=8", "--model.d_model=32", "--model.moe_ffn_dim=32",
         "--model.n_heads=2", "--model.n_kv_heads=1", "--model.head_dim=16",
         "--train.eval_every=0", "--train.eval_batches=1", "--optim.warmup_steps=3",
         "--train.plot=false", "--comm.alltoall=flat", "--train.peak_tflops=1",
         "--train.timeout_s=120"]
ONE = ["--parallel.pp=1", "--parallel.ep=1", "--parallel.microbatches=1"]
REL = 1e-5  # see the module docstring


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return stdlib_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 20, 200_000)


def _fake_checkpoint(root: Path, step: int, argv: list[str], mesh: dict, **meta) -> Path:
    """A checkpoint folder with the meta.json `decide` reads (and the DCP marker file)."""
    path = root / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    run = parse_args(argv).to_dict()
    (path / "meta.json").write_text(json.dumps({"step": step, "mesh": mesh, "run": run, **meta}))
    return path


# -- decisions, without processes -----------------------------------------------------------------
def test_replan_off_refuses_a_layout_that_no_longer_fits(tmp_path):
    argv = [*SMALL, f"--train.out_dir={tmp_path}", "--train.resume=auto"]
    _fake_checkpoint(tmp_path, 6, argv, {"pp": 2, "dp": 1, "ep": 2, "tp": 1})
    cfg = parse_args(argv)  # tiny.toml: pp=2 x ep=2, which 2 ranks cannot hold
    with pytest.raises(ConfigError) as e:
        resolve(cfg, 2, 0, _no_planner, _no_pg)
    msg = str(e.value)
    for needle in ("written by 4 ranks (pp=2 x dp=1 x ep=2), this attempt has 2",
                   "--train.replan=off keeps the configured layout", "--train.replan=auto"):
        assert needle in msg, msg
    # a layout that still fits (dp inferred) runs as configured: today's behaviour
    cfg2 = parse_args([*argv, "--parallel.pp=1", "--parallel.microbatches=1"])
    same, record = resolve(cfg2, 2, 0, _no_planner, _no_pg)
    assert same is cfg2 and record == {"configured_world": 4, "replanned": False}


def _no_planner(*a, **k):
    raise AssertionError("the planner must not run here")


def _no_pg() -> None:
    raise AssertionError("no process group is needed here")


def test_decide_kinds(tmp_path):
    argv = [*SMALL, f"--train.out_dir={tmp_path}", "--train.resume=auto", "--train.replan=auto"]
    cfg = parse_args(argv)
    mcfg = build_model_config(cfg)
    assert decide(cfg, mcfg, 4).kind == "none"  # no checkpoint yet, the configured layout fits
    assert decide(cfg, mcfg, 2).kind == "replan"  # no checkpoint yet, pp=2 x ep=2 > 2 ranks
    _fake_checkpoint(tmp_path, 3, argv, {"pp": 2, "dp": 1, "ep": 2, "tp": 1},
                     elastic={"configured_world": 4, "replanned": False})
    assert decide(cfg, mcfg, 4).kind == "none"  # same world
    assert decide(cfg, mcfg, 2).kind == "replan"
    # written by 2 ranks under a re-planned layout; 2 ranks again keep it, 4 return home
    lay = [*argv, "--parallel.pp=1", "--parallel.ep=1", "--parallel.microbatches=1",
           "--parallel.zero=1"]
    _fake_checkpoint(tmp_path, 6, lay, {"pp": 1, "dp": 2, "ep": 1, "tp": 1},
                     elastic={"configured_world": 4, "replanned": True})
    d = decide(cfg, mcfg, 2)
    assert d.kind == "keep-replanned" and checkpoint_world(d.meta) == 2
    assert decide(cfg, mcfg, 4).kind == "configured"
    assert decide(cfg, mcfg, 8).kind == "replan"  # neither world: plan for 8


def test_with_layout_resets_what_the_plan_does_not_set():
    cfg = parse_args([*SMALL, "--parallel.layer_split=1,3", "--train.global_batch=8"])
    new = with_layout(cfg, {"parallel": {"pp": 1, "ep": 2, "dp": 2, "zero": 2},
                            "train": {"global_batch": 64, "checkpointing": "full"}})
    p = new.parallel
    assert (p.pp, p.ep, p.dp, p.zero, p.layer_split, p.microbatches) == (1, 2, 2, 2, "", 1)
    assert new.train.checkpointing == "full"
    assert new.train.global_batch == 8  # never changed by a layout
    assert cfg.parallel.layer_split == "1,3"  # a copy
    mcfg = build_model_config(new)
    assert layout_problem(new, mcfg, 4) == ""
    assert layout_problem(new, mcfg, 3)  # 3 ranks cannot hold ep=2 x dp=2


def test_with_layout_applies_the_planned_overlap():
    """The planner searches the all-to-all overlap (tuner.space), so a re-planned layout runs
    the mode and chunks it was priced with, and a run's own overlap does not outlive it."""
    cfg = parse_args([*SMALL, "--comm.a2a_overlap=fb", "--comm.a2a_chunks=3"])
    new = with_layout(cfg, {"parallel": {"pp": 1, "ep": 2, "dp": 2},
                            "comm": {"alltoall": "flat", "a2a_overlap": "layer",
                                     "a2a_chunks": 2}})
    assert (new.comm.a2a_overlap, new.comm.a2a_chunks) == ("layer", "2")
    bare = with_layout(cfg, {"parallel": {"pp": 1, "ep": 2, "dp": 2}})
    assert (bare.comm.a2a_overlap, bare.comm.a2a_chunks) == ("none", "auto")


def test_replan_with_the_planner_keeps_the_global_batch(tmp_path):
    """Rank 0's side of a re-plan, with the real planner (tuner.replan), one process."""
    from tuner.replan import runnable_layouts

    argv = [*SMALL, f"--train.out_dir={tmp_path}", "--train.resume=auto", "--train.replan=auto",
            "--train.replan_trials=30"]
    _fake_checkpoint(tmp_path, 3, argv, {"pp": 2, "dp": 1, "ep": 2, "tp": 1})
    cfg = parse_args(argv)
    new, record = resolve(cfg, 2, 0, runnable_layouts, lambda: None)
    assert record == {"configured_world": 4, "replanned": True}
    assert new.train.global_batch == 8 and new.train.seq_len == 32
    assert layout_problem(new, build_model_config(new), 2) == ""
    row = json.loads((tmp_path / "elastic.jsonl").read_text().splitlines()[-1])
    assert (row["event"], row["world_before"], row["world_after"], row["step"]) == \
        ("replan", 4, 2, 3)
    assert row["after"]["parallel"]["pp"] * row["after"]["parallel"]["ep"] <= 2
    # 8 ranks cannot split a global batch of 3 (4 layers: pp <= 4, so >= 2 data shards):
    # refused naming why, not changed
    bad = parse_args([*argv, "--train.global_batch=3", "--parallel.microbatches=1",
                      "--parallel.pp=1", "--parallel.ep=1"])
    with pytest.raises(ConfigError, match=r"no layout of 8 ranks: .*global batch"):
        resolve(bad, 8, 0, runnable_layouts, lambda: None)


# -- expert placement across a change of EP size ----------------------------------------------------
class _Layer:
    def __init__(self, E: int, n_slots: int, replicated: bool):
        self.num_experts, self.n_slots, self.replicated = E, n_slots, replicated


def test_remap_placement_rebalances_the_recorded_load():
    E = 8
    load = [50.0, 40, 30, 20, 10, 5, 3, 2]
    saved = [0, 1, 2, 3, 4, 5, 6, 7]  # at ep=2: experts 0-3 (the hot ones) on rank 0
    meta = {"mesh": {"ep": 2}, "placement": {"l": saved}, "layer_state": {"l": {"load": load}}}
    got = remap_placement(meta, {"l": _Layer(E, E, False)}, 4)["l"]
    assert sorted(got) == list(range(E))  # a permutation of the slots
    e2r = np.asarray(got) // 2
    assert np.bincount(e2r, minlength=4).tolist() == [2, 2, 2, 2]
    ref = greedy_repack(load, np.asarray(saved) // 2, 4)  # the balancer's own re-placement
    assert rank_loads(load, e2r, 4).max() == rank_loads(load, ref, 4).max()
    assert rank_loads(load, e2r, 4).max() < rank_loads(load, np.asarray(saved) // 2, 4).max()
    # with redundant slots: a valid slot map of 4 ranks x (2 + 1) slots
    rep = remap_placement(meta, {"l": _Layer(E, 12, True)}, 4)["l"]["slots"]
    assert len(rep) == 12 and set(rep) == set(range(E))
    # no recorded load, or the same EP size: nothing to change
    assert remap_placement({**meta, "layer_state": {}}, {"l": _Layer(E, E, False)}, 4) == {}
    assert remap_placement(meta, {"l": _Layer(E, E, False)}, 2) == {}


def test_load_record_sums_the_last_window():
    rec = LoadRecord(window=2)
    for k in range(3):
        rec.add([torch.full((4,), float(k)), torch.full((4,), 10.0 * k)])
    assert rec.by_layer(["a", "b"]) == {"a": [3.0] * 4, "b": [30.0] * 4}


# -- training across a change of world size ------------------------------------------------------------
def _windows(out: Path) -> dict[int, list[int]]:
    """{step: sorted window starts of all data shards} from --debug.trace_data files (the ranks of
    one data shard, e.g. the stages of a pipeline, read the same windows: counted once)."""
    shards: dict[tuple[int, int], list[int]] = {}
    for f in sorted(out.glob("data_order.rank*.jsonl")):
        for row in map(json.loads, f.read_text().splitlines()):
            prev = shards.setdefault((row["step"], row["rank"]), row["starts"])
            assert prev == row["starts"], row  # one shard, one list of windows
    got: dict[int, list[int]] = {}
    for (step, _), starts in shards.items():
        got.setdefault(step, []).extend(starts)
    return {s: sorted(v) for s, v in got.items()}


def _compare(got: dict[int, float], ref: dict[int, float], steps: range) -> None:
    for s in steps:
        assert got[s] == pytest.approx(ref[s], rel=REL), (s, got[s], ref[s])


@pytest.mark.multiproc
@pytest.mark.integration
def test_one_process_checkpoint_resumes_replanned_on_two(tmp_path, data):
    """1 process writes step 3; 2 ranks resume with --train.replan=auto (rank 0 plans and
    broadcasts); losses and windows equal a 1-process resume of the same checkpoint."""
    args = [*SMALL, *ONE, "--data", data, "--train.steps=6", "--debug.trace_data=true"]
    first = train_ok([*args, "--train.stop_after=3"], tmp_path / "two")
    ref = tmp_path / "one"
    import shutil

    shutil.copytree(first, ref)
    train_ok([*args, "--train.resume=auto"], ref)
    r = run_train([*args, "--train.resume=auto", "--train.replan=auto",
                   "--train.replan_trials=10", f"--train.out_dir={first}"], nproc=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "elastic: checkpoint" in r.stdout and "re-planned with the planner" in r.stdout
    row = json.loads((first / "elastic.jsonl").read_text().splitlines()[-1])
    assert (row["world_before"], row["world_after"]) == (1, 2)
    got, want = step_losses(first), step_losses(ref)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    _compare(got, want, range(1, 7))
    assert _windows(first) == _windows(ref)  # no window twice, none skipped
    meta = json.loads((first / "checkpoints" / "step_00000006" / "meta.json").read_text())
    assert meta["elastic"] == {"configured_world": 1, "replanned": True}


@pytest.mark.multiproc
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_four_ranks_to_two_with_replan(tmp_path, data, zero):
    """PP=2 x EP=2 on 4 ranks (ZeRO-`zero`), checkpoint at step 3, 2 ranks re-plan; the
    reference is one process resumed from the same checkpoint."""
    args = [*SMALL, "--data", data, "--train.steps=8", "--debug.trace_data=true",
            f"--parallel.zero={zero}", "--parallel.ep=2", "--parallel.pp=2",
            "--parallel.microbatches=2"]
    first = train_ok([*args, "--train.stop_after=3"], tmp_path / "run", nproc=4)
    ref = tmp_path / "ref"
    import shutil

    shutil.copytree(first, ref)
    train_ok([*args, *ONE, "--parallel.zero=0", "--train.resume=auto"], ref)
    r = run_train([*args, "--train.resume=auto", "--train.replan=auto",
                   f"--train.out_dir={first}"], nproc=2)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _compare(step_losses(first), step_losses(ref), range(1, 9))
    assert _windows(first) == _windows(ref)


@pytest.mark.multiproc
@pytest.mark.integration
@pytest.mark.slow
def test_ep2_to_ep4_rebalances_placement(tmp_path, data):
    """EP=2 with forced migrations (a non-identity placement and a recorded load), checkpoint,
    then EP=4 on 4 ranks: the placement is re-balanced from the recorded load and the losses
    equal a one-process resume."""
    args = [*SMALL, *ONE, "--data", data, "--train.steps=8", "--balance.enabled=true",
            "--debug.force_every=2"]
    first = train_ok([*args, "--parallel.ep=2", "--train.stop_after=4"], tmp_path / "run",
                     nproc=2)
    meta = json.loads((first / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert all("load" in v for v in meta["layer_state"].values())
    ref = tmp_path / "ref"
    import shutil

    shutil.copytree(first, ref)
    train_ok([*args, "--balance.enabled=false", "--train.resume=auto"], ref)
    r = run_train([*args, "--balance.enabled=false", "--parallel.ep=4", "--train.resume=auto",
                   f"--train.out_dir={first}"], nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "re-balanced from the recorded load" in r.stdout
    _compare(step_losses(first), step_losses(ref), range(1, 9))
    new = json.loads((first / "checkpoints" / "step_00000008" / "meta.json").read_text())
    want = remap_placement(meta, {n: _Layer(8, 8, False) for n in meta["placement"]}, 4)
    assert new["placement"] == want


def test_runconfig_defaults_keep_todays_behaviour():
    t = RunConfig().train
    assert (t.replan, t.replan_trials, t.platform) == ("off", 100, "")
