"""Validate `tuner.estimate` on this machine: predicted vs measured peak memory and step time.

Issue 33 (item 7, "Local"): at least 12 CPU layouts (PP, EP, DP, ZeRO levels, schedules, the
README's fine-tune recipe, the default job) on a freshly measured platform, step time within
15 % and peak memory within 10 % for each. The layouts: ten at 16 x 256 tokens (PP 1-2, EP
1-2, DP 1-2, 1f1b / gpipe / interleaved / zb-h1), the default job (`configs/tiny.toml`: PP=2 x
EP=2, 1F1B over 4 micro-batches, `comm.alltoall` auto), seven ZeRO rows (ZeRO 0/1/2/3 at DP = 2,
8 x 128 tokens, where the training state outweighs the activations, so what ZeRO shards moves
the total; each also judged on the state bytes alone), and the README recipe: the tiny
Mixtral checkpoint of `examples/make_tiny_hf.py`, its data prepared with its tokenizer, and
the layout `python -m tuner plan --model <it> --gpus 4 --seq 128 --global-batch 16` picks on
the freshly measured 4-process platform (so the row checks the plan the README launches).

Besides the totals every row keeps the step's parts, measured (the trainer's metrics.jsonl,
rank 0, medians over the measured steps: `fwd_bwd_s` forward + backward incl. the pipeline's
waits and the MoE exchanges, `grad_sync_s` the gradient reduction and clipping after the
backward, `optim_s` the optimizer step incl. ZeRO's broadcast of updated weights, the rest of
the step: loss and metric all-reduces) and predicted (`Estimate.time`, `dp_collectives`),
and the machine's load average before and after each run.

Machine drift. This VM's speed moves by 10-30 % over minutes (other tenants), so a platform
measured at one moment can be stale by the time a row runs. `tuner.measure.speed_probe` (a
fixed unit of training work on W processes at once) is timed right after each platform is
measured (kept beside it, tuner_validate_platform_w<W>[.m<k>].probe.json; the median
platform's is the median of those) and again right before and after every row; `speed_ratio`
= the mean of the row's two probes / the platform's. Since 2026-12-06 the platform is measured
before every pass and the rows are predicted on the median of those measurements: one
measurement taken in a fast minute (peak GEMM rate 0.091 against 0.077 TFLOP/s an hour
earlier) put all 2-process rows 10-27 % slow of their prediction in one record. The row
keeps the raw error (`step_err`) and the error of the prediction scaled by that ratio
(`step_err_adj`: the prediction for the machine as fast as the probe found it during the
row), and a row whose two probes differ by more than `UNSTEADY` is marked unsteady. Pass /
fail takes the raw error: on the 2026-12-02 records the probe did not track the rows (it
found the machine as fast or faster while the 2-process rows ran 16-26 % slower than
predicted), so the scaled error is a diagnostic, not the check.

    flock /tmp/piper-bench.lock .venv/bin/python benchmarks/bench_tuner_validate.py
    flock /tmp/piper-bench.lock .venv/bin/python benchmarks/bench_tuner_validate.py --reuse-platforms
    .venv/bin/python benchmarks/bench_tuner_validate.py --repredict   # no runs: the last measured
        rows of tuner_validate.jsonl against the current model and platform files
    .venv/bin/python benchmarks/bench_tuner_validate.py --repredict --dedicated-bubble  # the
        same, the bubble priced as on dedicated devices (no `tuner.sharing` replay)
    .venv/bin/python benchmarks/repredict_tuner_records.py --records 11   # every stored
        record re-predicted on its own platforms: the model's bias per layout
    flock /tmp/piper-bench.lock .venv/bin/python benchmarks/bench_tuner_validate.py \
        --reuse-platforms --only zero        # the ZeRO rows only (names starting with "zero")
    flock /tmp/piper-bench.lock .venv/bin/python benchmarks/bench_tuner_validate.py \
        --reuse-platforms --only "pp1-ep2,readme"   # some rows; "readme": the README recipe
    flock /tmp/piper-bench.lock .venv/bin/python benchmarks/bench_tuner_validate.py --record
(`flock` keeps other timing runs on this shared machine from overlapping with it.)

1. Platform. A CPU "device" is one training process, and W processes share this machine's
   cores, so compute rates depend on W: `tuner.measure` is run with W processes at once for
   every world size used (2 and 4), once before every pass over the rows (`--repeats`), each
   written to tuner_validate_platform_w<W>.m<k>.toml in the output folder; the rows are
   predicted on their field-wise median (`tuner.measure.median_platform`: each efficiency the
   median of its measured rates over the median peak; the fields fitted
   against the platform's other entries, such as the elementwise rate, fitted again from
   the medians of their measured inputs, kept as tuner_validate_platform_w<W>.m<k>.raw.json),
   tuner_validate_platform_w<W>.toml, each config on the platform of its own world size
   (`--reuse-platforms` and `--repredict` take the output folder's platform files, else the
   recorded ones in benchmarks/results/).
2. Runs. Each config runs as a short real `torchrun` job of train.py (fp32, gloo)
   through `tuner.launch.run_plan_locally`; after the warm-up steps the medians of
   `step_time_s`, `mem_state_bytes_max` and `mem_act_peak_bytes_max` are the measurement.
   The memory meter runs on every `--meter-every`-th step (default 2) and the step time is
   the median of the steps without it: its saved-tensor hooks (Python per saved tensor) cost
   2-6 % of these steps (measured with and without, alternated, 2026-12-06), a cost no
   plan has. Before, every step was metered and timed.
3. Prediction. `tuner.estimate` with the precision policy, activation set and ZeRO sharding
   of this trainer (`FP32_TRAINER_PRECISION`, `Assumptions(activation_set="trainer",
   zero_sharding="per-parameter")`, 4 memory passes over
   the saved activations for the unfused elementwise work, see `Assumptions`) on the platform
   of the run's world size. Routing imbalance is a property of the router and data, not of the
   layout: the model takes it as an input (`Assumptions.routing_imbalance`), and here it is
   the run's own measured value (the trainer's max / mean EP-rank load, median over the
   measured steps; 1.0 without EP). A young tiny router is far from balanced (~1.4), so the
   a-priori prediction with balanced routing is recorded beside (`*_balanced`) and shown, but
   pass/fail uses the measured imbalance.
   Peak memory per rank = max over ranks of state + max over ranks of saved activations,
   predicted the same way from the per-stage breakdown (the trainer reports each maximum
   separately). Communication buffers are not seen by the trainer's meter, so they are left
   out of both sides.

Results: tuner_validate.jsonl (rows appended) and tuner_validate.md in runs/bench/tuner_validate/
(ignored by git) or `--out DIR`; `--record` writes them to benchmarks/results/, the tracked
record. `--repredict` reads the output folder's rows, else the recorded ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from _common import (
    ROOT,
    RUNS,
    add_output_args,
    cpu_name,
    cpu_times,
    git_sha,
    output_dir,
    previous,
    print_written,
    steal_fraction,
)

from model import ModelConfig, presets
from tuner import Assumptions, ParallelPlan, estimate, load_platform
from tuner.launch import Measured, run_plan_locally, step_rows
from tuner.layout import CPU_TRAFFIC_PASSES, FP32_TRAINER_PRECISION
from tuner.measure import measure_platform, median_platform, speed_probe

MEM_TOL, TIME_TOL = 0.10, 0.15  # issue 33, item 7
UNSTEADY = 0.10  # a row's before / after speed probes further apart than this: unsteady
PROBE_ROUNDS = 40
TARGET_LAYOUTS = 12

# (name, plan): world size <= 4; tiny preset, 16 sequences of 256 tokens per step.
B, S = 16, 256
CONFIGS: list[tuple[str, ParallelPlan]] = [
    ("pp1-ep2", ParallelPlan(pp=1, ep=2, dp=1, microbatches=1, global_batch=B, seq_len=S)),
    ("pp1-ep1-dp2", ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=B, seq_len=S)),
    ("pp1-ep2-dp2", ParallelPlan(pp=1, ep=2, dp=2, microbatches=1, global_batch=B, seq_len=S)),
    ("pp2-ep1 gpipe m4", ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=B,
                                      seq_len=S, schedule="gpipe")),
    ("pp2-ep1 interleaved:2 m4", ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=B,
                                              seq_len=S, schedule="interleaved-1f1b", n_virtual=2)),
    ("pp2-ep2 1f1b m4", ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=B, seq_len=S)),
    ("pp2-ep2 gpipe m4", ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=B,
                                      seq_len=S, schedule="gpipe")),
    ("pp2-ep1 zb-h1 m4", ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=B,
                                      seq_len=S, schedule="zb-h1")),
    ("pp2-ep2 zb-h1 m8", ParallelPlan(pp=2, ep=2, dp=1, microbatches=8, global_batch=B,
                                      seq_len=S, schedule="zb-h1")),
    ("pp2-ep1-dp2 1f1b m2", ParallelPlan(pp=2, ep=1, dp=2, microbatches=2, global_batch=B, seq_len=S)),
    # recompute (model/checkpointing.py): the FFN intermediates, and whole blocks
    ("selective pp1-ep1-dp2", ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=B,
                                           seq_len=S, checkpointing="selective")),
    ("full pp2-ep2 1f1b m4", ParallelPlan(pp=2, ep=2, dp=1, microbatches=4, global_batch=B,
                                          seq_len=S, checkpointing="full")),
]


def default_job_plan(path: Path = ROOT / "configs" / "tiny.toml", world: int = 4) -> ParallelPlan:
    """The layout and batch of the default CPU job (`make train`: configs/tiny.toml on `world`
    processes; dp = 0 there means world / (pp x ep))."""
    c = tomllib.loads(path.read_text())
    par, tr = c["parallel"], c["train"]
    dp = par.get("dp", 0) or world // (par["pp"] * par["ep"])
    return ParallelPlan(pp=par["pp"], ep=par["ep"], dp=dp, microbatches=par["microbatches"],
                        global_batch=tr["global_batch"], seq_len=tr["seq_len"],
                        schedule=par.get("schedule", "1f1b"),
                        alltoall=c.get("comm", {}).get("alltoall", "flat"))


DEFAULT_JOB = "default job (configs/tiny.toml)"
CONFIGS.append((DEFAULT_JOB, default_job_plan()))
# ZeRO rows (issue 19): 8 x 128 tokens per step, where the tiny model's fp32 state (54.6 MB
# per rank at DP = 2: weights 13.7, grads 13.7, AdamW 27.3) outweighs its activations
# (~32 MB), so sharding moves the total; a ZeRO-0 row of the same size is the baseline.
BZ, SZ = 8, 128
CONFIGS += [
    ("zero0 pp1-ep1-dp2", ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=BZ, seq_len=SZ)),
    ("zero1 pp1-ep1-dp2", ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=BZ,
                                       seq_len=SZ, zero=1)),
    ("zero2 pp1-ep1-dp2", ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=BZ,
                                       seq_len=SZ, zero=2)),
    ("zero1 pp1-ep2-dp2", ParallelPlan(pp=1, ep=2, dp=2, microbatches=1, global_batch=BZ,
                                       seq_len=SZ, zero=1)),
    ("zero1 pp2-ep1-dp2 m2", ParallelPlan(pp=2, ep=1, dp=2, microbatches=2, global_batch=BZ,
                                          seq_len=SZ, zero=1)),
    # ZeRO-3 (the trainer's FSDP2): priced with the platform's measured per-layer overhead
    ("zero3 pp1-ep1-dp2", ParallelPlan(pp=1, ep=1, dp=2, microbatches=1, global_batch=BZ,
                                       seq_len=SZ, zero=3)),
    ("zero3 pp2-ep1-dp2 m2", ParallelPlan(pp=2, ep=1, dp=2, microbatches=2, global_batch=BZ,
                                          seq_len=SZ, zero=3)),
]
# The README's fine-tune recipe: its layout is what the planner picks, so it is planned at run
# time (`readme_recipe`) on the 4-process platform just measured.
README = "README recipe (tiny Mixtral, planned)"
README_REQUEST = {"gpus": 4, "seq": 128, "global_batch": 16}
NAMES = [n for n, _ in CONFIGS] + [README]
# the recipe's checkpoint, data and plan files: ignored by git, also with --record
WORK = RUNS / "tuner_validate"


@dataclass(frozen=True)
class Recipe:
    """The README recipe's checkpoint folder, its prepared data and the planned layout."""

    hf_dir: Path
    data: Path
    plan: ParallelPlan
    plan_file: Path


