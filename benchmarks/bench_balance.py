"""Expert-migration planners on synthetic and recorded routing traces.

Compares four policies for one MoE layer's EP group: no migration, the published
hill-climbing (``hill-climb``), this project's planner (``minmax``) and an EPLB-style full
greedy re-placement (``greedy-repack``), reporting imbalance (max / mean rank load), max load
over the lower bounds, moved experts and planning time.

1. static: Zipf(s) expert popularity, s in {0.5, 1.0, 1.5}, E in 8..384, R in 4..64, the
   start placement contiguous (expert e on rank e // (E/R)); the Zipf ranking is either
   shuffled across experts (realistic: hot experts are scattered) or not (hot experts all on
   rank 0, the worst case). Load = a window of routed token counts, multinomial draws.
2. drift: per-step counts whose hot experts move over time; a Monitor + MigrationPolicy
   triggers each planner; reports the imbalance each step actually saw and total moves.
3. trace (``--trace FILE``): per-step counts recorded from real training, JSON lines
   ``{"step": int, "counts": [[E counts of layer 0], [layer 1], ...]}``; run like (2).
4. replication (``--replication`` only): Zipf s in {0.8, 1.0, 1.3}, E in {64, 256}, R in
   {8, 32}, r in {0, 1, 2} redundant slots per rank: max / mean rank load and slot changes
   (from the trainer's start map, and from the previous window's plan) of swaps only, an
   EPLB-style greedy and balance.plan_replicas (replication_grid's docstring). With --trace the
   trace is also replayed with r = 1, 2 redundant slots, fixed or re-placed the way
   trainer/balancing.py does (simulate_replicas).

Lower bounds: LB = max(mean rank load, hottest expert) (the target in issue 7) and the
slot-aware SLB >= LB (every rank hosts exactly E/R experts; see balance.slot_lower_bound).

    python benchmarks/bench_balance.py            # full grid, ~1 min on 2 CPU cores
    python benchmarks/bench_balance.py --quick    # headline case + short drift run
    python benchmarks/bench_balance.py --trace runs/tiny/counts.jsonl --ranks 4
    python benchmarks/bench_balance.py --replication   # redundant slots: ours vs EPLB's greedy

Results: bench_balance.jsonl (rows appended) and bench_balance.png in runs/bench/balance/
(ignored by git) or `--out DIR`; `--record` appends to benchmarks/results/, the tracked record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import add_output_args, cpu_name, git_sha, output_dir  # noqa: E402

from balance import (
    MigrationPolicy,
    Monitor,
    apply_swaps,
    count_moves,
    lower_bound,
    plan_swaps,
    rank_loads,
    slot_lower_bound,
)

# "minmax-tol0" is minmax with tolerance=0: lowest max first, moves only break ties.
METHODS = ("none", "hill-climb", "minmax", "minmax-tol0", "greedy-repack")


def _device() -> str:
    return cpu_name()


def zipf_probs(n_experts: int, s: float, shuffle: bool, rng: np.random.Generator) -> np.ndarray:
    p = np.arange(1, n_experts + 1, dtype=np.float64) ** -s
    p /= p.sum()
    return rng.permutation(p) if shuffle else p


def timed_plan(load: np.ndarray, place: np.ndarray, r: int, method: str, max_swaps: int | None,
               repeats: int) -> tuple[list, float]:
    if method == "none":
        return [], 0.0
    kw = {"method": "minmax", "tolerance": 0.0} if method == "minmax-tol0" else {"method": method}
    swaps = plan_swaps(load, place, r, max_swaps, **kw)  # warm-up, also the result
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        plan_swaps(load, place, r, max_swaps, **kw)
        times.append(time.perf_counter() - t)
    return swaps, statistics.median(times) * 1e3


def static_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.quick:
        cases = [(1.0, 256, 32)]
    else:
        cases = [
            (s, e, r)
            for s in (0.5, 1.0, 1.5)
            for e in (8, 64, 128, 256, 384)
            for r in (4, 8, 16, 32, 64)
            if r < e and e % r == 0
        ]
    rows = []
    for s, e, r in cases:
        for shuffle in (True, False):
            rng = np.random.default_rng(args.seed)
            p = zipf_probs(e, s, shuffle, rng)
            load = rng.multinomial(args.tokens * args.topk * args.window, p).astype(np.float64)
            place = np.arange(e) // (e // r)
            lb, slb = lower_bound(load, r), slot_lower_bound(load, r)
            mean = load.sum() / r
            for m in METHODS:
                swaps, ms = timed_plan(load, place, r, m, args.max_swaps, args.repeats)
                after = np.asarray(apply_swaps(place, swaps))
                mx = rank_loads(load, after, r).max()
                rows.append({
                    "bench": "static", "s": s, "E": e, "R": r, "shuffled": shuffle, "method": m,
                    "imbalance": mx / mean, "max_over_lb": mx / lb, "max_over_slb": mx / slb,
                    "moves": count_moves(place, after), "swaps": len(swaps), "plan_ms": ms,
                })
    return rows


def drift_counts(args: argparse.Namespace, e: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """[steps, E] counts; every ``drift_every`` steps ~10 % of the experts trade popularity."""
    p = zipf_probs(e, s, True, rng)
    out = np.empty((args.steps, e))
    for t in range(args.steps):
        if t and t % args.drift_every == 0:
            k = max(2, e // 10)
            idx = rng.choice(e, size=k, replace=False)
            p[idx] = p[rng.permutation(idx)]
        out[t] = rng.multinomial(args.tokens * args.topk, p)
    return out


def simulate(counts_TLE: np.ndarray, r: int, method: str, args: argparse.Namespace) -> dict:
    """Run Monitor + policy over a trace; imbalance is measured on each step's own counts."""
    steps, n_layers, e = counts_TLE.shape
    # A full re-placement is all or nothing: give it the swaps it needs (at most E).
    budget = e if method == "greedy-repack" else args.policy_swaps
    pol = MigrationPolicy(threshold=args.threshold, window=args.window, cooldown=args.cooldown,
                          max_swaps=budget,
                          method=method if method != "none" else "minmax")
    mon = Monitor(n_layers, e, r, pol)
    place = np.tile(np.arange(e) // (e // r), (n_layers, 1))
    imb, moves, plan_ms = [], 0, []
    for t in range(steps):
        c = counts_TLE[t]
        rl = np.stack([np.bincount(place[i], weights=c[i], minlength=r) for i in range(n_layers)])
        mean = rl.mean(axis=1)
        imb.append(float(np.mean(np.where(mean > 0, rl.max(axis=1) / np.maximum(mean, 1e-12), 1))))
        mon.record(c)
        if method == "none":
            continue
        t0 = time.perf_counter()
        plans = mon.plan(t, place)
        plan_ms.append((time.perf_counter() - t0) * 1e3)
        for layer, swaps in plans.items():
            new = np.asarray(apply_swaps(place[layer], swaps))
            moves += count_moves(place[layer], new)
            place[layer] = new
    events = sum(1 for ev in mon.events if ev["executed"])
    return {
        "method": method, "steps": steps, "layers": n_layers, "E": e, "R": r,
        "mean_imbalance": float(np.mean(imb)), "p95_imbalance": float(np.percentile(imb, 95)),
        "moves": moves, "events": events,
        "plan_ms_max": max(plan_ms) if plan_ms else 0.0, "series": imb,
    }


def load_trace(path: str) -> np.ndarray:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda x: x["step"])
    arr = np.asarray([row["counts"] for row in rows], dtype=np.float64)
    if arr.ndim == 2:
        arr = arr[:, None, :]
    if arr.ndim != 3:
        raise ValueError(f"{path}: counts must be [layers][experts] per step, got {arr.shape[1:]}")
    return arr


