"""What a run reports: TensorBoard event files, per-MoE-layer metrics from every pipeline stage,
torch.profiler traces, `python -m trainer.report`, and the errors of bad logging options.

One short run of the default layout (configs/tiny.toml: PP=2 x EP=2 on 4 processes, small
sequences) feeds most checks; its per-layer numbers are compared with a 1-process run of the
same model and batches (the same routing, no pipeline, no gather across stages), from whose
raw per-expert counts the test computes the statistics itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, run_train, stdlib_corpus

from trainer import parse_args, prepare

STEPS = 4
SMALL = ["--config", "configs/tiny.toml", "--train.seq_len=32", "--train.global_batch=8",
         "--model.d_model=32", "--model.moe_ffn_dim=32", "--model.n_heads=2",
         "--model.n_kv_heads=1", "--model.head_dim=16", f"--train.steps={STEPS}",
         "--train.eval_every=2", "--train.eval_batches=1", "--optim.warmup_steps=2",
         "--train.plot=false", "--comm.alltoall=flat", "--train.trace_counts=true"]
LAYER_KEYS = ("load_max_over_mean", "load_cv", "empty_experts", "router_entropy")
N_MOE = 4  # tiny: every layer is MoE; PP=2 puts layers 0-1 on stage 0 and 2-3 on stage 1


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return stdlib_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 10, 100_000)


@pytest.fixture(scope="module")
def run(tmp_path_factory, data) -> tuple[Path, str]:
    """PP=2 x EP=2: TensorBoard on, memory report, a migration every 2 steps, step 3 profiled."""
    out = tmp_path_factory.mktemp("pp2ep2")
    r = run_train([*SMALL, "--data", data, f"--train.out_dir={out}", "--train.tensorboard=true",
                   "--train.memory_report=true", "--balance.enabled=true",
                   "--debug.force_every=2", "--train.profile_steps=3,3"], nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out, r.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> Path:
    """The same model and batches in one process (no TensorBoard)."""
    out = tmp_path_factory.mktemp("ref")
    r = run_train([*SMALL, "--data", data, f"--train.out_dir={out}", "--parallel.pp=1",
                   "--parallel.ep=1", "--train.tensorboard=false"], nproc=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


def _scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


@pytest.mark.multiproc
def test_tensorboard_tags_and_steps(run):
    out, stdout = run
    assert f"tensorboard --logdir {out / 'tensorboard'}" in stdout
    sc = _scalars(out)
    every_step = ["train/loss", "train/aux_loss", "train/lr", "train/grad_norm",
                  "train/ep_imbalance", "perf/tokens_per_s", "perf/mfu", "time/step_s",
                  "time/forward_backward_s", "time/grad_sync_s", "time/optimizer_s",
                  "time/ep_exchange_max_s", "time/ep_exchange_min_s", "time/pp_bubble_max_s",
                  "time/pp_bubble_frac_max", "memory/state_bytes_max",
                  "memory/act_peak_bytes_max", "data/epoch", "data/tokens_seen"]
    every_step += [f"moe/layer_{i:02d}/{k}" for i in range(N_MOE) for k in LAYER_KEYS]
    for tag in every_step:
        assert tag in sc, (tag, sorted(sc))
        assert [s for s, _ in sc[tag]] == list(range(1, STEPS + 1)), (tag, sc[tag])
    # validation every 2 steps; forced migrations at steps 2 and 4, in both stages' layers
    for tag in ["val/loss", "migration/swaps", "migration/moved_experts",
                "migration/bytes_sent", "migration/seconds"]:
        assert [s for s, _ in sc[tag]] == [2, 4], (tag, sc[tag])
    assert all(v == 4 for _, v in sc["migration/swaps"])  # 1 swap in each of 4 layers
    assert set(sc) == set(every_step) | {"val/loss", "migration/swaps", "migration/moved_experts",
                                         "migration/bytes_sent", "migration/seconds"}
    # the event file holds the numbers of metrics.jsonl (TensorBoard stores float32)
    for row in _rows(out):
        got = dict(sc["train/loss"])[row["step"]]
        assert got == pytest.approx(row["loss"], rel=1e-6)
        for st in row["layers"]:
            tag = f"moe/layer_{st['layer']:02d}/load_cv"
            assert dict(sc[tag])[row["step"]] == pytest.approx(st["load_cv"], rel=1e-6)


def _stats(c: np.ndarray) -> dict[str, float]:
    """The per-layer statistics, computed here from raw per-expert counts."""
    return {"load_max_over_mean": c.max() / c.mean(), "load_cv": c.std() / c.mean(),
            "empty_experts": float((c == 0).sum())}


@pytest.mark.multiproc
def test_layer_metrics_of_both_stages_match_one_process(run, reference):
    out, _ = run
    sc = _scalars(out)
    ref_counts = [json.loads(x) for x in (reference / "counts.jsonl").read_text().splitlines()]
    ref_rows = {r["step"]: r for r in _rows(reference)}
    pp_rows = {r["step"]: r for r in _rows(out)}
    assert [r["step"] for r in ref_counts] == list(range(1, STEPS + 1))
    for rec in ref_counts:
        step = rec["step"]
        assert rec["layers"] == list(range(N_MOE))
        # the 4-process run's rows hold every layer, each stage's from its own ranks
        assert [st["layer"] for st in pp_rows[step]["layers"]] == list(range(N_MOE))
        for i, counts in enumerate(rec["counts"]):
            c = np.asarray(counts, dtype=np.float64)
            assert c.sum() == 8 * 32 * 2  # global batch x seq_len x top_k token copies
            want = _stats(c)
            # The 4-process run computes router logits in GEMMs of other shapes, so a near-tie
            # top-k choice may flip on some CPU: allow up to 2 flipped token copies (each moves
            # one count by -1 and another by +1, ||delta||_2 <= 2): max/mean moves <= 2/mean,
            # cv <= 2/(sqrt(E) mean), empty experts <= 2. A stage reporting another stage's
            # layer, or a wrong statistic, is far outside these (here they match exactly).
            m, n_e = c.mean(), len(c)
            tol = {"load_max_over_mean": 2 / m, "load_cv": 2 / (math.sqrt(n_e) * m),
                   "empty_experts": 2.0}
            for k, v in want.items():
                tb = dict(sc[f"moe/layer_{i:02d}/{k}"])[step]
                assert tb == pytest.approx(v, rel=1e-5, abs=tol[k] + 1e-6), (step, i, k, tb, v)
            # router entropy: same routing probabilities in one process (fp32 sums reordered)
            h_pp = pp_rows[step]["layers"][i]["router_entropy"]
            h_ref = ref_rows[step]["layers"][i]["router_entropy"]
            assert h_pp == pytest.approx(h_ref, rel=1e-4)
            assert 0 < h_pp <= math.log(8) + 1e-9


@pytest.mark.multiproc
def test_profiler_traces_have_named_ranges(run):
    out, stdout = run
    assert "profiler trace of steps 3,3" in stdout and str(out / "profile" / "rank_0.json") in stdout
    common = {"forward_backward", "grad_sync", "optimizer.step", "ep.dispatch_all_to_all",
              "ep.combine_all_to_all", "moe.grouped_gemm"}
    for rank in range(4):
        trace = json.loads((out / "profile" / f"rank_{rank}.json").read_text())
        names = {ev.get("name") for ev in trace["traceEvents"]}
        stage = "pipeline.stage0.forward" if rank < 2 else "pipeline.stage1.forward"
        missing = (common | {stage}) - names
        assert not missing, (rank, missing)
        s = 0 if rank < 2 else 1  # the runtime's per-action ranges (pipeline/runtime.py)
        for kind in ("F", "B"):
            assert any(str(n).startswith(f"pipeline.{kind} s{s} mb") for n in names), (rank, kind)
        # one profiled step: one forward_backward range on this rank
        assert sum(ev.get("name") == "forward_backward" for ev in trace["traceEvents"]) == 1


@pytest.mark.multiproc
def test_report_prints_summary_and_draws(run):
    out, _ = run
    r = subprocess.run([sys.executable, "-m", "trainer.report", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"steps            {STEPS}" in r.stdout
    final = _rows(out)[-1]
    assert f"final val loss   {final['val_loss']:.4f} (step {STEPS})" in r.stdout
    for i in range(N_MOE):  # one table row per MoE layer, both stages
        assert any(ln.split("|")[0].strip() == str(i) for ln in r.stdout.splitlines()), r.stdout
    for png in ("loss.png", "load_heatmap.png", "step_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert str(out / png) in r.stdout



def test_report_on_a_folder_without_a_run(tmp_path, capsys):
    from trainer.observe.report import main

    assert main([str(tmp_path / "nope")]) == 2
    assert "nope/metrics.jsonl does not exist" in capsys.readouterr().err


@pytest.mark.integration
def test_tensorboard_false_writes_nothing(reference):
    assert not (reference / "tensorboard").exists()
    assert "layers" in _rows(reference)[0]


def test_router_entropy_matches_torch_distributions():
    """Router.last_entropy_sum against torch.distributions.Categorical, both router kinds."""
    from model import presets
    from model.router import Router

    for kind in ("softmax", "sigmoid"):
        cfg = dataclasses.replace(presets.get("tiny"), router=kind)
        r = Router(cfg)
        torch.nn.init.normal_(r.weight, std=0.5)
        r.track_entropy = True
        x = torch.randn(3, 5, cfg.d_model)
        r.route(x)
        s = r.scores(x.reshape(15, -1))
        p = s if kind == "softmax" else s / s.sum(-1, keepdim=True)
        want = torch.distributions.Categorical(probs=p.detach()).entropy().sum()
        assert float(r.last_entropy_sum) == pytest.approx(float(want), rel=1e-5)
        assert not r.last_entropy_sum.requires_grad


def _prepare(argv: list[str], world: int = 1):
    return prepare(parse_args(["--config", "configs/tiny.toml", "--parallel.pp=1",
                               "--parallel.ep=1", "--parallel.microbatches=1",
                               "--data=configs/tiny.toml", "--train.seq_len=16", *argv]),
                   world, 0)


BAD = {
    "profile one number": (["--train.profile_steps=3"], ["train.profile_steps='3'", "A,B"]),
    "profile not numbers": (["--train.profile_steps=a,b"], ["train.profile_steps='a,b'"]),
    "profile from 0": (["--train.profile_steps=0,2"], ["1 <= A <= B <= train.steps=200"]),
    "profile reversed": (["--train.profile_steps=5,4"], ["'5,4'", "1 <= A <= B"]),
    "profile past the end": (["--train.steps=10", "--train.profile_steps=9,11"],
                             ["'9,11'", "train.steps=10"]),
    "tensorboard value": (["--train.tensorboard=maybe"], ["train.tensorboard='maybe'",
                                                          "true, false, auto"]),
    "wandb mode": (["--train.wandb_mode=cloud"], ["train.wandb_mode='cloud'", "offline, online"]),
    "schedule with pp=1": (["--parallel.schedule=1f2b"], ["unknown schedule '1f2b'", "gpipe"]),
    "n_virtual with pp=1": (["--parallel.n_virtual=0"], ["parallel.n_virtual=0"]),
    "microbatches with pp=1": (["--parallel.microbatches=0"], ["parallel.microbatches=0",
                                                               ">= 1"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_logging_options(name):
    argv, needles = BAD[name]
    with pytest.raises(ValueError) as e:
        _prepare(argv)
    for n in needles:
        assert n in str(e.value), str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_requested_but_not_installed():
    with pytest.raises(ValueError) as e:
        _prepare(["--train.wandb_project=demo"])
    assert "train.wandb_project='demo'" in str(e.value) and "pip install wandb" in str(e.value)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_run(tmp_path, data):
    out = tmp_path / "run"
    r = run_train([*SMALL, "--data", data, f"--train.out_dir={out}", "--parallel.pp=1",
                   "--parallel.ep=1", "--train.tensorboard=false",
                   "--train.wandb_project=piper-test"], nproc=1,
                  env={"WANDB_SILENT": "true"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    runs = list((out / "wandb").glob("offline-run-*/*.wandb"))
    assert runs, list((out / "wandb").rglob("*"))


def test_step_result_carries_every_tagged_number():
    """Every per-step number the sinks tag (trainer.observe.metrics.ROW_TAGS) is a field of the step's
    StepResult, and row() leaves out exactly the numbers a run did not measure (None)."""
    from trainer.observe.metrics import ROW_TAGS
    from trainer.step import StepResult

    names = {f.name for f in dataclasses.fields(StepResult)}
    assert set(ROW_TAGS) <= names, sorted(set(ROW_TAGS) - names)
    values = {f.name: 1.0 for f in dataclasses.fields(StepResult)
              if f.name not in ("events", "logged")}
    full = StepResult(**{**values, "pp_idle_max_s": None, "layers": None})
    row = full.row()
    assert "pp_idle_max_s" not in row and "layers" not in row and "events" not in row
    assert set(row) == set(values) - {"pp_idle_max_s", "layers"}


def test_memory_report_every_meters_every_nth_step(tmp_path, data):
    """--train.memory_report_every=2: the meter (and its saved-tensor hooks) runs on steps 2
    and 4 only; `tuner.launch.read_metrics` takes the memory from those and the step time
    from steps 1 and 3, the ones that ran as a plain step."""
    import statistics

    from tuner.launch import read_metrics

    out = tmp_path / "metered"
    r = run_train([*SMALL, "--data", data, f"--train.out_dir={out}", "--parallel.pp=1",
                   "--parallel.ep=1", "--train.tensorboard=false", "--train.memory_report=true",
                   "--train.memory_report_every=2"], nproc=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = _rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert [x["step"] for x in rows if "mem_act_peak_bytes_max" in x] == [2, 4]
    assert [x["step"] for x in rows if "mem_state_bytes_max" in x] == [2, 4]
    assert all(x["mem_act_peak_bytes_max"] > 0 for x in rows if x["step"] in (2, 4))
    m = read_metrics(out, 0)
    assert m.step_time_s == statistics.median(x["step_time_s"] for x in rows[0::2])
    assert m.act_peak_bytes == statistics.median(x["mem_act_peak_bytes_max"] for x in rows[1::2])
    assert m.steps == 2