def _run(cmd: list[str], what: str) -> None:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n"
                           f"{(p.stdout + p.stderr)[-2000:]}")


def recipe_files(out: Path) -> tuple[Path, Path]:
    """The tiny Mixtral folder and its tokenized data, made once in `out` (the README's first
    two commands)."""
    out.mkdir(parents=True, exist_ok=True)
    hf, data = out / "tiny-hf", out / "tiny-hf-data.bin"
    if not (hf / "config.json").is_file():
        _run([sys.executable, "examples/make_tiny_hf.py", "--out", str(hf)], "make_tiny_hf")
    if not data.is_file():
        _run([sys.executable, "-m", "trainer.data", "prepare", "--tokenizer", str(hf), "--input",
              "model/", "--out", str(data), "--no-progress"], "trainer.data prepare")
    return hf, data


def plan_from_file(path: Path) -> ParallelPlan:
    """The layout a plan file launches (its [run.parallel], [run.comm], [run.train])."""
    run = tomllib.loads(path.read_text())["run"]
    par, tr = run["parallel"], run["train"]
    return ParallelPlan(pp=par["pp"], ep=par["ep"], dp=par["dp"],
                        microbatches=par["microbatches"], global_batch=tr["global_batch"],
                        seq_len=tr["seq_len"], schedule=par["schedule"],
                        n_virtual=par.get("n_virtual", 1), alltoall=run["comm"]["alltoall"],
                        checkpointing=tr.get("checkpointing", "none"),
                        ep_placement=par.get("ep_placement", "local"), zero=par.get("zero", 0),
                        redundant=run.get("balance", {}).get("redundant", 0))


