"""Expert migration on a skewed CPU training run (EP=4): does it cut the time ranks wait?

Two runs of the same job on 4 processes (EP=4), with the router skewed by a fixed selection bias
(`--balance.skew`, hot experts all on EP rank 0 at the start) and no aux loss:
  static    no migration
  migrate   balance.enabled, threshold/window/cooldown below
Per step the trainer records `ep_exchange_max_s`: the longest time any EP rank spent inside the
forward MoE exchanges. The least-loaded rank finishes its experts first and then waits there for
the most-loaded one, so this is the waiting the imbalance causes (plus the transfer itself).
Reported: medians over the steps after the first migration (same steps in both runs), and the
ratio migrate / static, measured in the same invocation.

    python benchmarks/bench_migration.py [--steps 40] [--skew 0.05] [--out DIR]
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _run(out: Path, steps: int, skew: float, migrate: bool) -> list[dict]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "train.py", "--config", "configs/tiny-ep-dp.toml", f"--train.out_dir={out}",
            f"--train.steps={steps}", "--train.eval_every=0", "--train.eval_batches=1",
            "--train.plot=false", "--parallel.ep=4", "--model.aux_loss_coef=0",
            "--model.moe_ffn_dim=1024", f"--balance.skew={skew}", "--comm.alltoall=flat"]
    if migrate:
        args += ["--balance.enabled=true", "--balance.threshold=1.1", "--balance.window=4",
                 "--balance.cooldown=10"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"run failed:\n{r.stderr[-4000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skew", type=float, default=0.05)
    ap.add_argument("--out", default="/tmp/piper-bench-migration")
    args = ap.parse_args()
    base = Path(args.out)
    runs = {}
    for name, mig in (("static", False), ("migrate", True)):
        t0 = time.perf_counter()
        runs[name] = _run(base / name, args.steps, args.skew, mig)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    events = [r for r in runs["migrate"] if r.get("event") == "migration"]
    first = min((e["step"] for e in events), default=args.steps)
    lo = first + 2  # skip the migration step and the one after
    table = []
    for name, rows in runs.items():
        steps = [r for r in rows if "loss" in r and r["step"] >= lo]
        early = [r for r in rows if "loss" in r and 2 <= r["step"] <= first]
        table.append({
            "run": name,
            "imbalance_before": statistics.median(r["imbalance"] for r in early) if early else None,
            "imbalance_after": statistics.median(r["imbalance"] for r in steps),
            "wait_s_after": statistics.median(r["ep_exchange_max_s"] for r in steps),
            "step_s_after": statistics.median(r["step_time_s"] for r in steps),
            "steps_measured": len(steps),
        })
    s, m = table
    ratio_wait = m["wait_s_after"] / s["wait_s_after"]
    ratio_step = m["step_s_after"] / s["step_s_after"]
    print(f"\nEP=4, skew {args.skew}, migrations: {len(events)} events (first at step {first}); "
          f"medians over steps {lo}..{args.steps}")
    print(f"{'run':<8} {'imb. before':>11} {'imb. after':>10} {'wait (s)':>9} {'step (s)':>9}")
    for r in table:
        ib = f"{r['imbalance_before']:.2f}" if r["imbalance_before"] else "-"
        print(f"{r['run']:<8} {ib:>11} {r['imbalance_after']:>10.2f} {r['wait_s_after']:>9.3f} "
              f"{r['step_s_after']:>9.3f}")
    print(f"migrate / static: wait {ratio_wait:.2f}x, step time {ratio_step:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    with open(RESULTS / "bench_migration.jsonl", "a") as f:
        f.write(json.dumps({"sha": sha, "device": "cpu", "steps": args.steps, "skew": args.skew,
                            "first_migration": first, "events": len(events), "table": table,
                            "wait_ratio": ratio_wait, "step_ratio": ratio_step}) + "\n")


if __name__ == "__main__":
    main()
