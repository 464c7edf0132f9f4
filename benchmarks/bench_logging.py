"""What observability costs the default job: TensorBoard + per-layer metrics on vs off.

The default job (configs/tiny.toml: PP=2 x EP=2 on 4 CPU processes, seq_len 256, global batch
16), shortened to --steps steps, evaluation only at the end.
  on    TensorBoard and --train.layer_metrics (router entropy in every MoE forward, the
        per-layer table gathered from both stages, the "layers" rows, the TensorBoard event)
  off   neither (metrics.jsonl and the progress line as always; the EP-imbalance all-reduce)

--mode ab (default): in ONE run, on and off alternate step by step (`--debug.logging_ab`:
odd steps on, even steps off), so both see the same machine load; a shared CPU whose
neighbours come and go makes separate runs differ by far more than 2 % (--mode runs shows it).
Per step after --skip warm-up steps: cycle = step_time_s (the training step, including the
gather) + the gap until the next step starts (next row's `time` - this row's `time` - next
step_time_s: writing metrics.jsonl, the TensorBoard event, the progress line). Reported: the
median step time and median cycle of on steps and off steps, pooled over --repeats runs, and
on / off.
--mode runs: separate runs, on, off, on, off, ... (--repeats each), medians of step_time_s
and of the row-to-row interval per run, median over runs.

Appends one row to logging.jsonl in runs/bench/logging/ (ignored by git) or `--out DIR`;
`--record` appends it to benchmarks/results/, the tracked record. The training runs themselves
go to --work-dir.

    flock /tmp/piper-bench.lock .venv/bin/python benchmarks/bench_logging.py [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import add_output_args, git_sha, output_dir, print_written

ROOT = Path(__file__).resolve().parents[1]
MODES = {"on": ["--train.tensorboard=true", "--train.layer_metrics=true"],
         "off": ["--train.tensorboard=false", "--train.layer_metrics=false"],
         "ab": ["--train.tensorboard=true", "--train.layer_metrics=true",
                "--debug.logging_ab=true"]}


def _run(out: Path, steps: int, mode: str) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
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


def _ab(rows: list[dict], skip: int) -> dict[str, dict[str, list[float]]]:
    """Per mode: the step times and cycles (step + following gap) of steps after `skip`."""
    got = {"on": {"step": [], "cycle": []}, "off": {"step": [], "cycle": []}}
    for r, nxt in zip(rows[skip:], rows[skip + 1:], strict=False):
        mode = "on" if "layers" in r else "off"
        gap = nxt["time"] - r["time"] - nxt["step_time_s"]
        got[mode]["step"].append(r["step_time_s"])
        got[mode]["cycle"].append(r["step_time_s"] + gap)
    return got


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("ab", "runs"), default="ab")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", type=int, default=6, help="warm-up steps left out of the medians")
    ap.add_argument("--work-dir", default="/tmp/piper-bench-logging",
                    help="where the training runs write (each run's folder is replaced)")
    add_output_args(ap, "logging")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not 1 <= args.skip < args.steps - 4 or args.repeats < 1:
        raise SystemExit(f"need 1 <= --skip < --steps - 4 and --repeats >= 1 (got skip "
                         f"{args.skip}, steps {args.steps}, repeats {args.repeats})")
    t0 = time.time()
    row = {"bench": "logging", "mode": args.mode, "git": git_sha(), "steps": args.steps,
           "skip": args.skip, "repeats": args.repeats, "cpus": os.cpu_count(),
           "loadavg_start": os.getloadavg()[0]}
    if args.mode == "ab":
        pooled = {"on": {"step": [], "cycle": []}, "off": {"step": [], "cycle": []}}
        for k in range(args.repeats):
            rows = _run(Path(args.work_dir) / f"ab_{k}", args.steps, "ab")
            got = _ab(rows, args.skip)
            for m in pooled:
                for key in ("step", "cycle"):
                    pooled[m][key] += got[m][key]
            print(f"run {k}: " + ", ".join(
                f"{m} step {statistics.median(got[m]['step']) * 1e3:.1f} ms cycle "
                f"{statistics.median(got[m]['cycle']) * 1e3:.1f} ms" for m in got), flush=True)
        for m in pooled:
            row[f"{m}_step_s"] = statistics.median(pooled[m]["step"])
            row[f"{m}_cycle_s"] = statistics.median(pooled[m]["cycle"])
            row[f"{m}_n"] = len(pooled[m]["step"])
        row["step_ratio"] = row["on_step_s"] / row["off_step_s"]
        row["cycle_ratio"] = row["on_cycle_s"] / row["off_cycle_s"]
        print(f"median step: on {row['on_step_s'] * 1e3:.1f} ms, off {row['off_step_s'] * 1e3:.1f}"
              f" ms, on/off {row['step_ratio']:.4f}; median cycle (step + logging until the next "
              f"step): on {row['on_cycle_s'] * 1e3:.1f} ms, off {row['off_cycle_s'] * 1e3:.1f} ms,"
              f" on/off {row['cycle_ratio']:.4f} ({row['on_n']} + {row['off_n']} steps)")
    else:
        per: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
        for k in range(args.repeats):
            for mode in ("on", "off"):
                rows = _run(Path(args.work_dir) / f"{mode}_{k}", args.steps, mode)[args.skip:]
                times = [r["time"] for r in rows]
                per[mode].append((statistics.median(r["step_time_s"] for r in rows),
                                  statistics.median(b - a for a, b in zip(times, times[1:],
                                                                          strict=False))))
                print(f"repeat {k} {mode:>3}: step {per[mode][-1][0] * 1e3:.1f} ms, interval "
                      f"{per[mode][-1][1] * 1e3:.1f} ms", flush=True)
        for m, v in per.items():
            row[f"{m}_step_s"] = statistics.median(s for s, _ in v)
            row[f"{m}_interval_s"] = statistics.median(i for _, i in v)
        row["per_repeat"] = per
        row["step_ratio"] = row["on_step_s"] / row["off_step_s"]
        row["interval_ratio"] = row["on_interval_s"] / row["off_interval_s"]
        print(f"median step time on/off {row['step_ratio']:.4f}, interval on/off "
              f"{row['interval_ratio']:.4f}")
    row["loadavg_end"] = os.getloadavg()[0]
    row["wall_s"] = time.time() - t0
    res = output_dir(args) / "logging.jsonl"
    with open(res, "a") as f:
        f.write(json.dumps(row) + "\n")
    print_written(res)


if __name__ == "__main__":
    main()
