"""Command line of the tuner: `python -m tuner plan | reproduce-paper | measure`.

    python -m tuner plan --model deepseek-v3 --platform frontier --gpus 1024 --seq 4096 \\
        --global-batch 4096 [--trials 300] [--seed 0] [--storage study.db] [--out runs/plans]
        [--alltoall-model closed-form|netsim]
    python -m tuner reproduce-paper [--out benchmarks/results/reproduce_paper.md]
    python -m tuner measure [--out configs/platforms/local.toml]

User mistakes (unknown model or platform, a GPU count the mesh cannot use, a model that does
not fit) print one `error:` line saying what would work and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def _plan(args: argparse.Namespace) -> int:
    from model import presets
    from tuner.planner import PlanRequest, run_plan
    from tuner.platform import load_platform
    from tuner.report import format_table

    if args.measure:
        raise ValueError(
            f"--measure {args.measure}: launching the top plans as real runs is not implemented "
            "yet; run a plan file with train.py --plan FILE and compare by hand"
        )
    cfg = presets.get(args.model)
    platform = load_platform(args.platform)
    storage = None
    if args.storage:
        storage = args.storage if "://" in args.storage else f"sqlite:///{Path(args.storage).resolve()}"
    req = PlanRequest(args.model, args.platform, args.gpus, args.seq, args.global_batch,
                      args.trials, args.seed, storage)
    from tuner.layout import Assumptions

    out = run_plan(cfg, platform, req, Path(args.out),
                   assumptions=Assumptions(alltoall_model=args.alltoall_model))
    r = out.result
    print(f"{cfg.name} on {args.gpus} x {platform.name}, seq {args.seq}, global batch "
          f"{args.global_batch}: {r.trials} trials, {r.memory_checks} memory checks, "
          f"{r.evaluations} step-time evaluations, rejected {r.rejected} "
          f"(search space {out.space.size} points)")
    print(f"times are seconds per step on the busiest rank; usable HBM "
          f"{platform.usable_hbm / 1e9:.1f} GB per GPU\n")
    print(format_table(r.ranked, args.top))
    best = r.best.estimate
    print(f"\nbest: MFU {100 * best.mfu:.1f} %, {best.tflops_per_gpu:.1f} TFLOPS/GPU, "
          f"{best.tokens_per_s:,.0f} tokens/s, peak memory {best.peak_memory / 1e9:.1f} GB")
    for s in best.stages[:1] + best.stages[-1:]:
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(s.state_by_part.items()))
        acts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(s.act_by_part.items()))
        print(f"  stage {s.rank} (layers {s.layers[0]}-{s.layers[-1]}): state GB [{parts}]; "
              f"activations GB [{acts}]; buffers {s.buffers / 1e9:.2f} GB")
    for n in best.notes:
        print(f"  assumption: {n}")
    print(f"\nplan file: {out.plan_path}\nplot: {out.plot_path}")
    if out.sbatch_path:
        print(f"sbatch script: {out.sbatch_path}")
    print("launch:")
    for line in out.launch or []:
        print(f"  {line}")
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    from tuner.paper import reproduce_paper

    text = reproduce_paper(trials=args.trials, seed=args.seed)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    print(f"written to {path}")
    return 0


def _measure(args: argparse.Namespace) -> int:
    from tuner.measure import measure_platform

    path = measure_platform(Path(args.out), n_procs=args.procs, quick=args.quick)
    print(path.read_text())
    print(f"written to {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tuner", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="rank layouts for a model on a platform; write a plan file")
    p.add_argument("--model", required=True, help="preset name, e.g. deepseek-v3")
    p.add_argument("--platform", required=True, help="configs/platforms/<name>.toml or a path")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--trials", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage", default="", help="SQLite file (or an Optuna URL): resumes")
    p.add_argument("--out", default="runs/plans", help="folder for plan, sbatch script, plot")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--alltoall-model", default="closed-form", choices=("closed-form", "netsim"),
                   help="all-to-all cost: closed form, or comm.netsim's flow simulation")
    p.add_argument("--measure", type=int, default=0, help="(not yet) run the top K for real")
    p.set_defaults(func=_plan)
    r = sub.add_parser("reproduce-paper", help="published Table IV and results beside ours")
    r.add_argument("--out", default="benchmarks/results/reproduce_paper.md")
    r.add_argument("--trials", type=int, default=300)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=_reproduce)
    m = sub.add_parser("measure", help="micro-benchmark this machine into a platform file")
    m.add_argument("--out", default="configs/platforms/local.toml")
    m.add_argument("--procs", type=int, default=2, help="processes for the gloo collectives")
    m.add_argument("--quick", action="store_true", help="fewer shapes and repeats (tests)")
    m.set_defaults(func=_measure)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
