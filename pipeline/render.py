"""Views of a schedule or a measured run: step x rank text table, Chrome trace, Gantt PNG.

Planned and measured timelines share one representation (a list of `Span`s, see
`pipeline.analysis`), so `chrome_trace` and `plot_timeline` draw both the same way: planned
spans are in unit steps (or simulated cost units), measured ones in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.analysis import Span
from pipeline.schedule import Schedule

__all__ = ["format_table", "chrome_trace", "plot_timeline"]

# One colour per kind, the convention of the zero-bubble paper's figures (F blue, B teal,
# W green) so plots read like the ones people know.
_COLORS = {"F": "#4c72b0", "B": "#55a8a0", "W": "#7fbf5f"}


def format_table(schedule: Schedule) -> str:
    """Rows = time steps, columns = ranks; each cell an action ("2F0") or "." when idle."""
    ranks = sorted(schedule)
    length = max((len(schedule[r]) for r in ranks), default=0)
    cells = [[f"r{r}" for r in ranks]]
    for t in range(length):
        row = []
        for r in ranks:
            a = schedule[r][t] if t < len(schedule[r]) else None
            row.append("." if a is None else str(a))
        cells.append(row)
    width = max(len(c) for row in cells for c in row)
    step_w = max(4, len(str(max(length - 1, 0))))
    lines = []
    for i, row in enumerate(cells):
        label = "step".rjust(step_w) if i == 0 else f"{i - 1}".rjust(step_w)
        lines.append(label + " | " + " ".join(c.rjust(width) for c in row))
    return "\n".join(lines)


def chrome_trace(
    spans: Iterable[Span], path: str | Path | None = None, time_unit_us: float = 1e6
) -> dict[str, Any]:
    """Chrome trace ("traceEvents", open in chrome://tracing or Perfetto): one thread per
    rank, one complete event per span. `time_unit_us` converts span times to microseconds
    (1e6 for seconds; use e.g. 1000 to draw unit steps as 1 ms). Written to `path` if given."""
    spans = list(spans)
    t0 = min((s.start for s in spans), default=0.0)
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in sorted({s.rank for s in spans})
    ]
    for s in spans:
        events.append(
            {
                "name": str(s.action),
                "cat": s.action.kind,
                "ph": "X",
                "pid": 0,
                "tid": s.rank,
                "ts": (s.start - t0) * time_unit_us,
                "dur": (s.end - s.start) * time_unit_us,
                "args": {"stage": s.action.stage, "microbatch": s.action.microbatch},
            }
        )
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def plot_timeline(
    spans: Iterable[Span],
    path: str | Path,
    title: str = "",
    xlabel: str = "time step",
    n_ranks: int | None = None,
) -> None:
    """Gantt chart PNG: one row per rank (rank 0 on top), boxes labelled with the action."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = list(spans)
    if not spans:
        raise ValueError("no spans to plot")
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    ranks = n_ranks if n_ranks is not None else max(s.rank for s in spans) + 1
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.35 * len(spans) / ranks + 3)),
                                    0.5 * ranks + 1.2))
    for s in spans:
        y = ranks - 1 - s.rank
        ax.barh(y, s.end - s.start, left=s.start - t0, height=0.8,
                color=_COLORS[s.action.kind], edgecolor="black", linewidth=0.4)
        # Labels only where they fit; long runs would otherwise be unreadable ink.
        if (s.end - s.start) / max(t1 - t0, 1e-12) > 0.012:
            ax.text(s.start - t0 + (s.end - s.start) / 2, y, str(s.action),
                    ha="center", va="center", fontsize=6)
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {ranks - 1 - i}" for i in range(ranks)])
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