def readme_recipe(out: Path, platform: Path) -> Recipe:
    """Plan the README recipe on `platform` (`python -m tuner plan`, as the README runs it)."""
    hf, data = recipe_files(out)
    plans = out / "readme-plan"
    r = README_REQUEST
    _run([sys.executable, "-m", "tuner", "plan", "--model", str(hf), "--platform", str(platform),
          "--gpus", str(r["gpus"]), "--seq", str(r["seq"]), "--global-batch",
          str(r["global_batch"]), "--out", str(plans)], "tuner plan")
    files = sorted(plans.glob("*.toml"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise RuntimeError(f"tuner plan wrote no plan file into {plans}")
    return Recipe(hf, data, plan_from_file(files[-1]), files[-1])


def trainer_supports_zero() -> bool:
    """Whether the trainer acts on `parallel.zero`: some trainer module other than the config
    that declares it reads the field (`cfg.parallel.zero`, `par.zero`, ...). A declared but
    unread field would run every ZeRO row as ZeRO-0 and report a wrong pass or fail."""
    import re

    root = ROOT / "trainer"
    return any(re.search(r"\.zero\b", f.read_text()) for f in root.glob("*.py")
               if f.name != "config.py")


def probe_path(platform: Path) -> Path:
    """The speed probe timed beside a platform file (see the module docstring)."""
    return platform.with_suffix(".probe.json")


def raw_path(platform: Path) -> Path:
    """The measured inputs of a platform's fitted fields (`measure_platform`'s raw_out), which
    `median_platform` fits again against the median platform."""
    return platform.with_suffix(".raw.json")


def stale_measurements(out: Path, world: int) -> list[Path]:
    """The separate platform measurements of `world` processes (.m<k>.toml and the .raw.json
    and .probe.json beside each) an earlier run left in `out`: removed before a run measures
    its own, so a record of fewer passes than the one before keeps only its own files."""
    return sorted(f for f in out.glob(f"tuner_validate_platform_w{world}.m*.*")
                  if f.name.split(".")[1][1:].isdigit())


def platform_probe(platform: Path) -> float | None:
    """Seconds of `speed_probe` timed right after `platform` was measured; None if never."""
    f = probe_path(platform)
    return json.loads(f.read_text())["probe_s"] if f.is_file() else None


def platform_path(out: Path, world: int) -> Path:
    """The measured platform of `world` processes in output folder `out`."""
    return out / f"tuner_validate_platform_w{world}.toml"


def predict(cfg: ModelConfig, plan: ParallelPlan, platform: Path,
            imbalance: float = 1.0, shared_cores: bool = True) -> dict:
    """Predicted per-rank peak memory (state + activations, bytes), step time (s) and its
    parts on the platform file `platform`; `shared_cores`: the pipeline replayed on the
    node's shared cores (`Assumptions.shared_cores`)."""
    pf = load_platform(platform)
    # ZeRO as the trainer shards it: whole parameters per owner (trainer/distributed/zero.py)
    asm = Assumptions(activation_set="trainer", routing_imbalance=imbalance,
                      activation_traffic_passes=CPU_TRAFFIC_PASSES, zero_sharding="per-parameter",
                      shared_cores=shared_cores)
    e = estimate(cfg, plan, pf, FP32_TRAINER_PRECISION, asm)
    # ZeRO-3's gathered layer copies (FSDP2's unsharded parameters, transient around each
    # layer's use) are held to no module parameter, gradient or optimizer state, so the
    # trainer's memory meter (trainer/observe/memory.py) does not see them: the comparison
    # leaves them out of the state and reports them apart (`gathered`)
    held = [(s.state, s.state_by_part.get("zero3_gathered", 0.0)) for s in e.stages]
    gathered = max(g for _, g in held)
    state = max(st - g for st, g in held)
    # Likewise what a recompute rebuilds in the backward (one layer's dropped activations):
    # torch's checkpoint saves it under its own hooks, unseen by the meter (`rebuilt`, apart)
    seen = [(s.activations - s.act_by_part.get("recompute", 0.0),
             s.act_by_part.get("recompute", 0.0)) for s in e.stages]
    act = max(a for a, _ in seen)
    rebuilt = max(r for _, r in seen)
    return {"state": state, "act": act, "memory": state + act, "step_time": e.step_time,
            "gathered": gathered, "rebuilt": rebuilt,
            "zero_saved": max(s.zero_saved for s in e.stages), "time": dict(e.time),
            "dp_collectives": dict(e.dp_collectives)}


# The trainer's step-time parts (metrics.jsonl, rank 0) the rows keep
PARTS = ("fwd_bwd_s", "grad_sync_s", "optim_s", "ep_exchange_max_s", "pp_idle_max_s")


def measured_parts(run_dir: Path, warmup: int) -> dict[str, float]:
    """Medians over the timed steps (`tuner.launch.step_rows`: those the step time comes
    from) of the trainer's step parts, and "other_s": the step minus forward/backward,
    gradient sync and optimizer (loss and metric all-reduces)."""
    rows = step_rows(run_dir, warmup)[0]
    out = {k: statistics.median(r[k] for r in rows) for k in PARTS if k in rows[0]}
    out["other_s"] = statistics.median(
        r["step_time_s"] - r["fwd_bwd_s"] - r["grad_sync_s"] - r["optim_s"] for r in rows)
    return out


def predicted_parts(p: dict) -> dict[str, float]:
    """The estimate's parts grouped as the trainer times them: forward/backward = compute +
    all-to-all + P2P + bubble (+ TP/CP/ETP/ZeRO-3 terms); grad sync = the gradient reduction
    (all-reduce or reduce to owners, replica sums); optimizer = the update + ZeRO's broadcast
    of the updated weights and its pack / unpack copies (trainer/distributed/zero.py
    broadcasts inside its step); grad sync
    also the trainer's gradient passes and the clipping's small all-reduces ("grad_post"),
    other = the step's other small all-reduces ("step_syncs"; both measured platform terms)."""
    t, dc = p["time"], p["dp_collectives"]
    bcast = dc.get("broadcast", 0.0) + dc.get("broadcast_copy", 0.0) + dc.get("all_gather", 0.0)
    rest = ("dp_sync", "optimizer", "grad_post", "step_syncs")
    return {"fwd_bwd_s": sum(v for k, v in t.items() if k not in rest),
            "grad_sync_s": t.get("dp_sync", 0.0) - bcast + t.get("grad_post", 0.0),
            "optim_s": t.get("optimizer", 0.0) + bcast, "other_s": t.get("step_syncs", 0.0)}


HDR = (f"{'config':36} {'W':>1} {'mem pred':>8} {'meas':>7} {'err':>6} {'step pred':>9} "
       f"{'meas':>7} {'err':>6} {'imb':>5} ok  balanced: {'mem err':>7} {'step err':>8}")


def speed_fields(base: float | None, before: float, after: float) -> dict:
    """The row's machine-drift record: its probes, the platform's, their ratio (1.0 where the
    platform has no probe) and whether the machine held its speed during the row."""
    ratio = (before + after) / 2 / base if base else 1.0
    return {"probe_platform_s": base, "probe_before_s": before, "probe_after_s": after,
            "speed_ratio": ratio, "unsteady": abs(after / before - 1) > UNSTEADY}


def _row(cfg: ModelConfig, name: str, plan: ParallelPlan, m: Measured, args: argparse.Namespace,
         platforms: dict[int, Path], parts: dict[str, float], load: tuple[float, float],
         measured_at: str = "", extra: dict | None = None, speed: dict | None = None) -> dict:
    """Predict `plan` on `platforms[world]`, compare with measurement `m` (raw, and scaled by
    the row's `speed` record, `speed_fields`), print one line, return the JSON row."""
    sc = not getattr(args, "dedicated_bubble", False)
    p = predict(cfg, plan, platforms[plan.n_gpus], max(1.0, m.imbalance), sc)
    p_bal = predict(cfg, plan, platforms[plan.n_gpus], shared_cores=sc)
    speed = speed or {"speed_ratio": 1.0, "unsteady": False}
    mem_err = p["memory"] / m.memory_bytes - 1
    t_err = p["step_time"] / m.step_time_s - 1
    t_adj = p["step_time"] * speed["speed_ratio"]
    t_err_adj = t_adj / m.step_time_s - 1
    state_err = p["state"] / m.state_bytes - 1
    ok = abs(mem_err) <= MEM_TOL and abs(t_err) <= TIME_TOL
    if plan.zero:  # what ZeRO changes is the state: it is held to the memory bound as well
        ok = ok and abs(state_err) <= MEM_TOL
    pparts = predicted_parts(p)
    row = {
        "bench": "tuner_validate", "sha": git_sha(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "measured_at": measured_at or time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": cpu_name(), "cores": os.cpu_count(), "config": name,
        "plan": plan.to_dict(), "world": plan.n_gpus, "model": cfg.name,
        "steps": args.steps if not measured_at else m.steps + args.warmup, "warmup": args.warmup,
        "pred_mem_gb": p["memory"] / 1e9, "meas_mem_gb": m.memory_bytes / 1e9,
        "pred_state_gb": p["state"] / 1e9, "meas_state_gb": m.state_bytes / 1e9,
        "state_err": state_err, "zero": plan.zero, "pred_zero_saved_gb": p["zero_saved"] / 1e9,
        "pred_act_gb": p["act"] / 1e9, "meas_act_gb": m.act_peak_bytes / 1e9,
        "pred_zero3_gathered_gb": p["gathered"] / 1e9,
        "pred_recompute_rebuilt_gb": p["rebuilt"] / 1e9,
        "meas_act_max_gb": m.act_peak_bytes_max / 1e9,
        "pred_mem_balanced_gb": p_bal["memory"] / 1e9,
        "pred_step_balanced_s": p_bal["step_time"], "meas_imbalance": m.imbalance,
        "mem_err": mem_err, "pred_step_s": p["step_time"], "meas_step_s": m.step_time_s,
        "step_err": t_err, "pred_step_adj_s": t_adj, "step_err_adj": t_err_adj, **speed,
        "pred_time_breakdown": p["time"],
        "pred_dp_collectives": p["dp_collectives"], "pred_parts": pparts, "meas_parts": parts,
        "load_before": load[0], "load_after": load[1], "pass": ok, "shared_cores": sc,
        **(extra or {}),
    }
    print(f"{name:36} {plan.n_gpus:>1} {p['memory'] / 1e6:>7.1f}M {m.memory_bytes / 1e6:>6.1f}M "
          f"{100 * mem_err:>+5.1f}% {p['step_time']:>8.3f}s {m.step_time_s:>6.3f}s "
          f"{100 * t_err:>+5.1f}% {m.imbalance:>5.2f} {'yes' if ok else 'NO':3} "
          f"{100 * (p_bal['memory'] / m.memory_bytes - 1):>+16.1f}% "
          f"{100 * (p_bal['step_time'] / m.step_time_s - 1):>+7.1f}%"
          f"  state {p['state'] / 1e6:.1f}/{m.state_bytes / 1e6:.1f}M ({100 * state_err:+.1f}%)")
    print(f"    machine speed vs the platform's: x{speed['speed_ratio']:.2f}"
          f"{' (unsteady)' if speed['unsteady'] else ''}; prediction scaled {t_adj:.3f}s, "
          f"error {100 * t_err_adj:+.1f}%")
    if parts:
        print("    parts measured / predicted (s): " + ", ".join(
            f"{k[:-2]} {parts[k]:.3f}/{pparts[k]:.3f}" for k in pparts if k in parts)
            + f"; load {load[0]:.1f} -> {load[1]:.1f}")
    return row


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--meter-every", type=int, default=2,
                    help="the memory meter on every Nth step only; the step time is the median "
                         "of the other steps (the meter's saved-tensor hooks cost 2-6 %% of a "
                         "step here); 1 = meter and time every step (the records before "
                         "2026-12-06 14:40 UTC)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over every row, each row's step time the median pass's: this "
                         "VM's speed moves by 10-30 %% for minutes at a time (measured: one row "
                         "0.394 s, then 0.506 s ten minutes later, nothing else running)")
    ap.add_argument("--reuse-platforms", action="store_true",
                    help="use the platform files already measured (skip ~4 min of benchmarks)")
    ap.add_argument("--only", default="",
                    help="comma-separated config names to run; 'zero' selects the ZeRO rows, "
                         "'readme' the README recipe")
    ap.add_argument("--zero-rows", choices=("auto", "on", "off"), default="auto",
                    help="ZeRO rows: auto runs them when the trainer acts on parallel.zero")
    ap.add_argument("--repredict", action="store_true",
                    help="no runs: compare the last measured rows with the current model")
    ap.add_argument("--dedicated-bubble", action="store_true",
                    help="predict the pipeline bubble as on dedicated devices (without "
                         "Assumptions.shared_cores' replay on the platform's shared cores)")
    add_output_args(ap, "tuner_validate")
    return ap


def _selected(args: argparse.Namespace) -> tuple[list[tuple[str, ParallelPlan]], bool]:
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1 (passes over every row)")
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    for w in wanted:
        if w not in NAMES and w not in ("zero", "readme"):
            raise ValueError(f"--only {w!r}: not a config; valid: zero, readme, "
                             + ", ".join(repr(n) for n in NAMES))
    configs = [c for c in CONFIGS if not wanted or c[0] in wanted
               or ("zero" in wanted and c[0].startswith("zero"))]
    readme = not wanted or "readme" in wanted or README in wanted
    zero_on = args.zero_rows == "on" or (args.zero_rows == "auto" and trainer_supports_zero())
    if not zero_on and any(p.zero for _, p in configs):
        print("ZeRO rows skipped: " + ("--zero-rows=off" if args.zero_rows == "off" else
              "the trainer does not act on parallel.zero yet (no trainer module reads it)"))
        configs = [c for c in configs if not c[1].zero]
    return configs, readme


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.meter_every < 1 or args.steps <= args.warmup + args.meter_every:
        ap.error(f"--meter-every {args.meter_every}, --steps {args.steps}, --warmup "
                 f"{args.warmup}: need meter-every >= 1 and steps > warmup + meter-every (a "
                 f"metered and a timed step after the warm-up)")
    out = output_dir(args)
    configs, readme = _selected(args)
    tiny = presets.get("tiny")
    worlds = sorted({p.n_gpus for _, p in configs} | ({README_REQUEST["gpus"]} if readme else set()))
    platforms: dict[int, Path] = {}
    platform_load: dict[int, list[float]] = {}
    measurements: dict[int, list[Path]] = {}  # each world's platform files, one per pass

    def measure_round(k: int) -> None:
        """Measure every world's platform once more (before pass k): file .m<k>.toml."""
        for w in worlds:
            f = platform_path(out, w).with_suffix(f".m{k}.toml")
            t0, l0, c0 = time.perf_counter(), os.getloadavg()[0], cpu_times()
            measure_platform(f, n_procs=w, raw_out=raw_path(f))
            probe_path(f).write_text(json.dumps(
                {"probe_s": speed_probe(w, PROBE_ROUNDS), "rounds": PROBE_ROUNDS,
                 "steal": steal_fraction(c0, cpu_times()),
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
            platform_load.setdefault(w, []).extend([l0, os.getloadavg()[0]])
            measurements.setdefault(w, []).append(f)
            platforms.setdefault(w, f)  # the first until the passes are done
            print(f"measured platform {k} of {args.repeats} for {w} processes in "
                  f"{time.perf_counter() - t0:.0f} s: {f} (load average {l0:.1f} -> "
                  f"{os.getloadavg()[0]:.1f})", flush=True)

    for w in worlds:
        if args.reuse_platforms or args.repredict:
            platforms[w] = previous(out, platform_path(out, w).name)
            if platforms[w].is_file():
                print(f"platform for {w} processes: {platforms[w]}")
                continue
            del platforms[w]
    if any(w not in platforms for w in worlds):
        if args.repredict:
            raise SystemExit(f"--repredict: no platform file for {sorted(set(worlds) - set(platforms))}"
                             f" processes in {out} or among the recorded results")
        worlds = [w for w in worlds if w not in platforms]
        # an earlier run's measurements beyond this run's passes would stay beside this
        # run's median and be read as its own (repredict_tuner_records.py)
        for w in worlds:
            for f in stale_measurements(out, w):
                f.unlink()
        measure_round(1)

    rows = []
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(HDR + "\n" + "-" * len(HDR))
    if args.repredict:
        last = {}
        measured = previous(out, "tuner_validate.jsonl")
        print(f"--repredict: measured rows from {measured}")
        for line in measured.read_text().splitlines():
            r = json.loads(line)
            last[r["config"]] = r
        todo = list(configs)
        if readme and README in last:
            todo.append((README, ParallelPlan(**last[README]["plan"])))
        for name, plan in todo:
            if name not in last:
                print(f"--repredict: no measured row for {name!r} yet; skipped")
                continue
            r = last[name]
            cfg = ModelConfig.from_hf_config(str(recipe_files(WORK)[0])) if name == README \
                else tiny
            m = Measured(r["meas_step_s"], r["meas_state_gb"] * 1e9, r["meas_act_gb"] * 1e9,
                         r["meas_act_max_gb"] * 1e9, r["meas_imbalance"], r["steps"] - r["warmup"])
            speed = ({k: r[k] for k in ("probe_platform_s", "probe_before_s", "probe_after_s",
                                        "speed_ratio", "unsteady")}
                     if "speed_ratio" in r else None)
            rows.append(_row(cfg, name, plan, m, args, platforms, r.get("meas_parts", {}),
                             (r.get("load_before", -1.0), r.get("load_after", -1.0)),
                             measured_at=r.get("measured_at", r.get("time", "")), speed=speed))
    else:
        with tempfile.TemporaryDirectory(prefix="tuner-validate-") as tmp:
            jobs: list[tuple[str, ParallelPlan, ModelConfig, str, Path | None, dict]] = [
                (n, p, tiny, "tiny", None, {}) for n, p in configs]
            if readme:
                rec = readme_recipe(WORK, platforms[README_REQUEST["gpus"]])
                print(f"README recipe: planned {rec.plan} ({rec.plan_file})")
                jobs.append((README, rec.plan, ModelConfig.from_hf_config(str(rec.hf_dir)),
                             str(rec.hf_dir), rec.data, {"plan_file": rec.plan_file.read_text()}))
            runs: dict[str, list[tuple[Measured, dict, tuple[float, float], dict]]] = {
                name: [] for name, *_ in jobs}
            steals: dict[str, list[float | None]] = {name: [] for name, *_ in jobs}
            for rep in range(args.repeats):  # passes over every row: a slow spell hits one pass
                if measurements and rep > 0:
                    measure_round(rep + 1)
                for name, plan, _cfg, model, data, _extra in jobs:
                    run_dir = Path(tmp) / name.replace(" ", "_").replace(":", "").replace("/", "_")
                    l0 = os.getloadavg()[0]
                    before = speed_probe(plan.n_gpus, PROBE_ROUNDS)
                    c0 = cpu_times()
                    m = run_plan_locally(plan, model, run_dir, steps=args.steps,
                                         warmup=args.warmup, data=data,
                                         meter_every=args.meter_every)
                    # the run's stolen CPU share: a slow spell of the host, not of the row
                    steals[name].append(steal_fraction(c0, cpu_times()))
                    # the row's probes; against the platform's once the platform is final
                    probes = {"probe_before_s": before,
                              "probe_after_s": speed_probe(plan.n_gpus, PROBE_ROUNDS)}
                    runs[name].append((m, measured_parts(run_dir, args.warmup),
                                       (l0, os.getloadavg()[0]), probes))
                    if args.repeats > 1:
                        print(f"[pass {rep + 1}/{args.repeats}] {name}: step {m.step_time_s:.3f} s",
                              flush=True)
            for w, files in measurements.items():  # the rows are predicted on the median
                platforms[w] = median_platform(files, platform_path(out, w),
                                               [raw_path(f) for f in files])
                probe_path(platforms[w]).write_text(json.dumps(
                    {"probe_s": statistics.median(platform_probe(f) or 0.0 for f in files),
                     "of": [f.name for f in files],
                     "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
                print(f"platform for {w} processes: the median of {len(files)} measurements, "
                      f"{platforms[w]}")
            for name, plan, *_ in jobs:  # each row's probes against its platform's (median)
                runs[name] = [(m, parts, load, speed_fields(
                    platform_probe(platforms[plan.n_gpus]), sp["probe_before_s"],
                    sp["probe_after_s"])) for m, parts, load, sp in runs[name]]
            for name, plan, cfg, _model, _data, extra in jobs:
                m, parts, load, speed = combine_passes(runs[name])
                rows.append(_row(cfg, name, plan, m, args, platforms, parts, load,
                                 extra={**extra, "platform_load": platform_load,
                                        "pass_step_s": [r[0].step_time_s for r in runs[name]],
                                        "pass_steal": steals[name],
                                        "pass_probe_s": [[r[3]["probe_before_s"],
                                                          r[3]["probe_after_s"]]
                                                         for r in runs[name]]},
                                 speed=speed))
    _summary(rows)
    with open(out / "tuner_validate.jsonl", "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    # The summary holds the latest row of every config in this folder, so a run of a few
    # (--only) keeps the rest.
    latest = {}
    for line in (out / "tuner_validate.jsonl").read_text().splitlines():
        r = json.loads(line)
        latest[r["config"]] = r
    _markdown([latest[n] for n in NAMES if n in latest], out / "tuner_validate.md")
    print_written(out / "tuner_validate.jsonl", out / "tuner_validate.md",
                  *(f for p in [*platforms.values(), *(g for fs in measurements.values() for g in fs)]
                    if p.parent == out for f in (p, probe_path(p)) if f.is_file()))


def combine_passes(runs: list[tuple[Measured, dict, tuple[float, float], dict]]
                   ) -> tuple[Measured, dict, tuple[float, float], dict]:
    """One row from its passes (`--repeats`): the median pass's step time and parts (each
    pass's own figures are medians over its measured steps), the memory of the first pass
    (the same tensors every pass), the largest activation peak, the loads around all passes
    and the speed probes of the pass whose step time is the median one."""
    times = [m.step_time_s for m, *_ in runs]
    mid = sorted(range(len(runs)), key=lambda i: times[i])[(len(runs) - 1) // 2]
    first = runs[0][0]
    m = Measured(statistics.median(times), first.state_bytes,
                 statistics.median(r[0].act_peak_bytes for r in runs),
                 max(r[0].act_peak_bytes_max for r in runs),
                 statistics.median(r[0].imbalance for r in runs), sum(r[0].steps for r in runs))
    keys = set.intersection(*(set(r[1]) for r in runs))
    parts = {k: statistics.median(r[1][k] for r in runs) for k in sorted(keys)}
    return m, parts, (runs[0][2][0], runs[-1][2][1]), runs[mid][3]


def _summary(rows: list[dict]) -> None:
    n_ok = sum(r["pass"] for r in rows)
    layouts = {json.dumps({k: v for k, v in r["plan"].items()
                           if k not in ("global_batch", "seq_len")}, sort_keys=True) for r in rows}
    n_t = sum(abs(r["step_err"]) <= TIME_TOL for r in rows)
    n_adj = sum(abs(r.get("step_err_adj", r["step_err"])) <= TIME_TOL for r in rows)
    n_unsteady = sum(bool(r.get("unsteady")) for r in rows)
    n_m = sum(abs(r["mem_err"]) <= MEM_TOL for r in rows)
    print(f"\n{n_ok} of {len(rows)} configurations ({len(layouts)} distinct layouts) within "
          f"{MEM_TOL:.0%} (memory) and {TIME_TOL:.0%} (step time); memory alone {n_m}, step "
          f"time alone {n_t} ({n_adj} scaled by the speed probe); "
          f"{n_unsteady} rows unsteady; issue 33 asks all of >= {TARGET_LAYOUTS}: "
          f"{'holds' if n_ok == len(rows) and len(layouts) >= TARGET_LAYOUTS else 'FAILS'}")
    zrows = [r for r in rows if r["plan"].get("zero") and r["config"].startswith("zero")]
    if zrows:
        n_mem = sum(abs(r["mem_err"]) <= MEM_TOL and abs(r["state_err"]) <= MEM_TOL for r in zrows)
        print(f"ZeRO rows: {n_mem} of {len(zrows)} with memory and state within {MEM_TOL:.0%}")
        base = next((r for r in rows if r["config"] == "zero0 pp1-ep1-dp2"), None)
        for r in zrows:
            if base and r["world"] == base["world"] and r["plan"]["global_batch"] == BZ:
                print(f"  {r['config']}: state {1e3 * r['meas_state_gb']:.1f} MB measured vs "
                      f"ZeRO-0 {1e3 * base['meas_state_gb']:.1f} MB "
                      f"({r['meas_state_gb'] / base['meas_state_gb']:.2f}x; predicted "
                      f"{r['pred_state_gb'] / base['pred_state_gb']:.2f}x); step "
                      f"{r['meas_step_s'] / base['meas_step_s']:.2f}x ZeRO-0's (predicted "
                      f"{r['pred_step_s'] / base['pred_step_s']:.2f}x)")


# What the zb-h1 rows carry that the model does not:
ZB_NOTE = (
    "zb-h1: the split backward (pipeline/split_backward.py) is priced from the platform's "
    "measured extra over a plain backward (split_backward_extra) and B's share of B + W "
    "(split_backward_input_share), which shapes the schedule's bubble (docs/planner.md, "
    "'Zero bubble: the split backward, measured').")


def _speed_cell(r: dict) -> str:
    if not r.get("probe_platform_s"):
        return "-"
    return f"{r['speed_ratio']:.2f}" + (" (unsteady)" if r.get("unsteady") else "")


def _fmt_parts(r: dict) -> str:
    mp, pp = r.get("meas_parts") or {}, r.get("pred_parts") or {}
    if not mp:
        return "-"
    return " / ".join(f"{mp.get(k, 0.0):.3f}:{pp.get(k, 0.0):.3f}"
                      for k in ("fwd_bwd_s", "grad_sync_s", "optim_s", "other_s"))


def _markdown(rows: list[dict], path: Path) -> None:
    lines = [
        "<!-- written by benchmarks/bench_tuner_validate.py -->",
        f"tiny preset, {B} x {S} tokens per step ({BZ} x {SZ} for the zero* rows; the README "
        "recipe: tiny Mixtral, the planned layout), fp32 on CPU processes (gloo); the latest "
        "row of each config (sha, measured and predicted times in tuner_validate.jsonl). "
        "Memory = max state + max saved activations per rank; step time = median after the "
        "warm-up steps. Parts (s, measured:predicted): forward+backward / gradient sync / "
        "optimizer (incl. ZeRO's broadcast) / other (the step's small all-reduces). Speed "
        "ratio: the machine's speed probe around the row / at the platform's measurement "
        "(> 1: slower); 'error, scaled' compares the prediction times that ratio.",
        "",
        "| config | procs | memory pred (MB) | measured (MB) | error | state pred / measured (MB) "
        "| step pred (s) | measured (s) | error | speed ratio | error, scaled | parts meas:pred (s) "
        "| routing imbalance (measured) | within 10 % / 15 % | balanced routing: memory "
        "error | step error | load avg before/after | sha, measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lb, la = r.get("load_before"), r.get("load_after")
        load = f"{lb:.1f} / {la:.1f}" if lb is not None and lb >= 0 else "-"
        lines.append(
            f"| {r['config']} | {r['world']} | {1e3 * r['pred_mem_gb']:.1f} | "
            f"{1e3 * r['meas_mem_gb']:.1f} | {100 * r['mem_err']:+.1f} % | "
            f"{1e3 * r['pred_state_gb']:.1f} / {1e3 * r['meas_state_gb']:.1f} | {r['pred_step_s']:.3f} | "
            f"{r['meas_step_s']:.3f} | {100 * r['step_err']:+.1f} % | {_speed_cell(r)} | "
            f"{100 * r.get('step_err_adj', r['step_err']):+.1f} % | {_fmt_parts(r)} | "
            f"{r['meas_imbalance']:.2f} | "
            f"{'yes' if r['pass'] else 'no'} | "
            f"{100 * (r['pred_mem_balanced_gb'] / r['meas_mem_gb'] - 1):+.1f} % | "
            f"{100 * (r['pred_step_balanced_s'] / r['meas_step_s'] - 1):+.1f} % | {load} | "
            f"{r['sha']}, {r.get('measured_at', r['time'])[:16]} |")
    if any("zb-h1" in r["config"] for r in rows):
        lines += ["", ZB_NOTE]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
