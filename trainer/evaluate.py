"""Evaluation: the mean validation cross-entropy over `train.eval_batches` fixed batches."""

from __future__ import annotations

import torch

from .step import allreduce_mean, forward_loss

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(tr) -> float:
    """Every rank calls it; returns the global-batch mean (nats per token) on every rank."""
    t = tr.cfg.train
    tr.model.eval()
    total = 0.0
    for v in range(t.eval_batches):
        tokens, targets = tr.corpus.batch(v, t.global_batch, t.seq_len, tr.mesh.data_idx,
                                          tr.mesh.n_data_shards, tr.cfg.data.seed, "val")
        tokens, targets = tokens.to(tr.device), targets.to(tr.device)
        if tr.pipe is not None:  # the forward-only schedule, one micro-batch
            first, last = 0 in tr.pipe.stages, tr.pipe.n_stages - 1 in tr.pipe.stages
            tr.queue_docs([tokens])
            losses = tr.pipe.eval_runtime.step([tokens] if first else None,
                                               [targets] if last else None)
            tr.check_docs_used()
            total += float(losses[0]) if losses else 0.0
        else:
            ce, _ = forward_loss(tr, tokens, targets)
            total += float(ce)
    return allreduce_mean(tr, [total / t.eval_batches])[0]
