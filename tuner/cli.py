"""Command line of the tuner: `python -m tuner plan | estimate | reproduce-paper | measure`.

    python -m tuner plan --model deepseek-v3|HF_CHECKPOINT_DIR --platform frontier --gpus 1024 --seq 4096 \\
        --global-batch 4096 [--search auto|tpe|exhaustive] [--trials 300] [--seed 0]
        [--storage study.db] [--out runs/plans]
        [--alltoall-model closed-form|netsim] [--zero 0,1,2,3] [--zero-sharding per-parameter|flat]
        [--a2a-overlap none,layer,fb] [--redundant R] [--precision-policy trainer|published|megatron]
        [--measure K [--measure-steps 8]]
    python -m tuner estimate --model M --platform P --gpus N --seq S --global-batch B [--mbs 1]
        [--pp 1] [--vpp 1] [--tp 1] [--cp 1] [--ep 1] [--etp 1] [--zero 0|1|2|3]
        [--recompute none|selective|full] [--dispatch flat|halo|dedup|auto]
        [--a2a-overlap none|layer|fb|auto] [--precision bf16|fp8]
        [--precision-policy trainer|published|megatron] [--schedule S] [--ep-placement P]
        [--redundant R] [--zero3-gather microbatch|step [--zero3-runs N]] [--host-floor-ms MS]
        [--mtp-layers N] [--json]
    python -m tuner reproduce-paper [--out FILE | --record]   (default: runs/bench/reproduce_paper/;
        --record: the tracked benchmarks/results/reproduce_paper.md)
    python -m tuner measure [--out configs/platforms/local.toml] [--procs 4]

`--zero` lists the ZeRO levels searched (default all: 0 replicated state, 1 optimizer state
sharded over each parameter's data-parallel replicas, 2 gradients too, 3 the parameters too,
gathered per layer); the plan file carries the chosen one as `[run.parallel] zero` and the
report says what it saves.
`--search` (default auto): exhaustive, every point of the space by branch and bound (the
model's optimum; DeepSeek-V3 on 1024 GPUs, ~1 minute here, progress printed), with the
closed-form all-to-all model; a seeded TPE study of `--trials` trials with netsim, whose
evaluations simulate the exchange's flows. `--search tpe` is the fast answer (seconds), which
can end off the optimum (1.15x on DeepSeek-V3 / 1024 Frontier GCDs: benchmarks/bench_tuner.py).
`--a2a-overlap` lists the all-to-all overlap modes searched (default all: none, layer with 2
chunks, fb with 2 chunks; `tuner.space.overlap_chunks`); the plan file carries the chosen one
as `[run.comm] a2a_overlap` and `a2a_chunks`, and the report says what it hides. "auto" is
not searched: it runs one of the three, which the search compares.
`--zero-sharding` says how the state is split (`Assumptions.zero_sharding`): "per-parameter"
(default: what train.py does, whole parameters per owner, trainer/distributed/zero.py) or "flat" (even
shards, as Megatron's distributed optimizer, DeepSpeed or FSDP2 would).
`--redundant R` gives every EP rank R redundant expert slots per MoE layer (the trainer's
`--balance.redundant`; default 0). It is fixed, not searched: whether replicas pay depends on
the routing load, which the planner cannot see. The estimate counts the slots' weights,
gradients and optimizer state and their replica gradient sum; only EP degrees that can
host R are searched; the report prints the memory they take and the plan file carries
`[run.balance] redundant = R`.

`--measure K` runs the best K plans as short real torchrun jobs on this machine (CPU
processes, gloo), stores each measurement beside its prediction in the study (user attribute
`measured/<i>`), prints both, re-ranks by measured step time and writes the plan file of the
measured best. It needs a platform measured here (`--platform local`) and at most 4 GPUs.
`--precision-policy` (plan and estimate; default "trainer") prices the training state and
collectives as train.py holds and sends them on the platform's backend: on gloo (CPU) fp32
state and activations, with the activations our eager model really saves
(`Assumptions(activation_set="trainer")`) and 4 memory passes over them for the unfused
elementwise work (`activation_traffic_passes`); on GPUs fp32 state under bf16 autocast.
"published" is the paper's 16 B per parameter, "megatron" Megatron-Core's distributed
optimizer. The plan file is the fastest layout train.py runs; a faster one it cannot run yet
(e.g. a dedup all-to-all or ZeRO-3, when searched) is printed as "best overall".

`estimate` prices one layout without searching (`tuner.single`). Degrees fold as Megatron-Core
does (`tuner.layout.fold_degrees`): gpus = pp x tp x cp x dp = pp x etp x ep x edp, the EP
groups formed from the DP x TP x CP ranks of a stage, so ep x etp must divide tp x cp x dp;
dp and edp are derived, M = global batch / (dp x mbs). `--precision-policy` says what the
training state and collectives cost per element: "trainer" (default: what train.py holds and
sends on that platform), "published" (the paper's 16 B per parameter) or "megatron"
(Megatron-Core's bf16 parameters, fp32 main gradients and distributed optimizer). `--json`
prints one JSON object as the last stdout line (`tuner.single.summary`). A layout train.py
cannot run yet is priced and reported with `runnable: false` and what is missing.

User mistakes (unknown model or platform, a GPU count the mesh cannot use, a model that does
not fit) print one `error:` line saying what would work and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from tuner.search import Candidate

__all__ = ["main", "parser", "reproduce_path"]

_ROOT = Path(__file__).resolve().parents[1]  # the checkout: tracked records and runs/


def _hf_model_path(model: str) -> str:
    """The absolute folder of a Hugging Face checkpoint when --model names one (a folder with a
    config.json, or the config.json itself), else "" (a preset name)."""
    p = Path(model)
    if p.name == "config.json" and p.is_file():
        p = p.parent
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"--model {model!r} is a folder without config.json; pass a preset "
                             f"name or a Hugging Face checkpoint folder")
        return str(p.resolve())
    return ""


def _zero_levels(text: str) -> tuple[int, ...]:
    """`--zero 0,1,2` -> (0, 1, 2); anything else is refused naming the bad value."""
    from tuner.layout import ZERO_LEVELS, check_zero_levels

    levels = []
    for part in text.split(","):
        try:
            levels.append(int(part.strip()))
        except ValueError:
            raise ValueError(f"--zero {text!r}: {part.strip()!r} is not a ZeRO level; valid: "
                             f"{', '.join(map(str, ZERO_LEVELS))}, comma-separated (e.g. --zero "
                             f"0,1,2)") from None
    return check_zero_levels(levels, what="--zero")


def _overlap_modes(text: str) -> tuple[str, ...]:
    """`--a2a-overlap none,layer,fb` -> ("none", "layer", "fb"); an unknown mode is refused
    naming it and the valid ones (`tuner.space.check_overlap_modes`)."""
    from tuner.space import check_overlap_modes

    return check_overlap_modes([m.strip() for m in text.split(",")], what="--a2a-overlap")


def _plan(args: argparse.Namespace) -> int:
    from model import presets
    from tuner.planner import PlanRequest, run_plan
    from tuner.platform import load_platform
    from tuner.report import format_table, overlap_summary, redundant_summary, zero_summary

    zero = _zero_levels(args.zero)
    overlap = _overlap_modes(args.a2a_overlap)
    if args.redundant < 0:
        raise ValueError(f"--redundant {args.redundant}: redundant expert slots per EP rank must "
                         f"be >= 0 (0 = one slot per expert)")
    hf_path = _hf_model_path(args.model)
    if hf_path:
        from model import ModelConfig

        if args.measure:
            raise ValueError("--measure runs presets only; plan a Hugging Face checkpoint "
                             "without it and launch the plan file")
        cfg = ModelConfig.from_hf_config(hf_path)
        args.model = hf_path
    else:
        cfg = presets.get(args.model)
    platform = load_platform(args.platform)
    if args.measure:
        _check_measurable(args, cfg, platform)
    storage = None
    if args.storage:
        storage = args.storage if "://" in args.storage else f"sqlite:///{Path(args.storage).resolve()}"
    req = PlanRequest(args.model, args.platform, args.gpus, args.seq, args.global_batch,
                      args.trials, args.seed, storage, zero, args.redundant, overlap,
                      args.search)
    from tuner.counts import trainer_act_supported
    from tuner.layout import CPU_TRAFFIC_PASSES, Assumptions, precision_policy

    cpu = platform.backend == "gloo"
    trainer_set = cpu and trainer_act_supported(cfg)
    out = run_plan(cfg, platform, req, Path(args.out),
                   precision=precision_policy(args.precision_policy, platform.backend,
                                              args.param_dtype, args.reduce_dtype),
                   assumptions=Assumptions(alltoall_model=args.alltoall_model,
                                           activation_set="trainer" if trainer_set else "published",
                                           activation_traffic_passes=CPU_TRAFFIC_PASSES if cpu else 0.0,
                                           zero_sharding=args.zero_sharding))
    r = out.result
    print(f"{cfg.name} on {args.gpus} x {platform.name}, seq {args.seq}, global batch "
          f"{args.global_batch}: {r.trials} trials, {r.memory_checks} memory checks, "
          f"{r.evaluations} step-time evaluations, rejected {r.rejected} "
          f"(search space {out.space.size} points)")
    print(f"times are seconds per step on the busiest rank; usable HBM "
          f"{platform.usable_hbm / 1e9:.1f} GB per GPU\n")
    print(format_table(r.ranked, args.top))
    if r.best is not r.best_runnable and r.best is not None and r.best.estimate is not None:
        o = r.best.estimate
        print(f"\nbest overall (not runnable: {'; '.join(r.best.not_runnable)}): "
              f"{o.step_time:.3g} s per step, MFU {100 * o.mfu:.1f} %; the plan file holds "
              f"the best layout train.py runs")
    assert r.best_runnable is not None and r.best_runnable.estimate is not None  # run_plan's
    best = r.best_runnable.estimate
    print(f"\nbest: MFU {100 * best.mfu:.1f} %, {best.tflops_per_gpu:.1f} TFLOPS/GPU, "
          f"{best.tokens_per_s:,.0f} tokens/s, peak memory {best.peak_memory / 1e9:.1f} GB")
    print(f"  {zero_summary(best)}")
    print(f"  {overlap_summary(best)}")
    if best.plan.redundant:
        print(f"  {redundant_summary(best)}")
    for s in (best.stages[:1] + best.stages[-1:])[:len(best.stages)]:  # first and last stage
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(s.state_by_part.items()))
        acts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(s.act_by_part.items()))
        print(f"  stage {s.rank} (layers {s.layers[0]}-{s.layers[-1]}): state GB [{parts}]; "
              f"activations GB [{acts}]; buffers {s.buffers / 1e9:.2f} GB")
    for n in best.notes:
        print(f"  assumption: {n}")
    if args.measure:
        _measure_top(args, cfg, platform, out)
    print(f"\nplan file: {out.plan_path}\nplot: {out.plot_path}")
    if out.sbatch_path:
        print(f"sbatch script: {out.sbatch_path}")
    print("launch:")
    for line in out.launch or []:
        print(f"  {line}")
    return 0


def _check_measurable(args: argparse.Namespace, cfg, platform) -> None:  # noqa: ANN001
    """Refuse `--measure` before any search when its plans could not run here."""
    from tuner.launch import MAX_LOCAL_PROCS

    if args.measure < 1:
        raise ValueError(f"--measure {args.measure}: must be >= 1 (plans to run for real)")
    if platform.backend != "gloo":
        raise ValueError(
            f"--measure runs the plans as CPU processes on this machine, but platform "
            f"{platform.name!r} describes {platform.backend} GPUs: plan for --platform local "
            f"(written by `python -m tuner measure`) to compare predictions with runs here")
    if args.gpus > MAX_LOCAL_PROCS:
        raise ValueError(f"--measure with --gpus {args.gpus}: this machine runs at most "
                         f"{MAX_LOCAL_PROCS} training processes; use --gpus 2 or 4")


def _measure_top(args: argparse.Namespace, cfg, platform, out) -> None:  # noqa: ANN001
    from tuner.launch import measure_top
    from tuner.report import plan_toml

    r = out.result
    got = measure_top([c for c in r.ranked if c.runnable], args.model, args.measure, Path(args.out) / "measured",
                      steps=args.measure_steps, study=r.study)
    print(f"\nmeasured on this machine ({args.measure_steps} steps each, median after warm-up), "
          f"best measured first:")
    print(f"{'#':>2} {'pred #':>6} {'pp':>2} {'ep':>2} {'dp':>2} {'M':>2} {'z':>1} {'schedule':>18} "
          f"{'step pred s':>11} {'measured s':>10} {'error':>7} {'mem pred MB':>11} {'measured MB':>11}")
    for i, (cand, m) in enumerate(got):
        c = cast("Candidate", cand)
        assert c.estimate is not None  # measure_top runs evaluated candidates only
        e, p = c.estimate, c.estimate.plan
        sched = p.schedule + (f":{p.n_virtual}" if p.n_virtual > 1 else "")
        mem = max(s.state for s in e.stages) + max(s.activations for s in e.stages)
        print(f"{i + 1:>2} {r.ranked.index(c) + 1:>6} {p.pp:>2} {p.ep:>2} {p.dp:>2} {p.microbatches:>2} "
              f"{p.zero:>1} "
              f"{sched:>18} {e.step_time:>11.3f} {m.step_time_s:>10.3f} "
              f"{100 * (e.step_time / m.step_time_s - 1):>+6.1f}% {mem / 1e6:>11.1f} "
              f"{m.memory_bytes / 1e6:>11.1f}")
    best, m = cast("Candidate", got[0][0]), got[0][1]
    assert best.estimate is not None
    request = {"model": cfg.name, "platform": platform.name, "gpus": args.gpus,
               "seq_len": args.seq, "global_batch": args.global_batch, "trials": r.trials,
               "measured_step_time_s": round(m.step_time_s, 4),
               "measured_peak_memory_gb": round(m.memory_bytes / 1e9, 4)}
    out.plan_path.write_text(plan_toml(best.estimate, cfg.name, request))
    print("plan file re-written for the measured best")


def _estimate(args: argparse.Namespace) -> int:
    import json

    from model import ModelConfig, presets
    from tuner.counts import trainer_act_supported
    from tuner.layout import CPU_TRAFFIC_PASSES, Assumptions, precision_policy
    from tuner.platform import load_platform
    from tuner.single import EstimateRequest, format_report, plan_of, summary

    if not 0.0 <= args.host_floor_ms < float("inf"):
        raise ValueError(f"--host-floor-ms {args.host_floor_ms} must be a number of "
                         f"milliseconds >= 0 (0: not priced)")
    req = EstimateRequest(
        gpus=args.gpus, seq=args.seq, global_batch=args.global_batch, mbs=args.mbs, pp=args.pp,
        tp=args.tp, cp=args.cp, ep=args.ep, etp=args.etp, vpp=args.vpp, zero=args.zero,
        recompute=args.recompute, dispatch=args.dispatch, a2a_overlap=args.a2a_overlap,
        precision=args.precision, schedule=args.schedule, ep_placement=args.ep_placement,
        redundant=args.redundant)
    plan = plan_of(req)  # every degree and choice checked before the model is read
    hf_path = _hf_model_path(args.model)
    cfg = ModelConfig.from_hf_config(hf_path) if hf_path else presets.get(args.model)
    platform = load_platform(args.platform)
    cpu = platform.backend == "gloo"
    trainer_set = cpu and trainer_act_supported(cfg)
    asm = Assumptions(alltoall_model=args.alltoall_model,
                      activation_set="trainer" if trainer_set else "published",
                      activation_traffic_passes=CPU_TRAFFIC_PASSES if cpu else 0.0,
                      zero_sharding=args.zero_sharding, fp8_peak_factor=args.fp8_peak_factor,
                      fp8_cast_bytes=args.fp8_cast_bytes, zero3_gather=args.zero3_gather, zero3_runs=args.zero3_runs,
                      host_floor=args.host_floor_ms / 1e3,
                      host_floor_scope=args.host_floor_scope, fb_pairing=args.fb_pairing,
                      mtp_layers=args.mtp_layers)
    from tuner.estimate import estimate

    e = estimate(cfg, plan, platform, precision_policy(args.precision_policy, platform.backend,
                                                       args.param_dtype, args.reduce_dtype),
                 asm)
    s = summary(cfg, platform, e, args.precision_policy)
    if args.zero3_gather == "step" and plan.zero == 3:
        # an assumption about someone else's FSDP (published runs), not train.py's ZeRO-3
        s["runnable"] = False
        s["not_runnable_because"] = [*s["not_runnable_because"],
                                     "ZeRO-3 gathered once per schedule run (--zero3-gather "
                                     "step, FSDP2 under torch.distributed.pipelining) is not "
                                     "train.py's ZeRO-3, which gathers every micro-batch"]
    if args.json:
        print(json.dumps(s))
    else:
        print(format_report(s))
    return 0


def reproduce_path(args: argparse.Namespace) -> Path:
    """Where `reproduce-paper` writes, by the benchmarks' convention (benchmarks/_common.py):
    `--out`, the tracked benchmarks/results/reproduce_paper.md with `--record`, else
    runs/bench/reproduce_paper/reproduce_paper.md (ignored by git)."""
    if args.record:
        return _ROOT / "benchmarks" / "results" / "reproduce_paper.md"
    if args.out:
        return Path(args.out)
    return _ROOT / "runs" / "bench" / "reproduce_paper" / "reproduce_paper.md"


def _reproduce(args: argparse.Namespace) -> int:
    from tuner.paper import reproduce_paper

    path = reproduce_path(args)
    text = reproduce_paper(trials=args.trials, seed=args.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    print(f"written to {path}")
    return 0


def _measure(args: argparse.Namespace) -> int:
    from tuner.measure import measure_platform

    if args.emulator:  # the emulated cluster: compute measured here, the link its parameters
        from tuner.measure import parse_emulator_shape, write_emulator_platform
        from tuner.platform import load_platform

        nodes, gpus, mbit = parse_emulator_shape(args.emulator)
        base = Path(args.base) if args.base else measure_platform(
            Path(args.out).with_suffix(".base.toml"), n_procs=nodes * gpus, quick=args.quick)
        path = write_emulator_platform(load_platform(base), Path(args.out), nodes, gpus, mbit,
                                       args.latency_ms, args.mtu)
        print(path.read_text())
        print(f"written to {path}")
        return 0
    path = measure_platform(Path(args.out), n_procs=args.procs, quick=args.quick)
    print(path.read_text())
    print(f"written to {path}")
    return 0


def parser() -> argparse.ArgumentParser:
    """The `python -m tuner` argument parser (every subcommand)."""
    from tuner.layout import PRECISION_POLICIES

    ap = argparse.ArgumentParser(prog="python -m tuner", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="rank layouts for a model on a platform; write a plan file")
    p.add_argument("--model", required=True,
                   help="preset name (e.g. deepseek-v3) or a Hugging Face checkpoint folder "
                        "(its config.json); the plan file then starts from that checkpoint")
    p.add_argument("--platform", required=True, help="configs/platforms/<name>.toml or a path")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--trials", type=int, default=300)
    p.add_argument("--search", default="auto",
                   help="auto (default): exhaustive with the closed-form all-to-all model, tpe "
                        "with netsim; exhaustive: every point of the space by branch and "
                        "bound, the model's optimum (DeepSeek-V3 on 1024 GPUs with ZeRO 0-3: "
                        "~1 minute); tpe: the seeded Optuna study of --trials trials (seconds; "
                        "can end off the optimum)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", default="", help="SQLite file (or an Optuna URL): resumes")
    p.add_argument("--out", default="runs/plans", help="folder for plan, sbatch script, plot")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--alltoall-model", default="closed-form", choices=("closed-form", "netsim"),
                   help="all-to-all cost: closed form, or comm.netsim's flow simulation")
    p.add_argument("--zero", default="0,1,2,3",
                   help="ZeRO levels to search, comma-separated: 0 replicated state, 1 sharded "
                        "optimizer state, 2 also sharded gradients, 3 also sharded parameters "
                        "(default all)")
    p.add_argument("--zero-sharding", default="per-parameter", choices=("per-parameter", "flat"),
                   help="ZeRO's split: whole parameters per owner (train.py's) or even flat shards")
    p.add_argument("--a2a-overlap", default="none,layer,fb",
                   help="all-to-all overlap modes to search, comma-separated: none, layer "
                        "(2 chunks inside the MoE layer), fb (across micro-batches, 2 chunks); "
                        "default none,layer,fb")
    p.add_argument("--precision-policy", default="trainer", choices=PRECISION_POLICIES,
                   help="bytes of training state and collectives: what train.py holds "
                        "(default), the paper's 16 B/param, or Megatron-Core's")
    _dtype_args(p)
    p.add_argument("--redundant", type=int, default=0, metavar="R",
                   help="redundant expert slots per EP rank and MoE layer (the trainer's "
                        "--balance.redundant; fixed, not searched; default 0)")
    p.add_argument("--measure", type=int, default=0,
                   help="run the top K plans for real on this machine and re-rank by measured time")
    p.add_argument("--measure-steps", type=int, default=8, help="training steps per measured run")
    p.set_defaults(func=_plan)
    _estimate_parser(sub)
    r = sub.add_parser("reproduce-paper", help="published Table IV and results beside ours")
    w = r.add_mutually_exclusive_group()
    w.add_argument("--out", default=None,
                   help="file to write (default runs/bench/reproduce_paper/reproduce_paper.md, "
                        "ignored by git)")
    w.add_argument("--record", action="store_true",
                   help="write the tracked benchmarks/results/reproduce_paper.md instead")
    r.add_argument("--trials", type=int, default=300)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_reproduce)
    m = sub.add_parser("measure", help="micro-benchmark this machine into a platform file")
    m.add_argument("--out", default="configs/platforms/local.toml")
    m.add_argument("--procs", type=int, default=4,
                   help="training processes the platform describes (the default CPU job, "
                        "configs/tiny.toml, runs 4); compute is measured in all of them at once")
    m.add_argument("--quick", action="store_true", help="fewer shapes and repeats (tests)")
    m.add_argument("--emulator", default="", metavar="NxG@MBIT",
                   help="describe `comm.emulate --nodes N --gpus-per-node G --nic-mbit MBIT` "
                        "(tuner.measure.emulator_platform): compute measured with N x G "
                        "processes (or taken from --base), the inter-node link from the "
                        "emulator's parameters")
    m.add_argument("--base", default="", help="--emulator: a platform measured here with N x G "
                                              "processes (skips the measurement)")
    m.add_argument("--latency-ms", type=float, default=None, help="--emulator: its --latency-ms")
    m.add_argument("--mtu", type=int, default=1500, help="--emulator: its --mtu")
    m.set_defaults(func=_measure)
    return ap


def _dtype_args(p: argparse.ArgumentParser) -> None:
    from tuner.layout import PARAM_DTYPES, REDUCE_DTYPES

    p.add_argument("--param-dtype", default="auto", choices=PARAM_DTYPES,
                   help="train.py's --train.param_dtype the 'trainer' policy prices: auto (bf16 "
                        "weights + fp32 masters on GPUs, fp32 on CPU), bf16, fp32")
    p.add_argument("--reduce-dtype", default="fp32", choices=REDUCE_DTYPES,
                   help="train.py's --train.reduce_dtype: gradients on the wire (default fp32)")


def _estimate_parser(sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    from trainer.layout import RECOMPUTE_MODES
    from tuner.layout import (
        A2A_OVERLAP,
        ALLTOALL_ALGORITHMS,
        EP_PLACEMENTS,
        FB_PAIRINGS,
        HOST_FLOOR_SCOPES,
        PRECISION_POLICIES,
        PRECISIONS,
        SCHEDULES,
        ZERO3_GATHER,
        ZERO_LEVELS,
    )

    e = sub.add_parser(
        "estimate", help="price one layout (no search): step time, memory, MFU, runnable",
        description="Price one layout. Parallel folding: gpus = pp x tp x cp x dp = pp x etp "
                    "x ep x edp (EP groups formed from the DP x TP x CP ranks of a stage; ep x "
                    "etp must divide tp x cp x dp); dp and edp are derived.")
    e.add_argument("--model", required=True, help="preset name or Hugging Face checkpoint folder")
    e.add_argument("--platform", required=True, help="configs/platforms/<name>.toml or a path")
    e.add_argument("--gpus", type=int, required=True)
    e.add_argument("--seq", type=int, default=4096)
    e.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    e.add_argument("--mbs", type=int, default=1,
                   help="sequences per micro-batch per data-parallel rank (M = B / (dp x mbs))")
    for name, what in (("pp", "pipeline ranks"), ("vpp", "virtual stages per pipeline rank"),
                       ("tp", "tensor parallel (with sequence parallel)"),
                       ("cp", "context parallel"), ("ep", "expert parallel"),
                       ("etp", "expert tensor parallel")):
        e.add_argument(f"--{name}", type=int, default=1, help=f"{what} (default 1)")
    e.add_argument("--zero", type=int, default=0, choices=ZERO_LEVELS,
                   help="0 replicated state, 1 optimizer state sharded, 2 + gradients, "
                        "3 + parameters (gathered per layer)")
    e.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES,
                   help="activation recompute: the trainer's checkpointing modes (none, "
                        "selective, full), or moe (Megatron-Core's whole-MoE-layer module; "
                        "priced, not runnable)")
    e.add_argument("--dispatch", default="flat", choices=ALLTOALL_ALGORITHMS,
                   help="MoE all-to-all: flat, halo, dedup (one copy per remote node), auto")
    e.add_argument("--a2a-overlap", default="none", choices=A2A_OVERLAP,
                   help="all-to-all hidden behind compute: none, inside the MoE layer, across "
                        "micro-batches, or auto (what train.py's --comm.a2a_overlap=auto runs "
                        "on this layout: trainer.layout.auto_overlap)")
    e.add_argument("--precision", default="bf16", choices=PRECISIONS, help="GEMM precision")
    e.add_argument("--precision-policy", default="trainer", choices=PRECISION_POLICIES,
                   help="bytes of training state and collectives: what train.py holds "
                        "(default), the paper's 16 B/param, or Megatron-Core's")
    _dtype_args(e)
    e.add_argument("--schedule", default="", choices=("",) + tuple(SCHEDULES),
                   help="pipeline schedule (default 1f1b, interleaved-1f1b with --vpp > 1)")
    e.add_argument("--ep-placement", default="local", choices=EP_PLACEMENTS)
    e.add_argument("--redundant", type=int, default=0, metavar="R",
                   help="redundant expert slots per EP rank and MoE layer")
    e.add_argument("--zero-sharding", default="per-parameter", choices=("per-parameter", "flat"),
                   help="ZeRO-1/2 split: whole parameters per owner (train.py's) or flat shards")
    e.add_argument("--alltoall-model", default="closed-form", choices=("closed-form", "netsim"))
    e.add_argument("--fp8-peak-factor", type=float, default=None,
                   help="FP8 / bf16 GEMM peak for a platform file without an FP8 rate")
    e.add_argument("--fp8-cast-bytes", type=float, default=4.0, metavar="B",
                   help="HBM bytes per element cast to FP8 (each GEMM's input and output "
                        "gradient: bf16 read + row- and column-wise FP8 writes = 4); 0: casts "
                        "fused away (Assumptions.fp8_cast_bytes)")
    e.add_argument("--zero3-gather", default="microbatch", choices=ZERO3_GATHER,
                   help="ZeRO-3 gathers and reduce-scatters every micro-batch (train.py's) or "
                        "once per step per pipeline stage (FSDP2 under "
                        "torch.distributed.pipelining; Assumptions.zero3_gather)")
    e.add_argument("--zero3-runs", type=int, default=1, metavar="N",
                   help="with --zero3-gather step: pipeline-schedule runs per optimizer step "
                        "(gradient accumulation over runs), each gathering and "
                        "reduce-scattering once (default 1)")
    e.add_argument("--host-floor-ms", type=float, default=0.0, metavar="MS",
                   help="the least time of one MoE layer's forward + backward per micro-batch: "
                        "the host's launch time in a host-bound eager framework (dropless MoE "
                        "syncs the host every dispatch); 0 (default): not priced "
                        "(Assumptions.host_floor)")
    e.add_argument("--host-floor-scope", default="layer", choices=HOST_FLOOR_SCOPES,
                   help="what --host-floor-ms bounds: the layer's forward + backward (layer) or "
                        "each pass that syncs the host, the forward and a recomputed forward, "
                        "the backward at its device time (forward; Assumptions.host_floor_scope)")
    e.add_argument("--fb-pairing", default="trainer", choices=FB_PAIRINGS,
                   help="activations held by --a2a-overlap fb's paired micro-batches: whole "
                        "micro-batches as train.py pairs them (trainer, default), or the plain "
                        "schedule's plus one layer, as Megatron-Core's combined 1F1B "
                        "interleaves the pair layer by layer (layer; Assumptions.fb_pairing)")
    e.add_argument("--mtp-layers", type=int, default=0, metavar="N",
                   help="multi-token-prediction modules to price on the last stage (time "
                        "only; DeepSeek-V3 runs train 1; train.py builds none: default 0; "
                        "Assumptions.mtp_layers)")
    e.add_argument("--json", action="store_true",
                   help="print one JSON object as the last line (tuner.single.summary)")
    e.set_defaults(func=_estimate)


def main(argv: list[str] | None = None) -> int:
    from tuner.launch import LaunchError

    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except LaunchError as e:
        print(f"error: a measured run failed: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
