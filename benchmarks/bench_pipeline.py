"""Measured vs predicted pipeline bubble and activation memory, per schedule, on CPU (gloo).

For every (ranks, micro-batches) pair, `p` processes run each schedule on a stack of
Linear(d, d)+ReLU layers (`layers` per rank, split evenly over virtual stages), plain matmul
compute with no sleeps. Per schedule:

  bubble     measured: 1 - busy / (p x makespan) from the runtime's per-action wall-clock
             spans, median over `repeats` timed steps after `warmup`; predicted: (a)
             `bubble_fraction(schedule)` (unit costs), (b) `bubble_fraction(schedule, costs)`
             with per-(stage, kind) median action times of the same run, (c) the same with
             every action's own duration in that step (replay), gap = median of per-step
             differences measured - replay; (b) and (c) also with the measured one-way P2P
             time of one activation added at every stage boundary (`transfer=`), "+p2p".
  memory     measured: peak bytes of tensors saved for backward that are alive at once on a
             rank during one step, counted exactly with saved_tensors_hooks (unique storages,
             parameters excluded); predicted: the peak_inflight walk weighted by the saved
             bytes of one micro-batch through each stage, measured alone with the same hooks
             (`peak_activation_bytes`; = peak_inflight[rank] x bytes when stages weigh the
             same, which they do except for the loss's saved tensors on the last stage).

Rows go to pipeline.jsonl (git SHA, device); plots: a summary figure and planned vs measured
Gantt charts for the largest configuration, all in runs/bench/pipeline/ (ignored by git) or
`--out DIR`; `--record` writes them to benchmarks/results/, the tracked record. A table is
printed.

    .venv/bin/python benchmarks/bench_pipeline.py                 # 2 and 4 ranks, 4 and 8 mbs
    .venv/bin/python benchmarks/bench_pipeline.py --ranks 2 --microbatches 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import add_output_args, cpu_name, git_sha, output_dir  # noqa: E402

import pipeline  # noqa: E402
from comm import run_local  # noqa: E402
from tuner.measure import p2p_one_way_s  # noqa: E402

SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("interleaved-1f1b", {"n_virtual": 2}), ("zb-h1", {})]


class SavedBytes:
    """Live and peak bytes of activations saved for backward (saved_tensors_hooks)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = defaultdict(int)
        self.size: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.skip:
            return t
        if self.refs[key] == 0:
            self.size[key] = t.untyped_storage().nbytes()
            self.live += self.size[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        # detach: a saved *output* keeps its grad_fn, which holds this handle, which would
        # hold the output: a C++-side cycle that keeps the graph alive forever.
        return _Handle(self, key, t.detach())

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Handle) else h

    def release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.live -= self.size.pop(key)
            del self.refs[key]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Handle:
    """Holds one saved tensor; freed (CPython refcounting) when autograd drops the graph."""

    def __init__(self, owner: SavedBytes, key: int, t: torch.Tensor) -> None:
        self.owner, self.key, self.t = owner, key, t

    def __del__(self) -> None:
        self.owner.release(self.key)


def _stage(d: int, n_layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(n_layers) for m in (nn.Linear(d, d), nn.ReLU())])


