"""Loss curves of `train.py` runs for the GPU checks (`benchmarks/gpu_check*.sh`).

    python benchmarks/gpu_check_losses.py curve RUN_DIR [--min-drop 0.05]
        the loss curve and tokens/s of one run; exit 1 when a loss is not finite or the loss
        of the last steps is not at least `min-drop` (relative) below the first steps'
    python benchmarks/gpu_check_losses.py compare REF_DIR RUN_DIR --rtol R
        step by step |loss - ref| <= R * |ref|; exit 1 when a step differs by more, or the
        two runs do not have the same steps

RUN_DIR is a run's `train.out_dir`: its metrics.jsonl holds one row per step
({"step", "loss", "tokens_per_s", ...}; event rows without a loss are skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def read_losses(run: Path) -> dict[int, dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path}: no such file (did the run start?)")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if "loss" in r}


def curve(run: Path, min_drop: float) -> int:
    rows = read_losses(run)
    if len(rows) < 2:
        print(f"{run}: {len(rows)} step(s) logged, need >= 2")
        return 1
    steps = sorted(rows)
    every = max(1, len(steps) // 10)
    print(f"{'step':>5} {'loss':>9} {'tokens/s':>10}")
    for s in steps:
        if s in (steps[0], steps[-1]) or s % every == 0:
            print(f"{s:>5} {rows[s]['loss']:>9.4f} {rows[s].get('tokens_per_s', 0.0):>10.0f}")
    losses = [rows[s]["loss"] for s in steps]
    # The first steps compile kernels and warm caches: tokens/s over the second half.
    tok = [rows[s].get("tokens_per_s", 0.0) for s in steps[len(steps) // 2:]]
    print(f"tokens/s (median of steps {steps[len(steps) // 2]}-{steps[-1]}): {statistics.median(tok):.0f}")
    bad = [s for s in steps if not math.isfinite(rows[s]["loss"])]
    if bad:
        print(f"non-finite loss at steps {bad}")
        return 1
    k = max(1, len(steps) // 5)
    first, last = statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])
    drop = (first - last) / abs(first)
    print(f"loss: mean of the first {k} steps {first:.4f}, of the last {k} {last:.4f} "
          f"(drop {100 * drop:.1f} %, required >= {100 * min_drop:.1f} %)")
    return 0 if drop >= min_drop else 1


def compare(ref_dir: Path, run_dir: Path, rtol: float) -> int:
    ref, run = read_losses(ref_dir), read_losses(run_dir)
    if sorted(ref) != sorted(run):
        print(f"steps differ: reference {sorted(ref)}, run {sorted(run)}")
        return 1
    worst, failed = 0.0, []
    print(f"{'step':>5} {'reference':>10} {'run':>10} {'rel diff':>9}")
    for s in sorted(ref):
        a, b = ref[s]["loss"], run[s]["loss"]
        rel = abs(b - a) / abs(a) if math.isfinite(a) and math.isfinite(b) else math.inf
        worst = max(worst, rel)
        print(f"{s:>5} {a:>10.5f} {b:>10.5f} {rel:>9.2e}")
        if not rel <= rtol:
            failed.append(s)
    verdict = "FAIL" if failed else "ok"
    print(f"{verdict}: worst relative difference {worst:.2e}, tolerance {rtol:.1e}"
          + (f"; over it at step {', step '.join(map(str, failed))}" if failed else ""))
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("curve")
    c.add_argument("run", type=Path)
    c.add_argument("--min-drop", type=float, default=0.05)
    k = sub.add_parser("compare")
    k.add_argument("ref", type=Path)
    k.add_argument("run", type=Path)
    k.add_argument("--rtol", type=float, required=True)
    a = p.parse_args(argv)
    if a.cmd == "curve":
        return curve(a.run, a.min_drop)
    return compare(a.ref, a.run, a.rtol)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
