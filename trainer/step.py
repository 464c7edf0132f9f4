"""The training step: the one place the hot loop lives.

    batch -> forward + backward (pipelined with pp > 1; m micro-batches accumulated with pp = 1)
          -> gradient sync + clip -> loss / counts all-reduce -> optimizer (or skip a
          non-finite step) -> router bias, expert migration -> the step's `StepResult`

What the step works with is a `StepParts` (built once per run by the Trainer, trainer/loop.py);
what it advances is a `StepState` (steps done, non-finite steps skipped, the phase it is in,
which a failure message names); what it returns is a `StepResult`: every per-step number a
metrics.jsonl row holds (`StepResult.row()`), the step's events and whether it logged layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from model import cross_entropy

from .common import TrainingError
from .distributed.replicas import replica_row_weights, sum_replica_grads
from .observe.memory import state_bytes

if TYPE_CHECKING:
    from model import ModelConfig, MoETransformer

    from .balancing import Balancer
    from .build import Pipeline
    from .config import RunConfig
    from .distributed.grad_sync import GradSync
    from .distributed.mesh import Mesh
    from .distributed.precision import Precision
    from .faults import StepHooks
    from .observe.stats import StepStats

__all__ = ["StepParts", "StepState", "StepResult", "train_step", "forward_loss", "lr_at", "update_state",
           "allreduce_mean", "doc_layout", "queue_docs", "check_docs_used"]


@dataclass
class StepParts:
    """What a step works with: built once per run (trainer/loop.py), not changed by a step."""

    cfg: RunConfig
    mcfg: ModelConfig
    mesh: Mesh
    corpus: Any  # trainer.data.Corpus or Blend
    device: torch.device
    precision: Precision
    model: MoETransformer
    pipe: Pipeline | None  # None with pp = 1
    sync: GradSync
    optim: torch.optim.Optimizer
    stats: StepStats
    hooks: StepHooks
    balancer: Balancer | None  # None without migration
    flops_per_token: float
    peak: float  # FLOP/s per process (0: no MFU)
    fb: bool = False  # --comm.a2a_overlap fb, as resolved (auto may pick it): micro-batches paired


@dataclass
class StepState:
    """What a step advances. `phase` names what the run is doing now, for the message a failed
    collective ends the run with (trainer/ckpt_manager.py)."""

    step: int = 0  # optimizer steps done (skipped non-finite steps included)
    nonfinite_steps: int = 0
    phase: str = "setup"


@dataclass
class StepResult:
    """One step's numbers: every field but `events` and `logged` is a metrics.jsonl key, in
    the row's order; None = not measured in this run (the key is left out of the row).
    Wall-clock fields: `*_s`, `tokens_per_s`, `mfu`, `pp_idle_frac_max`, `migration_seconds`,
    `time`."""

    step: int
    epoch: float
    tokens_seen: int
    source_epochs: dict[str, float] | None  # a blend: each source's epochs
    loss: float  # the global batch's mean cross-entropy
    aux_loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float
    mfu: float
    imbalance: float  # max / mean EP-rank load, mean over MoE layers (1.0 without EP)
    # summed over this step's migration events (only when one moved something)
    migration_swaps: float | None
    migration_moved_experts: float | None
    migration_bytes_sent: float | None
    migration_seconds: float | None
    pp_idle_max_s: float | None  # with pp > 1: the most idle PP rank
    pp_idle_frac_max: float | None
    step_time_s: float
    fwd_bwd_s: float
    grad_sync_s: float
    optim_s: float
    ep_exchange_max_s: float | None  # with EP: forward exchange seconds over the EP group
    ep_exchange_min_s: float | None
    ep_remote_rows: float | None  # with an EP group across nodes: rows sent off the node
    ep_remote_bytes: float | None
    ep_flat_remote_rows: float | None
    ep_node_imbalance: float | None  # busiest node's inter-node rows / mean (observe.stats)
    mem_state_bytes_max: float | None  # with train.memory_report
    mem_act_peak_bytes_max: float | None
    time: float  # wall clock: row-to-row intervals include the logging
    nonfinite_steps: int | None  # non-finite steps so far, once there is one
    layers: list[dict[str, Any]] | None  # per-MoE-layer numbers when logged
    # set by the loop after the step (trainer/loop.py)
    compiled_graphs: int | None = None
    val_loss: float | None = None
    recompilations: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)  # migrations, non-finite skips
    logged: bool = True  # per-layer values collected this step (debug.logging_ab alternates)

    def row(self) -> dict[str, Any]:
        """The metrics.jsonl row (what `events` and `logged` are not)."""
        return {f.name: v for f in dataclasses.fields(self)
                if f.name not in ("events", "logged") and (v := getattr(self, f.name)) is not None}


def metered(t, step: int) -> bool:
    """Whether step `step` (1-based) runs under the memory meter: --train.memory_report, every
    --train.memory_report_every-th step."""
    return bool(t.memory_report) and step % t.memory_report_every == 0


def lr_at(o, step: int, total: int) -> float:
    """Linear warm-up to o.lr, then cosine decay to o.min_lr at step `total`."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def allreduce_mean(parts: StepParts, values: list[float]) -> list[float]:
    """Sum over every rank, / number of data shards: the global-batch mean of per-shard values
    (ranks that do not hold a quantity, e.g. the CE off the last stage, pass 0). The TP ranks
    of a shard hold the same values (tensor_parallel: the same loss on each), so / tp too."""
    t = torch.tensor(values, dtype=torch.float64, device=parts.device)
    if parts.mesh.world_size > 1:
        dist.all_reduce(t)
        t /= parts.mesh.n_data_shards * parts.mesh.tp
    return t.tolist()


