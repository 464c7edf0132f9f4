"""The training step: the one place the hot loop lives.

    batch -> forward + backward (pipelined with pp > 1; m micro-batches accumulated with pp = 1)
          -> gradient sync + clip -> loss / counts all-reduce -> optimizer (or skip a
          non-finite step) -> router bias, expert migration -> the step's metrics row

`tr` is the `Trainer` (trainer/loop.py): these functions read its parts (model, pipeline,
sync, optimizer, stats, hooks) and advance `tr.step`.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from model import cross_entropy

from .common import TrainingError
from .memory import state_bytes
from .replicas import replica_row_weights, sum_replica_grads

__all__ = ["train_step", "forward_loss", "lr_at", "allreduce_mean", "doc_layout"]


def lr_at(o, step: int, total: int) -> float:
    """Linear warm-up to o.lr, then cosine decay to o.min_lr at step `total`."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    frac = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def allreduce_mean(tr, values: list[float]) -> list[float]:
    """Sum over every rank, / number of data shards: the global-batch mean of per-shard values
    (ranks that do not hold a quantity, e.g. the CE off the last stage, pass 0). The TP ranks
    of a shard hold the same values (tensor_parallel: the same loss on each), so / tp too."""
    t = torch.tensor(values, dtype=torch.float64, device=tr.device)
    if tr.mesh.world_size > 1:
        dist.all_reduce(t)
        t /= tr.mesh.n_data_shards * tr.mesh.tp
    return t.tolist()


def doc_layout(tr, tokens: torch.Tensor):
    """The batch's document layout under --data.doc_mask (None otherwise)."""
    if not tr.cfg.data.doc_mask:
        return None
    from model import DocLayout

    return DocLayout.from_tokens(tokens, tr.corpus.eos_id, tr.cfg.data.doc_attention)


def forward_loss(tr, tokens: torch.Tensor, targets: torch.Tensor):
    """(cross-entropy, MoE aux loss) of one unpipelined forward."""
    with tr.precision.autocast_ctx(tokens.device.type):
        logits = tr.model(tokens, doc=doc_layout(tr, tokens))
    return cross_entropy(logits, targets), tr.model.aux_loss()


def _forward_backward(tr, tokens: torch.Tensor, targets: torch.Tensor):
    """One step's forward and backward over m micro-batches; returns (ce, aux), each the mean
    over micro-batches (the pipeline runs them in its schedule's order; with pp = 1 they run
    one after another and their gradients accumulate)."""
    M = tr.cfg.parallel.microbatches
    if tr.pipe is not None:
        first, last = 0 in tr.pipe.stages, tr.pipe.n_stages - 1 in tr.pipe.stages
        tr.queue_docs(tokens.chunk(M))
        w0 = time.perf_counter()
        losses = tr.pipe.runtime.step(list(tokens.chunk(M)) if first else None,
                                      list(targets.chunk(M)) if last else None)
        wall = time.perf_counter() - w0  # this rank's idle: wall minus its actions' spans
        tr.pp_idle = (wall - sum(sp.end - sp.start for sp in tr.pipe.runtime.spans), wall)
        tr.check_docs_used()
        ce = torch.stack(losses).mean() if last else torch.zeros(())
        return ce, torch.tensor(sum(tr.pipe.runtime.last_aux.values()) / M)
    if M == 1:
        ce, aux = forward_loss(tr, tokens, targets)
        (ce + aux).backward()
        return ce, aux
    ces, auxes = [], []
    for tok, tgt in zip(tokens.chunk(M), targets.chunk(M), strict=True):
        ce, aux = forward_loss(tr, tok, tgt)
        ((ce + aux) / M).backward()
        ces.append(ce.detach())
        auxes.append(aux.detach())
    return torch.stack(ces).mean(), torch.stack(auxes).mean()


def _update(tr, loss: float, norm: float, lr: float, counts) -> list[dict[str, Any]]:
    """The optimizer step, router bias and migration; or, for a non-finite step, skip it (or
    stop, per train.nan_policy). Every rank agrees: loss and norm are global values."""
    t = tr.cfg.train
    if math.isfinite(loss) and math.isfinite(norm):
        tr.phase = "optimizer step"
        for g in tr.optim.param_groups:
            g["lr"] = lr
        with record_function("optimizer.step"):
            tr.optim.step()
        if t.memory_report:  # weights + grads + optimizer state, all alive right now
            tr.stats.state_bytes = state_bytes(tr.model, tr.optim)
        tr.optim.zero_grad(set_to_none=True)
        if tr.mcfg.bias_balancing:
            for layer, c in zip(tr.model.moe_layers(), counts, strict=True):
                layer.router.update_bias(c.to(tr.device))
        tr.phase = "expert migration"
        return tr.balancer.after_step(tr.step + 1, counts) if tr.balancer else []
    tr.optim.zero_grad(set_to_none=True)
    tr.nonfinite_steps += 1
    if t.nan_policy == "stop" or tr.nonfinite_steps > t.max_nonfinite_steps:
        raise TrainingError(
            f"non-finite loss/gradient at step {tr.step + 1} (loss {loss}, grad norm {norm}); "
            f"{tr.nonfinite_steps} such step(s), policy {t.nan_policy!r} allows "
            f"{0 if t.nan_policy == 'stop' else t.max_nonfinite_steps}; stopping. The weights "
            f"are those of the last finite step; lower optim.lr or check the data")
    return [{"event": "nonfinite", "step": tr.step + 1, "loss": loss, "grad_norm": norm,
             "action": "skipped step", "count": tr.nonfinite_steps}]


