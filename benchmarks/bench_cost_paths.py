"""The one cost path against an older comm/ (issue 28): same numbers, same host time.

    python benchmarks/bench_cost_paths.py [--baseline bf21b2c] [--cases 400] [--repeats 7]
                                          [--out DIR | --record]

Loads the comm/ of `--baseline` (a revision from before comm's sub-packages, as
bench_comm_host does) beside this checkout's, then
1. on `--cases` random split matrices (1-8 nodes of 1-8 ranks, a NIC count dividing them,
   pairwise and concurrent flat models, with and without corrections; the matrix, its
   transposed view and lists) checks that both return identical values from
   choose_algorithm, predict_flat, predict_halo, busiest_nic_bytes, row_summary,
   summary_bracket and decide_from_summaries: the exact floats, not a tolerance;
2. times choose_algorithm and row_summary of both, interleaved (old, new, old, ...), and
   prints the median of `--repeats` new/old ratios with their range (absolute times on a
   loaded machine say little; the ratio in one run does).
Writes cost_paths.json (the counts and ratios) to the output folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_output_args, git_sha, output_dir, print_written  # noqa: E402
from bench_comm_host import load_baseline  # noqa: E402

import comm  # noqa: E402
import comm.cost as new_cost  # noqa: E402

SHAPES = ((4, 2, False), (4, 4, True), (8, 4, False), (8, 8, False))  # nodes, ranks, pairwise


def _case(rng: np.random.Generator, trial: int) -> tuple[int, int, int, np.ndarray, dict]:
    nodes, G = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    if trial % 10 == 0:  # beyond 32 ranks: the blocked path
        nodes, G = int(rng.integers(5, 9)), 8
    divisors = [d for d in range(1, G + 1) if G % d == 0]
    nics = divisors[int(rng.integers(0, len(divisors)))]
    R = nodes * G
    S = rng.integers(0, 50, (R, R))
    S[rng.random((R, R)) < rng.random()] = 0
    kw = dict(nic_bandwidth=float(rng.uniform(1, 100)), local_bandwidth=float(rng.uniform(10, 1000)),
              alpha_net=float(rng.uniform(0, .2)), alpha_local=float(rng.uniform(0, .05)),
              halo_overhead_s=float(rng.uniform(0, .5)), flat_pairwise=bool(rng.random() < .3),
              flat_empty_messages=bool(rng.random() < .5))
    if rng.random() < .5:
        kw["corrections"] = ((1e3, 1.1, 0.9), (1e6, 0.8, 1.2))
    return nodes, G, nics, S, kw


def check_identical(base: object, cases: int) -> int:
    """Every value of both versions on `cases` random exchanges; AssertionError on the first
    difference. Returns the number of values compared."""
    old_cost = sys.modules["comm_base.cost"]
    rng = np.random.default_rng(0)
    n = 0
    for trial in range(cases):
        nodes, G, nics, S, kw = _case(rng, trial)
        R, rows = nodes * G, S.tolist()
        to = base.Topology.uniform(nodes, G, nics_per_node=nics)
        tn = comm.Topology.uniform(nodes, G, nics_per_node=nics)
        mo, mn = old_cost.CostModel(**kw), new_cost.CostModel(**kw)
        pairs = [(old_cost.choose_algorithm(M, 64, to, mo), new_cost.choose_algorithm(M, 64, tn, mn))
                 for M in (S, S.T, rows)]
        pairs += [(getattr(old_cost, f)(rows, 64, to, mo), getattr(new_cost, f)(rows, 64, tn, mn))
                  for f in ("predict_flat", "predict_halo")]
        pairs.append((old_cost.busiest_nic_bytes(rows, 64, to),
                      new_cost.busiest_nic_bytes(rows, 64, tn)))
        pairs += [(old_cost.row_summary(rows[s], s, to), new_cost.row_summary(rows[s], s, tn))
                  for s in range(R)]
        if not kw["flat_pairwise"]:
            packed = sum((rows[s] + old_cost.row_summary(rows[s], s, to) for s in range(R)), [])
            width = old_cost.summary_width(to) + R
            for f in ("summary_bracket", "decide_from_summaries"):
                pairs.append((getattr(old_cost, f)(packed, R, width, 64, to, mo),
                              getattr(new_cost, f)(packed, R, width, 64, tn, mn)))
        for i, (a, b) in enumerate(pairs):
            assert a == b, f"case {trial} value {i}: baseline {a!r}, this checkout {b!r}"
        n += len(pairs)
    return n


def time_ratios(base: object, repeats: int) -> list[dict]:
    old_cost = sys.modules["comm_base.cost"]
    rng = np.random.default_rng(1)

    def t(f: partial, number: int) -> float:
        return min(timeit.repeat(f, number=number, repeat=3)) / number

    rows = []
    for nodes, G, pairwise in SHAPES:
        R = nodes * G
        S = rng.integers(0, 500, (R, R)).tolist()
        kw = dict(flat_pairwise=pairwise, corrections=((1e3, 1.1, 0.9), (1e6, 0.8, 1.2)))
        to, tn = base.Topology.uniform(nodes, G), comm.Topology.uniform(nodes, G)
        mo, mn = old_cost.CostModel(**kw), new_cost.CostModel(**kw)
        choose, summary = [], []
        for _ in range(repeats):
            o = t(partial(old_cost.choose_algorithm, S, 64, to, mo), 100)
            choose.append(t(partial(new_cost.choose_algorithm, S, 64, tn, mn), 100) / o)
            o = t(partial(old_cost.row_summary, S[1], 1, to), 300)
            summary.append(t(partial(new_cost.row_summary, S[1], 1, tn), 300) / o)
        rows.append({"ranks": R, "pairwise": pairwise,
                     "choose_ratio": statistics.median(choose),
                     "choose_range": [min(choose), max(choose)],
                     "summary_ratio": statistics.median(summary),
                     "summary_range": [min(summary), max(summary)]})
        print(f"R={R:4d} pairwise={pairwise!s:5}: choose_algorithm new/old "
              f"{rows[-1]['choose_ratio']:.2f} ({min(choose):.2f}-{max(choose):.2f}), "
              f"row_summary {rows[-1]['summary_ratio']:.2f} ({min(summary):.2f}-{max(summary):.2f})")
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="bf21b2c",
                   help="git revision of the old comm/ (before its sub-packages: comm/*.py)")
    p.add_argument("--cases", type=int, default=400, help="random exchanges compared")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing pairs per shape")
    add_output_args(p, "cost_paths")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.cases < 1 or args.repeats < 1:
        raise SystemExit(f"--cases={args.cases} and --repeats={args.repeats} must be >= 1")
    out = output_dir(args)
    base = load_baseline(args.baseline)
    values = check_identical(base, args.cases)
    print(f"identical: {values} values on {args.cases} cases ({args.baseline} vs this checkout)")
    rows = time_ratios(base, args.repeats)
    path = out / "cost_paths.json"
    path.write_text(json.dumps({"commit": git_sha(), "baseline": args.baseline,
                                "cases": args.cases, "values_identical": values,
                                "timing": rows}, indent=1) + "\n")
    print_written(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