def _worker(rank: int, world: int, group: dist.ProcessGroup, m: int, args: dict) -> dict:
    d, rows = args["dim"], args["rows"]
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, d, generator=g) for _ in range(m)]
    ys = [torch.randn(rows, d, generator=g) for _ in range(m)]
    # one-way hand-over of one activation between ranks 0 and 1 (median of half round trips)
    out["p2p_s"] = p2p_one_way_s(rank, torch.randn(rows, d), repeats=21)
    dist.barrier()
    for name, kw in SCHEDULES:
        if name == "interleaved-1f1b" and m % world:
            continue
        sched = pipeline.build(name, world, m, **kw)
        v = pipeline.n_stages(sched) // world
        per_stage = max(1, args["layers"] // v)
        stages = {s: _stage(d, per_stage, s) for s, r in pipeline.stage2rank(sched).items()
                  if r == rank}
        rt = pipeline.PipelineRuntime(sched, stages, F.mse_loss, act_shape=(rows, d))
        bubbles, all_spans = [], []
        for i in range(args["warmup"] + args["repeats"]):
            rt.step(xs, ys)
            spans = rt.gather_spans()
            if i >= args["warmup"]:
                bubbles.append(pipeline.bubble_from_spans(spans, world))
                all_spans.append(spans)
        # Memory: one untimed step under the counting hooks (they slow every op down).
        params = [p for s in stages.values() for p in s.parameters()]
        counter = SavedBytes(params)
        with counter.hooks():
            rt.step(xs, ys)
        assert counter.live == 0, f"{counter.live} saved bytes outlived the step"
        per_mb = {}
        for s, mod in stages.items():
            one = SavedBytes(params)
            x = xs[0].clone().requires_grad_(s > 0)
            with one.hooks():
                y = mod(x)
                loss = F.mse_loss(y, ys[0]) if s == pipeline.n_stages(sched) - 1 else y.sum()
            per_mb[s] = one.peak
            del y, loss
        for p in params:
            p.grad = None
        out[name] = {"bubbles": bubbles, "spans": all_spans, "peak_bytes": counter.peak,
                     "per_mb_bytes": per_mb}
    return out


def _device() -> str:
    return f"{cpu_name()} x{os.cpu_count()} (CPU, gloo)"


def _analyse(name: str, kw: dict, p: int, m: int, res: list[dict]) -> dict:
    sched = pipeline.build(name, p, m, **kw)
    runs = [r[name] for r in res]
    bubbles = runs[0]["bubbles"]
    k = sorted(range(len(bubbles)), key=lambda i: bubbles[i])[len(bubbles) // 2]
    spans = runs[0]["spans"][k]
    by = defaultdict(list)
    for rep in runs[0]["spans"]:
        for s in rep:
            by[(s.action.stage, s.action.kind)].append(s.end - s.start)
    cost = {key: statistics.median(v) for key, v in by.items()}
    # Replay of each timed step with its own action durations: what the schedule predicts
    # for exactly the compute that ran; the gap to the measurement is P2P latency, runtime
    # overhead and preemption on a shared machine.
    p2p = res[0]["p2p_s"]
    replay, replay_p2p = [], []
    for rep in runs[0]["spans"]:
        dur = {sp.action: sp.end - sp.start for sp in rep}
        replay.append(pipeline.bubble_fraction(sched, costs=lambda a, dur=dur: dur[a]))
        replay_p2p.append(pipeline.bubble_fraction(sched, costs=lambda a, dur=dur: dur[a],
                                                   transfer=p2p))
    inflight = pipeline.peak_inflight(sched)
    s2r = pipeline.stage2rank(sched)
    per_stage = {s: b for r in range(p) for s, b in runs[r]["per_mb_bytes"].items()}
    weighted = pipeline.peak_activation_bytes(sched, per_stage)
    pred_bytes = [weighted[r] for r in range(p)]
    meas_bytes = [runs[r]["peak_bytes"] for r in range(p)]
    return {
        "schedule": name, "ranks": p, "microbatches": m, "n_stages": len(s2r),
        "bubble_measured": statistics.median(bubbles),
        "bubble_pred_unit": pipeline.bubble_fraction(sched),
        "bubble_pred_costs": pipeline.bubble_fraction(
            sched, costs=lambda a: cost[(a.stage, a.kind)]),
        "bubble_pred_replay": statistics.median(replay),
        # the same two predictions with the measured P2P hand-over time at stage boundaries
        "p2p_ms": 1e3 * p2p,
        "bubble_pred_costs_p2p": pipeline.bubble_fraction(
            sched, costs=lambda a: cost[(a.stage, a.kind)], transfer=p2p),
        "bubble_pred_replay_p2p": statistics.median(replay_p2p),
        "bubble_gap_replay_pp": 100 * statistics.median(
            [b - r for b, r in zip(bubbles, replay, strict=True)]),
        "cost_ms": {f"{s}{kd}": round(1e3 * c, 3) for (s, kd), c in sorted(cost.items())},
        "peak_inflight": [inflight[r] for r in range(p)],
        "act_bytes_pred": pred_bytes, "act_bytes_measured": meas_bytes,
        "_spans": spans, "_sched": sched,
    }


def _plots(rows: list[dict], out: Path, stamp: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    labels = [f"{r['schedule']}\np={r['ranks']} m={r['microbatches']}" for r in rows]
    xs = range(len(rows))
    ax1.bar([x - 0.3 for x in xs], [r["bubble_pred_unit"] for r in rows], 0.2,
            label="predicted (unit costs)")
    ax1.bar([x - 0.1 for x in xs], [r["bubble_pred_costs"] for r in rows], 0.2,
            label="predicted (median costs)")
    ax1.bar([x + 0.1 for x in xs], [r["bubble_pred_replay"] for r in rows], 0.2,
            label="predicted (replay)")
    ax1.bar([x + 0.3 for x in xs], [r["bubble_measured"] for r in rows], 0.2, label="measured")
    ax1.set_xticks(list(xs), labels, fontsize=6, rotation=90)
    ax1.set_ylabel("bubble fraction")
    ax1.legend(fontsize=7)
    ax2.bar([x - 0.2 for x in xs], [r["act_bytes_pred"][0] / 2**20 for r in rows], 0.4,
            label="predicted rank 0")
    ax2.bar([x + 0.2 for x in xs], [r["act_bytes_measured"][0] / 2**20 for r in rows], 0.4,
            label="measured rank 0")
    ax2.set_xticks(list(xs), labels, fontsize=6, rotation=90)
    ax2.set_ylabel("peak saved activations (MiB)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pipeline_summary.png", dpi=120)
    plt.close(fig)
    p_max = max(r["ranks"] for r in rows)
    m_max = max(r["microbatches"] for r in rows if r["ranks"] == p_max)
    for r in rows:
        if r["ranks"] == p_max and r["microbatches"] == m_max:
            tag = f"{r['schedule']}_p{p_max}_m{m_max}"  # latest run overwrites
            pipeline.plot_timeline(pipeline.timeline_spans(r["_sched"]),
                                   out / f"pipeline_planned_{tag}.png",
                                   title=f"{r['schedule']} planned (unit steps)")
            pipeline.plot_timeline(r["_spans"], out / f"pipeline_measured_{tag}.png",
                                   title=f"{r['schedule']} measured", xlabel="seconds",
                                   n_ranks=p_max)
            pipeline.chrome_trace(r["_spans"], out / f"pipeline_measured_{tag}.json")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=128, help="rows per micro-batch")
    ap.add_argument("--layers", type=int, default=4, help="Linear+ReLU layers per rank")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    add_output_args(ap, "pipeline")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = output_dir(args)
    cfg = {k: getattr(args, k) for k in ("dim", "rows", "layers", "warmup", "repeats")}
    sha, device, stamp = git_sha(), _device(), time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for p in args.ranks:
        for m in args.microbatches:
            res = run_local(_worker, p, m, cfg, timeout_s=900)
            for name, kw in SCHEDULES:
                if name in res[0]:
                    rows.append(_analyse(name, kw, p, m, res))
    hdr = (f"{'schedule':<17}{'p':>3}{'m':>3} {'bubble meas':>11} {'unit':>6} {'cost':>6} "
           f"{'+p2p':>6} {'replay':>6} {'+p2p':>6} {'gap pp':>6}  "
           f"{'act MiB meas/pred per rank':<40}")
    print(hdr)
    print("-" * len(hdr))
    with open(out / "pipeline.jsonl", "a") as f:
        for r in rows:
            mem = " ".join(f"{a / 2**20:.2f}/{b / 2**20:.2f}"
                           for a, b in zip(r["act_bytes_measured"], r["act_bytes_pred"],
                                           strict=True))
            print(f"{r['schedule']:<17}{r['ranks']:>3}{r['microbatches']:>3} "
                  f"{r['bubble_measured']:>11.3f} {r['bubble_pred_unit']:>6.3f} "
                  f"{r['bubble_pred_costs']:>6.3f} {r['bubble_pred_costs_p2p']:>6.3f} "
                  f"{r['bubble_pred_replay']:>6.3f} {r['bubble_pred_replay_p2p']:>6.3f} "
                  f"{r['bubble_gap_replay_pp']:>+6.1f}  {mem:<40}")
            row = {k: v for k, v in r.items() if not k.startswith("_")}
            row.update(git_sha=sha, device=device, time=stamp, config=cfg)
            f.write(json.dumps(row) + "\n")
    _plots(rows, out, stamp)
    print(f"one-way P2P hand-over of a {args.rows} x {args.dim} fp32 activation: "
          f"{rows[0]['p2p_ms']:.3f} ms (median, ranks 0 -> 1)" if rows else "")
    print(f"rows appended to {out / 'pipeline.jsonl'}; plots {out}/pipeline_*.png (overwritten "
          "by each run)")


if __name__ == "__main__":
    main()
