"""HALO vs flat all-to-all on the simulated Frontier Dragonfly, 2 to 512 nodes (issue 5).

Machine: frontier(1024 nodes in 8 populated groups, 74 groups of switches: the published
1.75:1 taper; see comm.netsim.topologies). Every rank sends every rank `bytes` (uniform
splits), simulated with comm.netsim (max-min fair flows, lumped interchangeable nodes).

Sweeps (all unpublished quantities are swept, not guessed):
    routing    minimal | balanced (Valiant share of adaptive routing: not published)
    placement  packed (fill switches and groups) | spread (round-robin over 8 groups) |
               random (seeded, of the 1024 machine nodes; <= 256 nodes to bound memory)
    bytes/gap  1 MiB with no per-message cost (pure bandwidth), and 4 KiB, 64 KiB, 1 MiB
               with a serial per-message posting cost of --gap seconds (LogGP g;
               the RCCL/Slingshot value is not published, default 5 us is an assumption)
The published claim (docs/reference.md 1.4): HALO 1.2-9x the vendor all-to-all at 16-512 nodes.
Speed section: the flat all-to-all over 1024 GPUs, full (10^6 flows) and lumped, warm-up +
median of --repeats.
DGX section: the rail-optimised fat tree (dgx_fat_tree) with spine taper 1, 2, 4, 4-256
nodes, 1 MiB per pair, bandwidth only: HALO's rail-aligned phase II avoids the spines.
Validation section: every flat / HALO row that benchmarks/bench_alltoall.py measured on the
emulated cluster (the record benchmarks/results/alltoall.jsonl) is simulated on `emulator(nodes, G, mbit)` with
the same split matrix; predicted vs measured time and the error are printed and stored. Its
NIC efficiency is fitted on 2-node all-to-all rows; benchmarks/bench_netsim_validate.py is
the validation with an independent point-to-point calibration (the README's table).

    python benchmarks/bench_netsim.py             # full sweep, ~10 min on 2 cores
    python benchmarks/bench_netsim.py --quick     # 2-64 nodes, packed, balanced only
    python benchmarks/bench_netsim.py --sections dgx,validate

Results: bench_netsim.jsonl (rows appended) and bench_netsim.png in runs/bench/netsim/ (ignored
by git) or `--out DIR`; `--record` writes them to benchmarks/results/, the tracked record.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from _common import RECORDS, add_output_args, git_sha, output_dir, previous, print_written

from comm.netsim import (
    dgx_fat_tree,
    emulator,
    flat_all_to_all,
    frontier,
    halo_all_to_all,
    place,
    simulate,
    uniform_splits,
)
from comm.netsim.cli import Case, format_table, run_case
from comm.netsim.topologies import FRONTIER_GROUPS
from comm.topology import Topology

PUBLISHED = (1.2, 9.0)  # HALO / vendor all-to-all bandwidth, 16-512 nodes (docs/reference.md 1.4)


def _device() -> str:
    return f"cpu:{platform.processor() or platform.machine()} (simulated Frontier)"


def sweep(args: argparse.Namespace) -> list[dict]:
    rows = []
    routings = ["balanced"] if args.quick else ["minimal", "balanced"]
    placements = ["packed"] if args.quick else ["packed", "spread", "random"]
    nodes = [n for n in (2, 4, 8, 16, 32, 64, 128, 256, 512) if n <= args.max_nodes]
    sizes = [(1 << 20, 0.0), (4 << 10, args.gap), (64 << 10, args.gap), (1 << 20, args.gap)]
    print(format_table([]) + "  routing   ratio")
    for routing in routings:
        nm = 0.0 if routing == "minimal" else "balanced"
        build = functools.partial(frontier, 1024, nonminimal=nm, groups=FRONTIER_GROUPS)
        net = build()
        for placement in placements:
            for n in nodes:
                if placement == "random" and n > args.max_random:
                    continue
                groups = min(8, n) if placement == "spread" else None
                for b, gap in sizes:
                    pair: dict[str, Case] = {}
                    for algo in ("flat", "halo"):
                        pair[algo] = run_case(build, net, n, placement, algo, b, gap, 0.0,
                                              args.seed, groups, nm)
                    ratio = pair["flat"].time_s / pair["halo"].time_s
                    for c in pair.values():
                        row = asdict(c) | {"kind": "frontier", "routing": routing,
                                           "flat_over_halo": ratio}
                        rows.append(row)
                        print(format_table([c]).splitlines()[-1]
                              + f"  {routing:<9} {ratio:5.2f}", flush=True)
    return rows


def speed(args: argparse.Namespace) -> list[dict]:
    """Wall time of the 1024-GPU flat all-to-all, full and lumped (median of repeats)."""
    build = functools.partial(frontier, 128)
    net = build()
    rank2gpu, topo = place(net, 128)
    out = []
    for mode in ("full", "lumped"):
        times = []
        for rep in range(args.repeats + 1):  # the first run is the warm-up
            t0 = time.perf_counter()
            if mode == "full":
                res = simulate(net, flat_all_to_all(uniform_splits(1024, 1 << 20)), rank2gpu)
                sim_time = res.time
            else:
                sim_time = run_case(build, net, 128, "packed", "flat", 1 << 20).time_s
            if rep:
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        out.append({"kind": "speed", "mode": mode, "gpus": 1024, "median_s": med,
                    "repeats": args.repeats, "sim_time_s": sim_time})
        print(f"flat all-to-all, 1024 GPUs, {mode:<6}: {med:6.2f} s wall (median of "
              f"{args.repeats}), simulated {sim_time * 1e3:.3f} ms")
    return out


def dgx(args: argparse.Namespace) -> list[dict]:
    """HALO vs flat on DGX H100 clusters with tapered spines (bandwidth only)."""
    rows = []
    print("\n" + format_table([]) + "  taper   ratio")
    for taper in (1.0, 2.0, 4.0):
        build = functools.partial(dgx_fat_tree, 256, taper=taper)
        net = build()
        for n in (4, 16, 64, 256):
            pair = {a: run_case(build, net, n, "packed", a, 1 << 20) for a in ("flat", "halo")}
            ratio = pair["flat"].time_s / pair["halo"].time_s
            for c in pair.values():
                rows.append(asdict(c) | {"kind": "dgx", "taper": taper, "flat_over_halo": ratio})
                print(format_table([c]).splitlines()[-1] + f"  {taper:<5g} {ratio:5.2f}",
                      flush=True)
    return rows


def validate() -> list[dict]:
    """Simulated vs emulator-measured times (rows of bench_alltoall.py, same splits)."""
    measured = RECORDS / "alltoall.jsonl"
    if not measured.exists():
        print(f"no {measured}: run benchmarks/bench_alltoall.py first")
        return []
    # The split matrices come from bench_alltoall itself, so both sides move the same rows.
    spec = importlib.util.spec_from_file_location("bench_alltoall",
                                                  Path(__file__).with_name("bench_alltoall.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = []
    for line in measured.read_text().splitlines():
        m = json.loads(line)
        if m["algorithm"] not in ("flat", "halo"):
            continue
        n, G, mbit = m["nodes"], m["gpus_per_node"], m["nic_mbit"]
        S = np.array(mod.split_matrix(n * G, m["pair_bytes"], m["pattern"])) * mod.ROW_BYTES
        tr = flat_all_to_all(S) if m["algorithm"] == "flat" else \
            halo_all_to_all(S, Topology.uniform(n, G, nics_per_node=1))
        pred = simulate(emulator(n, G, mbit=mbit), tr, np.arange(n * G)).time
        out.append({"kind": "validation", "nodes": n, "gpus_per_node": G, "nic_mbit": mbit,
                    "pattern": m["pattern"], "pair_bytes": m["pair_bytes"],
                    "algo": m["algorithm"], "measured_s": m["time_s"], "predicted_s": pred,
                    "measured_at": m.get("time"), "measured_git": m.get("git_sha")})
    # One calibration: the payload share of the shaped NIC rate (emulator(nic_efficiency=)),
    # fitted on the 2-node, >= 256 KiB rows only and checked on all the others. The fluid
    # model scales every NIC-bound time by 1 / efficiency, so no re-simulation is needed.
    fit = [r["predicted_s"] / r["measured_s"] for r in out
           if r["nodes"] == 2 and r["pair_bytes"] >= 256 << 10 and r["nic_mbit"] <= 1000]
    eff = statistics.median(fit) if fit else 1.0
    print(f"\nemulator validation; calibrated nic_efficiency = {eff:.3f} (fit on 2-node "
          f">= 256 KiB rows)")
    print(f"{'nodes':>5} {'G':>2} {'Mbit/s':>7} {'pattern':<8} {'bytes/pair':>10} {'algo':<5} "
          f"{'measured ms':>11} {'ideal ms':>9} {'error':>6} {'calib ms':>9} {'error':>6}")
    for r in out:
        r["error"] = r["predicted_s"] / r["measured_s"] - 1.0
        r["nic_efficiency"] = eff
        r["calibrated_s"] = r["predicted_s"] / eff
        r["calibrated_error"] = r["calibrated_s"] / r["measured_s"] - 1.0
        print(f"{r['nodes']:>5} {r['gpus_per_node']:>2} {r['nic_mbit']:>7g} {r['pattern']:<8} "
              f"{r['pair_bytes']:>10} {r['algo']:<5} {r['measured_s'] * 1e3:>11.2f} "
              f"{r['predicted_s'] * 1e3:>9.2f} {r['error']:>+6.0%} "
              f"{r['calibrated_s'] * 1e3:>9.2f} {r['calibrated_error']:>+6.0%}")
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    halo = [r for r in rows if r.get("algo") == "halo" and r.get("routing") == "balanced"]
    placements = sorted({r["placement"] for r in halo})
    fig, axes = plt.subplots(1, len(placements), figsize=(5 * len(placements), 4),
                             squeeze=False, sharey=True)
    for ax, placement in zip(axes[0], placements, strict=True):
        sel = [r for r in halo if r["placement"] == placement]
        for key in sorted({(r["bytes_per_pair"], r["message_gap"]) for r in sel}):
            pts = sorted((r["nodes"], r["flat_over_halo"]) for r in sel
                         if (r["bytes_per_pair"], r["message_gap"]) == key)
            label = f"{key[0] >> 10} KiB, gap {key[1] * 1e6:g} us"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.fill_between([16, 512], *PUBLISHED, color="tab:green", alpha=0.12,
                        label="published 1.2-9x (16-512 nodes)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"Frontier model, {placement}, balanced routing")
        ax.set_xlabel("nodes (8 GCDs each)")
    axes[0][0].set_ylabel("flat time / HALO time")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--gap", type=float, default=5e-6, help="serial seconds per message")
    p.add_argument("--max-nodes", type=int, default=512)
    p.add_argument("--max-random", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sections", default="frontier,speed,dgx,validate",
                   help="comma-separated subset of frontier,speed,dgx,validate; 'plot' "
                        "alone redraws the plot from the last run's rows in the JSONL (the "
                        "output folder's, else the record's)")
    add_output_args(p, "netsim")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sections = {x.strip() for x in args.sections.split(",")}
    if args.quick:
        args.max_nodes = min(args.max_nodes, 64)
    out = output_dir(args)
    if sections == {"plot"}:
        src = previous(out, "bench_netsim.jsonl")
        old = [json.loads(x) for x in src.read_text().splitlines()]
        last = max(r["time"] for r in old if r.get("kind") == "frontier")
        plot([r for r in old if r.get("time") == last], out / "bench_netsim.png")
        print(f"rows of {last} from {src}")
        print_written(out / "bench_netsim.png")
        return
    meta = {"git": git_sha(), "device": _device(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    rows = sweep(args) if "frontier" in sections else []
    rows += speed(args) if "speed" in sections else []
    rows += dgx(args) if "dgx" in sections else []
    rows += validate() if "validate" in sections else []
    with open(out / "bench_netsim.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(meta | r) + "\n")
    if "frontier" in sections:
        plot(rows, out / "bench_netsim.png")
    print(f"\nrows appended to {out / 'bench_netsim.jsonl'}"
          + (f"; plot {out / 'bench_netsim.png'}" if "frontier" in sections else ""))


if __name__ == "__main__":
    main()
