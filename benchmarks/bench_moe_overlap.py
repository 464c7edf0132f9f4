"""Training steps with the expert all-to-all plain, overlapped and deduplicated, on the
namespace-emulated cluster (comm.emulate; needs root).

    python benchmarks/bench_moe_overlap.py                      # 2x2 @ 200 Mbit/s, issue 26's setup
    python benchmarks/bench_moe_overlap.py --setups 2x2@200,2x2@1000 --repeats 2 --record
    python benchmarks/bench_moe_overlap.py --microbatches 2 \
        --arms flat/none,flat/layer/2,flat/fb,flat/fb/2      # across micro-batches (fb)

Each arm is one `train.py` run inside the emulated cluster (EP over every rank, so the group
spans the nodes): the tiny model with 16 experts at top-4 (--top-k, --experts), d_model 128,
seq 256, global batch 16 (the issue's "Why" job). Per run: the median over the steps after
--warmup of the step time, of the EP exchange's forward seconds on the slowest rank (plain:
the whole exchange; overlapped: the time the forward blocked waiting for rows, the exposed
part) and the forward dispatch bytes every rank sent to another node in a step (from the
dispatcher's plan; `ep_flat_remote_rows` is what flat would have sent). Arms run in a rotated
order per repeat (repeat r starts at arm r), so slow drift of the shared machine's load
spreads over all arms; the table gives the median of the repeats' medians and each arm's
ratio to the first arm (flat, no overlap) of the same setup. `--microbatches` (every arm the
same, so the baseline is fair) splits each rank's batch for gradient accumulation; the fb
arms (--comm.a2a_overlap=fb: one micro-batch's forward beside another's backward exchanges;
`flat/fb/2` also pipelines each layer in 2 chunks, layer + fb) need 2 or more. Under fb the
exchange column is still the forward's blocked time; the paired backward's waits are not in
it (the step time shows them).

An arm with auto (e.g. `auto/auto`: --comm.alltoall=auto --comm.a2a_overlap=auto
--comm.a2a_chunks=auto) runs --trial-steps more steps, for auto's trial over the first steps
(trainer/a2a_trial.py); its medians start after the trial and --warmup, and its row keeps what
auto ran (picked_alltoall, picked_overlap, picked_chunks) and the trial's log line.

Rows: `moe_overlap.jsonl` under runs/bench/moe_overlap/ (or --out, or --record).

`--netsim` projects one MoE dispatch of DeepSeek-V3 instead (comm.netsim, no emulator): every
rank sends tokens x top-k rows of d_model bf16 values spread evenly over the EP group
(uniform routing), on Frontier and DGX H100 at 256, 512 and 1024 GPUs (packed placement,
switch-level lumping). flat and HALO as comm.netsim simulates them; dedup as HALO with its
inter-node phase scaled by the expected dedup byte ratio (`comm.collectives.dedup.dedup_byte_ratio`: the
relay hop is HALO's phase II, the fan-out its phase III), once for routing uniform over all
experts and once with every token's experts on at most --node-limit nodes (DeepSeek-V3's
node-limited routing, M = 4; the ratio is then (M - M/N) / (k (N - 1) / N) of the copies).
Rows: `moe_overlap_netsim.jsonl`.
"""

from __future__ import annotations

import argparse
import functools
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

from _common import ROOT, add_output_args, cpu_name, git_sha, output_dir, print_written

ARMS = ("flat/none", "halo/none", "dedup/none", "flat/layer/2", "halo/layer/2",
        "dedup/layer/2")


def train_emulated(setup: str, arm: str, args: argparse.Namespace) -> list[dict] | None:
    """One arm's `train.py` run inside the emulated cluster `setup` (NODESxGPUS@MBIT; the
    module docstring's job with this parser's `args`); its metrics.jsonl rows, or None after
    printing why the run failed."""
    shape, mbit = setup.split("@")
    nodes, gpus = (int(v) for v in shape.split("x"))
    algo, overlap, *rest = arm.split("/")
    with tempfile.TemporaryDirectory(prefix="bench-moe-overlap-") as tmp:
        out = Path(tmp) / "run"
        train = ["train.py", "--config", "configs/tiny-ep-dp.toml", f"--parallel.ep={nodes * gpus}",
                 f"--model.n_routed_experts={args.experts}", f"--model.top_k={args.top_k}",
                 f"--train.steps={args.steps + (args.trial_steps if 'auto' in arm else 0)}",
                 f"--train.seq_len={args.seq_len}",
                 f"--train.global_batch={args.global_batch}", "--train.eval_every=0",
                 "--train.eval_batches=1", "--train.ckpt_every=0", "--train.plot=false",
                 "--train.tensorboard=false", "--train.layer_metrics=false",
                 f"--comm.alltoall={algo}", f"--comm.a2a_overlap={overlap}",
                 f"--comm.a2a_chunks={rest[0] if rest else 'auto' if overlap == 'auto' else 1}",
                 f"--parallel.microbatches={args.microbatches}", f"--train.out_dir={out}",
                 *(["--data", args.data] if args.data else [])]
        cmd = [sys.executable, "-m", "comm.emulate", "--nodes", str(nodes), "--gpus-per-node",
               str(gpus), "--nic-mbit", mbit, "--timeout-s", str(args.timeout_s), "--", *train]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR",
               "OMP_NUM_THREADS": "1"}
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        metrics = out / "metrics.jsonl"
        if r.returncode != 0 or not metrics.is_file():
            print(f"{setup} {arm} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-3000:]}",
                  file=sys.stderr)
            return None
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        picks = auto_picks(r.stdout)
        return [{**row, **picks} for row in rows]


