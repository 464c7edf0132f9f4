"""The planner against the emulated cluster: `tuner.estimate` vs the measured moe_overlap rows.

    .venv/bin/python benchmarks/bench_tuner_emulator.py               # rows of moe_overlap.jsonl
    .venv/bin/python benchmarks/bench_tuner_emulator.py --rows /work/main/benchmarks/results/moe_overlap.jsonl --record

Issue 26, item 6: the planner prices each overlap mode and the dedup volume; checked against
the emulator's measurements within 20 %. The measurements are benchmarks/bench_moe_overlap.py's
rows (one `train.py` run per arm inside `comm.emulate`: configs/tiny-ep-dp.toml, EP over every
rank, 16 experts top-4, seq 256, global batch 16, the row's micro-batches). No training here:
for each (setup, arm, micro-batches, experts, top-k, git sha) group of rows this script
  1. derives the emulated cluster's platform (`tuner.measure.emulator_platform`): compute,
     memory and the intra-node exchange from a platform `tuner measure` measured on this
     machine with nodes x gpus processes (--base; configs/platforms/local.toml: 4), the
     inter-node link from the emulator's own parameters (tbf rate x the TCP payload share of
     a frame, the netem delay; none measured),
  2. runs `tuner.estimate` on the job with the row's layout, dispatch (alltoall), overlap and
     chunks (Assumptions as benchmarks/bench_tuner_validate.py predicts the trainer: fp32,
     the trainer's activation set, 4 memory passes over the saved activations), the routing
     imbalance the job's router produces (--imbalance: the trainer's `imbalance` metric,
     max / mean EP-rank load, a property of the router and data and not of the arm: every
     arm of a setup trains the same tokens to the same loss): a row's own, else the median of
     the rows of that EP size, experts and top-k that carry one (the --run rows), else
     JOB_IMBALANCE for the EP-4 job it was measured on),
  3. prints predicted vs measured step time (median of the group's rows) and error =
     predicted / measured - 1, and the exchange: predicted exposed all-to-all seconds of the
     step (forward and backward) beside the measured forward exchange (`exchange_s`: the
     slowest rank's blocked forward seconds; without overlap the model's forward half is
     the comparable figure, printed as "pred fwd").
Rows whose shape has no base platform of that many processes are reported and skipped.

The moe_overlap rows keep only the step and the forward exchange. `--run` first runs arms
itself (bench_moe_overlap's job and flags; needs root, take the bench lock) and keeps what the
trainer logs besides, the step's parts (fwd_bwd_s, grad_sync_s, optim_s) and the router's
`imbalance`, in tuner_emulator_runs.jsonl, which is read beside the moe_overlap rows:

    flock /tmp/piper-bench.lock .venv/bin/python benchmarks/bench_tuner_emulator.py --record \
        --run 2x2@200:flat/none:1,2x2@200:dedup/none:1,2x2@200:dedup/layer/2:1 --measure-base

`--measure-base` first measures the base platform of every process count among the --run arms
(`tuner measure --procs N`, ~1-2 minutes each) and writes it beside the rows as
tuner_emulator_platform_w<N>.<time>.toml; each row of those runs names its file
(`base_platform`) and is predicted from it, whatever --base says. This VM's speed drifts by
10-30 % over tens of minutes, so a base measured right before the arms is the one that
describes them. A row without a `base_platform` (measured before that flag existed) is
predicted from the stored base of its process count measured nearest its time, within
NEAREST_BASE_H hours (`nearest_base`: the `tuner_emulator_platform_w<N>.<stamp>.toml` files
beside the rows; stamps of files recovered from git are the time of the commit that wrote
them, see their first line), else from the invocation's --base / --base-8. The default --base
is a frozen copy (tuner_emulator_platform_w4.toml), not the local validation record's file,
which every record replaces: a record no longer moves an emulator verdict.

The summary counts every arm, and apart the arms measured with at least two repeats on a
quiet VM (`quiet_repeated`: LOADED_VM_SHAS lists the records taken while other sessions
loaded the VM); docs/alltoall.md quotes both lines.

Results: tuner_emulator.jsonl (rows appended) and tuner_emulator.md in
runs/bench/tuner_emulator/ or --out; --record writes them to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

from _common import add_output_args, cpu_name, git_sha, output_dir, previous, print_written

from model import ModelConfig, presets
from tuner import Assumptions, ParallelPlan, estimate, load_platform
from tuner.layout import CPU_TRAFFIC_PASSES, FP32_TRAINER_PRECISION
from tuner.measure import emulator_platform, parse_emulator_shape
from tuner.platform import Platform

TOL = 0.20  # issue 26, item 6
# The bench_moe_overlap job (benchmarks/bench_moe_overlap.py::run_arm)
SEQ, GLOBAL_BATCH = 256, 16
# The trainer's `imbalance` (max / mean EP-rank load), median of steps 3-8 of the flat/none
# job at 2x2@200, 16 experts top-4 (git a5d7bd2, the rows' loss 4.4284 at step 8):
#   python -m comm.emulate --nodes 2 --gpus-per-node 2 --nic-mbit 200 -- train.py \
#     --config configs/tiny-ep-dp.toml --parallel.ep=4 --model.n_routed_experts=16 \
#     --model.top_k=4 --train.steps=8 ... (bench_moe_overlap.py's run_arm flags)
# A row that carries its own `imbalance` uses that instead.
JOB_IMBALANCE = 1.697
RUNS_FILE = "tuner_emulator_runs.jsonl"  # those runs, as bench_moe_overlap rows + step parts
NEAREST_BASE_H = 3.0  # this VM drifts 10-30 % over tens of minutes: a base hours away is another
# The rows taken while other sessions loaded the VM (docs/alltoall.md: the 2026-12-01/02 records
# whose misses were traced to that load); counted in the "every arm" line, not in the quiet one.
LOADED_VM_SHAS = frozenset({"d86e4ee", "a5d7bd2", "b0e9c6c", "6a5e27c"})
STAMPED_BASE = re.compile(r"tuner_emulator_platform_w(\d+)\.(\d{8}T\d{6})\.toml")
GROUP_KEYS = ("nodes", "gpus_per_node", "nic_mbit", "arm", "microbatches", "experts", "top_k",
              "git_sha")


def parse_run_spec(spec: str) -> tuple[str, str, int, int, int]:
    """`--run`'s SETUP:ARM:M[:EXPERTS:TOPK] -> (setup, arm, micro-batches, experts, top-k);
    without the last two the bench_moe_overlap job's 16 experts at top-4."""
    parts = spec.split(":")
    if len(parts) not in (3, 5):
        raise ValueError(f"--run {spec!r}: need SETUP:ARM:M or SETUP:ARM:M:EXPERTS:TOPK, e.g. "
                         f"2x2@200:dedup/none:1 or 2x2@200:dedup/none:1:64:8")
    try:
        nums = [int(x) for x in parts[2:]]
    except ValueError:
        raise ValueError(f"--run {spec!r}: M, EXPERTS and TOPK must be integers") from None
    m, experts, top_k = nums if len(nums) == 3 else (nums[0], 16, 4)
    if m < 1 or experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"--run {spec!r}: need M >= 1, EXPERTS >= 1 and 1 <= TOPK <= EXPERTS")
    parse_emulator_shape(parts[0])  # a named error for a bad setup, before anything runs
    return parts[0], parts[1], m, experts, top_k


