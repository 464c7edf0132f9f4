"""Evaluation: the mean validation cross-entropy over `train.eval_batches` fixed batches."""

from __future__ import annotations

import torch

from .pipe import pp_eval_forward
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
        if tr.pipe is not None:
            tr.queue_docs([tokens])
            ce = pp_eval_forward(tr.pipe.stages, tr.mesh.pp, tr.pipe.n_stages,
                                 tr.mesh.pp_ranks(), tokens, targets,
                                 (tokens.shape[0], *tr.pipe.act_shape[1:]), tr.device)
            tr.check_docs_used()
            total += ce or 0.0
        else:
            ce, _ = forward_loss(tr, tokens, targets)
            total += float(ce)
    return allreduce_mean(tr, [total / t.eval_batches])[0]