def auto_picks(stdout: str) -> dict:
    """What `auto` ran, from train.py's log: the rules' choice (trainer.build.resolve_a2a's
    lines), or where its trial ran (trainer.a2a_trial) the trial's pick, as picked_alltoall /
    picked_overlap / picked_chunks; the trial's line as auto_trial and its length in steps
    as trial_steps. Empty for an arm without auto."""
    out: dict = {}
    for line in stdout.splitlines():
        for prefix, key in (("comm.alltoall=auto: ", "picked_alltoall"),
                            ("comm.a2a_overlap=auto: ", "picked_overlap"),
                            ("comm.a2a_chunks=auto: ", "picked_chunks")):
            if line.startswith(prefix):
                out[key] = line[len(prefix):].split(" ")[0]
        m = re.match(r"comm.alltoall / a2a_overlap=auto: the next (\d+) steps try", line)
        if m:
            out["trial_steps"] = int(m.group(1))
        m = re.match(r"comm.alltoall / a2a_overlap=auto: (trial over .*; runs (\S+) from here)",
                     line)
        if m:
            out["auto_trial"] = m.group(1)
            algo, overlap, *chunks = m.group(2).split("/")
            out |= {"picked_alltoall": algo, "picked_overlap": overlap,
                    "picked_chunks": chunks[0] if chunks else "1"}
    return out


def run_arm(setup: str, arm: str, args: argparse.Namespace) -> dict | None:
    shape, mbit = setup.split("@")
    nodes, gpus = (int(v) for v in shape.split("x"))
    algo, overlap, *rest = arm.split("/")
    chunks = rest[0] if rest else "1"
    rows = train_emulated(setup, arm, args)
    if rows is None:
        return None
    # an auto arm's trial steps (trainer/a2a_trial.py) are left out, then --warmup more
    skip = args.warmup + (rows[0].get("trial_steps", 0) if rows else 0)
    steps = [s for s in rows if "step_time_s" in s and s["step"] > skip]

    def med(key: str) -> float:
        return statistics.median(float(s.get(key, 0.0)) for s in steps)

    return {"nodes": nodes, "gpus_per_node": gpus, "nic_mbit": float(mbit), "arm": arm,
            "alltoall": algo, "a2a_overlap": overlap, "a2a_chunks": int(chunks),
            "experts": args.experts, "top_k": args.top_k, "microbatches": args.microbatches,
            "steps": len(steps),
            "step_s": med("step_time_s"), "exchange_s": med("ep_exchange_max_s"),
            "remote_bytes": med("ep_remote_bytes"), "remote_rows": med("ep_remote_rows"),
            "flat_remote_rows": med("ep_flat_remote_rows"),
            "node_imbalance": med("ep_node_imbalance"),
            **{k: rows[0][k] for k in ("picked_alltoall", "picked_overlap", "picked_chunks",
                                       "auto_trial", "trial_steps") if rows and k in rows[0]},
            "loss_last": steps[-1]["loss"] if steps else None}


