"""Summary of a finished (or running) run from its metrics.jsonl:

    python -m trainer.report RUN_DIR

prints a table (steps, final loss and validation loss, median tokens/s, MFU, step time and its
parts, and per MoE layer the load statistics of `trainer.observe.metrics` over the run) and draws
into RUN_DIR: loss.png (training and validation loss), load_heatmap.png (max/mean expert
load per MoE layer and step) and step_time.png (the measured parts of each step's time).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["read_rows", "summary", "plot_loss", "plot_load_heatmap", "plot_step_time", "main"]

# the measured parts of a step (metrics.jsonl keys), as drawn in step_time.png
PARTS = {"fwd_bwd_s": "forward + backward", "grad_sync_s": "gradient sync + clip",
         "optim_s": "optimizer + migration", "ep_exchange_max_s": "EP all-to-all (max rank)",
         "pp_idle_max_s": "pipeline idle (max rank)"}


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The step rows of RUN_DIR/metrics.jsonl (event rows left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: RUN_DIR must be a run's out_dir "
                                f"(train.out_dir, e.g. runs/tiny)")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    rows = [r for r in rows if "loss" in r]
    if not rows:
        raise ValueError(f"{path} has no step rows yet")
    return rows


def _med(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return statistics.median(vals) if vals else None


def summary(rows: list[dict[str, Any]], skip: int = 2) -> str:
    """The printed table; medians skip the first `skip` steps (warm-up) when there are more."""
    steady = rows[skip:] if len(rows) > skip else rows
    val = [r for r in rows if "val_loss" in r]
    lines = [f"steps            {rows[-1]['step']}",
             f"final loss       {rows[-1]['loss']:.4f}",
             f"final val loss   {val[-1]['val_loss']:.4f} (step {val[-1]['step']})" if val
             else "final val loss   -"]
    for key, label, fmt in (("tokens_per_s", "tokens/s", "{:,.0f}"), ("mfu", "MFU", "{:.2%}"),
                            ("step_time_s", "step time", "{:.4f} s"),
                            *((k, v, "{:.4f} s") for k, v in PARTS.items()),
                            ("imbalance", "EP imbalance", "{:.3f}")):
        m = _med(steady, key)
        if m is not None:
            lines.append(f"{label:<28} {fmt.format(m)}  (median of steps "
                         f"{steady[0]['step']}..{steady[-1]['step']})")
    with_layers = [r for r in rows if r.get("layers")]
    if with_layers:
        lines += ["", "MoE layer | max/mean load (median, max) | CV (median) | empty experts "
                  "(max) | router entropy (first -> last)"]
        n = len(with_layers[0]["layers"])
        for j in range(n):
            st = [r["layers"][j] for r in with_layers]
            mm = [s["load_max_over_mean"] for s in st]
            lines.append(f"{st[0]['layer']:>9} | {statistics.median(mm):>13.3f} {max(mm):>12.3f} | "
                         f"{statistics.median(s['load_cv'] for s in st):>11.3f} | "
                         f"{max(s['empty_experts'] for s in st):>19} | "
                         f"{st[0]['router_entropy']:.3f} -> {st[-1]['router_entropy']:.3f} nats")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(metrics_path: Path, png: Path) -> None:
    """Training and validation loss over steps."""
    try:
        plt = _pyplot()
    except ImportError:
        print("matplotlib not installed: no loss plot", file=sys.stderr)
        return
    rows = read_rows(Path(metrics_path).parent)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
    val = [r for r in rows if "val_loss" in r]
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.axhline(math.log(256), color="gray", ls=":", lw=1, label="uniform (ln 256)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def plot_load_heatmap(rows: list[dict[str, Any]], png: Path) -> bool:
    """max/mean expert load, MoE layers x steps; False when the run has no per-layer rows."""
    rows = [r for r in rows if r.get("layers")]
    if not rows:
        return False
    plt = _pyplot()
    grid = [[r["layers"][j]["load_max_over_mean"] for r in rows]
            for j in range(len(rows[0]["layers"]))]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.35 * len(grid)))
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                   extent=(rows[0]["step"] - 0.5, rows[-1]["step"] + 0.5, len(grid) - 0.5, -0.5))
    ax.set_yticks(range(len(grid)), [f"layer {s['layer']}" for s in rows[0]["layers"]])
    ax.set_xlabel("step")
    fig.colorbar(im, ax=ax, label="max / mean tokens per expert")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def plot_step_time(rows: list[dict[str, Any]], png: Path) -> None:
    """Step time and its measured parts over steps (the parts overlap: the EP exchange and the
    pipeline idle happen inside forward + backward)."""
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(steps, [r["step_time_s"] for r in rows], "k-", lw=1.5, label="step time")
    for key, label in PARTS.items():
        if any(key in r for r in rows):
            ax.plot(steps, [r.get(key, float("nan")) for r in rows], lw=1, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m trainer.report RUN_DIR", file=sys.stderr)
        return 2
    run = Path(argv[0])
    try:
        rows = read_rows(run)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(rows))
    try:
        _pyplot()
    except ImportError:
        print("matplotlib not installed: no plots (pip install matplotlib)", file=sys.stderr)
        return 0
    plot_loss(run / "metrics.jsonl", run / "loss.png")
    drawn = [run / "loss.png"]
    if plot_load_heatmap(rows, run / "load_heatmap.png"):
        drawn.append(run / "load_heatmap.png")
    plot_step_time(rows, run / "step_time.png")
    drawn.append(run / "step_time.png")
    print("plots: " + ", ".join(str(p) for p in drawn))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
