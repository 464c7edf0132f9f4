"""Evaluation: the mean validation cross-entropy over `train.eval_batches` fixed batches."""

from __future__ import annotations

import torch

from .step import StepParts, allreduce_mean, check_docs_used, forward_loss, queue_docs

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(parts: StepParts) -> float:
    """Every rank calls it; returns the global-batch mean (nats per token) on every rank."""
    t, mesh = parts.cfg.train, parts.mesh
    parts.model.eval()
    total = 0.0
    for v in range(t.eval_batches):
        tokens, targets = parts.corpus.batch(v, t.global_batch, t.seq_len, mesh.data_idx,
                                             mesh.n_data_shards, parts.cfg.data.seed, "val")
        tokens, targets = tokens.to(parts.device), targets.to(parts.device)
        if parts.pipe is not None:  # the forward-only schedule, one micro-batch
            first, last = 0 in parts.pipe.stages, parts.pipe.n_stages - 1 in parts.pipe.stages
            queue_docs(parts, [tokens])
            losses = parts.pipe.eval_runtime.step([tokens] if first else None,
                                                  [targets] if last else None)
            check_docs_used(parts)
            total += float(losses[0]) if losses else 0.0
        else:
            ce, _ = forward_loss(parts, tokens, targets)
            total += float(ce)
    return allreduce_mean(parts, [total / t.eval_batches])[0]
