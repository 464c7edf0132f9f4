"""Command line: simulate flat and HALO all-to-alls on a chosen network, print a table.

    python -m comm.netsim --topology frontier --nodes 16 --bytes 1M --algos flat,halo
    python -m comm.netsim --topology emulator --nodes 4 --ranks-per-node 4 --mbit 100
    python -m comm.netsim --topology frontier --nodes 64 --placement spread --machine-nodes 512
    python -m comm.netsim --topology platform --platform dgx-h100 --nodes 4 16 64

Sizes take K/M/G suffixes (powers of 1024). `--bytes` is what every rank sends every rank
(uniform splits). Bandwidth in the table = bytes a rank sends to other ranks / time.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from comm.netsim.engine import simulate
from comm.netsim.lumped import lumped_all_to_all
from comm.netsim.network import Network
from comm.netsim.topologies import dgx_fat_tree, emulator, from_platform, frontier, generic
from comm.netsim.traffic import PLACEMENTS, flat_all_to_all, halo_all_to_all, place, uniform_splits

__all__ = ["Case", "build_network", "main", "parse_size", "run_case"]

TOPOLOGIES = ("frontier", "dgx", "emulator", "generic", "platform")
ALGOS = ("flat", "halo")


def parse_size(text: str) -> int:
    """'256K' -> 262144; plain integers are bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count like 4096, 256K, 1M, 2G") from None


@dataclass(frozen=True)
class Case:
    """One simulated all-to-all and what it cost to simulate."""

    topology: str
    nodes: int
    ranks: int
    placement: str
    algo: str
    bytes_per_pair: int
    nonminimal: float | str
    message_gap: float
    message_overhead: float
    time_s: float
    bw_per_rank_gbs: float
    phase_end: dict[str, float]
    flows: int
    classes: int
    events: int
    sim_s: float


def build_network(args: argparse.Namespace, machine_nodes: int) -> Callable[..., Network]:
    """A builder of the machine: call it for the full network, or with sites=/scale= for
    a lumped one (`comm.netsim.lumped`)."""
    if args.topology == "frontier":
        return functools.partial(frontier, machine_nodes, nonminimal=args.nonminimal,
                                 link_latency=args.latency, groups=args.groups_in_machine)
    if args.topology == "dgx":
        return functools.partial(dgx_fat_tree, machine_nodes, taper=args.taper,
                                 link_latency=args.latency)
    if args.topology == "platform":
        return functools.partial(from_platform, args.platform, machine_nodes)
    if args.topology == "emulator":
        return functools.partial(emulator, machine_nodes, args.ranks_per_node, mbit=args.mbit,
                                 link_latency=args.latency)
    return functools.partial(generic, machine_nodes, args.ranks_per_node, args.nics_per_node,
                             nic_bw=args.nic_gbs * 1e9, intra_bw=args.intra_gbs * 1e9,
                             nodes_per_switch=args.nodes_per_switch, taper=args.taper,
                             link_latency=args.latency)


def run_case(build: Callable[..., Network], net: Network, nodes: int, placement: str,
             algo: str, bytes_per_pair: int, message_gap: float = 0.0,
             message_overhead: float = 0.0, seed: int = 0, groups: int | None = None,
             nonminimal: float | str = 0.0, lump: bool = True) -> Case:
    """Place `nodes` nodes of `net` (= build()), make the traffic of `algo`, simulate it;
    lump=True merges interchangeable nodes first (exact for these uniform splits)."""
    if algo not in ALGOS:
        raise ValueError(f"algo {algo!r} is not one of {ALGOS}")
    t0 = time.perf_counter()
    rank2gpu, topo = place(net, nodes, placement, groups=groups, seed=seed)
    R = len(rank2gpu)
    if lump:
        sim_net, traffic, sim_r2g = lumped_all_to_all(build, net, rank2gpu, topo, algo,
                                                      bytes_per_pair)
    else:
        S = uniform_splits(R, bytes_per_pair)
        traffic = flat_all_to_all(S) if algo == "flat" else halo_all_to_all(S, topo)
        sim_net, sim_r2g = net, rank2gpu
        del S
    res = simulate(sim_net, traffic, sim_r2g, message_overhead=message_overhead,
                   message_gap=message_gap)
    sent = bytes_per_pair * (R - 1)
    assert traffic.mult is not None, "Traffic.__post_init__ fills it"
    return Case(net.name.split("-")[0], nodes, R, placement, algo, bytes_per_pair, nonminimal,
                message_gap, message_overhead, res.time,
                sent / res.time / 1e9 if res.time > 0 else float("inf"), res.phase_end,
                int(traffic.mult[(traffic.src != traffic.dst) | traffic.remote].sum())
                if lump else res.flows,
                res.classes, res.events, time.perf_counter() - t0)