def print_static(rows: list[dict]) -> None:
    print(f"{'s':>4} {'E':>4} {'R':>3} {'shuf':>5} {'method':>14} {'max/mean':>9} {'max/LB':>7} "
          f"{'max/SLB':>8} {'moves':>6} {'swaps':>6} {'ms':>7}")
    for x in rows:
        print(f"{x['s']:>4} {x['E']:>4} {x['R']:>3} {x['shuffled']!s:>5} {x['method']:>14} "
              f"{x['imbalance']:>9.3f} {x['max_over_lb']:>7.3f} {x['max_over_slb']:>8.3f} "
              f"{x['moves']:>6} {x['swaps']:>6} {x['plan_ms']:>7.2f}")


def headline(rows: list[dict]) -> None:
    for shuffle in (True, False):
        sel = {x["method"]: x for x in rows if (x["s"], x["E"], x["R"], x["shuffled"]) ==
               (1.0, 256, 32, shuffle)}
        if not sel:
            continue
        ours, full, hc = sel["minmax"], sel["greedy-repack"], sel["hill-climb"]
        ok = (ours["max_over_lb"] <= 1.05 and ours["moves"] <= full["moves"] / 2
              and ours["plan_ms"] < 50)
        print(f"headline s=1.0 E=256 R=32 shuffled={shuffle}: minmax max/LB "
              f"{ours['max_over_lb']:.3f} (<= 1.05), moves {ours['moves']} (<= "
              f"{full['moves']}/2), {ours['plan_ms']:.2f} ms (< 50) -> "
              f"{'PASS' if ok else 'FAIL'}; hill-climb {hc['max_over_lb']:.3f}, "
              f"{hc['moves']} moves, {hc['plan_ms']:.2f} ms")


