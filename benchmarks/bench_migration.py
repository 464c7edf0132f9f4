"""Expert migration and replication on a skewed CPU training run (EP=4): do they cut the wait?

Four runs of the same job on 4 processes (EP=4, tiny preset: 8 experts, 2 per rank), with the
router skewed by a fixed selection bias (`--debug.skew`, hot experts 0 and 1 both on EP rank 0
at the start) and no aux loss:
  static       r=0, no migration
  migrate      r=0, balance.enabled: swaps (threshold/window/cooldown below)
  r1-static    --balance.redundant=1 (3 slots per rank), balance disabled: only the initial
               replicas (trainer/distributed/replicas.initial_slot_map: rank q's spare slot holds expert
               2(q+1) mod 8, so experts 2, 4, 6 and 0 have two replicas)
  r1-replace   --balance.redundant=1 and balance.enabled: replicas re-placed by
               balance.plan_replicas (same threshold/window/cooldown, <= 2*max_swaps slot
               changes per event)
Per step the trainer records the time every EP rank spends inside the forward MoE exchanges
(dispatch + combine all-to-alls), max and min over the EP group: `ep_exchange_max_s`,
`ep_exchange_min_s`. The least-loaded rank finishes its experts first and then waits in the
combine for the most-loaded one, so `ep_exchange_max_s` is (about) the least-loaded rank's time
there: the transfer plus its wait. The most-loaded rank waits for nobody, so
`ep_exchange_max_s - ep_exchange_min_s` (the spread) is the wait the imbalance causes, the
transfer taken out.
Reported per run: medians over the same steps in every run (from two steps after the last
first-migration among the migrating runs), ratios against `static` from the same invocation,
and slot changes: experts (slots) whose weights + AdamW state moved, summed over the run's
migration events (a swap changes 2 slots).

    python benchmarks/bench_migration.py [--steps 40] [--skew 0.05] [--runs static,migrate,...]

One row is appended to bench_migration.jsonl in runs/bench/migration/ (ignored by git) or
`--out DIR`; `--record` appends it to benchmarks/results/, the tracked record. The training
runs themselves go to --work-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import add_output_args, output_dir, print_written

ROOT = Path(__file__).resolve().parents[1]


# name: (redundant slots per rank, balance.enabled)
RUNS = {"static": (0, False), "migrate": (0, True), "r1-static": (1, False),
        "r1-replace": (1, True)}


def _run(out: Path, steps: int, skew: float, redundant: int, migrate: bool) -> list[dict]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "train.py", "--config", "configs/tiny-ep-dp.toml", f"--train.out_dir={out}",
            f"--train.steps={steps}", "--train.eval_every=0", "--train.eval_batches=1",
            "--train.plot=false", "--parallel.ep=4", "--model.aux_loss_coef=0",
            "--model.moe_ffn_dim=1024", f"--debug.skew={skew}", "--comm.alltoall=flat",
            f"--balance.redundant={redundant}"]
    if migrate:
        args += ["--balance.enabled=true", "--balance.threshold=1.1", "--balance.window=4",
                 "--balance.cooldown=10"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"run failed:\n{r.stderr[-4000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skew", type=float, default=0.05)
    ap.add_argument("--runs", default=",".join(RUNS),
                    help=f"comma-separated subset of {', '.join(RUNS)} (static is the baseline)")
    ap.add_argument("--work-dir", default="/tmp/piper-bench-migration",
                    help="where the training runs write, one folder per run")
    add_output_args(ap, "migration")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in RUNS]
    if bad or "static" not in names:
        sys.exit(f"--runs={args.runs!r}: unknown {bad}; valid: {', '.join(RUNS)}, "
                 "and static (the baseline) must be among them")
    base = Path(args.work_dir)
    runs = {}
    for name in names:
        t0 = time.perf_counter()
        runs[name] = _run(base / name, args.steps, args.skew, *RUNS[name])
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    events = {n: [r for r in rows if r.get("event") == "migration"] for n, rows in runs.items()}
    firsts = [min((e["step"] for e in ev), default=args.steps) for n, ev in events.items()
              if RUNS[n][1]]
    first = max(firsts, default=0)  # no migrating run: every step from step 2 is measured
    lo = first + 2  # skip the migration step and the one after, in every run
    table = []
    for name, rows in runs.items():
        steps = [r for r in rows if "loss" in r and r["step"] >= lo]
        if not steps:
            sys.exit(f"{name}: no step after step {lo - 1} (the first migrations end at step "
                     f"{first}) to measure; raise --steps={args.steps}")
        early = [r for r in rows if "loss" in r and 2 <= r["step"] <= first]
        ev = events[name]
        table.append({
            "run": name, "redundant": RUNS[name][0], "balance": RUNS[name][1],
            "imbalance_before": statistics.median(r["imbalance"] for r in early) if early else None,
            "imbalance_after": statistics.median(r["imbalance"] for r in steps),
            "wait_s_after": statistics.median(r["ep_exchange_max_s"] for r in steps),
            "spread_s_after": statistics.median(r["ep_exchange_max_s"] - r["ep_exchange_min_s"]
                                                for r in steps),
            "step_s_after": statistics.median(r["step_time_s"] for r in steps),
            "steps_measured": len(steps),
            "events": len(ev),
            "first_event": min((e["step"] for e in ev), default=None),
            "slot_changes": int(sum(e["moved_experts"] for e in ev)),
        })
    ref = table[0] if table[0]["run"] == "static" else next(t for t in table
                                                            if t["run"] == "static")
    for t in table:
        for k in ("wait_s_after", "spread_s_after", "step_s_after"):
            t[k.replace("_after", "_ratio")] = t[k] / ref[k] if ref[k] > 0 else None
    print(f"\nEP=4, skew {args.skew}, {args.steps} steps; medians over steps {lo}..{args.steps} "
          f"(first migrations: " + ", ".join(
              f"{t['run']} step {t['first_event']} ({t['events']} events)"
              for t in table if t["balance"]) + ")")
    print(f"{'run':<11} {'imb. before':>11} {'imb. after':>10} {'wait (s)':>9} {'spread (s)':>10} "
          f"{'step (s)':>9} {'slot chg':>8} {'wait x':>7} {'spread x':>8} {'step x':>7}")
    for r in table:
        print(f"{r['run']:<11} {_fmt(r['imbalance_before'], '.2f'):>11} "
              f"{r['imbalance_after']:>10.2f} {r['wait_s_after']:>9.3f} "
              f"{r['spread_s_after']:>10.3f} {r['step_s_after']:>9.3f} {r['slot_changes']:>8} "
              f"{_fmt(r['wait_s_ratio'], '.2f'):>7} {_fmt(r['spread_s_ratio'], '.2f'):>8} "
              f"{_fmt(r['step_s_ratio'], '.2f'):>7}")
    res = output_dir(args) / "bench_migration.jsonl"
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    mig = next((t for t in table if t["run"] == "migrate"), None)
    with open(res, "a") as f:
        f.write(json.dumps({
            "sha": sha, "device": "cpu", "steps": args.steps, "skew": args.skew,
            "first_migration": first, "events": sum(len(v) for v in events.values()),
            "table": table,
            # the two-run fields of earlier rows: migrate / static
            "wait_ratio": mig["wait_s_ratio"] if mig else None,
            "step_ratio": mig["step_s_ratio"] if mig else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_avg_1m": os.getloadavg()[0]}) + "\n")
    print_written(res)


if __name__ == "__main__":
    main()