def netsim_rows(args: argparse.Namespace) -> list[dict]:
    """The DeepSeek-V3 dispatch projection (module docstring)."""
    import dataclasses

    from comm.collectives.dedup import dedup_byte_ratio
    from comm.netsim.engine import simulate
    from comm.netsim.lumped import lumped_all_to_all
    from comm.netsim.topologies import from_platform
    from comm.netsim.traffic import place

    D, k, E, tokens, elt = 7168, 8, 256, args.tokens, 2  # DeepSeek-V3: d_model, top-8 of 256
    rows = []
    for platform_name in ("frontier", "dgx-h100"):
        for gpus in (256, 512, 1024):
            build = functools.partial(from_platform, platform_name, gpus // 8)
            net = build()
            rank2gpu, topo = place(net, gpus // 8, "packed")
            R, N = len(rank2gpu), topo.num_nodes
            pair = tokens * k * D * elt // R
            uniform = dedup_byte_ratio(N, k, E, D, elt)
            M = args.node_limit
            limited = (M - M / N) / (k * (N - 1) / N) * ((D + k) * elt + 4 * k) / (D * elt)
            for arm, ratio in (("flat", None), ("halo", None), ("dedup", uniform),
                               (f"dedup-M{M}", limited)):
                algo = "flat" if arm == "flat" else "halo"
                sim_net, traffic, r2g = lumped_all_to_all(build, net, rank2gpu, topo, algo, pair)
                if ratio is not None:  # phase II (the relay hop) carries the distinct pairs
                    nb = traffic.nbytes.copy()
                    nb[traffic.phase == 1] *= ratio
                    traffic = dataclasses.replace(traffic, nbytes=nb)
                t = simulate(sim_net, traffic, r2g).time
                rows.append({"platform": platform_name, "gpus": R, "nodes": N, "arm": arm,
                             "bytes_per_pair": pair, "tokens": tokens, "top_k": k,
                             "dedup_ratio": ratio, "time_s": t})
                print(f"{platform_name:<9} {R:>5} {arm:<9} {pair / 1e6:7.3f} MB/pair "
                      f"{t * 1e3:9.2f} ms", flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="2x2@200", help="comma list of NODESxGPUS@MBIT")
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma list of ALLTOALL/OVERLAP[/CHUNKS]")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--trial-steps", type=int, default=13,
                   help="extra steps of an arm with auto (its trial: 1 + 2 rounds x 6 choices "
                        "at most), left out of the medians with --warmup after them")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=1,
                   help="gradient-accumulation micro-batches of every arm (fb arms: >= 2)")
    p.add_argument("--data", default="", help="corpus (default: train.py's)")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--netsim", action="store_true",
                   help="project DeepSeek-V3's dispatch with comm.netsim instead")
    p.add_argument("--tokens", type=int, default=4096,
                   help="--netsim: tokens per GPU per micro-batch (one 4096-token sequence)")
    p.add_argument("--node-limit", type=int, default=4,
                   help="--netsim: nodes a token's experts may span (DeepSeek-V3: 4)")
    add_output_args(p, "moe_overlap")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.netsim:
        out = output_dir(args)
        meta = {"bench": "moe_overlap_netsim", "git_sha": git_sha(),
                "time": time.strftime("%FT%T"), "device": f"{cpu_name()} (simulated)"}
        rows = [{**meta, **r} for r in netsim_rows(args)]
        with open(out / "moe_overlap_netsim.jsonl", "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print_written(out / "moe_overlap_netsim.jsonl")
        return 0
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    arms = args.arms.split(",")
    fb = [a for a in arms if a.split("/")[1:2] == ["fb"]]
    if fb and args.microbatches < 2:
        raise SystemExit(f"arms {fb} pair micro-batches: give --microbatches 2 or more (every "
                         f"arm runs with it), got {args.microbatches}")
    out = output_dir(args)
    meta = {"bench": "moe_overlap", "git_sha": git_sha(), "time": time.strftime("%FT%T"),
            "device": f"{cpu_name()} ({os.cpu_count()} cores), emulated NICs",
            "host": platform.node()}
    rows: list[dict] = []
    for setup in args.setups.split(","):
        for rep in range(args.repeats):
            for arm in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                row = run_arm(setup, arm, args)
                if row is not None:
                    rows.append({**meta, **row, "repeat": rep})
                    picked = "/".join(str(row[k]) for k in ("picked_alltoall", "picked_overlap",
                                                            "picked_chunks") if k in row)
                    print(f"{setup} {arm}: step {row['step_s']:.3f} s, exchange "
                          f"{row['exchange_s']:.3f} s, inter-node {row['remote_bytes'] / 1e6:.2f} "
                          f"MB{f', auto ran {picked}' if picked else ''}", flush=True)
    with open(out / "moe_overlap.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"\n{'setup':<10} {'arm':<15} {'step s':>7} {'vs base':>7} {'exch s':>7} "
          f"{'inter-node MB':>13} {'vs flat':>7}")
    for setup in args.setups.split(","):
        mine = [r for r in rows if f"{r['nodes']}x{r['gpus_per_node']}@{r['nic_mbit']:g}"
                == setup]
        med = {a: {k: statistics.median(r[k] for r in mine if r["arm"] == a)
                   for k in ("step_s", "exchange_s", "remote_bytes", "remote_rows",
                             "flat_remote_rows")}
               for a in arms if any(r["arm"] == a for r in mine)}
        base = med.get(arms[0])
        for a, m in med.items():
            vs = m["step_s"] / base["step_s"] if base else float("nan")
            rows_vs = m["remote_rows"] / m["flat_remote_rows"] if m["flat_remote_rows"] else 1
            print(f"{setup:<10} {a:<15} {m['step_s']:>7.3f} {vs:>7.3f} {m['exchange_s']:>7.3f} "
                  f"{m['remote_bytes'] / 1e6:>13.2f} {rows_vs:>7.3f}")
    print_written(out / "moe_overlap.jsonl")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
