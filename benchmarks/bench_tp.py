"""Tensor parallel vs expert parallel on 4 CPU processes (gloo): memory per rank and step time,
measured by train.py, beside the planner's prediction of each layout.

Layouts (the tiny preset at its own sizes: d_model 128, 4 MoE layers of 8 experts; fp32):

    tp2_ep2   TP=2 (SP) x EP=2 x expert-DP=2    vs   ep4       EP=4 (every weight but the
                                                               experts whole on each rank)
    pp2_tp2   PP=2 x TP=2 (SP), EP=2 over the   vs   pp2_ep2   PP=2 x EP=2
              TP pair (parallel folding)

Each layout is one `train.py` run (torchrun, 4 processes) with `--train.memory_report=true`;
the runs take turns over `--repeats` rounds so machine load hits them alike. Per run:
state bytes (weights + gradients + AdamW moments, max over ranks, right after the optimizer
step), the weights' share of it (fp32 AdamW holds 16 B per parameter, 4 of them the weight),
peak saved-activation bytes (max over ranks) and the median step time of the steps after
`--warmup`; the table gives the medians over the rounds and each layout's ratio to its
baseline (ep4, pp2_ep2) from the same rounds. The planner's prediction is
`python -m tuner estimate ... --json` for the same layout on the `local` platform: weights,
gradients + optimizer state, activations and step time of its most loaded stage.

    flock /tmp/piper-bench.lock flock /tmp/piper-cpu.lock \\
        python benchmarks/bench_tp.py [--repeats 3] [--steps 8] [--warmup 3]

Rows go to bench_tp.jsonl in runs/bench/tp/ (ignored by git) or `--out DIR`; `--record`
appends them to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import add_output_args, cpu_name, git_sha, output_dir, print_written  # noqa: E402

# name -> (pp, tp, ep, baseline)
LAYOUTS = {"ep4": (1, 1, 4, "ep4"), "tp2_ep2": (1, 2, 2, "ep4"),
           "pp2_ep2": (2, 1, 2, "pp2_ep2"), "pp2_tp2": (2, 2, 2, "pp2_ep2")}
SEQ, BATCH = 128, 8


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="rounds over all layouts")
    ap.add_argument("--steps", type=int, default=8, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the step time")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset")
    ap.add_argument("--data", default="", help="corpus (default: the trainer's default)")
    add_output_args(ap, "tp")
    return ap


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _microbatches(pp: int) -> int:
    return 2 if pp > 1 else 1


def _run(name: str, steps: int, data: str, tmp: Path) -> list[dict]:
    pp, tp, ep, _ = LAYOUTS[name]
    out = tmp / f"{name}_{time.monotonic_ns()}"
    args = ["--config", "configs/tiny-ep-dp.toml", f"--parallel.pp={pp}", f"--parallel.tp={tp}",
            f"--parallel.ep={ep}", f"--parallel.microbatches={_microbatches(pp)}",
            "--comm.alltoall=flat", f"--train.steps={steps}", f"--train.seq_len={SEQ}",
            f"--train.global_batch={BATCH}", "--train.eval_every=0", "--train.eval_batches=1",
            "--train.plot=false", "--train.memory_report=true", "--train.tensorboard=false",
            "--train.layer_metrics=false", f"--train.out_dir={out}"]
    if data:
        args.append(f"--data.path={data}")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "4", "--master-addr", "127.0.0.1", "--master-port", str(_port()), "train.py", *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [x for x in rows if "loss" in x]


def _predict(name: str) -> dict:
    """The planner's estimate of the layout (`python -m tuner estimate --json`)."""
    pp, tp, ep, _ = LAYOUTS[name]
    shards = 4 // pp // tp  # the dense side's data shards
    mbs = BATCH // shards // _microbatches(pp)
    cmd = [sys.executable, "-m", "tuner", "estimate", "--model", "tiny", "--platform", "local",
           "--gpus", "4", "--seq", str(SEQ), "--global-batch", str(BATCH), "--mbs", str(mbs),
           "--pp", str(pp), "--tp", str(tp), "--ep", str(ep), "--dispatch", "flat", "--json"]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"tuner estimate for {name} failed: {r.stderr[-2000:]}")
    s = json.loads(r.stdout.strip().splitlines()[-1])
    worst = max(s["stages"], key=lambda st: st["total_gb"])
    return {"step_time_s": s["step_time_s"], "weights_bytes": worst["weights_gb"] * 1e9,
            "state_bytes": (worst["weights_gb"] + worst["grads_gb"] + worst["optimizer_gb"]) * 1e9,
            "act_bytes": worst["activations_gb"] * 1e9, "time_s": s["time_s"],
            "runnable": s["runnable"]}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    names = [n for n in args.layouts.split(",") if n]
    bad = [n for n in names if n not in LAYOUTS]
    if bad or args.repeats < 1 or not 0 <= args.warmup < args.steps:
        raise SystemExit(f"--layouts {bad} unknown (valid: {', '.join(LAYOUTS)}), or --repeats "
                         f"{args.repeats} < 1, or --warmup {args.warmup} not in 0..steps-1")
    pred = {n: _predict(n) for n in names}
    meas: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for n in names:
                rows = _run(n, args.steps, args.data, Path(tmp))
                last = rows[-1]
                meas[n].append({
                    "step_time_s": statistics.median(x["step_time_s"]
                                                     for x in rows[args.warmup:]),
                    "state_bytes": last["mem_state_bytes_max"],
                    "act_bytes": last["mem_act_peak_bytes_max"], "loss": last["loss"]})
                print(f"round {r + 1}/{args.repeats} {n}: {meas[n][-1]}", flush=True)
    out = output_dir(args)
    path = out / "bench_tp.jsonl"
    lines = ["| layout | state MB (weights MB) | planner state MB (weights) | activations MB | "
             "planner act. MB | step s (ratio) | planner step s |",
             "|---|---|---|---|---|---|---|"]
    with open(path, "a") as f:
        for n in names:
            pp, tp, ep, base = LAYOUTS[n]
            med = {k: statistics.median(m[k] for m in meas[n])
                   for k in ("step_time_s", "state_bytes", "act_bytes")}
            ratio = (statistics.median(a["step_time_s"] / b["step_time_s"]
                                       for a, b in zip(meas[n], meas[base], strict=True))
                     if base in meas else None)
            row = {"bench": "tp", "layout": n, "pp": pp, "tp": tp, "ep": ep, "sp": tp > 1,
                   "seq_len": SEQ, "global_batch": BATCH, "steps": args.steps,
                   "warmup": args.warmup, "repeats": args.repeats, **med,
                   "weights_bytes": med["state_bytes"] / 4, "step_ratio_to_baseline": ratio,
                   "baseline": base, "runs": meas[n], "planner": pred[n], "sha": git_sha(),
                   "cpu": cpu_name(), "load_avg": os.getloadavg()[0], "time": time.time()}
            f.write(json.dumps(row) + "\n")
            p = pred[n]
            lines.append(
                f"| {n} | {med['state_bytes'] / 1e6:.2f} ({med['state_bytes'] / 4e6:.2f}) | "
                f"{p['state_bytes'] / 1e6:.2f} ({p['weights_bytes'] / 1e6:.2f}) | "
                f"{med['act_bytes'] / 1e6:.2f} | {p['act_bytes'] / 1e6:.2f} | "
                f"{med['step_time_s']:.3f} ({'-' if ratio is None else f'{ratio:.2f}'}) | "
                f"{p['step_time_s']:.3f} |")
    print("\n".join(lines))
    print_written(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