def run_parts(setup: str, arm: str, microbatches: int, steps: int = 8, warmup: int = 2,
              timeout_s: float = 900, experts: int = 16, top_k: int = 4) -> dict | None:
    """One bench_moe_overlap arm (its `run_arm` job and flags) as a row that keeps the step
    parts the trainer logs (fwd_bwd_s, grad_sync_s, optim_s) and the router's imbalance."""
    import bench_moe_overlap

    args = bench_moe_overlap.parser().parse_args(
        ["--steps", str(steps), "--warmup", str(warmup), "--microbatches", str(microbatches),
         "--timeout-s", str(timeout_s), "--experts", str(experts), "--top-k", str(top_k)])
    nodes, gpus, mbit = parse_emulator_shape(setup)
    algo, overlap, *rest = arm.split("/")
    got = bench_moe_overlap.train_emulated(setup, arm, args)  # its job, the metrics kept
    if got is None:
        return None
    st = [x for x in got if "step_time_s" in x and x["step"] > warmup]

    def med(key: str) -> float:
        return statistics.median(float(x.get(key, 0.0)) for x in st)

    return {"bench": "moe_overlap", "source": "bench_tuner_emulator --run", "nodes": nodes,
            "gpus_per_node": gpus, "nic_mbit": mbit, "arm": arm, "alltoall": algo,
            "a2a_overlap": overlap, "a2a_chunks": int(rest[0]) if rest else 1,
            "experts": args.experts, "top_k": args.top_k, "microbatches": microbatches,
            "steps": len(st), "step_s": med("step_time_s"), "exchange_s": med("ep_exchange_max_s"),
            "exchange_min_s": med("ep_exchange_min_s"),
            "fwd_bwd_s": med("fwd_bwd_s"), "grad_sync_s": med("grad_sync_s"),
            "optim_s": med("optim_s"), "imbalance": med("imbalance"),
            "remote_bytes": med("ep_remote_bytes"), "remote_rows": med("ep_remote_rows"),
            "flat_remote_rows": med("ep_flat_remote_rows"),
            "node_imbalance": med("ep_node_imbalance"), "loss_last": st[-1]["loss"]}


