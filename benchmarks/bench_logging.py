"""What observability costs the default job: step time with TensorBoard + per-layer metrics on
vs off, same invocation.

The default job (configs/tiny.toml: PP=2 x EP=2 on 4 CPU processes, seq_len 256, global batch
16), shortened to --steps steps, no evaluation until the end:
  on    --train.tensorboard=true  --train.layer_metrics=true  (router entropy, the per-layer
        gather from both stages, the "layers" rows, one TensorBoard scalar per tag and step)
  off   --train.tensorboard=false --train.layer_metrics=false (the EP-imbalance all-reduce only)
run alternately (on, off, on, off, ...) --repeats times each, so that a busy neighbour on a
shared machine slows both about equally. Per run, over the steps after --skip warm-up steps:
  step_s      median of the rows' step_time_s (train_step: forward/backward, syncs, optimizer,
              the per-layer gather)
  interval_s  median wall time between consecutive metrics.jsonl rows: also what happens
              between steps (writing metrics.jsonl, the TensorBoard scalars, the progress line)
Reported: the median over repeats of each, and on / off. Appends one row to
benchmarks/results/logging.jsonl.

    flock /tmp/piper-bench.lock python benchmarks/bench_logging.py [--steps 30] [--repeats 3]
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

from _common import git_sha

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODES = {"on": ["--train.tensorboard=true", "--train.layer_metrics=true"],
         "off": ["--train.tensorboard=false", "--train.layer_metrics=false"]}


def _run(out: Path, steps: int, mode: str) -> list[dict]:
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "train.py", "--config", "configs/tiny.toml", f"--train.out_dir={out}",
            f"--train.steps={steps}", "--train.eval_every=0", "--train.eval_batches=1",
            "--train.plot=false", "--train.ckpt_every=0", *MODES[mode]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [x for x in rows if "loss" in x]


def _medians(rows: list[dict], skip: int) -> tuple[float, float]:
    steady = rows[skip:]
    step = statistics.median(r["step_time_s"] for r in steady)
    times = [r["time"] for r in rows[skip - 1:]]
    interval = statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
    return step, interval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    ap.add_argument("--out", default="/tmp/piper-bench-logging")
    args = ap.parse_args()
    if not 1 <= args.skip < args.steps - 2 or args.repeats < 1:
        raise SystemExit(f"need 1 <= --skip < --steps - 2 and --repeats >= 1 (got skip "
                         f"{args.skip}, steps {args.steps}, repeats {args.repeats})")
    got: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    t0 = time.time()
    for k in range(args.repeats):
        for mode in ("on", "off"):
            out = Path(args.out) / f"{mode}_{k}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            rows = _run(out, args.steps, mode)
            if mode == "on":
                assert rows[-1].get("layers") and (out / "tensorboard").is_dir(), "logging is off?"
            got[mode].append(_medians(rows, args.skip))
            print(f"repeat {k} {mode:>3}: step {got[mode][-1][0] * 1e3:.1f} ms, interval "
                  f"{got[mode][-1][1] * 1e3:.1f} ms", flush=True)
    med = {m: (statistics.median(s for s, _ in v), statistics.median(i for _, i in v))
           for m, v in got.items()}
    row = {"bench": "logging", "git": git_sha(), "steps": args.steps, "skip": args.skip,
           "repeats": args.repeats, "cpus": os.cpu_count(),
           "on_step_s": med["on"][0], "off_step_s": med["off"][0],
           "on_interval_s": med["on"][1], "off_interval_s": med["off"][1],
           "step_ratio": med["on"][0] / med["off"][0],
           "interval_ratio": med["on"][1] / med["off"][1],
           "per_repeat": got, "wall_s": time.time() - t0}
    print(f"median step time: on {med['on'][0] * 1e3:.1f} ms, off {med['off'][0] * 1e3:.1f} ms, "
          f"on/off {row['step_ratio']:.4f}")
    print(f"median row-to-row interval: on {med['on'][1] * 1e3:.1f} ms, off "
          f"{med['off'][1] * 1e3:.1f} ms, on/off {row['interval_ratio']:.4f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "logging.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
