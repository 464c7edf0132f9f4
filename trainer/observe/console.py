"""What rank 0 writes after each step: metrics.jsonl (rows and events), counts.jsonl (the
routing trace), the sinks (TensorBoard / W&B, trainer.observe.metrics) and the console progress line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..common import log

__all__ = ["StepWriter", "format_row", "format_event", "truncate_jsonl"]


class StepWriter:
    def __init__(self, t, out: Path, sinks, start_step: int, logging_ab: bool = False):
        self.t, self.out, self.sinks, self.logging_ab = t, out, sinks, logging_ab
        self.metrics_path = out / "metrics.jsonl"
        self.start_step = start_step

    def write(self, m: dict[str, Any], events: list[dict[str, Any]], stats, logged: bool,
              elapsed: float) -> None:
        """Rank 0 only. `stats` is the step's `trainer.observe.stats.StepStats`; `logged` says whether
        this step's per-layer values were collected (--debug.logging_ab alternates)."""
        t, step = self.t, m["step"]
        if t.trace_counts and stats.last_counts:
            # routing trace, for benchmarks/bench_balance.py --trace: every stage's MoE layers
            # with --train.layer_metrics (the default), else rank 0's
            all_layers = stats.gather.last_counts is not None
            counts = stats.gather.last_counts if all_layers else stats.last_counts
            ids = stats.gather.moe_ids if all_layers else stats.gather.local_ids
            with open(self.out / "counts.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "layers": ids, "counts": [
                    [int(v) for v in c.tolist()] for c in counts]}) + "\n")
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
            for ev in events:
                f.write(json.dumps(ev) + "\n")
        if logged or not self.logging_ab:
            self.sinks.write(m)
        for ev in events:
            log(format_event(ev))
        if step % t.log_every == 0 or "val_loss" in m or step == t.steps:
            eta = elapsed / (step - self.start_step) * (t.steps - step)
            log(format_row(m, t.steps, eta))


def format_row(m: dict[str, Any], total: int, eta: float) -> str:
    width = 20
    done = int(width * m["step"] / total)
    bar = "#" * done + "-" * (width - done)
    s = (f"[{bar}] {m['step']:>5}/{total} | loss {m['loss']:.4f} | aux {m['aux_loss']:.4f} | "
         f"lr {m['lr']:.2e} | {m['tokens_per_s'] / 1e3:.1f}k tok/s | MFU {100 * m['mfu']:.1f}% | "
         f"imbalance {m['imbalance']:.2f} | epoch {m['epoch']:.3f} | "
         f"{_count(m['tokens_seen'])} tok seen | eta {eta:.0f}s")
    if "val_loss" in m:
        s += f" | val {m['val_loss']:.4f}"
    return s


def _count(n: float) -> str:
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def format_event(ev: dict[str, Any]) -> str:
    if ev["event"] == "nonfinite":
        return (f"  non-finite loss/gradient at step {ev['step']} (loss {ev['loss']}, grad norm "
                f"{ev['grad_norm']}): {ev['action']} ({ev['count']} so far)")
    if ev.get("replicas"):
        s = (f"  replica re-placement at step {ev['step']}: {ev['layer']} {ev['swaps']} slot(s) "
             f"changed, {ev['bytes_sent'] / 1e6:.2f} MB sent by rank 0, {1e3 * ev['seconds']:.1f} ms")
        if "imbalance_before" in ev:
            s += (f", imbalance {ev['imbalance_before']:.2f} -> "
                  f"{ev['imbalance_after_planned']:.2f} (window)")
        return s
    s = (f"  migration at step {ev['step']}: {ev['layer']} {ev['swaps']} swap(s), "
         f"{ev['moved_experts']} experts moved, {ev['bytes_sent'] / 1e6:.2f} MB sent by rank 0, "
         f"{1e3 * ev['seconds']:.1f} ms")
    if "imbalance_before" in ev:
        s += f", imbalance {ev['imbalance_before']:.2f} -> {ev['imbalance_after_planned']:.2f} (window)"
    return s


def truncate_jsonl(path: Path, step: int) -> None:
    """On resume, drop rows of steps the resumed run will redo."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in keep))