def read_rows(path: Path) -> list[dict]:
    """The measured moe_overlap rows of `path` (other benches' rows and blank lines skipped)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r for r in rows if r.get("bench", "moe_overlap") == "moe_overlap" and "step_s" in r]


def group_key(row: dict) -> tuple:
    """(setup, arm, micro-batches, experts, top-k, sha) of a row; rows before the
    micro-batches field ran with 1."""
    return tuple(row.get(k, 1) if k == "microbatches" else row[k] for k in GROUP_KEYS)


def group_rows(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by `group_key`, in first-seen order."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(group_key(r), []).append(r)
    return out


def job(row: dict) -> tuple[ModelConfig, ParallelPlan, Assumptions]:
    """The model, layout and assumptions of the bench_moe_overlap run a row measured."""
    cfg = dataclasses.replace(presets.get("tiny"), n_routed_experts=int(row["experts"]),
                              top_k=int(row["top_k"]))
    ep = int(row["nodes"]) * int(row["gpus_per_node"])
    plan = ParallelPlan(pp=1, ep=ep, dp=1, microbatches=int(row.get("microbatches", 1)),
                        global_batch=GLOBAL_BATCH, seq_len=SEQ, alltoall=row["alltoall"],
                        a2a_overlap=row["a2a_overlap"])
    asm = Assumptions(activation_set="trainer", activation_traffic_passes=CPU_TRAFFIC_PASSES,
                      zero_sharding="per-parameter", a2a_chunks=int(row.get("a2a_chunks", 1)),
                      routing_imbalance=float(row.get("imbalance", JOB_IMBALANCE)),
                      exchange_imbalance=row.get("node_imbalance") or None)
    return cfg, plan, asm


def predict(row: dict, pf: Platform) -> dict:
    """Predicted step, exposed all-to-all (step, fwd + bwd) and its hidden part for a row."""
    cfg, plan, asm = job(row)
    e = estimate(cfg, plan, pf, FP32_TRAINER_PRECISION, asm)
    return {"step_s": e.step_time, "alltoall_s": e.time.get("alltoall", 0.0),
            "hidden_s": e.alltoall_hidden, "compute_s": e.time.get("compute", 0.0),
            "dp_sync_s": e.time.get("dp_sync", 0.0), "imbalance": asm.routing_imbalance,
            "node_imbalance": asm.exchange_imbalance}


def router_key(row: dict) -> tuple[int, int, int]:
    """What the routing imbalance depends on: the EP group's size and the router's experts
    and top-k (not the network, the dispatch or the overlap)."""
    return int(row["nodes"]) * int(row["gpus_per_node"]), int(row["experts"]), int(row["top_k"])


def imbalances(rows: list[dict]) -> dict[tuple[int, int, int], float]:
    """The measured imbalance by `router_key`: the median over the rows that carry one, and
    JOB_IMBALANCE for the job it was measured on (EP 4, 16 experts, top-4)."""
    got: dict[tuple[int, int, int], list[float]] = {}
    for r in rows:
        if "imbalance" in r:
            got.setdefault(router_key(r), []).append(float(r["imbalance"]))
    return {(4, 16, 4): JOB_IMBALANCE, **{k: statistics.median(v) for k, v in got.items()}}


def node_imbalances(rows: list[dict]) -> dict[tuple[tuple[int, int, int], str], float]:
    """The trainer's measured `ep_node_imbalance` by (`router_key`, all-to-all algorithm):
    the median over the rows that carry it (runs from --run since the metric exists); rows
    without it take this, and rows of a key nobody measured price with the routing
    imbalance (Assumptions.exchange_imbalance None)."""
    got: dict[tuple[tuple[int, int, int], str], list[float]] = {}
    for r in rows:
        if r.get("node_imbalance"):
            got.setdefault((router_key(r), r["alltoall"]), []).append(float(r["node_imbalance"]))
    return {k: statistics.median(v) for k, v in got.items()}


def row_base(row: dict, dirs: list[Path], cache: dict[str, Platform]) -> Platform | None:
    """The platform measured for a row's run (`base_platform`, --measure-base), found in the
    first of `dirs` that has it; None when the row names none. A named file that is missing
    is an error: predicting the row from another base would hide it."""
    name = row.get("base_platform")
    if not name:
        return None
    if name not in cache:
        path = next((d / name for d in dirs if (d / name).is_file()), None)
        if path is None:
            raise FileNotFoundError(f"row {row['arm']} ({row.get('time')}) was measured with base "
                                    f"platform {name!r}, found in none of "
                                    f"{[str(d) for d in dirs]}")
        cache[name] = load_platform(path)
    return cache[name]


def stored_bases(dirs: list[Path]) -> dict[int, list[tuple[datetime.datetime, str]]]:
    """The stamped base platforms in `dirs` (`STAMPED_BASE`) by process count: (stamp, name)."""
    out: dict[int, list[tuple[datetime.datetime, str]]] = {}
    for d in dirs:
        for path in sorted(d.glob("tuner_emulator_platform_w*.*.toml")):
            m = STAMPED_BASE.fullmatch(path.name)
            if m:
                out.setdefault(int(m[1]), []).append(
                    (datetime.datetime.strptime(m[2], "%Y%m%dT%H%M%S"), path.name))
    return out


def nearest_base(row: dict, stored: dict[int, list[tuple[datetime.datetime, str]]],
                 hours: float = NEAREST_BASE_H) -> str | None:
    """The name of the stored base of the row's process count stamped nearest the row's
    `time` (either side), if within `hours`; None for a row without a time or no such base."""
    if not row.get("time"):
        return None
    t = datetime.datetime.fromisoformat(row["time"])
    n = int(row["nodes"]) * int(row["gpus_per_node"])
    near = [(abs((t - s).total_seconds()), name) for s, name in stored.get(n, [])]
    near = [x for x in near if x[0] <= hours * 3600]
    return min(near)[1] if near else None


def quiet_repeated(results: list[dict]) -> list[dict]:
    """The arms measured with at least two repeats outside the loaded-VM records."""
    return [r for r in results if r["repeats"] >= 2 and r["measured_sha"] not in LOADED_VM_SHAS]


def compare(rows: list[dict], bases: dict[int, Platform],
            base_dirs: list[Path] | None = None) -> tuple[list[dict], list[str]]:
    """One result per row group (medians over its repeats), and the groups skipped. A group
    whose rows name their own base platform (`row_base`, looked up in `base_dirs`) is
    predicted from it; one that names none from the stored base nearest its time
    (`nearest_base`), else from `bases`."""
    out, skipped = [], []
    cache: dict[str, Platform] = {}
    stored = stored_bases(base_dirs or [])
    imb = imbalances(rows)
    node_imb = node_imbalances(rows)
    for grp in group_rows(rows).values():
        r0 = grp[0]
        n = int(r0["nodes"]) * int(r0["gpus_per_node"])
        setup = f"{r0['nodes']}x{r0['gpus_per_node']}@{float(r0['nic_mbit']):g}"
        rule = "own" if r0.get("base_platform") else ""
        if not rule:
            near = nearest_base(r0, stored)
            rule = "nearest" if near else "default"
            if near:
                r0 = {**r0, "base_platform": near}
        own = row_base(r0, base_dirs or [], cache)
        if own is not None and own.gpus_per_node != n:
            raise ValueError(f"{setup} {r0['arm']}: its base platform {r0['base_platform']} "
                             f"describes {own.gpus_per_node} processes, the run had {n}")
        if own is None and n not in bases:
            skipped.append(f"{setup} {r0['arm']} m{r0.get('microbatches', 1)}: no base platform "
                           f"of {n} processes (--base-{n})")
            continue
        if router_key(r0) not in imb:
            skipped.append(f"{setup} {r0['arm']}: no measured imbalance for EP {n}, "
                           f"{r0['experts']} experts top-{r0['top_k']} (--run one arm)")
            continue
        r0 = {**r0, "imbalance": r0.get("imbalance", imb[router_key(r0)])}
        if not r0.get("node_imbalance") and (router_key(r0), r0["alltoall"]) in node_imb:
            # the same tokens through the same dispatch: the node loads another run measured
            r0["node_imbalance"] = node_imb[(router_key(r0), r0["alltoall"])]
        pf = emulator_platform(own or bases[n], int(r0["nodes"]), int(r0["gpus_per_node"]),
                               float(r0["nic_mbit"]))
        p = predict(r0, pf)
        step = statistics.median(r["step_s"] for r in grp)
        exch = statistics.median(r["exchange_s"] for r in grp)
        out.append({"setup": setup, "arm": r0["arm"], "microbatches": int(r0.get("microbatches", 1)),
                    "measured_sha": r0["git_sha"], "repeats": len(grp),
                    "meas_step_s": step, "meas_exchange_fwd_s": exch,
                    "pred_step_s": p["step_s"], "pred_alltoall_s": p["alltoall_s"],
                    "pred_hidden_s": p["hidden_s"], "pred_compute_s": p["compute_s"],
                    "pred_dp_sync_s": p["dp_sync_s"], "imbalance": p["imbalance"],
                    "node_imbalance": p["node_imbalance"],
                    **{f"meas_{k}": statistics.median(r[k] for r in grp)
                       for k in ("fwd_bwd_s", "grad_sync_s", "optim_s") if k in r0},
                    "platform": pf.name, "base_platform": r0.get("base_platform", ""),
                    "base_rule": rule,
                    "step_err": p["step_s"] / step - 1,
                    "ok": abs(p["step_s"] / step - 1) <= TOL})
    return out, skipped


def _opt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _base_label(r: dict) -> str:
    """Which base platform predicted a row: its own / the nearest stored one (the stamp), or
    the invocation's."""
    m = STAMPED_BASE.fullmatch(r.get("base_platform", ""))
    if r.get("base_rule") == "default" or not r.get("base_platform"):
        return "--base"
    return f"{r.get('base_rule', 'own')} {m[2] if m else r['base_platform']}"


