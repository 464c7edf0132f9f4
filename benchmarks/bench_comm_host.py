"""Host time per HALO / `auto` call at R ranks: the planning and validation work that every
rank does around the rows, without moving any (one process, a fake topology).

    python benchmarks/bench_comm_host.py [--ranks 64 256 1024] [--repeats 7]
                                         [--baseline a865662] [--out DIR | --record]

What one repeat times, starting from the ints the small exchange delivered (built outside
the timed region, as the exchange would hand them over) on rank 1 of R = N x 8 ranks
(`Topology.uniform(R // 8, 8)`, one NIC per rank) with a skewed split matrix (per source, a
multinomial of 8192 rows over destinations whose weights fall as 1 / (1 + k), k a random
rank of the destination):
    layer  the MoE dispatcher's four exchanges of one layer and micro-batch, planned ahead
           (`settle_plan`, then dispatch forward, combine forward = `reverse()`, combine
           backward, dispatch backward: each exchange's rank plan and, for auto, decision)
    call   one unplanned `all_to_all` forward and its backward
`new_ms_per_call` is a repeat's wall time divided by its exchanges (4 or 2): the median of
the repeats; `new_cpu_ms_per_call` (printed as "(cpu)") the same in this process's CPU
time. `auto` runs the concurrent model of configs/platforms/frontier.toml's link rates
(what a calibrated model is too; transfers added up, as the baseline has them); its own
row summary is part of the call.

Old vs new in one run: the comm/*.py of `--baseline` (a git revision: by default the one
before this work) are read with `git show` into a temporary package `comm_base` and run
on the same inputs; both versions' rank plans and decisions are checked equal. Rows are
appended to comm_host.jsonl with the git SHA, the machine and its load average, in
runs/bench/comm_host/ (ignored by git) or `--out DIR`; `--record` appends to
benchmarks/results/comm_host.jsonl, the tracked record.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import ROOT, add_output_args, git_sha, output_dir  # noqa: E402

import comm  # noqa: E402
from comm.collectives.alltoall import settle_plan  # noqa: E402
from comm.cost import row_summary  # noqa: E402

G = 8  # ranks per node
ROWS = 8192  # rows each rank sends per exchange
ME = 1  # the rank whose host work is timed


def load_baseline(rev: str) -> object:
    """The package comm/ of git revision `rev`, imported as `comm_base`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:comm"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    pkg = Path(tempfile.mkdtemp(prefix="comm-base-")) / "comm_base"
    pkg.mkdir()
    for name in (n for n in names if n.endswith(".py")):
        text = subprocess.run(["git", "show", f"{rev}:comm/{name}"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
        text = re.sub(r"\b(from|import) comm\b", r"\1 comm_base", text)
        (pkg / name).write_text(text)
    sys.path.insert(0, str(pkg.parent))
    return importlib.import_module("comm_base")


def split_matrix(R: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = 1.0 / (1.0 + rng.permutation(R))
    return np.stack([rng.multinomial(ROWS, weights / weights.sum()) for _ in range(R)])


def model_numbers(cls: type | None = None) -> dict:
    """The frontier platform's link rates as the fields of CostModel `cls` (default this
    checkout's). The flat collective's transfers add up (flat_overlap off, the only form
    the baseline knows) so that both versions decide alike; the host work is the same."""
    m = dataclasses.replace(comm.CostModel.from_platform("frontier"), flat_overlap=False)
    names = {f.name for f in dataclasses.fields(cls or comm.CostModel)} - {"source"}
    return {k: v for k, v in dataclasses.asdict(m).items() if k in names}


def _plans_equal(a: object, b: object) -> bool:
    return dataclasses.astuple(a) == dataclasses.astuple(b)


class New:
    """This checkout's path: the ints arrive as a numpy array."""

    def __init__(self, S: np.ndarray, algorithm: str) -> None:
        R = len(S)
        self.topo = comm.Topology.uniform(R // G, G)
        self.model = comm.CostModel(**model_numbers()) if algorithm == "auto" else None
        self.algorithm, self.R = algorithm, R
        rows = S.tolist()
        parts = [r + (row_summary(r, s, self.topo) if algorithm == "auto" else [])
                 for s, r in enumerate(rows)]
        # what the exchange hands over: int64 for plan_all_to_all (the layer), int32 for
        # an unplanned all_to_all (the call)
        self.values = {dtype: np.asarray(parts, dtype=dtype).reshape(-1)
                       for dtype in (np.int64, np.int32)}
        for v in self.values.values():
            v.flags.writeable = False
        self.splits = rows[ME]

    def layer(self) -> tuple:
        if self.algorithm == "auto":
            row_summary(self.splits, ME, self.topo)
        plan, _ = settle_plan(self.values[np.int64], self.splits, 0, ME, self.algorithm,
                              self.topo, self.model, 4096)
        rev = plan.reverse()
        out = []
        for p, backward in ((plan, False), (rev, False), (rev, True), (plan, True)):
            if p.algorithm == "halo":
                sp = p.splits.transposed() if backward else p.splits
                out.append(sp.rank_plan(ME))
            else:
                out.append(p.algorithm)
        return tuple(out)

    def call(self) -> tuple:
        if self.algorithm == "auto":
            row_summary(self.splits, ME, self.topo)
        plan, _ = settle_plan(self.values[np.int32], self.splits, 0, ME, self.algorithm,
                              self.topo, self.model, 4096)
        if plan.algorithm != "halo":
            return (plan.algorithm,)
        return plan.splits.rank_plan(ME), plan.splits.transposed().rank_plan(ME)


class Base:
    """The baseline's path (its code, reproduced step by step from its all_to_all,
    plan_all_to_all, AllToAllPlan.reverse and HaloAllToAll): the ints arrive as a list."""

    def __init__(self, base: object, S: np.ndarray, algorithm: str) -> None:
        self.b = base
        R = len(S)
        self.topo = base.Topology.uniform(R // G, G)
        self.model = base.CostModel(**model_numbers(base.CostModel)) \
            if algorithm == "auto" else None
        self.algorithm, self.R = algorithm, R
        rows = S.tolist()
        cost = importlib.import_module("comm_base.cost")
        self.summary = cost.row_summary
        self.decide = cost.decide_from_summaries
        parts = [r + (cost.row_summary(r, s, self.topo) if algorithm == "auto" else [])
                 for s, r in enumerate(rows)]
        self.stride = len(parts[0])
        self.values = [v for p in parts for v in p]
        self.splits = rows[ME]
        self.alltoall = importlib.import_module("comm_base.alltoall")
        self.halo_plan = importlib.import_module("comm_base.halo_plan")

    def _settle(self) -> object:
        R, a = self.R, self.alltoall
        choice = self.algorithm
        if self.algorithm == "auto":
            self.summary(self.splits, ME, self.topo)
            choice = self.decide(self.values, R, self.stride, 4096, self.topo, self.model)
        S = a._matrix(self.values, 0, self.stride, R)
        if choice is None:
            choice = self.b.choose_algorithm(S, 4096, self.topo, self.model)
        return a.AllToAllPlan(tuple(self.splits), tuple(S[s][ME] for s in range(R)), choice,
                              tuple(map(tuple, S)), self.algorithm, self.topo, self.model,
                              4096)

    def _halo(self, matrix: object, backward: bool) -> object:
        hp = self.halo_plan
        return hp.rank_plan(hp.transpose(matrix) if backward else matrix, self.topo, ME)

    def layer(self) -> tuple:
        plan = self._settle()
        rev = plan.reverse()
        return tuple(self._halo(p.matrix, backward) if p.algorithm == "halo" else p.algorithm
                     for p, backward in ((plan, False), (rev, False), (rev, True),
                                         (plan, True)))

    def call(self) -> tuple:
        plan = self._settle()
        if plan.algorithm != "halo":
            return (plan.algorithm,)
        return self._halo(plan.matrix, False), self._halo(plan.matrix, True)


def timed(fn: object, repeats: int) -> tuple[float, float, object]:
    """(median wall seconds, median CPU seconds of this process, fn's result). On a shared
    machine the CPU time is the steadier of the two (the wall clock adds the time other
    jobs held the cores)."""
    out = fn()  # warm-up: per-topology tables are built once per run, as in training
    samples, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        samples.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(samples), statistics.median(cpu), out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_comm_host.py", description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline", default="a865662",
                   help="git revision of the old comm/ (default: before the vectorised path; a "
                        "revision from before comm's sub-packages: it reads comm/*.py)")
    p.add_argument("--no-baseline", action="store_true", help="time this checkout only")
    add_output_args(p, "comm_host")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    bad = [r for r in args.ranks if r < 2 * G or r % G]
    if bad or args.repeats < 1:
        raise SystemExit(f"--ranks must be multiples of {G} of at least {2 * G} (got {bad}); "
                         f"--repeats >= 1 (got {args.repeats})")
    base = None if args.no_baseline else load_baseline(args.baseline)
    machine = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
               "cores": os.cpu_count(), "python": platform.python_version(),
               "numpy": np.__version__}
    out = output_dir(args)
    rows = []
    print(f"{'R':>5} {'algorithm':>9} {'path':>6} {'new ms/call':>12} {'(cpu)':>7} "
          f"{'base ms/call':>13} {'ratio':>6}  chosen")
    for R in args.ranks:
        S = split_matrix(R, seed=R)
        for algorithm in ("halo", "auto"):
            new = New(S, algorithm)
            old = Base(base, S, algorithm) if base is not None else None
            for path, exchanges in (("layer", 4), ("call", 2)):
                t_new, cpu_new, got = timed(getattr(new, path), args.repeats)
                t_old, _, want = timed(getattr(old, path), args.repeats) if old else (
                    None, None, None)
                if old is not None:  # same decisions and the same rank plans
                    assert len(got) == len(want) and all(
                        (g == w) if isinstance(g, str) else _plans_equal(g, w)
                        for g, w in zip(got, want, strict=True)), (R, algorithm, path)
                chosen = ",".join(g if isinstance(g, str) else "halo" for g in got)
                row = {"bench": "comm_host", "R": R, "nodes": R // G, "gpus_per_node": G,
                       "algorithm": algorithm, "path": path, "exchanges": exchanges,
                       "chosen": chosen, "repeats": args.repeats,
                       "new_ms_per_call": 1e3 * t_new / exchanges,
                       "new_cpu_ms_per_call": 1e3 * cpu_new / exchanges,
                       "base_ms_per_call": None if t_old is None else 1e3 * t_old / exchanges,
                       "baseline": None if base is None else args.baseline,
                       "git_sha": git_sha(), "load_avg_1m": os.getloadavg()[0], **machine}
                rows.append(row)
                ratio = "" if t_old is None else f"{t_old / t_new:6.1f}"
                old_ms = "" if t_old is None else f"{row['base_ms_per_call']:13.3f}"
                print(f"{R:>5} {algorithm:>9} {path:>6} {row['new_ms_per_call']:12.3f} "
                      f"{row['new_cpu_ms_per_call']:7.3f} {old_ms:>13} {ratio:>6}  {chosen}",
                      flush=True)
    with open(out / "comm_host.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"appended {len(rows)} rows to {out / 'comm_host.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
