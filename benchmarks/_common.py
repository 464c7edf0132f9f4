"""Small helpers shared by the benchmark scripts (imported as `_common`: every script runs with
its own folder on sys.path).

Where a benchmark's files go: a run writes its rows, plots and tables to `runs/bench/<name>/`
(ignored by git) or to `--out DIR`; only `--record` appends to the tracked records in
`benchmarks/results/`, the rows the docs' tables cite. So running any benchmark with its
defaults leaves `git status` clean. Every script adds the two flags with `add_output_args`
and asks `output_dir` where to write.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "results"  # tracked: written only with --record
RUNS = ROOT / "runs" / "bench"  # ignored (.gitignore: runs/): the default for every run

__all__ = ["RECORDS", "ROOT", "RUNS", "add_output_args", "cpu_name", "cpu_times", "git_sha",
           "output_dir", "previous", "print_written", "Probe", "probe_trainer", "record_ranks",
           "steal_fraction"]


def add_output_args(p: argparse.ArgumentParser, name: str) -> None:
    """Add `--out DIR` and `--record` (exclusive) to a benchmark's parser; `name` is the
    benchmark's folder under runs/bench/, kept in the namespace for `output_dir`."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--out", type=Path, default=None,
                   help=f"folder for this run's rows and plots (default: runs/bench/{name}/, "
                        "ignored by git)")
    g.add_argument("--record", action="store_true",
                   help="append to the tracked records in benchmarks/results/ instead (the rows "
                        "the docs cite)")
    p.set_defaults(bench_name=name)


def output_dir(args: argparse.Namespace, create: bool = True) -> Path:
    """The folder a run writes to: `--out`, benchmarks/results/ with `--record`, else
    runs/bench/<name>/. Created unless `create` is False."""
    name = getattr(args, "bench_name", None)
    if name is None:
        raise ValueError("output_dir needs a namespace from a parser set up with "
                         "add_output_args(parser, name)")
    out = Path(args.out) if args.out is not None else RECORDS if args.record else RUNS / name
    if create:
        out.mkdir(parents=True, exist_ok=True)
    return out


def previous(out: Path, filename: str) -> Path:
    """Rows written earlier, for a script that reads them back (re-predict, replay, re-plot):
    `out/filename` when this output folder has it, else the tracked record of that name."""
    here = out / filename
    return here if here.is_file() else RECORDS / filename


def print_written(*paths: Path) -> None:
    """One line saying where this run's files went (paths relative to the checkout inside it)."""
    def show(p: Path) -> str:
        p = Path(p).resolve()
        return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
    print("results written to: " + ", ".join(show(p) for p in paths))


@functools.cache
def git_sha() -> str:
    """Short SHA of the checkout's HEAD, recorded with every result row; "unknown" without git.
    Looked up once per run (scripts call it per row)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


@functools.cache
def cpu_name() -> str:
    """The host CPU's model name (/proc/cpuinfo), recorded with benchmark rows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_times(stat: str | None = None) -> tuple[int, int] | None:
    """(steal, total) clock ticks of all CPUs since boot, from the first line of /proc/stat (or
    `stat`, its text). Steal is the time a virtual CPU was ready but the hypervisor ran
    something else: a VM's slow spell that no probe inside it can see as load. None where
    the file is missing or has no steal column (kernels before 2.6.11, not Linux)."""
    try:
        text = stat if stat is not None else Path("/proc/stat").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        f = line.split()
        if f and f[0] == "cpu":
            if len(f) < 9:
                return None
            ticks = [int(x) for x in f[1:]]
            # guest and guest_nice (fields 9-10) are already counted in user and nice
            return ticks[7], sum(ticks[:8])
    return None


def steal_fraction(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of CPU time stolen by the hypervisor between two `cpu_times` readings;
    None where either is missing or no tick passed."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


class Probe(NamedTuple):
    """What `probe_trainer` sets up."""

    args: argparse.Namespace  # the probe's own flags
    train_argv: list[str]  # the rest: train.py's
    cfg: Any  # trainer.RunConfig
    trainer: Any  # trainer.Trainer, built
    world: int
    rank: int
    iters: int


def probe_trainer(p: argparse.ArgumentParser, argv: list[str], iters: int) -> Probe:
    """For torchrun probes: `p` parses the probe's flags and leaves the rest to train.py's
    parser; threads as train.py sets them; a gloo process group where world > 1; the
    Trainer built; iterations from PROBE_ITERS, else `iters`."""
    import os

    import torch
    import torch.distributed as dist

    from trainer import Trainer, parse_args, prepare

    n_iter = int(os.environ.get("PROBE_ITERS", str(iters)))
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    args, train_argv = p.parse_known_args(argv)
    cfg = parse_args(train_argv)
    prep = prepare(cfg, world, rank)
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo")
    return Probe(args, train_argv, cfg, Trainer(prep), world, rank, n_iter)


def record_ranks(out: Path, name: str, rank: int, world: int, mine: dict, meta: dict) -> None:
    """For torchrun probes: gather every rank's `mine` (the caller's process group, torn
    down here), and on rank 0 print them, one line per rank, and append one JSON row
    (`meta`, the world size and the ranks' dicts) to `out`/`name`.jsonl."""
    import torch.distributed as dist

    every = [mine] * world
    if world > 1:
        dist.all_gather_object(every, mine)
        dist.destroy_process_group()
    if rank != 0:
        return
    for i, m in enumerate(every):
        print(f"rank {i} {json.dumps(m)}", flush=True)
    path = out / f"{name}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps({"commit": git_sha(), "world": world, **meta, "ranks": every}) + "\n")
    print_written(path)

