"""Reference runs: a handful of short, deterministic train.py jobs on the CPU (gloo) whose
per-step metrics, wall-clock fields removed, must stay bitwise identical across a refactor.

    # record: every job, into DIR/reference.json (plus each job's metrics.jsonl; default DIR:
    # runs/bench/reference_runs/)
    flock /tmp/piper-cpu.lock python benchmarks/reference_runs.py --out /tmp/ref_after
    # run another checkout's code (its train.py, with PYTHONPATH set to it)
    python benchmarks/reference_runs.py --code /work/main --out /tmp/ref_before
    # compare two records: one line per job, equal / unequal (first differing value named)
    python benchmarks/reference_runs.py --compare /tmp/ref_before /tmp/ref_after
    # a subset of jobs
    python benchmarks/reference_runs.py --out /tmp/ref --jobs default,zero3

What the jobs cover: the default job (PP=2 x EP=2, 1F1B), one process with gradient
accumulation, PP=2 interleaved 1F1B, EP=4 over HALO on two emulated nodes, EP=2 dedup with
the overlapped layer pipeline, ZeRO-1/2/3 at DP=2, expert migration (forced swaps on a skewed
router, stopped and resumed from its checkpoint), redundant expert slots (replicas), TP=2 x
EP=2; every job ends with an evaluation (`val_loss` of its last row). Each job is a few steps
of the tiny preset on 32-token windows of a 200 kB slice of the standard library's sources.

Removed before comparing (they measure the machine, not the computation): every key ending in
`_s` (step_time_s, fwd_bwd_s, tokens_per_s, ep_exchange_*_s, pp_idle_max_s, ...), `time`,
`mfu`, `pp_idle_frac_max`, `migration_seconds` and the events' `seconds`. Everything else
(losses, gradient norms, learning rates, counts, per-layer loads, migration and replica
events, memory bytes, validation losses) must match bit for bit: the same ops run on the same
shapes in the same order on the same machine.

Test and benchmark knobs (`--debug.*`) are spelled as they are today; against a checkout whose
config has no [debug] section (before issue 28) they are passed under their old sections.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import ROOT, add_output_args, output_dir, print_written

COMMON = ["--train.seq_len=32", "--train.global_batch=8", "--train.eval_every=0",
          "--train.eval_batches=2", "--optim.warmup_steps=2", "--train.plot=false",
          "--train.tensorboard=false", "--train.threads=1", "--train.timeout_s=300"]
TINY = ["--config", "configs/tiny.toml"]
EPDP = ["--config", "configs/tiny-ep-dp.toml"]

# name -> (processes, arguments); a list of argument lists runs one invocation after another
# in the same out_dir (the migration job stops at step 2 and resumes from its checkpoint)
JOBS: dict[str, tuple[int, list[list[str]]]] = {
    "default": (4, [[*TINY, "--train.steps=3"]]),
    "one_process": (1, [[*TINY, "--parallel.pp=1", "--parallel.ep=1", "--parallel.microbatches=2",
                         "--train.steps=3"]]),
    "pp2_interleaved": (2, [[*TINY, "--parallel.ep=1", "--parallel.schedule=interleaved-1f1b",
                             "--parallel.n_virtual=2", "--train.steps=3"]]),
    "ep4_halo": (4, [[*EPDP, "--parallel.ep=4", "--comm.alltoall=halo",
                      "--comm.topology=configs/topologies/2x2-local.toml", "--train.steps=3"]]),
    "ep2_dedup_overlap": (2, [[*EPDP, "--parallel.ep=2", "--comm.alltoall=dedup",
                               "--comm.topology=configs/topologies/2x1-local.toml",
                               "--comm.a2a_overlap=layer", "--comm.a2a_chunks=2",
                               "--train.steps=3"]]),
    "zero1": (2, [[*EPDP, "--parallel.ep=1", "--parallel.zero=1", "--train.steps=3"]]),
    "zero2": (2, [[*EPDP, "--parallel.ep=1", "--parallel.zero=2", "--train.memory_report=true",
                   "--train.steps=3"]]),
    "zero3": (2, [[*EPDP, "--parallel.ep=1", "--parallel.zero=3", "--train.steps=3"]]),
    "migration": (2, [[*EPDP, "--parallel.ep=2", "--comm.alltoall=flat", "--balance.enabled=true",
                       "--debug.force_every=1", "--debug.skew=1.0", "--train.steps=4",
                       "--train.stop_after=2"],
                      [*EPDP, "--parallel.ep=2", "--comm.alltoall=flat", "--balance.enabled=true",
                       "--debug.force_every=1", "--debug.skew=1.0", "--train.steps=4",
                       "--resume"]]),
    "replicas": (2, [[*EPDP, "--parallel.ep=2", "--comm.alltoall=flat", "--balance.enabled=true",
                      "--balance.redundant=1", "--balance.window=2", "--balance.cooldown=1",
                      "--balance.threshold=1.0", "--debug.skew=1.0", "--train.steps=4"]]),
    "tp2_ep2": (2, [[*TINY, "--parallel.pp=1", "--parallel.tp=2", "--parallel.ep=2",
                     "--train.steps=3"]]),
}

# --debug.<knob> -> where the knob lived before the [debug] section (issue 28)
LEGACY = {"debug.force_every": "balance.force_every", "debug.skew": "balance.skew",
          "debug.logging_ab": "train.logging_ab", "debug.fault_rank": "train.fault_rank",
          "debug.fault_nan_step": "train.fault_nan_step",
          "debug.fault_stall_step": "train.fault_stall_step", "debug.trace_data": "data.trace"}

WALL_CLOCK = {"time", "mfu", "pp_idle_frac_max", "migration_seconds", "seconds"}


def deterministic(row: dict[str, Any]) -> dict[str, Any]:
    """The row without its wall-clock fields (see the module docstring)."""
    return {k: v for k, v in row.items() if k not in WALL_CLOCK and not k.endswith("_s")}


def _has_debug_section(code: Path) -> bool:
    return "class DebugConfig" in (code / "trainer" / "config.py").read_text()


def _spell(args: list[str], legacy: bool) -> list[str]:
    if not legacy:
        return args
    out = []
    for a in args:
        key, eq, value = a[2:].partition("=")
        out.append(f"--{LEGACY[key]}={value}" if a.startswith("--") and key in LEGACY else a)
    return out


def run_job(code: Path, name: str, nproc: int, invocations: list[list[str]], out: Path,
            data: Path, legacy: bool) -> list[dict[str, Any]]:
    job_dir = out / name
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    for args in invocations:
        argv = [*_spell(args, legacy), *COMMON, "--data", str(data),
                f"--train.out_dir={job_dir}"]
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", str(nproc)] if nproc > 1 else [sys.executable]
        r = subprocess.run([*launch, str(code / "train.py"), *argv], cwd=code, env=env,
                           capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise SystemExit(f"job {name} failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-5000:]}")
    rows = [json.loads(x) for x in (job_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [deterministic(r) for r in rows]


def record(code: Path, out: Path, jobs: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    legacy = not _has_debug_section(code)
    sys.path.insert(0, str(code))  # the corpus helper of the code under test
    from tuner.launch import small_corpus  # the first 200 kB of the stdlib sources

    data = small_corpus(out / "corpus.txt", 200_000)
    result: dict[str, Any] = {"code": str(code), "jobs": {}}
    for name in jobs:
        nproc, invocations = JOBS[name]
        t0 = time.perf_counter()
        result["jobs"][name] = run_job(code, name, nproc, invocations, out, data, legacy)
        print(f"{name}: {len(result['jobs'][name])} rows, {time.perf_counter() - t0:.0f} s",
              flush=True)
    path = out / "reference.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {path}")
    return path


def _first_difference(a: Any, b: Any, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{where}.{k}: only in {'B' if k not in a else 'A'}"
            d = _first_difference(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} entries"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = _first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    # JSON round-trips floats exactly (repr); NaN != NaN, so compare their spelling
    return None if json.dumps(a) == json.dumps(b) else f"{where}: {a!r} vs {b!r}"


def compare(a: Path, b: Path) -> int:
    def load(p: Path) -> dict[str, Any]:
        p = p / "reference.json" if p.is_dir() else p
        return json.loads(p.read_text())["jobs"]

    ja, jb = load(a), load(b)
    bad = 0
    for name in sorted(set(ja) | set(jb)):
        if name not in ja or name not in jb:
            print(f"{name}: only in {'B' if name not in ja else 'A'}")
            bad += 1
            continue
        d = _first_difference(ja[name], jb[name])
        print(f"{name}: {'equal' if d is None else 'UNEQUAL ' + d}")
        bad += d is not None
    print(f"{len(set(ja) | set(jb)) - bad} equal, {bad} unequal")
    return 1 if bad else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", type=Path, default=ROOT,
                   help="checkout whose train.py runs, with PYTHONPATH set to it (default: this one)")
    p.add_argument("--jobs", default=",".join(JOBS),
                   help=f"comma-separated subset of: {', '.join(JOBS)}")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                   help="compare two records (folders or reference.json files); exit 1 if unequal")
    add_output_args(p, "reference_runs")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    jobs = [j for j in args.jobs.split(",") if j]
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        p.error(f"unknown job(s) {', '.join(bad)}; valid: {', '.join(JOBS)}")
    out = output_dir(args)
    record(args.code.resolve(), out.resolve(), jobs)
    print_written(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