def plot(static: list[dict], drift: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    axes = axes.ravel()
    sel = [x for x in static if x["s"] == 1.0 and x["shuffled"]]
    labels = sorted({(x["E"], x["R"]) for x in sel})
    xs = np.arange(len(labels))
    for k, m in enumerate(METHODS):
        by = {(x["E"], x["R"]): x for x in sel if x["method"] == m}
        off = xs + (k - 2) * 0.16
        axes[0].bar(off, [by[c]["max_over_slb"] for c in labels], 0.16, label=m)
        axes[1].bar(off, [max(by[c]["moves"], 0.5) for c in labels], 0.16, label=m)
    for ax, title in ((axes[0], "max load / slot-aware lower bound"), (axes[1], "moved experts")):
        ax.set_xticks(xs, [f"{e}/{r}" for e, r in labels], rotation=60, fontsize=7)
        ax.set_title(f"Zipf s=1.0 shuffled: {title}")
        ax.set_xlabel("E / R")
    axes[0].set_ylim(0.98, 1.4)  # "none" bars are clipped: their values are in the table
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    names = sorted({d["bench"] for d in drift})
    for ax, name in zip(axes[2:], names, strict=False):
        for d in (d for d in drift if d["bench"] == name):
            ax.plot(d["series"], label=f"{d['method']} ({d['moves']} moves)", lw=0.8)
        ax.set_title(f"{name}: per-step max/mean rank load")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def eplb_reference(load: np.ndarray, n_ranks: int, slots: int) -> np.ndarray:
    """DeepSeek EPLB's published two steps, written here as the reference: every redundant
    slot goes to the expert with the largest load per replica; then physical experts, heaviest
    first, go to the lightest rank that still has a free slot (no other rule)."""
    E = load.size
    count = np.ones(E, dtype=np.int64)
    for _ in range(n_ranks * slots - E):
        count[int(np.argmax(load / count))] += 1
    items = sorted(((load[e] / count[e], e) for e in range(E) for _ in range(count[e])),
                   key=lambda t: -t[0])
    rows: list[list[int]] = [[] for _ in range(n_ranks)]
    loads = np.zeros(n_ranks)
    for x, e in items:
        r = min((q for q in range(n_ranks) if len(rows[q]) < slots), key=lambda q: loads[q])
        rows[r].append(e)
        loads[r] += x
    return np.array([e for row in rows for e in row])


def _next_popularity(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """drift_counts' rule once: ~10 % of the experts trade popularity."""
    q = p.copy()
    idx = rng.choice(p.size, size=max(2, p.size // 10), replace=False)
    q[idx] = q[rng.permutation(idx)]
    return q


REPL_CASES = [(s, E, R) for s in (0.8, 1.0, 1.3) for E in (64, 256) for R in (8, 32)]
REPL_METHODS = ("swaps-only", "eplb-greedy", "plan_replicas", "plan_replicas-b16")


def _repl_plan(method: str, w: np.ndarray, cur: np.ndarray, R: int, S: int) -> np.ndarray:
    """One plan of `method` (REPL_METHODS) for window load `w` from the map in use `cur`."""
    from balance.replicas import plan_replicas

    if method == "swaps-only":  # cur: expert -> rank
        return np.asarray(apply_swaps(cur, plan_swaps(w, cur, R, max_swaps=w.size)))
    if method == "eplb-greedy":
        return eplb_reference(w, R, S)
    budget = 16 if method == "plan_replicas-b16" else None
    return plan_replicas(w, R, S, current=cur, max_moves=budget)


def replication_grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """max / mean rank load and slot changes with r redundant slots per rank (issue 20 item 5).

    Per case three windows of counts (multinomial draws, Zipf popularity shuffled over experts):
    w0, planned from the identity placement (the trainer's start: trainer.distributed.replicas
    .initial_slot_map, rank q's spare slots hold the next rank's first experts); then, each
    planned from w0's plan, w1-same (a fresh draw, same popularity: sampling noise only) and
    w1-drift (~10 % of the experts traded popularity, drift_counts' rule). Methods:
      swaps-only         r = 0, plan_swaps minmax, swap budget E (all it wants)
      eplb-greedy        EPLB's published greedy (eplb_reference): re-plans from scratch, no
                         notion of the current map
      plan_replicas      balance.plan_replicas(current=previous map), no move budget
      plan_replicas-b16  the same within 16 slot changes per plan (the trainer's 2 * max_swaps
                         at the default max_swaps = 8)
    Imbalance: the plan's max rank load / mean rank load on the window it was planned on
    (replica-aware: an expert's tokens shared evenly by its replicas)."""
    from balance.replicas import replica_loads
    from trainer.distributed.replicas import initial_slot_map

    rows = []
    for s, E, R in REPL_CASES:
        rng = np.random.default_rng([args.seed, int(s * 10), E, R])
        p0 = zipf_probs(E, s, True, rng)
        n = args.tokens * args.topk * args.window
        windows = {"w0": rng.multinomial(n, p0).astype(np.float64),
                   "w1-same": rng.multinomial(n, p0).astype(np.float64),
                   "w1-drift": rng.multinomial(n, _next_popularity(p0, rng)).astype(np.float64)}
        hot = {k: float(w.max() / (w.sum() / R)) for k, w in windows.items()}
        base = {"bench": "replication", "zipf_s": s, "E": E, "R": R,
                "hottest_over_mean": hot["w0"]}
        for method in REPL_METHODS:
            for r in ((0,) if method == "swaps-only" else (0, 1, 2)):
                S = E // R + r
                if method == "swaps-only":
                    start = np.repeat(np.arange(R), E // R)  # expert -> rank
                else:
                    start = np.asarray(initial_slot_map(E, R, r), dtype=np.int64)
                row = base | {"method": method, "r": r, "slots_per_rank": S}
                t0 = time.perf_counter()
                m0 = _repl_plan(method, windows["w0"], start, R, S)
                row["plan_ms"] = 1e3 * (time.perf_counter() - t0)
                for k, w in windows.items():
                    m = m0 if k == "w0" else _repl_plan(method, w, m0, R, S)
                    frm = start if k == "w0" else m0
                    rl = (rank_loads(w, m, R) if method == "swaps-only"
                          else replica_loads(w, m, R))
                    row[f"imbalance_{k}"] = float(rl.max() / (w.sum() / R))
                    # swaps-only maps are expert -> rank: a moved expert is one slot change
                    row[f"changes_{k}"] = int((np.asarray(frm) != np.asarray(m)).sum())
                if method != "swaps-only":
                    row["dup_on_rank"] = int(sum(len(set(x)) < S for x in m0.reshape(R, S)))
                rows.append(row)
    print_replication(rows, args)
    return rows


def print_replication(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nreplication (Zipf shuffled, window {args.window} x {args.tokens} tokens x top-"
          f"{args.topk}, seed {args.seed}); per method: max/mean on w0 and slot changes from the "
          "identity | changes w0 -> w1-same | max/mean on w1-drift and changes w0 -> w1-drift")
    cols = [("swaps-only", 0)] + [(m, r) for m in REPL_METHODS[1:] for r in (0, 1, 2)]
    for what in ("imbalance_w0", "changes_w0", "changes_w1-same", "imbalance_w1-drift",
                 "changes_w1-drift"):
        print(f"\n| {what} | s | E | R | hottest/mean | " + " | ".join(
            f"{m} r={r}" for m, r in cols) + " |")
        print("|---" * (5 + len(cols)) + "|")
        for s, E, R in REPL_CASES:
            sel = {(x["method"], x["r"]): x for x in rows
                   if (x["zipf_s"], x["E"], x["R"]) == (s, E, R)}
            if not sel:
                continue
            any_row = next(iter(sel.values()))
            fmt = "{:.3f}" if what.startswith("imbalance") else "{}"
            print(f"| | {s} | {E} | {R} | {any_row['hottest_over_mean']:.2f} | " + " | ".join(
                fmt.format(sel[c][what]) for c in cols) + " |")
    tgt = [x for x in rows if (x["zipf_s"], x["E"], x["R"], x["r"], x["method"]) ==
           (1.0, 256, 32, 1, "plan_replicas")]
    if tgt:
        v = tgt[0]["imbalance_w0"]
        print(f"\ntarget Zipf 1.0, E=256, R=32, r=1: plan_replicas max/mean {v:.3f} (<= 1.10) -> "
              f"{'PASS' if v <= 1.10 else 'FAIL'}")
    print("plan_replicas planning time (w0, ms): " + ", ".join(
        f"E={x['E']} R={x['R']} r={x['r']}: {x['plan_ms']:.0f}" for x in rows
        if x["method"] == "plan_replicas" and x["zipf_s"] == 1.0))


def simulate_replicas(counts_TLE: np.ndarray, R: int, r: int, replan: bool,
                      args: argparse.Namespace) -> dict:
    """Replay a trace with r redundant slots per rank, the way trainer/balancing.py runs them:
    start from trainer.distributed.replicas.initial_slot_map; with `replan`, when the window is full, the
    cooldown has passed and the replica-aware window imbalance exceeds the threshold, re-place
    with plan_replicas(current, max_moves = 2 * policy_swaps). Imbalance: each step's own
    counts on the map it ran with."""
    from balance.replicas import plan_replicas, replica_loads, slot_changes
    from trainer.distributed.replicas import initial_slot_map

    steps, n_layers, e = counts_TLE.shape
    S = e // R + r
    pol = MigrationPolicy(threshold=args.threshold, window=args.window, cooldown=args.cooldown,
                          max_swaps=args.policy_swaps)
    mon = Monitor(n_layers, e, R, pol)
    maps = [np.asarray(initial_slot_map(e, R, r), dtype=np.int64) for _ in range(n_layers)]
    imb, moves, events, plan_ms = [], 0, 0, []
    for t in range(steps):
        c = counts_TLE[t]
        per = []
        for i in range(n_layers):
            rl = replica_loads(c[i], maps[i], R)
            per.append(rl.max() / rl.mean() if rl.mean() > 0 else 1.0)
        imb.append(float(np.mean(per)))
        mon.record(c)
        if not replan or not mon.window_full:
            continue
        w = mon.load()
        t0 = time.perf_counter()
        for i in range(n_layers):
            if t - mon.last_event(i) < pol.cooldown:
                continue
            rl = replica_loads(w[i], maps[i], R)
            if rl.mean() <= 0 or rl.max() / rl.mean() <= pol.threshold:
                continue
            new = plan_replicas(w[i], R, S, current=maps[i], max_moves=2 * args.policy_swaps)
            mon.mark(i, t)
            if (new != maps[i]).any():
                moves += slot_changes(maps[i], new)
                events += 1
                maps[i] = np.asarray(new)
        plan_ms.append((time.perf_counter() - t0) * 1e3)
    return {
        "method": f"replicas r={r}" + (" re-placed" if replan else " static"), "steps": steps,
        "layers": n_layers, "E": e, "R": R, "redundant": r,
        "mean_imbalance": float(np.mean(imb)), "p95_imbalance": float(np.percentile(imb, 95)),
        "moves": moves, "events": events,
        "plan_ms_max": max(plan_ms) if plan_ms else 0.0, "series": imb,
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="headline case and a short drift run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="timed planning repeats (median)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--window", type=int, default=16, help="steps of counts per plan")
    ap.add_argument("--max-swaps", type=int, default=None, help="static: swap budget (None: E)")
    ap.add_argument("--steps", type=int, default=400, help="drift: steps simulated")
    ap.add_argument("--drift-every", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=4, help="trace: EP ranks")
    ap.add_argument("--threshold", type=float, default=1.1)
    ap.add_argument("--cooldown", type=int, default=20)
    ap.add_argument("--policy-swaps", type=int, default=8, help="drift / trace: swaps per event")
    ap.add_argument("--trace", default=None, help="JSON lines of recorded per-step counts")
    ap.add_argument("--replication", action="store_true",
                    help="only the redundant-slot grid (balance.plan_replicas vs EPLB's greedy)")
    add_output_args(ap, "balance")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 150)

    out = output_dir(args)
    meta = {"git": git_sha(), "device": _device(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seed": args.seed, "tokens": args.tokens, "topk": args.topk, "window": args.window}
    if args.replication:
        rows = replication_grid(args)
        with open(out / "bench_balance.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(meta | row) + "\n")
        print(f"\nrows appended to {out / 'bench_balance.jsonl'}")
        return

    static = static_grid(args)
    print_static(static)
    headline(static)

    rng = np.random.default_rng(args.seed)
    # Two drift regimes: mild skew where placement decides the step time, and strong skew
    # where the hottest expert alone exceeds a rank's share (only replication would help).
    sources = [
        (f"drift s={s} E={e} R={r}", drift_counts(args, e, s, rng)[:, None, :], r)
        for s, e, r in ((0.5, 64, 8), (1.0, 256, 32))
    ]
    if args.trace:
        tr = load_trace(args.trace)
        if tr.shape[2] % args.ranks:
            raise ValueError(f"trace has E={tr.shape[2]} experts, not a multiple of --ranks")
        sources.append(("trace", tr, args.ranks))
    else:
        print("no --trace given: recorded-training trace skipped")
    dyn: list[dict] = []
    for name, counts, r in sources:
        print(f"\n{name}: {counts.shape[0]} steps, {counts.shape[1]} layer(s), E={counts.shape[2]}, "
              f"R={r}, threshold {args.threshold}, window {args.window}, cooldown {args.cooldown}, "
              f"{args.policy_swaps} swaps/event")
        print(f"{'method':>14} {'mean max/mean':>14} {'p95':>7} {'moves':>6} {'events':>7} "
              f"{'plan ms max':>12}")
        for m in (m for m in METHODS if m != "minmax-tol0"):
            res = simulate(counts, r, m, args) | {"bench": name}
            dyn.append(res)
            print(f"{m:>14} {res['mean_imbalance']:>14.3f} {res['p95_imbalance']:>7.3f} "
                  f"{res['moves']:>6} {res['events']:>7} {res['plan_ms_max']:>12.2f}")
        if name == "trace":  # redundant slots on the recorded trace (issue 20)
            for red, replan in ((1, False), (1, True), (2, False), (2, True)):
                if red > counts.shape[2] - counts.shape[2] // r:
                    continue
                res = simulate_replicas(counts, r, red, replan, args) | {"bench": name}
                dyn.append(res)
                print(f"{res['method']:>22} {res['mean_imbalance']:>6.3f} "
                      f"{res['p95_imbalance']:>7.3f} {res['moves']:>6} {res['events']:>7} "
                      f"{res['plan_ms_max']:>12.2f}")

    with open(out / "bench_balance.jsonl", "a") as f:
        for row in static:
            f.write(json.dumps(meta | row) + "\n")
        for row in dyn:
            f.write(json.dumps(meta | {k: v for k, v in row.items() if k != "series"}) + "\n")
    plot(static, [d for d in dyn if d["bench"].startswith("drift")], out / "bench_balance.png")
    print(f"\nrows appended to {out / 'bench_balance.jsonl'}; plot {out / 'bench_balance.png'}")


if __name__ == "__main__":
    main()
