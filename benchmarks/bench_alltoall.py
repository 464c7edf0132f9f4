"""Flat vs HALO vs auto all-to-all on the namespace-emulated cluster (comm.emulate).

    .venv/bin/python benchmarks/bench_alltoall.py                  # the issue's two setups
    .venv/bin/python benchmarks/bench_alltoall.py --setups 4x2@1000 --sizes 1K,256K,4M

A setup `NxG@M` is N nodes x G ranks per node with M Mbit/s per node NIC. For every message
size S (bytes per rank pair) and split pattern (balanced: every pair S; skewed: rank d gets
weight 1/(1 + (d - s) mod R) from rank s, scaled so the mean pair is S), each algorithm runs
warm-up + repeats, the three alternating inside each repeat, every arm in every position
and after every other equally often; a repeat is start -> exchange -> max over ranks of
the elapsed time, cheap points repeat until each arm has run --min-time-s, and the median
repeat is reported. The emulated nodes share this host's clock, so by default
(--start-at clock) all ranks are released at one agreed time on it and timed from that
time; --start-at barrier times each rank from its own exit of a barrier instead, which on
2 cores adds the exits' spread (ms; printed with the summary) to every exchange.
`--control` adds the flat call again as a fourth arm: how far two medians of the same
exchange differ is the resolution of every comparison in the run.
Numbers per row:
    algbw_MBps   bytes each rank sends to other ranks (max over ranks) / time
    vs_flat      time / flat time, measured in the same run (<= 1 means not slower)
    nic_frac     time the shaped NICs need at least (busiest node direction / rate) / time
Results are appended to alltoall.jsonl (git SHA, device) and plotted in alltoall.png, in
runs/bench/alltoall/ (ignored by git) or `--out DIR`; `--record` writes them to
benchmarks/results/, the tracked record. Inside each emulated node this script runs as a torchrun
worker (--worker); the driver never touches torch.distributed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import add_output_args, git_sha, output_dir, print_written  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ROW_BYTES = 1024  # one row = 256 fp32 values
ALGORITHMS = ("flat", "halo", "auto")
CONTROL = "flat-again"  # --control: the flat call measured a second time, as its own arm
DEFAULT_SETUPS = "8x2@100,4x2@1000"  # the two targets


def parse_size(text: str) -> int:
    units = {"K": 1024, "M": 1024**2}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def split_matrix(R: int, pair_bytes: int, pattern: str) -> list[list[int]]:
    rows = max(1, pair_bytes // ROW_BYTES)
    if pattern == "balanced":
        return [[rows] * R for _ in range(R)]
    weights = [[1.0 / (1 + (d - s) % R) for d in range(R)] for s in range(R)]
    return [[max(0, round(rows * R * w / sum(ws))) for w in ws] for ws in weights]


def nic_bound_s(S: list[list[int]], G: int, mbit: float) -> float:
    """Busiest node NIC direction / shaped rate: no algorithm moving these bytes beats it."""
    R = len(S)
    nodes = R // G
    out = [0] * nodes
    inn = [0] * nodes
    for s in range(R):
        for d in range(R):
            if s // G != d // G:
                out[s // G] += S[s][d] * ROW_BYTES
                inn[d // G] += S[s][d] * ROW_BYTES
    return max(out + inn) / (mbit * 1e6 / 8)


# ---- worker (runs under torchrun inside the emulated cluster) ---------------------------
SLOTS = 4  # --dispatch: experts per rank whose counts travel ahead of the rows


def dispatch_arms(S: list[list[int]], group, topo, model) -> dict:
    """--dispatch: the MoE dispatcher's exchange, per-slot counts first (trainer.distributed.parallel).
    Planned arms send the counts in `comm.plan_all_to_all`'s one small exchange;
    "auto-unplanned" is the dispatcher before it: the counts in their own exchange, then
    all_to_all(auto) with the out splits known, which still makes its summary round."""
    import torch
    import torch.distributed as dist

    from comm import all_to_all, plan_all_to_all
    from comm.collectives.flat import exchange_ints

    rank, R = dist.get_rank(group), len(S)
    counts = [[S[rank][d] // SLOTS + (j < S[rank][d] % SLOTS) for j in range(SLOTS)]
              for d in range(R)]

    def planned(algorithm: str):
        def run(x: torch.Tensor) -> None:
            plan, _ = plan_all_to_all(S[rank], group, algorithm, topo, model, ROW_BYTES,
                                      counts)
            all_to_all(x, S[rank], group, plan=plan)
        return run

    def unplanned(x: torch.Tensor) -> None:
        got = exchange_ints([v for row in counts for v in row], group, torch.device("cpu"))
        out = [sum(got[s * SLOTS:(s + 1) * SLOTS]) for s in range(R)]
        all_to_all(x, S[rank], group, "auto", topo, out_splits=out, cost_model=model)

    return {a: planned(a) for a in ALGORITHMS} | {"auto-unplanned": unplanned}


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from comm import CostModel, Topology, calibrate, choose_algorithm
    from comm.tools.calibrate import time_samples

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    rank, R = dist.get_rank(), dist.get_world_size()
    # Discovery finds the nodes (one namespace each) but cannot see that an emulated node
    # has a single NIC shared by its ranks; say so, and give the cost model its rate.
    topo = dataclasses.replace(Topology.discover(group), rank2nic=(0,) * R)
    G = R // topo.num_nodes
    mbit = float(os.environ["PIPER_EMU_NIC_MBIT"])
    model = calibrate(group, topo, row_numel=ROW_BYTES // 4,
                      base=CostModel.for_backend("gloo", nic_bandwidth=mbit * 1e6 / 8))
    calibrated = {f"model_{k}": v for k, v in dataclasses.asdict(model).items()}
    rows_out = []
    for pattern in args.patterns:
        for size in args.sizes:
            S = split_matrix(R, size, pattern)
            arms = {a: a for a in ALGORITHMS} | ({CONTROL: "flat"} if args.control else {})
            if args.dispatch:
                arms = dispatch_arms(S, group, topo, model)
            # Arms in every order (`comm.tools.calibrate.arm_orders`), a whole number of rounds so
            # every order occurs equally often; cheap points repeat until each arm has run
            # --min-time-s (at most --max-repeats).
            spread: dict[str, list[float]] = {}
            samples = time_samples(group, topo, S, ROW_BYTES // 4, arms, args.repeats,
                                   args.warmup, model, args.min_time_s, args.max_repeats,
                                   whole_cycles=True, start=args.start, start_spread=spread)
            times = {a: statistics.median(v) for a, v in samples.items()}
            choice = choose_algorithm(S, ROW_BYTES, topo, model)  # what auto ran
            sent = max(sum(S[s]) - S[s][s] for s in range(R)) * ROW_BYTES
            bound = nic_bound_s(S, G, mbit)
            for algorithm, t in times.items():
                rows_out.append({
                    "nodes": topo.num_nodes, "gpus_per_node": G, "nic_mbit": mbit,
                    "pattern": pattern, "pair_bytes": size, "algorithm": algorithm,
                    "time_s": t, "algbw_MBps": sent / t / 1e6, "vs_flat": t / times["flat"],
                    "nic_frac": bound / t, "repeats": len(samples[algorithm]),
                    "start": args.start,
                    "start_spread_ms": statistics.median(spread[algorithm]) * 1e3,
                    "auto_choice": choice,
                    **calibrated,
                })
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows_out))
    dist.destroy_process_group()
    return 0


# ---- driver ----------------------------------------------------------------------------


def run_setup(setup: str, sizes: list[int], args: argparse.Namespace) -> list[dict]:
    shape, mbit = setup.split("@")
    nodes, gpus = (int(v) for v in shape.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "comm.emulate", "--nodes", str(nodes), "--gpus-per-node",
               str(gpus), "--nic-mbit", mbit, "--mtu", str(args.mtu),
               "--timeout-s", str(args.timeout_s), "--",
               sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-out", str(out),
               "--sizes", ",".join(map(str, sizes)), "--patterns", ",".join(args.patterns),
               "--warmup", str(args.warmup), "--repeats", str(args.repeats),
               "--min-time-s", str(args.min_time_s), "--max-repeats", str(args.max_repeats),
               "--start-at", args.start,
               *(["--control"] if args.control else []),
               *(["--dispatch"] if args.dispatch else [])]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"}
        rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
        if rc != 0 or not out.exists():
            print(f"setup {setup} failed with exit status {rc}", file=sys.stderr)
            return []
        return [{**r, "mtu": args.mtu} for r in json.loads(out.read_text())]


def points_by_setup(rows: list[dict]) -> dict[tuple, dict[tuple, dict[str, dict]]]:
    """setup (nodes, ranks per node, Mbit/s) -> point (setup, pattern, pair bytes) ->
    algorithm (arm) -> row, setups in sorted order."""
    by_point: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["nodes"], r["gpus_per_node"], r["nic_mbit"], r["pattern"], r["pair_bytes"])
        by_point.setdefault(key, {})[r["algorithm"]] = r
    return {setup: {k: v for k, v in by_point.items() if k[:3] == setup}
            for setup in sorted({k[:3] for k in by_point})}


def summarize(rows: list[dict]) -> None:
    """The issue's targets per setup: HALO/flat and NIC fraction at >= 256 KiB per pair,
    and auto against the better of flat and HALO at every point (all within one run)."""
    for setup, pts in points_by_setup(rows).items():
        big = [v for k, v in pts.items() if k[4] >= 256 << 10]
        ratio = [v["halo"]["vs_flat"] for v in big]
        frac = [v["halo"]["nic_frac"] for v in big]
        best = [min(v["flat"]["time_s"], v["halo"]["time_s"]) for v in pts.values()]
        auto = [v["auto"]["time_s"] / b for v, b in zip(pts.values(), best, strict=True)]
        # The choice alone: the measured time of the algorithm auto ran, over the best.
        chose = [v[v["auto"]["auto_choice"]]["time_s"] / b
                 for v, b in zip(pts.values(), best, strict=True)]
        control = [abs(v[CONTROL]["time_s"] / v["flat"]["time_s"] - 1) for v in pts.values()
                   if CONTROL in v]
        timed = [r for v in pts.values() for r in v.values() if "start" in r]
        if timed:
            spread = [r["start_spread_ms"] for r in timed]
            print(f"{setup[0]}x{setup[1]}@{setup[2]:g}: ranks started "
                  f"{min(spread):.2f}-{max(spread):.2f} ms apart (median per arm and point, "
                  f"start={','.join(sorted({r['start'] for r in timed}))})")
        if control:
            print(f"{setup[0]}x{setup[1]}@{setup[2]:g}: control (flat measured twice as two "
                  f"arms) differs by {min(control):.1%}-{max(control):.1%}: the resolution "
                  "of these medians")
        print(f"{setup[0]}x{setup[1]}@{setup[2]:g}: >= 256 KiB HALO/flat "
              f"{min(ratio, default=0):.2f}-{max(ratio, default=0):.2f}, HALO NIC fraction "
              f"{min(frac, default=0):.2f}-{max(frac, default=0):.2f}; auto/best "
              f"{min(auto):.2f}-{max(auto):.2f}, within 5 % at {sum(a <= 1.05 for a in auto)} "
              f"of {len(auto)} points; its choice within 5 % at "
              f"{sum(c <= 1.05 for c in chose)} of {len(chose)}")


def summarize_dispatch(rows: list[dict]) -> None:
    """Planned auto against the better planned algorithm, and against the unplanned call."""
    for setup, by_point in points_by_setup(rows).items():
        pts = list(by_point.values())
        best = [v["auto"]["time_s"] / min(v["flat"]["time_s"], v["halo"]["time_s"])
                for v in pts]
        old = [v["auto"]["time_s"] / v["auto-unplanned"]["time_s"] for v in pts]
        print(f"{setup[0]}x{setup[1]}@{setup[2]:g} dispatch: planned auto / better planned "
              f"{min(best):.2f}-{max(best):.2f}, within 5 % at {sum(b <= 1.05 for b in best)} "
              f"of {len(best)}; planned auto / unplanned auto {min(old):.2f}-{max(old):.2f}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = sorted({(r["nodes"], r["gpus_per_node"], r["nic_mbit"]) for r in rows})
    fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 4), squeeze=False)
    for ax, (n, g, m) in zip(axes[0], setups, strict=True):
        for pattern, style in (("balanced", "-"), ("skewed", "--")):
            for algorithm in ALGORITHMS:
                pts = sorted((r["pair_bytes"], r["nic_frac"]) for r in rows
                             if (r["nodes"], r["gpus_per_node"], r["nic_mbit"]) == (n, g, m)
                             and r["pattern"] == pattern and r["algorithm"] == algorithm)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                            label=f"{algorithm} {pattern}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank pair")
        ax.set_ylabel("fraction of the shaped-NIC bound")
        ax.set_title(f"{n} nodes x {g} ranks, {m:g} Mbit/s NIC (emulated)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--setups", default=DEFAULT_SETUPS,
                   help="comma list of NODESxGPUS@MBIT")
    p.add_argument("--sizes", default=None, help="bytes per pair, e.g. 1K,256K,16M "
                   "(default: 1K..1M at <= 100 Mbit/s, 1K..16M above: 16 MB x 14 peers at "
                   "100 Mbit/s would take 36 s per repeat)")
    p.add_argument("--patterns", default="balanced,skewed")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="at least this many timed repeats")
    # A 13 ms exchange of 8 ranks on 2 cores spreads from 8 to 21 ms (5th-95th percentile,
    # independent from call to call): a median of 64 repeats moves by +-9 %, of ~450 by +-3 %.
    p.add_argument("--min-time-s", type=float, default=6.0,
                   help="cheap points repeat until each algorithm spent this long")
    p.add_argument("--max-repeats", type=int, default=600)
    p.add_argument("--control", action="store_true",
                   help=f"add a fourth arm, {CONTROL!r}: the flat call again, to show how far "
                   "two medians of the same exchange differ")
    p.add_argument("--dispatch", action="store_true",
                   help="time the MoE dispatcher's path instead: per-slot counts ahead of the "
                   "rows, planned (flat, halo, auto) and auto as the dispatcher ran it before "
                   "plan_all_to_all (auto-unplanned); rows go to alltoall_dispatch.jsonl")
    # Each setup's emulated job: the default run with --min-time-s 20 takes ~20 min at 4x2.
    p.add_argument("--timeout-s", type=float, default=2400,
                   help="seconds one setup's emulated job may run before it is stopped")
    p.add_argument("--mtu", type=int, default=1500, help="emulated link MTU (bytes)")
    # comm.tools.calibrate.START_MODES, spelt out: the driver does not import torch.
    p.add_argument("--start-at", dest="start", choices=("clock", "barrier"), default="clock",
                   help="when a repeat starts: 'clock' releases all ranks at one time on the "
                   "host's clock (the emulated nodes share it); 'barrier' times each rank "
                   "from its own exit of a barrier, whose spread counts against the exchange")
    add_output_args(p, "alltoall")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.patterns = args.patterns.split(",")
    if args.worker:
        args.sizes = [int(v) for v in args.sizes.split(",")]
        return worker(args)
    out = output_dir(args)
    meta = {"git_sha": git_sha(), "device": f"{platform.node()} {platform.processor() or 'cpu'}"
            f" ({os.cpu_count()} cores), emulated NICs", "time": time.strftime("%FT%T")}
    rows = []
    for setup in args.setups.split(","):
        mbit = float(setup.split("@")[1])
        default = "1K,16K,256K,1M" if mbit <= 100 else "1K,16K,256K,1M,4M,16M"
        sizes = [parse_size(s) for s in (args.sizes or default).split(",")]
        rows += [{**meta, **r} for r in run_setup(setup, sizes, args)]
    name = "alltoall_dispatch" if args.dispatch else "alltoall"
    with open(out / f"{name}.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{'setup':<12} {'pattern':<9} {'pair':>8} {'algo':<5} {'time ms':>9} "
          f"{'algbw MB/s':>10} {'vs flat':>8} {'NIC frac':>8} {'auto ran':>8}")
    for r in rows:
        setup = f"{r['nodes']}x{r['gpus_per_node']}@{r['nic_mbit']:g}"
        print(f"{setup:<12} {r['pattern']:<9} {r['pair_bytes']:>8} {r['algorithm']:<5} "
              f"{r['time_s'] * 1e3:>9.2f} {r['algbw_MBps']:>10.2f} {r['vs_flat']:>8.3f} "
              f"{r['nic_frac']:>8.3f} {r['auto_choice']:>8}")
    if args.dispatch:
        summarize_dispatch(rows)
        print_written(out / f"{name}.jsonl")
        return 0 if rows else 1
    summarize(rows)
    if rows:  # the default run owns alltoall.png; other setups get their own picture
        tag = "" if args.setups == DEFAULT_SETUPS else "_" + args.setups.replace(",", "_")
        tag += "" if args.mtu == 1500 else f"_mtu{args.mtu}"
        png = out / f"alltoall{tag.replace('@', 'at')}.png"
        plot(rows, png)
        print_written(out / f"{name}.jsonl", png)
    else:
        print_written(out / f"{name}.jsonl")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