def doc_layout(parts: StepParts, tokens: torch.Tensor):
    """The batch's document layout under --data.doc_mask (None otherwise)."""
    if not parts.cfg.data.doc_mask:
        return None
    from model import DocLayout

    return DocLayout.from_tokens(tokens, parts.corpus.eos_id, parts.cfg.data.doc_attention)


def queue_docs(parts: StepParts, microbatches) -> None:
    """Under --data.doc_mask with pp > 1: every stage gets the layouts of its coming
    forwards, one per micro-batch (every rank holds the whole batch's tokens)."""
    if parts.cfg.data.doc_mask and parts.pipe is not None:
        layouts = [doc_layout(parts, mb) for mb in microbatches]
        for stage in parts.pipe.stages.values():
            stage.docs.extend(layouts)


def check_docs_used(parts: StepParts) -> None:
    """After a pipelined step or evaluation: every queued layout was used."""
    assert parts.pipe is not None, "called only with pp > 1"
    left = {s: len(st.docs) for s, st in parts.pipe.stages.items() if st.docs}
    if left:
        raise RuntimeError(f"document layouts left unused after the step: {left} "
                           f"(a stage ran fewer forwards than micro-batches)")


def forward_loss(parts: StepParts, tokens: torch.Tensor, targets: torch.Tensor):
    """(cross-entropy, MoE aux loss) of one unpipelined forward."""
    with parts.precision.autocast_ctx(tokens.device.type):
        logits = parts.model(tokens, doc=doc_layout(parts, tokens))
    return cross_entropy(logits, targets), parts.model.aux_loss()


