"""Gradient accumulation without a pipeline (--parallel.microbatches=m with pp=1) equals one
pass over the same batch.

Reference: the same run with m=1. The cross-entropy is a mean over equal-sized micro-batches, so
the accumulated gradient is the one-pass gradient up to fp32 summation order. The MoE aux loss is
computed per micro-batch (as in a pipelined run), which is not the one-pass value, so these runs
set aux_loss_coef=0; gradient clipping is active (the norms here exceed grad_clip=1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import stdlib_corpus, train_ok

COMMON = ["--config", "configs/tiny-ep-dp.toml", "--train.seq_len=64", "--train.global_batch=8",
          "--model.d_model=64", "--model.moe_ffn_dim=64", "--model.aux_loss_coef=0",
          "--train.eval_every=0", "--train.eval_batches=1", "--optim.warmup_steps=2",
          "--train.plot=false", "--train.steps=4", "--train.tensorboard=false"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return stdlib_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", 10, 100_000)


def _rows(tmp: Path, name: str, nproc: int, extra: list[str], data: str) -> dict[int, dict]:
    import json

    out = train_ok([*COMMON, "--data", data, *extra], tmp / name, nproc)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows if "loss" in r}


def _same(one: dict[int, dict], acc: dict[int, dict]) -> None:
    assert sorted(one) == sorted(acc) == [1, 2, 3, 4]
    for s in one:
        assert acc[s]["loss"] == pytest.approx(one[s]["loss"], rel=1e-5), s
        assert acc[s]["grad_norm"] == pytest.approx(one[s]["grad_norm"], rel=1e-5), s
    assert one[1]["grad_norm"] > 1.0  # clipping was active


@pytest.mark.integration
def test_accumulation_equals_one_pass(tmp_path, data):
    one = _rows(tmp_path, "m1", 1, ["--parallel.ep=1"], data)
    acc = _rows(tmp_path, "m4", 1, ["--parallel.ep=1", "--parallel.microbatches=4"], data)
    _same(one, acc)


@pytest.mark.slow
@pytest.mark.multiproc
def test_accumulation_with_ep_equals_one_pass(tmp_path, data):
    args = ["--parallel.ep=2", "--comm.alltoall=flat"]
    one = _rows(tmp_path, "m1", 2, args, data)
    acc = _rows(tmp_path, "m2", 2, [*args, "--parallel.microbatches=2"], data)
    _same(one, acc)


@pytest.mark.slow
@pytest.mark.multiproc
def test_overlapped_grad_sync_at_zero0_equals_the_flat_one(tmp_path, data):
    """--parallel.grad_overlap=true at ZeRO-0 (buckets launched from the backward's hooks, the
    GPU default) against the flat post-backward all-reduce, with 2 accumulated micro-batches."""
    args = ["--parallel.ep=2", "--comm.alltoall=flat", "--parallel.microbatches=2"]
    flat = _rows(tmp_path, "flat", 2, [*args, "--parallel.grad_overlap=false"], data)
    over = _rows(tmp_path, "over", 2, [*args, "--parallel.grad_overlap=true"], data)
    _same(flat, over)
