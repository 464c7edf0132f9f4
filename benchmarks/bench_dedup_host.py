"""Host time of one MoE layer's expert path per algorithm (flat / halo / dedup), in process.

    python benchmarks/bench_dedup_host.py [--repeats 15] [--warmup 3] [--profile dedup]
                                          [--out DIR | --record]

Four gloo processes on this machine (`comm.run_local`, loopback TCP, no emulated wire), EP = 4
declared as 2 nodes x 2 ranks (`Topology.uniform(2, 2)`), one MoE layer of the emulator job's
model (`benchmarks/bench_moe_overlap.py`: the tiny preset with 16 experts at top-4, d_model
128, no shared experts) in float32 on 4 sequences of 256 tokens per rank. One call is the
layer's forward and backward (`loss = (layer(x) * g).sum()`, routing, sort, exchanges,
expert GEMMs, and for dedup the relay's fan-out and sums), every rank starting together
after a barrier; the call's time is the slowest rank's. Repeats interleave the algorithms
(flat, halo, dedup, flat, ...) on the same input, so load drift of the shared machine hits
each alike; the row gives each algorithm's median over the repeats after `--warmup`, and its
ratio to halo and to flat. Loopback moves the rows at memory speed, so what this measures
is the host work around them (what the emulator's step pays on top of the wire time).
`--profile ALGO` also prints rank 0's torch.profiler table for ALGO (top CPU ops).

Rows go to runs/bench/dedup_host/dedup_host.jsonl (ignored), `--out DIR`, or with `--record`
to benchmarks/results/dedup_host.jsonl, with the git SHA and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import add_output_args, cpu_name, git_sha, output_dir, print_written  # noqa: E402

ALGOS = ("flat", "halo", "dedup")


def _worker(rank: int, world: int, group, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from comm import Topology
    from comm.ep import EPDispatcher
    from model import MoELayer, presets
    from trainer.distributed.parallel import shard_layer

    torch.set_num_threads(1)
    cfg = presets.get("tiny").replace(n_routed_experts=args["experts"], top_k=args["top_k"],
                                      moe_ffn_dim=args["ffn"])
    topo = Topology.uniform(2, world // 2)
    layers = {}
    for algo in ALGOS:
        torch.manual_seed(0)
        layer = MoELayer(cfg)
        disp = EPDispatcher(group, world, layer.n_slots, algo, topo, None, "none", 1)
        shard_layer(layer, disp, rank)
        layers[algo] = layer
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args["batch"], args["seq"], cfg.d_model, generator=g)
    dy = torch.randn(x.shape, generator=g)

    def call(algo: str) -> float:
        layer = layers[algo]
        xr = x.clone().requires_grad_(True)
        dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        (layer(xr) * dy).sum().backward()
        return time.perf_counter() - t0, time.process_time() - c0

    times: dict[str, list[float]] = {a: [] for a in ALGOS}
    cpu: dict[str, list[float]] = {a: [] for a in ALGOS}
    for r in range(args["warmup"] + args["repeats"]):
        for algo in ALGOS:
            t, c = call(algo)
            if r >= args["warmup"]:
                times[algo].append(t)
                cpu[algo].append(c)
    prof_table = None
    if args["profile"]:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                call(args["profile"])
        if rank == 0:
            prof_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    dist.barrier(group)
    return {"times": times, "cpu": cpu, "prof": prof_table}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256,
                   help="experts' hidden size (the preset's 256; small: the exchanges' host "
                        "work stands out of the expert GEMMs)")
    p.add_argument("--profile", choices=ALGOS, default=None)
    add_output_args(p, "dedup_host")
    return p


def main() -> None:
    args = parser().parse_args()
    from comm import run_local

    conf = {"experts": args.experts, "top_k": args.top_k, "batch": args.batch,
            "seq": args.seq, "ffn": args.ffn, "repeats": args.repeats, "warmup": args.warmup,
            "profile": args.profile}
    outs = run_local(_worker, 4, conf, timeout_s=1800)
    # one call's time is its slowest rank's
    per_call = {a: [max(o["times"][a][i] for o in outs) for i in range(args.repeats)]
                for a in ALGOS}
    med = {a: statistics.median(v) for a, v in per_call.items()}
    # the host work of a call: CPU seconds of the 4 processes (all their threads) together
    cpu_call = {a: [sum(o["cpu"][a][i] for o in outs) for i in range(args.repeats)]
                for a in ALGOS}
    cmed = {a: statistics.median(v) for a, v in cpu_call.items()}
    row = {"bench": "dedup_host", "git_sha": git_sha(), "cpu": cpu_name(),
           "loadavg": os.getloadavg()[0], "ranks": 4, "nodes": 2, **conf,
           **{f"{a}_ms": round(1e3 * med[a], 3) for a in ALGOS},
           "dedup_vs_halo": round(med["dedup"] / med["halo"], 4),
           "dedup_vs_flat": round(med["dedup"] / med["flat"], 4),
           "halo_vs_flat": round(med["halo"] / med["flat"], 4),
           **{f"{a}_cpu_ms": round(1e3 * cmed[a], 3) for a in ALGOS},
           "cpu_dedup_vs_halo": round(cmed["dedup"] / cmed["halo"], 4),
           "cpu_dedup_vs_flat": round(cmed["dedup"] / cmed["flat"], 4)}
    for a in ALGOS:
        print(f"{a:6s} median {1e3 * med[a]:8.2f} ms per call (fwd+bwd, slowest rank; "
              f"min {1e3 * min(per_call[a]):.2f}, max {1e3 * max(per_call[a]):.2f}); "
              f"CPU {1e3 * cmed[a]:8.2f} ms (4 ranks together)")
    print(f"dedup / halo {row['dedup_vs_halo']:.3f}   dedup / flat {row['dedup_vs_flat']:.3f}"
          f"   halo / flat {row['halo_vs_flat']:.3f}   CPU: dedup / halo "
          f"{row['cpu_dedup_vs_halo']:.3f}, dedup / flat {row['cpu_dedup_vs_flat']:.3f}")
    if outs[0]["prof"]:
        print(outs[0]["prof"])
    out = output_dir(args) / "dedup_host.jsonl"
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print_written(out)


if __name__ == "__main__":
    main()