def _forward_backward(parts: StepParts, tokens: torch.Tensor, targets: torch.Tensor):
    """One step's forward and backward over m micro-batches; returns (ce, aux, pp_idle), ce
    and aux each the mean over micro-batches (the pipeline runs them in its schedule's order;
    with pp = 1 they run one after another and their gradients accumulate); pp_idle = (this
    rank's idle seconds, wall seconds) of the pipeline, None with pp = 1."""
    M = parts.cfg.parallel.microbatches
    pipe = parts.pipe
    if pipe is not None:
        first, last = 0 in pipe.stages, pipe.n_stages - 1 in pipe.stages
        queue_docs(parts, tokens.chunk(M))
        w0 = time.perf_counter()
        losses = pipe.runtime.step(list(tokens.chunk(M)) if first else None,
                                   list(targets.chunk(M)) if last else None)
        wall = time.perf_counter() - w0  # this rank's idle: wall minus its actions' spans
        idle = (wall - sum(sp.end - sp.start for sp in pipe.runtime.spans), wall)
        check_docs_used(parts)
        ce = torch.stack(losses).mean() if last else torch.zeros(())
        return ce, torch.tensor(sum(pipe.runtime.last_aux.values()) / M), idle
    if M == 1:
        ce, aux = forward_loss(parts, tokens, targets)
        (ce + aux).backward()
        return ce, aux, None
    mbs = list(zip(tokens.chunk(M), targets.chunk(M), strict=True))
    ces, auxes = [], []

    def forward(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        ce, aux = forward_loss(parts, *mbs[j])
        ces.append(ce.detach())
        auxes.append(aux.detach())
        return ce, aux

    def backward(losses: tuple[torch.Tensor, torch.Tensor]) -> None:
        ((losses[0] + losses[1]) / M).backward()

    if parts.fb:
        _fb_microbatches(parts, M, forward, backward)
    else:
        for j in range(M):
            backward(forward(j))
    return torch.stack(ces).mean(), torch.stack(auxes).mean(), None


def _fb_microbatches(parts: StepParts, M: int, forward, backward) -> None:
    """--comm.a2a_overlap=fb with pp = 1: F(0); then B(j-1) paired with F(j) for j = 1..M-1
    on a `Baton` (comm/collectives/overlap.py: the two run as two threads, one at a time,
    handing over right after each exchange they start, so one's compute overlaps the other's
    exchange); then B(M-1). The gradients accumulate in the plain loop's order, so the result
    is the plain loop's; docs/alltoall.md gives the argument for one collective order. The
    baton is on every EP dispatcher for the span of the loop only."""
    from comm.collectives.overlap import Baton

    baton = Baton()
    disps = [layer.dispatcher for layer in parts.model.moe_layers()
             if hasattr(layer.dispatcher, "baton")]
    for d in disps:
        d.baton = baton
    try:
        baton.microbatches(M, forward, backward)
    finally:
        for d in disps:
            d.baton = None


def update_state(parts: StepParts, state: StepState, loss: float, norm: float, lr: float,
            counts, metering: bool = False) -> list[dict[str, Any]]:
    """The optimizer step, router bias and migration; or, for a non-finite step, skip it (or
    stop, per train.nan_policy). Every rank agrees: loss and norm are global values.
    `metering`: the step runs under the memory report (`metered`), so it records the state."""
    t = parts.cfg.train
    if math.isfinite(loss) and math.isfinite(norm):
        state.phase = "optimizer step"
        for g in parts.optim.param_groups:
            g["lr"] = lr
        with record_function("optimizer.step"):
            parts.optim.step()
        if metering:  # the memory report: weights + grads + optimizer state, all alive now
            parts.stats.state_bytes = state_bytes(parts.model, parts.optim)
        parts.optim.zero_grad(set_to_none=True)
        if parts.mcfg.bias_balancing:
            for layer, c in zip(parts.model.moe_layers(), counts, strict=True):
                layer.router.update_bias(c.to(parts.device))
        state.phase = "expert migration"
        return parts.balancer.after_step(state.step + 1, counts) if parts.balancer else []
    parts.optim.zero_grad(set_to_none=True)
    state.nonfinite_steps += 1
    if t.nan_policy == "stop" or state.nonfinite_steps > t.max_nonfinite_steps:
        raise TrainingError(
            f"non-finite loss/gradient at step {state.step + 1} (loss {loss}, grad norm {norm}); "
            f"{state.nonfinite_steps} such step(s), policy {t.nan_policy!r} allows "
            f"{0 if t.nan_policy == 'stop' else t.max_nonfinite_steps}; stopping. The weights "
            f"are those of the last finite step; lower optim.lr or check the data")
    return [{"event": "nonfinite", "step": state.step + 1, "loss": loss, "grad_norm": norm,
             "action": "skipped step", "count": state.nonfinite_steps}]


def _trace_windows(parts: StepParts, step: int) -> None:
    """--debug.trace_data: this rank's windows of the step, as `python -m trainer.data order`
    prints them (step 1-based, rank = data shard)."""
    import json
    from pathlib import Path

    t, d = parts.cfg.train, parts.cfg.data
    src, starts = parts.corpus.windows(step, t.global_batch, t.seq_len, parts.mesh.data_idx,
                                       parts.mesh.n_data_shards, d.seed)
    row: dict[str, Any] = {"step": step + 1, "rank": parts.mesh.data_idx,
                           "starts": [int(s) for s in starts]}
    files = parts.corpus.files
    if len(files) == 1:
        row["file"] = files[0]
    else:
        row["files"] = [files[i] for i in src]
    out = Path(t.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"data_order.rank{parts.mesh.rank}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def train_step(parts: StepParts, state: StepState) -> StepResult:
    """One optimizer step over the global batch; advances `state.step`."""
    t, stats, mesh = parts.cfg.train, parts.stats, parts.mesh
    parts.model.train()
    d = parts.cfg.data
    tokens, targets = parts.corpus.batch(state.step, t.global_batch, t.seq_len, mesh.data_idx,
                                         mesh.n_data_shards, d.seed)
    if parts.cfg.debug.trace_data:
        _trace_windows(parts, state.step)
    tokens, targets = tokens.to(parts.device), targets.to(parts.device)
    parts.hooks.before_step(state.step + 1)
    logged = t.layer_metrics and not (parts.cfg.debug.logging_ab and state.step % 2)
    stats.begin(logged)
    t0 = time.perf_counter()
    state.phase = "forward/backward (MoE all-to-all, pipeline P2P)"
    metering = metered(t, state.step + 1)
    if metering:
        stats.meter.reset_peak()
    meter = stats.meter if metering else contextlib.nullcontext()
    # arm the gradient hooks: a parameter's gradient is final after M accumulations
    parts.sync.start_step(parts.cfg.parallel.microbatches)
    with meter, record_function("forward_backward"):
        ce, aux, pp_idle = _forward_backward(parts, tokens, targets)
    t1 = time.perf_counter()
    ce = parts.hooks.after_backward(state.step + 1, parts.model, ce)
    state.phase = "gradient all-reduce"
    with record_function("grad_sync"):
        parts.sync.finish()  # what the backward's hooks have not launched yet, then wait
        if parts.cfg.balance.redundant:  # every replica gets its expert's whole gradient
            sum_replica_grads(parts.model, mesh.ep_group)
            parts.sync.row_weights = replica_row_weights(parts.model)
        norm = parts.sync.clip(parts.cfg.optim.grad_clip)
    t2 = time.perf_counter()
    loss, aux_v = allreduce_mean(parts, [float(ce.detach()), float(aux.detach())])
    lr = lr_at(parts.cfg.optim, state.step, t.steps)
    state.phase = "metrics all-reduce"
    counts = stats.expert_counts()
    imbalance = stats.imbalance(counts)  # of the placement this step ran with
    t3 = time.perf_counter()
    events = update_state(parts, state, loss, norm, lr, counts, metering)
    t4 = time.perf_counter()
    state.phase = "metrics all-reduce"  # every stage's layers, migrations, pipeline idle
    gathered = stats.gather.reduce(counts, stats.last_entropy, imbalance, events,
                                   stats.layer_names, pp_idle)
    if parts.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    wait = stats.exchange_time()
    if metering:
        wait.update(stats.memory())
    state.step += 1
    tok_s = t.global_batch * t.seq_len / dt
    mfu = parts.flops_per_token * tok_s / (parts.peak * mesh.world_size) if parts.peak else 0.0
    progress = parts.corpus.progress(state.step, t.global_batch, t.seq_len, d.seed)
    return StepResult(
        step=state.step, epoch=progress["epoch"], tokens_seen=progress["tokens_seen"],
        source_epochs=progress.get("source_epochs"), loss=loss, aux_loss=aux_v, lr=lr,
        grad_norm=norm, tokens_per_s=tok_s, mfu=mfu, imbalance=gathered["imbalance"],
        migration_swaps=gathered.get("migration_swaps"),
        migration_moved_experts=gathered.get("migration_moved_experts"),
        migration_bytes_sent=gathered.get("migration_bytes_sent"),
        migration_seconds=gathered.get("migration_seconds"),
        pp_idle_max_s=gathered.get("pp_idle_max_s"),
        pp_idle_frac_max=gathered.get("pp_idle_frac_max"),
        step_time_s=dt, fwd_bwd_s=t1 - t0, grad_sync_s=t2 - t1, optim_s=t4 - t3,
        ep_exchange_max_s=wait.get("ep_exchange_max_s"),
        ep_exchange_min_s=wait.get("ep_exchange_min_s"),
        ep_remote_rows=wait.get("ep_remote_rows"), ep_remote_bytes=wait.get("ep_remote_bytes"),
        ep_flat_remote_rows=wait.get("ep_flat_remote_rows"),
        ep_node_imbalance=wait.get("ep_node_imbalance"),
        mem_state_bytes_max=wait.get("mem_state_bytes_max"),
        mem_act_peak_bytes_max=wait.get("mem_act_peak_bytes_max"),
        time=time.time(), nonfinite_steps=state.nonfinite_steps or None,
        layers=gathered.get("layers"), events=events, logged=logged)