def format_table(cases: list[Case]) -> str:
    head = (f"{'topology':<9} {'nodes':>5} {'ranks':>5} {'placement':<8} {'algo':<5} "
            f"{'bytes/pair':>10} {'time ms':>10} {'GB/s/rank':>9} {'flows':>9} {'classes':>9} "
            f"{'sim s':>6}")
    rows = [head]
    for c in cases:
        rows.append(f"{c.topology:<9} {c.nodes:>5} {c.ranks:>5} {c.placement:<8} {c.algo:<5} "
                    f"{c.bytes_per_pair:>10} {c.time_s * 1e3:>10.4f} {c.bw_per_rank_gbs:>9.3f} "
                    f"{c.flows:>9} {c.classes:>9} {c.sim_s:>6.2f}")
    return "\n".join(rows)


def _fraction_or_balanced(text: str) -> float | str:
    return text if text == "balanced" else float(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m comm.netsim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", choices=TOPOLOGIES, default="frontier")
    p.add_argument("--nodes", type=int, nargs="+", default=[2], help="job node counts")
    p.add_argument("--machine-nodes", type=int, default=None,
                   help="nodes in the machine (default: the largest job)")
    p.add_argument("--platform", default="frontier",
                   help="--topology platform: a configs/platforms name or TOML path")
    p.add_argument("--placement", choices=PLACEMENTS, default="packed")
    p.add_argument("--groups", type=int, default=None, help="spread over this many groups")
    p.add_argument("--groups-in-machine", type=int, default=None,
                   help="Frontier Dragonfly groups (Valiant paths need >= 3; Frontier: 74)")
    p.add_argument("--no-lump", action="store_true",
                   help="simulate every rank (default: lump interchangeable nodes, exact)")
    p.add_argument("--seed", type=int, default=0, help="random placement seed")
    p.add_argument("--algos", default="flat,halo")
    p.add_argument("--bytes", nargs="+", default=["1M"], help="bytes per rank pair")
    p.add_argument("--nonminimal", type=_fraction_or_balanced, default=0.0,
                   help="Dragonfly share of non-minimal (Valiant) routes, or 'balanced' "
                        "(unpublished; see comm.netsim.topologies)")
    p.add_argument("--gap", type=float, default=0.0, help="serial seconds per posted message")
    p.add_argument("--overhead", type=float, default=0.0, help="seconds before a message starts")
    p.add_argument("--latency", type=float, default=0.0, help="seconds per link")
    p.add_argument("--ranks-per-node", type=int, default=8, help="emulator / generic")
    p.add_argument("--mbit", type=float, default=100.0, help="emulator NIC shaping")
    p.add_argument("--nics-per-node", type=int, default=1, help="generic")
    p.add_argument("--nic-gbs", type=float, default=25.0, help="generic NIC GB/s")
    p.add_argument("--intra-gbs", type=float, default=100.0, help="generic GB/s per GPU")
    p.add_argument("--nodes-per-switch", type=int, default=4, help="generic")
    p.add_argument("--taper", type=float, default=1.0, help="generic / dgx uplink taper")
    p.add_argument("--json", default=None, help="append one JSON row per case to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    bad = [a for a in algos if a not in ALGOS]
    if bad:
        raise SystemExit(f"--algos {bad} not in {ALGOS}")
    sizes = [parse_size(s) for s in args.bytes]
    machine = args.machine_nodes or max(args.nodes)
    build = build_network(args, machine)
    net = build()
    cases = []
    print(format_table([]), flush=True)
    for n in args.nodes:
        for b in sizes:
            for a in algos:
                cases.append(run_case(build, net, n, args.placement, a, b, args.gap,
                                      args.overhead, args.seed, args.groups, args.nonminimal,
                                      lump=not args.no_lump))
                print(format_table(cases[-1:]).splitlines()[-1], flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for c in cases:
                f.write(json.dumps(asdict(c)) + "\n")
    ratio = _ratios(cases)
    if ratio:
        print("\nflat time / HALO time:", ", ".join(ratio))
    return 0


def _ratios(cases: list[Case]) -> list[str]:
    by = {(c.nodes, c.bytes_per_pair, c.algo): c.time_s for c in cases}
    return [f"{n} nodes {b} B: {by[(n, b, 'flat')] / by[(n, b, 'halo')]:.2f}x"
            for (n, b, a) in by if a == "flat" and (n, b, "halo") in by
            and np.isfinite(by[(n, b, "halo")]) and by[(n, b, "halo")] > 0]