def table(results: list[dict]) -> list[str]:
    lines = ["| setup | arm | m | sha | n | imb | node imb | measured step s | predicted s | error | ok | "
             "measured fwd exchange s | pred exposed a2a s (fwd+bwd) | pred fwd (none: half) |"
             " pred hidden s | base |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        fwd = f"{r['pred_alltoall_s'] / 2:.3f}" if r["arm"].split("/")[1] == "none" else ""
        lines.append(f"| {r['setup']} | {r['arm']} | {r['microbatches']} | {r['measured_sha']} | "
                     f"{r['repeats']} | {r['imbalance']:.2f} | {_opt(r.get('node_imbalance'))} | "
                     f"{r['meas_step_s']:.3f} | {r['pred_step_s']:.3f} | "
                     f"{100 * r['step_err']:+.1f}% | {'yes' if r['ok'] else 'NO'} | "
                     f"{r['meas_exchange_fwd_s']:.3f} | {r['pred_alltoall_s']:.3f} | {fwd} | "
                     f"{r['pred_hidden_s']:.3f} | {_base_label(r)} |")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=Path, nargs="+", default=None,
                   help="files of bench_moe_overlap rows (default: moe_overlap.jsonl and "
                        "tuner_emulator_runs.jsonl, the runs that keep the step parts, from the "
                        "output folder where it has them, else the tracked records)")
    p.add_argument("--base", type=Path, default=None,
                   help="platform `tuner measure` measured here, used for emulator shapes of "
                        "as many processes as it describes, for rows with no stored base "
                        "near their time (default: tuner_emulator_platform_w4.toml, a frozen "
                        "copy of a local validation record's 4-process platform)")
    p.add_argument("--base-8", type=Path, default=None,
                   help="a measured 8-process platform (`tuner measure --procs 8`) for 4x2 rows "
                        "with no stored base near their time (default: "
                        "tuner_emulator_platform_w8.toml, measured before the cad6ea4 rows)")
    p.add_argument("--run", default="", metavar="SETUP:ARM:M[:EXPERTS:TOPK],...",
                   help="first run these bench_moe_overlap arms (needs root; hold "
                        "/tmp/piper-bench.lock), e.g. 2x2@200:dedup/none:1, appending rows "
                        f"with the step parts to {RUNS_FILE} in the output folder")
    p.add_argument("--measure-base", action="store_true",
                   help="with --run: first measure the base platform of each process count "
                        "among the arms (`tuner measure --procs N`) and predict those rows "
                        "from it (module docstring)")
    add_output_args(p, "tuner_emulator")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    here = output_dir(args, create=False)
    if args.run:
        meta_run = {"git_sha": git_sha(), "time": time.strftime("%FT%T"),
                    "device": f"{cpu_name()}, emulated NICs"}
        specs = [parse_run_spec(spec) for spec in args.run.split(",")]  # all checked first
        own_base: dict[int, str] = {}
        if args.measure_base:
            from tuner.measure import measure_platform

            stamp = time.strftime("%Y%m%dT%H%M%S")
            for n in sorted({math.prod(parse_emulator_shape(s)[:2]) for s, *_ in specs}):
                name = f"tuner_emulator_platform_w{n}.{stamp}.toml"
                print(f"[bench_tuner_emulator] measuring the {n}-process base platform -> "
                      f"{name}", file=sys.stderr, flush=True)
                measure_platform(output_dir(args) / name, n_procs=n)
                own_base[n] = name
        with open(output_dir(args) / RUNS_FILE, "a") as f:
            for setup, arm, m, experts, top_k in specs:
                row = run_parts(setup, arm, m, experts=experts, top_k=top_k)
                if row is not None:
                    n = row["nodes"] * row["gpus_per_node"]
                    extra = {"base_platform": own_base[n]} if n in own_base else {}
                    f.write(json.dumps({**meta_run, **row, **extra, "repeat": 0}) + "\n")
                    f.flush()
    elif args.measure_base:
        raise SystemExit("--measure-base measures the platform for the arms of --run; "
                         "give --run SETUP:ARM:M,...")
    if args.rows is None:
        args.rows = [previous(here, "moe_overlap.jsonl"), previous(here, RUNS_FILE)]
    if args.base is None:
        args.base = previous(here, "tuner_emulator_platform_w4.toml")
    if args.base_8 is None:
        args.base_8 = previous(here, "tuner_emulator_platform_w8.toml")
    bases: dict[int, Platform] = {}
    for path in (args.base, args.base_8):
        if path is not None:
            pf = load_platform(path)
            bases[pf.gpus_per_node] = pf
    rows = [r for path in args.rows if path.is_file() for r in read_rows(path)]
    # a row's base platform lies beside the rows that name it (or in this output folder)
    base_dirs = list(dict.fromkeys([here, *(p.parent for p in args.rows)]))
    results, skipped = compare(rows, bases, base_dirs)
    meta = {"bench": "tuner_emulator", "git_sha": git_sha(), "time": time.strftime("%FT%T"),
            "device": cpu_name(), "rows_files": [str(p) for p in args.rows],
            "base": str(args.base)}
    lines = [f"# tuner estimate vs the emulator ({meta['time']}, git {meta['git_sha']})", "",
             f"Rows: {', '.join(p.name for p in args.rows)}; platform: `tuner.measure.emulator_platform` on "
             f"{args.base.name}; routing imbalance (imb) measured, the job's (module docstring). "
             f"Target: |error| <= {TOL:.0%} on the step time.", "",
             *table(results)]
    if skipped:
        lines += ["", "Skipped:", *[f"- {s}" for s in skipped]]
    ok = sum(r["ok"] for r in results)
    quiet = quiet_repeated(results)
    lines += ["", f"{ok} of {len(results)} arms within {TOL:.0%}.",
              f"{sum(r['ok'] for r in quiet)} of {len(quiet)} arms measured with >= 2 repeats "
              f"on a quiet VM (records other than {', '.join(sorted(LOADED_VM_SHAS))}) within "
              f"{TOL:.0%}."]
    print("\n".join(lines))
    out = output_dir(args)
    with open(out / "tuner_emulator.jsonl", "a") as f:
        for r in results:
            f.write(json.dumps({**meta, **r}) + "\n")
    (out / "tuner_emulator.md").write_text("\n".join(lines) + "\n")
    print_written(out / "tuner_emulator.jsonl", out / "tuner_emulator.md")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
