"""pipeline: pipeline-parallel schedules as data, and the runtime that executes them.

Schedules (pure Python, no torch.distributed):

    sched = pipeline.build("1f1b", n_ranks=4, n_microbatches=8)   # {rank: [Action | None]}
    pipeline.validate(sched)                   # ValueError naming the offending action
    pipeline.bubble_fraction(sched)            # 3/11 = (p-1)/(m+p-1)
    pipeline.bubble_fraction(sched, costs={"F": 1.0, "B": 2.0})   # simulated with costs
    pipeline.peak_inflight(sched)              # {0: 4, 1: 3, 2: 2, 3: 1}
    pipeline.peak_activation_bytes(sched, {s: nbytes, ...})      # same walk, weighted
    print(pipeline.format_table(sched))        # step x rank table
    spans = pipeline.timeline_spans(sched)
    pipeline.chrome_trace(spans, "t.json"); pipeline.plot_timeline(spans, "t.png")

Names: "gpipe", "1f1b", "interleaved-1f1b" (n_virtual=v, stage s on rank s % p,
n_microbatches % n_ranks == 0), "zb-h1" (backward split into B and W); evaluation runs
`pipeline.forward_only(n_ranks, n_microbatches, n_virtual)` (forwards only) on the same runtime.
`derive_transfers` / `comm_plan` give the sends and receives the runtime posts.

Runtime (one call per rank of the PP group; see `pipeline.runtime` for the details):

    rt = pipeline.PipelineRuntime(sched, {stage: module, ...}, loss_fn, act_shape=(mb, d),
                                  group=pp_group, aux_fn=None)
    losses = rt.step(inputs_per_mb, targets_per_mb)  # list on the last stage, None elsewhere
    spans = rt.gather_spans()                         # measured Spans of every rank
    pipeline.bubble_from_spans(spans, n_ranks)        # measured bubble fraction
"""

from __future__ import annotations

from pipeline.analysis import (
    Costs,
    Span,
    Transfer,
    bubble_fraction,
    bubble_from_spans,
    comm_plan,
    derive_transfers,
    is_forward_only,
    peak_activation_bytes,
    peak_inflight,
    simulate,
    timeline_spans,
    validate,
)
from pipeline.render import chrome_trace, format_table, plot_timeline
from pipeline.runtime import PipelineRuntime
from pipeline.schedule import (
    KINDS,
    Action,
    Schedule,
    build,
    forward_only,
    n_stages,
    schedule_names,
    stage2rank,
)

__all__ = [
    "KINDS",
    "Action",
    "Costs",
    "PipelineRuntime",
    "Schedule",
    "Span",
    "Transfer",
    "bubble_fraction",
    "bubble_from_spans",
    "build",
    "chrome_trace",
    "comm_plan",
    "derive_transfers",
    "format_table",
    "forward_only",
    "is_forward_only",
    "n_stages",
    "peak_activation_bytes",
    "peak_inflight",
    "plot_timeline",
    "schedule_names",
    "simulate",
    "stage2rank",
    "timeline_spans",
    "validate",
]