def _trace_windows(tr) -> None:
    """--debug.trace_data: this rank's windows of the step, as `python -m trainer.data order`
    prints them (step 1-based, rank = data shard)."""
    import json
    from pathlib import Path

    t, d = tr.cfg.train, tr.cfg.data
    src, starts = tr.corpus.windows(tr.step, t.global_batch, t.seq_len, tr.mesh.data_idx,
                                    tr.mesh.n_data_shards, d.seed)
    row: dict[str, Any] = {"step": tr.step + 1, "rank": tr.mesh.data_idx,
                           "starts": [int(s) for s in starts]}
    files = tr.corpus.files
    if len(files) == 1:
        row["file"] = files[0]
    else:
        row["files"] = [files[i] for i in src]
    out = Path(t.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"data_order.rank{tr.rank}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def train_step(tr) -> dict[str, Any]:
    """One optimizer step over the global batch; returns its metrics row (with "events")."""
    t, stats = tr.cfg.train, tr.stats
    tr.model.train()
    d = tr.cfg.data
    tokens, targets = tr.corpus.batch(tr.step, t.global_batch, t.seq_len, tr.mesh.data_idx,
                                      tr.mesh.n_data_shards, d.seed)
    if tr.cfg.debug.trace_data:
        _trace_windows(tr)
    tokens, targets = tokens.to(tr.device), targets.to(tr.device)
    tr.hooks.before_step(tr.step + 1)
    tr.logging = t.layer_metrics and not (tr.cfg.debug.logging_ab and tr.step % 2)
    stats.begin(tr.logging)
    t0 = time.perf_counter()
    tr.phase = "forward/backward (MoE all-to-all, pipeline P2P)"
    if t.memory_report:
        stats.meter.reset_peak()
    meter = stats.meter if t.memory_report else contextlib.nullcontext()
    # arm the gradient hooks: a parameter's gradient is final after M accumulations
    tr.sync.start_step(tr.cfg.parallel.microbatches)
    with meter, record_function("forward_backward"):
        ce, aux = _forward_backward(tr, tokens, targets)
    t1 = time.perf_counter()
    ce = tr.hooks.after_backward(tr.step + 1, tr.model, ce)
    tr.phase = "gradient all-reduce"
    with record_function("grad_sync"):
        tr.sync.finish()  # what the backward's hooks have not launched yet, then wait
        if tr.cfg.balance.redundant:  # every replica gets its expert's whole gradient
            sum_replica_grads(tr.model, tr.mesh.ep_group)
            tr.sync.row_weights = replica_row_weights(tr.model)
        norm = tr.sync.clip(tr.cfg.optim.grad_clip)
    t2 = time.perf_counter()
    loss, aux_v = allreduce_mean(tr, [float(ce.detach()), float(aux.detach())])
    lr = lr_at(tr.cfg.optim, tr.step, t.steps)
    tr.phase = "metrics all-reduce"
    counts = stats.expert_counts()
    imbalance = stats.imbalance(counts)  # of the placement this step ran with
    t3 = time.perf_counter()
    events = _update(tr, loss, norm, lr, counts)
    t4 = time.perf_counter()
    tr.phase = "metrics all-reduce"  # every stage's layers, migrations, pipeline idle
    gathered = stats.gather.reduce(counts, stats.last_entropy, imbalance, events,
                                   stats.layer_names, tr.pp_idle)
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    wait = stats.exchange_time()
    if t.memory_report:
        wait.update(stats.memory())
    tr.step += 1
    tok_s = t.global_batch * t.seq_len / dt
    mfu = tr.flops_per_token * tok_s / (tr.peak * tr.mesh.world_size) if tr.peak else 0.0
    layers = gathered.pop("layers", None)
    progress = tr.corpus.progress(tr.step, t.global_batch, t.seq_len, tr.cfg.data.seed)
    row = {"step": tr.step, **progress, "loss": loss, "aux_loss": aux_v, "lr": lr, "grad_norm": norm,
           "tokens_per_s": tok_s, "mfu": mfu, **gathered, "step_time_s": dt,
           "fwd_bwd_s": t1 - t0, "grad_sync_s": t2 - t1, "optim_s": t4 - t3, **wait,
           "time": time.time()}  # wall clock: row-to-row intervals include the logging
    if tr.nonfinite_steps:
        row["nonfinite_steps"] = tr.nonfinite_steps
    if layers is not None:
        row["layers"] = layers
    return {**row, "events": events}
